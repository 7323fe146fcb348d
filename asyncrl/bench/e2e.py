"""`asyncrl bench e2e`: the same workload in sync and in async mode, in one invocation.

Workload (asyncrl/bench/_e2e_workload.py): long-tailed response lengths and a tool that sleeps a
seeded long-tailed time, a fixed number of training steps, on a tiny model (the point is the
system's overlap of rollout, tools and training, not the model's FLOPs). For each mode it reports
wall time per step, trajectories/s, the learner's idle fraction and mean reward per step, read from
the run's own metrics.jsonl; then the async/sync throughput ratio. The first step of each run is
excluded from the rates (it includes start-up). The modes run interleaved (sync, async, sync, ...) for
`--rounds` rounds; the ratio is the ratio of median trajectories/s, and each mode's detail is that of
its median run.

The limit (issue 41): after each async run, the learner alone trains that run's own batches again (read
from its buffer log, batch by batch as trained_uids.jsonl lists them) with the torch threads the async
run gave its learner (asyncrl/util/cpus.py cpu_threads) and nothing else running: `learner_only_s`, the
mean per step (a mean, as the wall time per step is: long-tailed batches make some steps twice as long).
`async_over_limit` = the async run's wall time per step / that (1.0: a loop as fast as its learner alone). The async run's own learner step and weight sync per step are reported beside it, so the gap
reads as: the learner slowed by sharing the cores, the sync, and the learner's idle time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from asyncrl.bench.rounds import MIN_ROUNDS, interleave, ratio, summary
from asyncrl.buffer import wal
from asyncrl.buffer.protocol import canonical_batch
from asyncrl.config import load_config
from asyncrl.data.schema import Batch, Group, Trajectory
from asyncrl.metrics import read_metrics
from asyncrl.run.controller import run as train
from asyncrl.run_dir import RunLayout
from asyncrl.testing import build_tiny_model
from asyncrl.util.cpus import available_cpus, cpu_threads


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
        "learner_step_s": statistics.median(m["learner/step_seconds"] for m in timed),
        "sync_s": statistics.median(m.get("sync/seconds", 0.0) for m in timed),
    }


def trained_batches(out: Path) -> list[Batch]:
    """The batches a finished run trained, in step order, rebuilt from its buffer log (every trajectory
    that arrived is a PUT record there; the log of a short run is never compacted) and trained_uids.jsonl."""
    layout = RunLayout(out)
    raw = {}
    dec = msgspec.msgpack.Decoder(Trajectory)
    for rec in wal.scan(layout.buffer / wal.WAL_NAME):
        if isinstance(rec, wal.Record) and rec.kind == wal.REC_PUT:
            t = dec.decode(rec.payload)
            raw[t.uid] = t
    batches = []
    for line in layout.trained_uids.read_text().splitlines():
        row = json.loads(line)
        trajs = [raw[u] for u in row["uids"]]
        groups: dict[str, list[Trajectory]] = {}
        for t in trajs:
            groups.setdefault(t.group_id, []).append(t)
        batches.append(canonical_batch(row["step"], [Group(group_id=g, trajectories=ts, expected=ts[0].group_size)
                                                     for g, ts in groups.items()]))
    return batches


def learner_only(cfg: Any, batches: list[Batch], threads: int) -> list[float]:
    """Seconds of LearnerWorker.train_step on each batch after the first (as `summarize` leaves out the first
    step), alone, on `threads` torch threads."""
    # lazy: imports torch, which this module does not load otherwise
    import torch

    # lazy: as above
    from asyncrl.learner.worker import LearnerWorker

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        worker = LearnerWorker(cfg, rank=0, world_size=1)
        times = []
        for i, batch in enumerate(batches):
            t0 = time.perf_counter()
            worker.train_step(batch)
            if i:
                times.append(time.perf_counter() - t0)
        return times
    finally:
        torch.set_num_threads(before)


def run(args: argparse.Namespace) -> dict:
    root = Path(args.out or tempfile.mkdtemp(prefix="asyncrl-bench-e2e-"))
    model = args.model_path or str(build_tiny_model(root / "model", hidden=128, layers=4))
    results: dict[str, list[dict]] = {"sync": [], "async": []}

    def side(mode: str):
        def one() -> float:
            out = root / f"{mode}-{len(results[mode])}"
            cfg = load_config(_overrides(args, model, out, mode))
            if train(cfg) != 0:
                raise RuntimeError(f"{mode} run failed; see {out}")
            metrics = read_metrics(RunLayout(out).metrics)
            results[mode].append(summarize(metrics))
            if mode == "async":
                _, threads = cpu_threads("async", available_cpus(), cfg.engine.num_engines, cfg.trainer.learner_ranks)
                alone = statistics.fmean(learner_only(cfg, trained_batches(out), threads))  # as wall_s_per_step
                results[mode][-1].update(learner_only_s=round(alone, 4), learner_threads=threads,
                                         async_over_limit=round(results[mode][-1]["wall_s_per_step"] / alone, 3))
            return results[mode][-1]["trajectories_per_s"]
        return one

    per_s = interleave({"sync": side("sync"), "async": side("async")}, args.rounds)
    median_run = {mode: sorted(runs, key=lambda r: r["trajectories_per_s"])[len(runs) // 2]
                  for mode, runs in results.items()}
    return {"baseline": "sync (max_staleness 0, rollout waits for each sync)", "steps": args.steps,
            "max_staleness": args.max_staleness, "rounds": args.rounds,
            **summary("sync_trajectories_per_s", per_s["sync"], 3), **summary("async_trajectories_per_s", per_s["async"], 3),
            "sync": median_run["sync"], "async": median_run["async"],
            "async_over_sync_throughput": ratio(per_s["async"], per_s["sync"]), "target": 2.5,
            **summary("async_over_limit", [r["async_over_limit"] for r in results["async"]], 3),
            "limit_target": 1.25, "output_dir": str(root)}
