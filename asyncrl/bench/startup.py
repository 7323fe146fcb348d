"""Start-up costs: a rollout worker's set-up, and an embedded engine's launch, each against its baseline.

A rollout worker: the CPU time and memory of setting one up, against what it cost before it left the
learner's plugins and transformers' model registry alone.

Each side runs in a fresh Python process (as a worker actor starts), in interleaved rounds (asyncrl/bench/rounds.py):
  - lean (what a rollout or eval worker does): the worker's modules, `registry.load_all(learner=False)`,
    `load_tokenizer` (asyncrl/models.py: a generic fast tokenizer loaded directly);
  - full (the baseline): the same modules, `registry.load_all()` (the losses and advantage estimators too:
    torch) and `AutoTokenizer.from_pretrained` (its AutoConfig imports transformers' model registry,
    DTensor and sympy).
Each process reports its own CPU seconds (user + system) and its peak resident memory. `cpu_ratio` is
full / lean by medians; `torch_imported` says which side imported torch.

An engine (`--engines`, default on): the seconds from `launch_embedded` to a healthy server and the CPU the
engine process spent by then, spawned (`fork=False`: a fresh interpreter, a process's first launch) against
forked by this process's fork server (`fork=True`: every launch after the first; asyncrl/engine/forkserver.py),
interleaved; the fork server is started before the rounds. `engine_launch_ratio` is spawned / forked.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
import time

import psutil

from asyncrl.bench.rounds import MIN_ROUNDS, interleave, ratio, summary
from asyncrl.config import ModelConfig
from asyncrl.engine.forkserver import fork_server
from asyncrl.engine.launcher import launch_embedded
from asyncrl.models import resolve_model_dir

SETUP = textwrap.dedent("""
    import json, resource, sys
    from asyncrl import registry
    from asyncrl.models import load_tokenizer
    from asyncrl.config import ModelConfig
    from asyncrl.rollout.worker import RolloutWorker
    import asyncrl.run.rollout_actor
    model = ModelConfig(path=sys.argv[2])
    if sys.argv[1] == "lean":
        registry.load_all([], learner=False)
        tok = load_tokenizer(model)
    else:
        from asyncrl.models import resolve_model_dir
        from transformers import AutoTokenizer
        registry.load_all([])
        tok = AutoTokenizer.from_pretrained(resolve_model_dir(model))
    tok.apply_chat_template([{"role": "user", "content": "2 + 2"}], tokenize=True, add_generation_prompt=True)
    use = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"cpu_s": use.ru_utime + use.ru_stime, "rss_mb": use.ru_maxrss / 1024,
                      "torch": "torch" in sys.modules}))
""")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", default=None, help="a model dir (default: the default model, converted once)")
    parser.add_argument("--rounds", type=int, default=5, help=f"interleaved rounds (at least {MIN_ROUNDS})")
    parser.add_argument("--no-engines", action="store_true", help="skip the engine launches")


def _side(name: str, model_dir: str, seen: dict[str, dict]) -> float:
    out = subprocess.run([sys.executable, "-c", SETUP, name, model_dir], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"the {name} set-up failed:\n{out.stderr[-2000:]}")
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    seen.setdefault(name, {"rss_mb": [], "torch": rec["torch"]})["rss_mb"].append(rec["rss_mb"])
    return rec["cpu_s"]


def _launch(model_dir: str, fork: bool, cpu: list[float]) -> float:
    t0 = time.perf_counter()
    with launch_embedded(model_dir, threads=1, fork=fork, startup_timeout_s=300) as eng:
        seconds = time.perf_counter() - t0
        times = psutil.Process(eng.pid).cpu_times()
        cpu.append(times.user + times.system)
    return seconds


def run(args: argparse.Namespace) -> dict:
    if args.rounds < MIN_ROUNDS:
        raise SystemExit(f"asyncrl bench startup: --rounds must be >= {MIN_ROUNDS}, got {args.rounds}")
    model_dir = str(resolve_model_dir(ModelConfig(path=args.model_path)))
    seen: dict[str, dict] = {}
    cpu = interleave({side: (lambda side=side: _side(side, model_dir, seen)) for side in ("lean", "full")}, args.rounds)
    out = {"model": model_dir, "rounds": args.rounds,
           **summary("lean_cpu_s", cpu["lean"]), **summary("full_cpu_s", cpu["full"]),
           **summary("lean_rss_mb", seen["lean"]["rss_mb"], 0), **summary("full_rss_mb", seen["full"]["rss_mb"], 0),
           "cpu_ratio": ratio(cpu["full"], cpu["lean"]),
           "torch_imported": {side: seen[side]["torch"] for side in ("lean", "full")}}
    if not args.no_engines:
        fork_server()  # its imports are paid once per launching process, before the rounds
        engine_cpu: dict[str, list[float]] = {"spawned": [], "forked": []}
        wall = interleave({"spawned": lambda: _launch(model_dir, False, engine_cpu["spawned"]),
                           "forked": lambda: _launch(model_dir, True, engine_cpu["forked"])}, args.rounds)
        out.update(**summary("engine_spawned_s", wall["spawned"]), **summary("engine_forked_s", wall["forked"]),
                   **summary("engine_spawned_cpu_s", engine_cpu["spawned"]),
                   **summary("engine_forked_cpu_s", engine_cpu["forked"]),
                   engine_launch_ratio=ratio(wall["spawned"], wall["forked"]))
    return out
