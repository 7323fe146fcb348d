"""The precision rule has one owner (asyncrl/models.py `precision`; docs/design.md "Precision").

The rule's table over roles x devices x configured values; the engine's CLI default, its server, SGLang's
flag and the run's launcher against it; the learner and critic built by it; and a scan of asyncrl's sources
that fails if a second spelling of the rule comes back (a dtype compared against "auto", an autocast context
or an FSDP2 mixed-precision policy built outside the owner).
"""

from __future__ import annotations

import argparse
import ast
import itertools
import typing
from pathlib import Path

import httpx
import pytest
import torch

import asyncrl
from asyncrl.config import Config, EngineConfig, ModelConfig
from asyncrl.models import (
    DTYPES,
    PRECISION_ROLES,
    Precision,
    compute_context,
    engine_dtype,
    fsdp_mixed_precision,
    precision,
)
from asyncrl.util import cpus

OWNER = Path(asyncrl.__file__).resolve().parent / "models.py"
CONFIGURED = ("auto", "float32", "bfloat16", "float16")
# the device kinds: (device string, what the CPU probe answers)
KINDS = {"cuda": ("cuda:0", False), "cpu_bf16": ("cpu", True), "cpu": ("cpu", False)}

# The rule, written out (docs/design.md "Precision"). Engine: configured -> kind -> weights = compute.
ENGINE = {"auto": {"cuda": "bfloat16", "cpu_bf16": "bfloat16", "cpu": "float32"},
          **{x: {"cuda": x, "cpu_bf16": x, "cpu": x} for x in ("float32", "bfloat16", "float16")}}
# Learner and critic: configured -> weights (every device).
MASTERS = {"auto": "float32", "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
# Learner and critic compute: (kind, model.cpu_bf16, world_size) -> (compute, via, reduce); None: the weights'.
COMPUTE = {
    ("cuda", False, 1): ("bfloat16", "autocast", None), ("cuda", True, 1): ("bfloat16", "autocast", None),
    ("cuda", False, 2): ("bfloat16", "fsdp", "float32"), ("cuda", True, 2): ("bfloat16", "fsdp", "float32"),
    ("cpu_bf16", True, 1): ("bfloat16", "autocast", None), ("cpu_bf16", True, 2): ("bfloat16", "autocast", None),
    ("cpu_bf16", False, 1): (None, "none", None), ("cpu_bf16", False, 2): (None, "none", None),
    ("cpu", True, 1): (None, "none", None), ("cpu", True, 2): (None, "none", None),
    ("cpu", False, 1): (None, "none", None), ("cpu", False, 2): (None, "none", None),
}


def expected(role: str, configured: str, kind: str, cpu_bf16: bool, world_size: int) -> Precision:
    if role == "engine":
        d = ENGINE[configured][kind]
        return Precision(d, d)
    weights = MASTERS[configured]
    compute, via, reduce = COMPUTE[(kind, cpu_bf16, world_size)]
    return Precision(weights, compute or weights, via, reduce)


@pytest.mark.parametrize("role,configured,kind,cpu_bf16,world_size", list(itertools.product(
    PRECISION_ROLES, CONFIGURED, KINDS, (False, True), (1, 2))))
def test_the_rule_over_roles_devices_and_configured_values(role, configured, kind, cpu_bf16, world_size):
    device, native = KINDS[kind]
    got = precision(role, configured, device, native_bf16=native, cpu_bf16=cpu_bf16, world_size=world_size)
    assert got == expected(role, configured, kind, cpu_bf16, world_size)


def test_the_default_config_on_each_device():
    """What a run with the schema's defaults (and with the smollm2-135m preset's cpu_bf16) gets."""
    cfg = Config()
    assert (cfg.model.dtype, cfg.engine.dtype, cfg.model.cpu_bf16) == ("auto", "auto", False)
    rows = {}
    for kind, (device, native) in KINDS.items():
        for preset in (False, True):
            learner = precision("learner", cfg.model.dtype, device, native_bf16=native, cpu_bf16=preset)
            rows[kind, preset] = (precision("engine", cfg.engine.dtype, device, native_bf16=native).compute,
                                  learner.weights, learner.compute)
    assert rows == {
        ("cuda", False): ("bfloat16", "float32", "bfloat16"), ("cuda", True): ("bfloat16", "float32", "bfloat16"),
        ("cpu_bf16", False): ("bfloat16", "float32", "float32"),
        ("cpu_bf16", True): ("bfloat16", "float32", "bfloat16"),
        ("cpu", False): ("float32", "float32", "float32"), ("cpu", True): ("float32", "float32", "float32"),
    }


def test_a_cuda_index_or_a_probe_answer_on_cuda_changes_nothing():
    for role, configured in itertools.product(PRECISION_ROLES, CONFIGURED):
        base = precision(role, configured, "cuda", native_bf16=False)
        assert precision(role, configured, "cuda:3", native_bf16=True) == base


def test_bad_inputs_name_the_value_and_where_it_came_from():
    with pytest.raises(ValueError, match=r"engine\.dtype='half'"):
        precision("engine", "half", "cpu", native_bf16=False)
    with pytest.raises(ValueError, match=r"model\.dtype='fp8'"):
        precision("learner", "fp8", "cpu", native_bf16=False)
    with pytest.raises(ValueError, match=r"role 'actor'"):
        precision("actor", "auto", "cpu", native_bf16=False)
    with pytest.raises(ValueError, match=r"device 'mps'"):
        precision("engine", "auto", "mps", native_bf16=False)
    with pytest.raises(ValueError, match=r"world_size must be >= 1, got 0"):
        precision("learner", "auto", "cpu", native_bf16=False, world_size=0)


def test_the_dtype_fields_and_the_rule_take_the_same_values():
    for cls in (ModelConfig, EngineConfig):
        assert typing.get_args(typing.get_type_hints(cls)["dtype"]) == ("auto", *DTYPES), cls.__name__
    assert DTYPES == ("float32", "bfloat16", "float16")


def test_the_mechanisms_come_from_the_decision():
    ctx = compute_context(Precision("float32", "bfloat16", "autocast"), "cpu")
    assert isinstance(ctx, torch.autocast) and ctx.device == "cpu" and ctx.fast_dtype == torch.bfloat16
    assert not isinstance(compute_context(Precision("float32", "float32"), "cpu"), torch.autocast)
    assert not isinstance(compute_context(Precision("float32", "bfloat16", "fsdp", "float32"), "cuda:0"),
                          torch.autocast)  # FSDP2 casts the parameters itself
    mp = fsdp_mixed_precision(Precision("float32", "bfloat16", "fsdp", "float32"))
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)
    plain = fsdp_mixed_precision(Precision("float32", "bfloat16", "autocast"))
    assert (plain.param_dtype, plain.reduce_dtype) == (None, None)


