"""Preflight (asyncrl/run/preflight.py): each mistake is one line naming the bad value, found before
anything starts. The check functions are called directly with hostile inputs; `asyncrl train` is
run in-process (the real entry point, `asyncrl.cli.main`) for each mistake, and as a subprocess
where the process itself is the point: that Ray is never imported and nothing is written."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from asyncrl.agents.base import resolve_agent
from asyncrl.cli import main as cli_main
from asyncrl.config import ConfigError, InteractionSpec, load_config
from asyncrl.envs.base import Sample
from asyncrl.learner.memory_estimate import SMOLLM2_135M, ModelShape, learner_step
from asyncrl.rollout.prompts import PromptSource
from asyncrl.run.preflight import (
    PreflightError,
    check_learner_memory,
    check_model,
    check_names,
    check_plugins,
    check_row_names,
    check_tools,
    preflight,
    prompt_lengths,
    too_long,
)
from asyncrl.tools.loader import load_tool_specs, tool_schemas


def _row(content: str = "What is 2 + 3?", **top) -> dict:
    return {"data_source": "arithmetic", "prompt": [{"role": "user", "content": content}],
            "reward_model": {"ground_truth": "5"}, **top}


def _write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _overrides(model_dir: Path, out: Path, rows: Path, *extra: str) -> list[str]:
    return ["model=custom", f"model.path={model_dir}", f"trainer.output_dir={out}", f"env.train_file={rows}",
            "trainer.wandb=off", *extra]


@pytest.fixture
def rows_file(tmp_path) -> Path:
    return _write_rows(tmp_path / "rows.jsonl", [_row(f"What is {i} + 3?") for i in range(4)])


# ----------------------------------------------------------------------------- plugins


def test_every_broken_plugin_is_one_line_naming_file_line_and_cause(tmp_path, plugin_registry):
    syntax = tmp_path / "syntax.py"
    syntax.write_text("x = 1\n\ndef f(:\n    pass\n")
    raising = tmp_path / "raising.py"
    raising.write_text("import os\nraise RuntimeError('no API key in the environment')\n")
    missing = tmp_path / "missing_dep.py"
    missing.write_text("import no_such_module_for_preflight\n")
    good = tmp_path / "good.py"
    good.write_text("from asyncrl.registry import register\n\n@register('reward', 'preflight_good')\n"
                    "def preflight_good(**kw):\n    return 0.0\n")
    problems = check_plugins([str(syntax), str(raising), str(missing), "no_such_pkg.plugins", str(good)])
    assert problems == [
        f"plugin {syntax}: syntax error at line 3: invalid syntax",
        f"plugin {raising}: RuntimeError while importing at {raising}:2: no API key in the environment",
        f"plugin {missing}: cannot import 'no_such_module_for_preflight' (No module named 'no_such_module_for_preflight')",
        "plugin module 'no_such_pkg.plugins' not found (no module named 'no_such_pkg')",
    ]
    assert plugin_registry.get("reward", "preflight_good")() == 0.0  # the good one after them still loaded
    assert not [m for m in sys.modules if m.startswith("asyncrl_user_plugin_")
                and getattr(sys.modules[m], "__file__", "") in (str(syntax), str(raising))]


def test_a_dotted_plugin_whose_dependency_is_missing_names_the_dependency(tmp_path, plugin_registry, monkeypatch):
    (tmp_path / "pf_plugin_pkg").mkdir()
    (tmp_path / "pf_plugin_pkg" / "__init__.py").write_text("import not_installed_dep_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert check_plugins(["pf_plugin_pkg"]) == [
        "plugin pf_plugin_pkg: cannot import 'not_installed_dep_xyz' (No module named 'not_installed_dep_xyz')"]


# ----------------------------------------------------------------------------- names, tools, model


def test_misspelled_agent_parser_and_interaction_class_are_each_named():
    cfg = load_config(["agent.name=reactt", "agent.tool_parser=hermz"])
    cfg.env.interactions = [InteractionSpec(name="feedback", class_name="answer_feedbak")]
    problems = check_names(cfg)
    assert len(problems) == 3
    assert problems[0].startswith("agent.name: unknown agent 'reactt' (did you mean 'react'?); registered agents:")
    assert problems[1].startswith("agent.tool_parser: unknown tool_parser 'hermz' (did you mean 'hermes'?)")
    assert problems[2].startswith("env.interactions[0] ('feedback'): unknown interaction 'answer_feedbak'")
    assert check_names(load_config(["agent.name=single_turn_agent"])) == []  # verl's name is an alias


def test_row_agent_names_and_interaction_names_are_checked_per_distinct_value():
    cfg = load_config([])
    cfg.env.interactions = [InteractionSpec(name="coach", class_name="answer_feedback")]
    rows = [_row(), _row(agent_name="reactt"), _row(agent_name="single_turn_agent"), _row(agent_name="reactt"),
            _row(agent_name="tool_agent", extra_info={"interaction_kwargs": {"name": "coach"}}),
            _row(extra_info={"interaction_kwargs": {"name": "answer_feedback"}}),
            _row(extra_info={"interaction_kwargs": {"name": "teacher"}})]
    problems = check_row_names(rows, cfg, "training")
    assert len(problems) == 2, problems
    assert problems[0].startswith("training rows 1, 3: agent_name: unknown agent 'reactt' (did you mean 'react'?)")
    assert problems[1].startswith("training row 6: extra_info.interaction_kwargs.name 'teacher' is neither in "
                                  "env.interactions nor registered: unknown interaction 'teacher'")
    many = check_row_names([_row(agent_name="nope")] * 8, cfg, "evaluation")
    assert many[0].startswith("evaluation rows 0, 1, 2, 3, 4 and 3 more: agent_name: unknown agent 'nope'")


def test_tool_yaml_naming_missing_classes_is_reported(tmp_path):
    yaml = tmp_path / "tools.yaml"
    yaml.write_text(textwrap.dedent("""
        tools:
          - class_name: no_such_pkg.tools:SearchTool
            config: {type: native}
    """))
    cfg = load_config([f"env.tools_config={yaml}"])
    specs, problems = check_tools(cfg)
    assert specs is None
    assert problems == [f"{yaml}: tools[0]: cannot import 'no_such_pkg.tools' for 'no_such_pkg.tools:SearchTool': No module named 'no_such_pkg'"]
    specs, problems = check_tools(load_config(["env.tools=[{class_name: calculatr}]"]))
    assert specs is None and problems[0].startswith("env.tools[0]: unknown tool 'calculatr' (did you mean 'calculator'?)")
    specs, problems = check_tools(load_config([]))
    assert problems == [] and [s.class_name for s in specs] == ["calculator"]


def test_model_path_must_hold_config_weights_and_tokenizer(tmp_path, tiny_model_dir):
    def problems(path: Path) -> list[str]:
        return check_model(load_config(["model=custom", f"model.path={path}"]))[1]

    assert problems(tiny_model_dir) == []
    assert problems(tmp_path / "absent") == [f"model.path='{tmp_path / 'absent'}': no such directory (looked at {tmp_path / 'absent'})"]
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    (msg,) = problems(partial)
    assert msg == (f"model.path='{partial}': not a Hugging Face checkpoint directory ({partial}): missing weights "
                   "(*.safetensors, pytorch_model*.bin, model.safetensors.index.json); tokenizer files "
                   "(tokenizer.json, tokenizer_config.json, tokenizer.model)")


def test_an_agent_budget_past_the_model_context_is_refused(tiny_model_dir):
    """An engine refuses a request whose input plus max_new_tokens pass the model's context (SGLang's rule):
    a budget that could grow past it would fail episodes late in the run, so it is refused before start."""
    def problems(*extra: str) -> list[str]:
        return check_model(load_config(["model=custom", f"model.path={tiny_model_dir}", *extra]))[1]

    assert problems("agent.max_prompt_tokens=3000", "agent.max_response_tokens=1096") == []  # 4096: the context
    (msg,) = problems("agent.max_prompt_tokens=3000", "agent.max_response_tokens=1097")
    assert msg == ("agent.max_prompt_tokens + agent.max_response_tokens = 3000 + 1097 = 4097 tokens is more than the "
                   f"model's context of 4096 tokens (max_position_embeddings in {tiny_model_dir / 'config.json'}): "
                   "lower them")


def test_default_model_is_found_without_converting_it(tmp_path):
    """An empty cache: preflight points at the GGUF the run will convert, and converts nothing itself."""
    cache = tmp_path / "cache"
    model, problems = check_model(load_config([f"model.cache_dir={cache}"]))
    assert problems == [] and model.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and Path(model).is_file()
    assert not cache.exists()
    assert check_model(load_config(["model.name=llama-7b"]))[1] == [
        "model.name='llama-7b': not a known default model (known: 'smollm2-135m'); use model=custom model.path=DIR"]


# ----------------------------------------------------------------------------- prompt lengths


def test_prompt_lengths_are_what_the_agent_loop_renders(tokenizer):
    cfg = load_config([])
    specs = load_tool_specs(cfg.env.tools)
    rows = [_row("short"), _row("a much longer question " * 20, agent_name="single_turn"),
            _row("x", prompt=[{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}])]
    got = prompt_lengths(rows, cfg, tokenizer, tool_schemas(specs))
    chat = resolve_agent("tool_agent").chat_format(tokenizer, cfg.agent, tool_schemas(specs))
    for i in (0, 2):  # as Episode measures them: tool_agent renders the tool schemas into the prompt
        msgs = Sample.from_row(rows[i], data_index=i, group_id="g", sample_index=0, group_size=1).messages
        assert got[i] == len(chat.prompt_ids(chat.prompt_messages(msgs)))
    assert got[0] > 200  # the hermes tool text is counted
    assert got[1] < got[0]  # single_turn renders no tools, even for a long question
    assert too_long(got, 10_000, "training") is None
    msg = too_long([5, 700, 12, 900], 512, "training")
    assert msg == "2 of 4 training rows have prompts longer than agent.max_prompt_tokens=512: row 3 (900 tokens), row 1 (700 tokens)"


def test_overlong_rows_fail_or_with_skip_bad_rows_are_dropped(tmp_path, tiny_model_dir):
    rows = _write_rows(tmp_path / "rows.jsonl", [_row("2+2?"), _row("word " * 400), _row("3+3?")])
    args = _overrides(tiny_model_dir, tmp_path / "out", rows, "agent.max_prompt_tokens=400")
    with pytest.raises(PreflightError) as e:
        preflight(load_config(args))
    (line,) = e.value.problems
    assert line.startswith("1 of 3 training rows have prompts longer than agent.max_prompt_tokens=400: row 1 (")
    report = preflight(load_config([*args, "env.skip_bad_rows=true"]))
    src = PromptSource(report.train_rows, run_id="t", seed=0, shuffle=False)  # what the run draws: row 1 is passed over
    assert [src.next().row["prompt"][0]["content"] for _ in range(3)] == ["2+2?", "3+3?", "2+2?"]
    assert [i for i, _ in report.dropped_rows] == [1] and report.dropped_rows[0][1] > 400
    assert report.warnings[0].endswith("dropped (env.skip_bad_rows=true)")
    assert report.longest_prompt <= 400 and "2 training, 1 dropped" in report.summary()
    assert not (tmp_path / "out").exists()


def test_evaluation_rows_are_checked_when_evaluation_is_on(tmp_path, tiny_model_dir, rows_file):
    val = _write_rows(tmp_path / "val.jsonl", [_row("word " * 400, agent_name="nope")])
    args = _overrides(tiny_model_dir, tmp_path / "out", rows_file, f"env.val_file={val}", "env.skip_bad_rows=true")
    assert preflight(load_config(args)).num_val_rows == 0  # eval off: the val file is not read
    with pytest.raises(PreflightError) as e:
        preflight(load_config([*args, "trainer.eval_every=1"]))
    assert [p.split(":")[0] for p in e.value.problems] == ["evaluation row 0"]


# ----------------------------------------------------------------------------- the entry point


MISTAKES = {  # override(s) -> a fragment of the one stderr line
    "env_option": (["env=nonexistent"], "env=nonexistent: no such option in config group 'env'; "
                                        "available: arithmetic, gsm8k, reasoning_gym, search_r1"),
    "agent_option": (["agent=reactt"], "agent=reactt: no such option in config group 'agent' (did you mean 'react'?)"),
    "custom_model_without_path": (["model=custom", "model.path=null"],
                                  "model=custom needs model.path (a local Hugging Face checkpoint directory)"),
    "n_samples": (["algorithm.n_samples=1"], "algorithm.n_samples: must be >= 2 with adv_estimator=grpo"),
    "workers": (["trainer.rollout_workers=0"], "trainer.rollout_workers: must be >= 1, got 0"),
    "agent_name": (["agent.name=reactt"], "agent.name: unknown agent 'reactt'"),
    "tool_parser": (["agent.tool_parser=hermz"], "agent.tool_parser: unknown tool_parser 'hermz'"),
    "tool_class": (["env.tools=[{class_name: calculatr}]"], "env.tools[0]: unknown tool 'calculatr'"),
    "model_path": (["model.path=/nonexistent/ckpt"], "model.path='/nonexistent/ckpt': no such directory"),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_each_mistake_is_one_line_exit_2_and_nothing_written(mistake, tmp_path, tiny_model_dir, rows_file, capsys,
                                                             plugin_registry):
    extra, fragment = MISTAKES[mistake]
    out = tmp_path / "out"
    rc = cli_main(["train", *_overrides(tiny_model_dir, out, rows_file), *extra])
    err = capsys.readouterr().err
    assert rc == 2
    assert len(err.strip().splitlines()) == 1, err
    assert fragment in err
    assert not out.exists()


@pytest.mark.parametrize("mistake", ["plugin_syntax", "row_agent_name", "long_prompt"])
def test_data_and_plugin_mistakes_through_the_entry_point(mistake, tmp_path, tiny_model_dir, capsys, plugin_registry):
    rows = [_row(), _row()]
    extra: list[str] = []
    if mistake == "plugin_syntax":
        (tmp_path / "bad.py").write_text("def f(:\n")
        extra, fragment = [f"plugins=[{tmp_path / 'bad.py'}]"], f"plugin {tmp_path / 'bad.py'}: syntax error at line 1"
    elif mistake == "row_agent_name":
        rows[1]["agent_name"] = "tool_agnt"
        fragment = "training row 1: agent_name: unknown agent 'tool_agnt' (did you mean 'tool_agent'?)"
    else:
        rows[0]["prompt"][0]["content"] = "word " * 600
        fragment = "1 of 2 training rows have prompts longer than agent.max_prompt_tokens=512: row 0 ("
    out = tmp_path / "out"
    rc = cli_main(["train", *_overrides(tiny_model_dir, out, _write_rows(tmp_path / "rows.jsonl", rows)), *extra])
    err = capsys.readouterr().err
    assert (rc, len(err.strip().splitlines())) == (2, 1), err
    assert fragment in err
    assert not out.exists()


def _train_subprocess(*args: str) -> subprocess.CompletedProcess:
    """`asyncrl train ARGS` in a fresh interpreter, which then reports whether ray was ever imported."""
    code = ("import sys; from asyncrl.cli import main; rc = main(['train', *sys.argv[1:]]); "
            "print('RAY_IMPORTED' if 'ray' in sys.modules else 'RAY_NOT_IMPORTED'); sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)


def test_dry_run_checks_everything_prints_a_summary_and_starts_nothing(tmp_path, tiny_model_dir, rows_file):
    out = tmp_path / "out"
    # a learner memory budget the configured micro-batch is far over: the preflight chooses one and says so
    proc = _train_subprocess("--dry-run", *_overrides(tiny_model_dir, out, rows_file),
                             "algorithm.micro_batch_tokens=65536", "trainer.learner_memory_gb=0.3")
    assert proc.returncode == 0, proc.stderr
    assert "asyncrl train: trainer.learner_memory_gb=0.3: algorithm.micro_batch_tokens 65536 -> " in proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "preflight passed; nothing started (--dry-run)"
    assert f"model: {tiny_model_dir}" in lines
    assert "rows: 4 training, 0 evaluation" in lines and "agent: tool_agent" in lines and "tools: calculator" in lines
    assert any(ln.startswith("longest prompt: ") and ln.endswith("(limit agent.max_prompt_tokens=512)") for ln in lines)
    assert lines[-1] == "RAY_NOT_IMPORTED"
    assert not out.exists()


def test_a_failing_preflight_exits_2_before_ray_is_imported(tmp_path, tiny_model_dir, rows_file):
    """Without --dry-run: the command that would train stops at preflight, in its own process."""
    out = tmp_path / "out"
    proc = _train_subprocess(*_overrides(tiny_model_dir, out, rows_file), "agent.name=reactt")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("asyncrl train: preflight: agent.name: unknown agent 'reactt'")
    assert proc.stdout.strip() == "RAY_NOT_IMPORTED"
    assert not out.exists()


# ----------------------------------------------------------------------------- memory


def test_a_learner_step_that_cannot_fit_the_machine_is_refused_naming_the_settings(tiny_model_dir):
    """The estimate (asyncrl/learner/memory_estimate.py) against this machine's memory: the default micro-batch
    fits; one of 50M tokens cannot (its activations alone pass any machine this runs on), and gradient
    checkpointing is named as the other way out until it is on."""
    def problems(*extra: str) -> list[str]:
        return check_learner_memory(load_config(["model=custom", f"model.path={tiny_model_dir}", *extra]),
                                    str(tiny_model_dir)).problems

    assert problems() == []
    (msg,) = problems("algorithm.micro_batch_tokens=50000000")
    assert msg.startswith("the learner's step is estimated at ")
    assert "activations" in msg and "over trainer.memory_stop_fraction=0.9 of this machine's " in msg
    assert msg.endswith("lower algorithm.micro_batch_tokens (now 50000000), set model.gradient_checkpointing=true, "
                        "or set trainer.learner_memory_gb to have the micro-batch chosen")
    (msg,) = problems("algorithm.micro_batch_tokens=500000000", "model.gradient_checkpointing=true")
    assert msg.endswith("lower algorithm.micro_batch_tokens (now 500000000), or set trainer.learner_memory_gb to "
                        "have the micro-batch chosen")


def test_a_learner_memory_budget_chooses_the_largest_micro_batch_that_fits_or_refuses_naming_it():
    """trainer.learner_memory_gb on the default model (SmolLM2-135M's shape): 16,384 tokens do not fit 6 GiB,
    the largest multiple of 256 that does is chosen, and said; its estimate is within the budget and the next
    step up's is not. A budget below the model's own state cannot hold even one sequence: refused, named."""
    from asyncrl.learner.memory_estimate import SMOLLM2_135M, learner_step
    from asyncrl.util.cpus import native_bf16

    cfg = load_config(["algorithm.micro_batch_tokens=16384", "trainer.learner_memory_gb=6"])
    fit = check_learner_memory(cfg, "/nonexistent")  # no config.json, no model.path: the default model's shape
    assert fit.problems == [] and fit.micro_batch_tokens % 256 == 0 and 0 < fit.micro_batch_tokens < 16384

    def gb(tokens: int) -> float:
        longest = cfg.agent.max_prompt_tokens + cfg.agent.max_response_tokens
        return learner_step(SMOLLM2_135M, max(tokens, longest), cfg.algorithm.logits_chunk_tokens,
                            cfg.model.gradient_checkpointing, bf16=cfg.model.cpu_bf16 and native_bf16()).total_gb

    assert gb(fit.micro_batch_tokens) <= 6 < gb(fit.micro_batch_tokens + 256)
    (note,) = fit.notes
    assert note.startswith(f"trainer.learner_memory_gb=6: algorithm.micro_batch_tokens 16384 -> "
                           f"{fit.micro_batch_tokens} (its step estimated at ")
    # already within the budget: nothing changes
    same = check_learner_memory(load_config(["algorithm.micro_batch_tokens=1024", "trainer.learner_memory_gb=20"]),
                                "/nonexistent")
    assert (same.micro_batch_tokens, same.problems, same.notes) == (1024, [], [])
    (msg,) = check_learner_memory(load_config(["trainer.learner_memory_gb=1"]), "/nonexistent").problems
    assert msg.startswith("the learner's step on one sequence of ") and "over trainer.learner_memory_gb=1: raise it" in msg
    with pytest.raises(ConfigError, match=r"trainer.learner_memory_gb: must be a finite number of GiB >= 0"):
        load_config(["trainer.learner_memory_gb=-1"])


def test_the_estimates_parameter_count_is_the_models_own(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    shape = ModelShape.from_config(json.loads((tiny_model_dir / "config.json").read_text()))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert shape.params == sum(p.numel() for p in model.parameters())
    small, big = (learner_step(shape, t, 256, False, True) for t in (1024, 4096))
    assert big.activations_gb == pytest.approx(4 * small.activations_gb) and big.state_gb == small.state_gb
    deep = [learner_step(SMOLLM2_135M, 4096, 256, gc, True).activations_gb for gc in (False, True)]
    assert deep[1] < deep[0] / 4  # 30 layers: checkpointing keeps each one's input, recomputes one at a time
