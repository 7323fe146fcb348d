"""`asyncrl bench e2e`: the same workload in sync and in async mode, in one invocation.

Workload (asyncrl/bench/_e2e_workload.py): long-tailed response lengths and a tool that sleeps a
seeded long-tailed time, a fixed number of training steps, on a tiny model (the point is the
system's overlap of rollout, tools and training, not the model's FLOPs). For each mode it reports
wall time per step, trajectories/s, the learner's idle fraction and mean reward per step, read from
the run's own metrics.jsonl; then the async/sync throughput ratio. The first step of each run is
excluded from the rates (it includes start-up). The modes run interleaved (sync, async, sync, ...) for
`--rounds` rounds; the ratio is the ratio of median trajectories/s, and each mode's detail is that of
its median run.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from asyncrl.bench.rounds import MIN_ROUNDS, interleave, ratio, summary
from asyncrl.config import load_config
from asyncrl.metrics import read_metrics
from asyncrl.run.controller import run as train
from asyncrl.run_dir import RunLayout
from asyncrl.testing import build_tiny_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-groups", type=int, default=4)
    parser.add_argument("--n-samples", type=int, default=4)
    parser.add_argument("--max-staleness", type=int, default=4)
    parser.add_argument("--tool-median-s", type=float, default=0.5)
    parser.add_argument("--max-turn-tokens", type=int, default=128)
    parser.add_argument("--model-path", default=None, help="default: a tiny model built for the run")
    parser.add_argument("--out", default=None, help="keep the runs' output directories here")
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS, help="interleaved rounds; medians are reported")


def _overrides(args: argparse.Namespace, model: str, out: Path, mode: str) -> list[str]:
    concurrency = (args.max_staleness + 1) * args.batch_groups * args.n_samples
    ov = {
        "model": "custom", "model.path": model, "env": "arithmetic", "env.name": "bench_env", "env.tools": "[]",
        "agent.name": "bench_agent", "agent.max_turn_tokens": args.max_turn_tokens,
        "agent.max_response_tokens": args.max_turn_tokens + 64, "plugins": "[asyncrl.bench._e2e_workload]",
        "trainer.mode": mode, "trainer.total_steps": args.steps, "trainer.batch_groups": args.batch_groups,
        "algorithm.n_samples": args.n_samples, "algorithm.max_staleness": args.max_staleness,
        "algorithm.lr": 1e-3, "trainer.output_dir": str(out), "trainer.wandb": "off", "trainer.progress": False,
        "trainer.episodes_per_worker": concurrency, "trainer.max_inflight_generations": 32,
        "engine.max_running_seqs": 32, "trainer.dump_trajectories": 0.0, "env.num_train": 512,
    }
    return [f"{k}={v}" for k, v in ov.items()]


def summarize(metrics: list[dict[str, Any]]) -> dict[str, float]:
    steps = [m for m in metrics if "train/reward_mean" in m]
    if len(steps) < 2:
        raise RuntimeError(f"need at least 2 training steps to measure, got {len(steps)}")
    timed = steps[1:]
    wall = steps[-1]["time"] - steps[0]["time"]
    trajs = sum(m["train/num_trajectories"] for m in timed)
    return {
        "wall_s_per_step": wall / len(timed),
        "trajectories_per_s": trajs / wall,
        "learner_idle_fraction": sum(m["learner/idle_fraction"] for m in timed) / len(timed),
        "reward_per_step": [round(m["train/reward_mean"], 4) for m in steps],
        "reward_mean": sum(m["train/reward_mean"] * m["train/num_trajectories"] for m in steps)
        / sum(m["train/num_trajectories"] for m in steps),
        "staleness_max": max(m["train/staleness_max"] for m in steps),
    }


def run(args: argparse.Namespace) -> dict:
    root = Path(args.out or tempfile.mkdtemp(prefix="asyncrl-bench-e2e-"))
    model = args.model_path or str(build_tiny_model(root / "model", hidden=128, layers=4))
    results: dict[str, list[dict]] = {"sync": [], "async": []}

    def side(mode: str):
        def one() -> float:
            out = root / f"{mode}-{len(results[mode])}"
            if train(load_config(_overrides(args, model, out, mode))) != 0:
                raise RuntimeError(f"{mode} run failed; see {out}")
            results[mode].append(summarize(read_metrics(RunLayout(out).metrics)))
            return results[mode][-1]["trajectories_per_s"]
        return one

    per_s = interleave({"sync": side("sync"), "async": side("async")}, args.rounds)
    median_run = {mode: sorted(runs, key=lambda r: r["trajectories_per_s"])[len(runs) // 2]
                  for mode, runs in results.items()}
    return {"baseline": "sync (max_staleness 0, rollout waits for each sync)", "steps": args.steps,
            "max_staleness": args.max_staleness, "rounds": args.rounds,
            **summary("sync_trajectories_per_s", per_s["sync"], 3), **summary("async_trajectories_per_s", per_s["async"], 3),
            "sync": median_run["sync"], "async": median_run["async"],
            "async_over_sync_throughput": ratio(per_s["async"], per_s["sync"]), "target": 2.5, "output_dir": str(root)}