# ------------------------------------------------------------------ the engine's CLI, server, SGLang, launcher


def _serve_parser() -> argparse.ArgumentParser:
    from asyncrl.engine.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p


def test_engine_cli_defaults_to_auto_and_takes_the_rules_values():
    p = _serve_parser()
    assert p.parse_args(["serve", "--model-path", "m"]).dtype == "auto" == EngineConfig().dtype
    serve = next(a for a in p._subparsers._group_actions[0].choices.values())  # the `serve` subparser
    dtype = next(a for a in serve._actions if a.dest == "dtype")
    assert tuple(dtype.choices) == ("auto", *DTYPES)


@pytest.mark.parametrize("native", [False, True])
def test_what_the_server_resolves_is_the_rule(monkeypatch, native):
    """The embedded server resolves --dtype with `engine_dtype`: the rule with this machine's probe."""
    monkeypatch.setattr(cpus, "native_bf16", lambda: native)
    for configured, device in itertools.product(CONFIGURED, ("cpu", "cuda")):
        assert engine_dtype(configured, device) == precision("engine", configured, device, native_bf16=native).weights


def test_sglang_gets_the_rules_cuda_dtype_always_explicit():
    from asyncrl.engine.launcher import EngineLaunchError, sglang_dtype

    for configured in CONFIGURED:
        assert sglang_dtype(configured) == precision("engine", configured, "cuda", native_bf16=False).weights != "auto"
    with pytest.raises(EngineLaunchError, match=r"engine\.dtype='half'"):
        sglang_dtype("half")


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("configured", CONFIGURED)
def test_the_launcher_gives_the_engine_the_rules_dtype(monkeypatch, tmp_path, native, configured):
    """launch_configured (a run's engine, eval, generate): whatever it passes as --dtype, the server's
    resolution of it is the rule's dtype for the config's engine.dtype."""
    from asyncrl.engine import launcher

    monkeypatch.setattr(cpus, "native_bf16", lambda: native)
    seen = []

    def fake_launch(model_dir, engine=None, **kw):
        seen.append((kw.get("dtype", engine.dtype if engine is not None else None),
                     kw.get("device", engine.device if engine is not None else None)))
        return None

    monkeypatch.setattr(launcher, "launch_embedded", fake_launch)
    cfg = Config(engine=EngineConfig(device="cpu", dtype=configured))
    launcher.launch_configured(cfg, str(tmp_path), port=1, threads=1, log_dir=str(tmp_path / "logs"))
    (dtype, device), = seen
    assert device == "cpu"
    assert engine_dtype(dtype, device) == precision("engine", configured, "cpu", native_bf16=native).weights


@pytest.mark.timeout(180)
def test_a_served_auto_engine_holds_the_rules_dtype(tiny_model_dir):
    """The real server process given --dtype auto (the CLI's default) serves the rule's dtype for this CPU."""
    from asyncrl.engine.launcher import launch_embedded
    from asyncrl.util.auth import auth_headers

    want = precision("engine", "auto", "cpu", native_bf16=cpus.native_bf16()).weights
    with launch_embedded(tiny_model_dir, device="cpu", dtype="auto", threads=1, startup_timeout_s=150) as proc:
        info = httpx.get(proc.url + "/weight_sync_info", headers=auth_headers(), timeout=30).json()
    assert info["dtype"] == want


# ------------------------------------------------------------------ the learner and critic


def test_learner_and_critic_are_built_and_compute_by_the_rule(tiny_model_dir, monkeypatch):
    """On a CPU with native bf16 and model.cpu_bf16: fp32 masters, bf16 compute for the policy and the critic
    (its value head then computes in bf16); without the probe's yes, fp32 for both."""
    from dataclasses import replace

    from asyncrl.config import CriticConfig
    from asyncrl.learner import critic as critic_mod
    from asyncrl.learner import worker as worker_mod
    from asyncrl.learner.packing import specs_of
    from tests.learner.helpers import make_batch, make_cfg

    cfg = make_cfg(tiny_model_dir, adv_estimator="gae", critic=CriticConfig(lr=1e-3))
    cfg = replace(cfg, model=replace(cfg.model, cpu_bf16=True))
    specs = specs_of(make_batch(seed=3).trajectories())[0]
    for native in (True, False):
        monkeypatch.setattr(worker_mod, "native_bf16", lambda native=native: native)
        monkeypatch.setattr(critic_mod, "native_bf16", lambda native=native: native)
        w = worker_mod.LearnerWorker(cfg)
        want = {role: precision(role, "auto", "cpu", native_bf16=native, cpu_bf16=True) for role in ("learner", "critic")}
        assert (w.precision, w.critic.precision) == (want["learner"], want["critic"])
        assert all(p.dtype == torch.float32 for p in [*w.model.parameters(), *w.critic.model.parameters()])
        seen = []
        hook = w.critic.model.value_head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        w.critic.values(specs, list(range(len(specs))))
        hook.remove()
        assert seen and set(seen) == {torch.bfloat16 if native else torch.float32}


# ------------------------------------------------------------------ no second spelling


AUTOCAST_OR_POLICY = {"autocast", "MixedPrecisionPolicy"}


def second_spellings(source: str, name: str = "<source>") -> list[str]:
    """Where `source` decides a precision itself: a comparison of a dtype (an operand, or the enclosing
    function's name or parameters, naming dtype or precision) against "auto", or a torch.autocast /
    MixedPrecisionPolicy built (with a literal dtype or not: the owner's compute_context and
    fsdp_mixed_precision build them)."""
    tree = ast.parse(source)
    found = []

    def dtype_words(text: str) -> bool:
        return "dtype" in text.lower() or "precision" in text.lower()

    def visit(node: ast.AST, scope: list[ast.AST]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            scope = [*scope, node]
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            flat = [e for o in operands for e in (o.elts if isinstance(o, (ast.Tuple, ast.List, ast.Set)) else [o])]
            if any(isinstance(e, ast.Constant) and e.value == "auto" for e in flat):
                others = [ast.unparse(o) for o in operands if not (isinstance(o, ast.Constant) and o.value == "auto")]
                names = [getattr(f, "name", "") for f in scope]
                params = [a.arg for f in scope for a in (*f.args.args, *f.args.kwonlyargs)]
                if any(map(dtype_words, [*others, *names, *params])):
                    found.append(f"{name}:{node.lineno}: compares against 'auto': {ast.unparse(node)}")
        if isinstance(node, ast.Call):
            f = node.func
            called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if called in AUTOCAST_OR_POLICY:
                found.append(f"{name}:{node.lineno}: builds {called}: {ast.unparse(node)}")
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, [])
    return found


def test_no_module_but_the_owner_decides_a_precision():
    root = OWNER.parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path != OWNER:
            found += second_spellings(path.read_text(), str(path.relative_to(root.parent)))
    assert not found, ("a second spelling of the precision rule (ask asyncrl.models.precision / compute_context / "
                       "fsdp_mixed_precision instead):\n" + "\n".join(found))


@pytest.mark.parametrize("bad", [
    'master_dtype = "float32" if cfg.model.dtype == "auto" else cfg.model.dtype',  # the learner's, before
    'def sglang_dtype(name):\n    if name == "auto":\n        return "bfloat16"',  # SGLang's flag, before
    'def f(dtype):\n    return x if dtype in ("auto", "float32") else y',
    'ctx = torch.autocast("cuda", dtype=torch.bfloat16)',  # the learner's autocast, before
    'from torch import autocast\nwith autocast("cpu"):\n    pass',
    'mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)',  # FSDP's, before
])
def test_the_scan_finds_each_old_spelling(bad):
    assert second_spellings(bad)


@pytest.mark.parametrize("fine", [
    'if requested != "auto":\n    pass',  # weight_sync's transport
    'device = default_device() if args.device == "auto" else args.device',
    'if compare in ("auto", "numeric"):\n    pass',
    'dtype = precision("engine", cfg.dtype, device, native_bf16=False).weights',
])
def test_the_scan_leaves_other_autos_alone(fine):
    assert not second_spellings(fine)
