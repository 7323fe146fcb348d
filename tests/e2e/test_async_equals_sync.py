"""The async path at staleness 0 is the synchronous algorithm, bit for bit (issue 39's proof).

Two real `asyncrl train` runs on the tiny model with the same seed: one `trainer.mode=async` with
`algorithm.max_staleness=0`, one `trainer.mode=sync`. They must sample the same tokens with the same
behaviour log-probabilities, train the same steps with the same losses, gradient norms and sampler/learner
mismatch, and end with byte-identical weights. What makes that hold: every episode's sampling seed is
fixed by the run's seed and its place (asyncrl/util/seeds.py; without it this test fails at the first
token, checked), the admission gate hands each version exactly its batch's prompts, and the learner's
batch has one canonical order whatever the order its trajectories arrived in (asyncrl/buffer/protocol.py
`decode_batch`; with one generation in flight they arrive in one order anyway, so that part is
tests/buffer/test_wire.py's).

Equal floats also need equal arithmetic: each run is pinned to one core, so both give the engine and the
learner one torch thread each (asyncrl/util/cpus.py gives sync mode every core, async half: a different
thread count reorders float sums), and one generation is in flight at a time (the embedded engine's
batches, whose composition follows timing, change logits in the last bits: measured 1e-6 between a
request run alone and in a batch of 8). The reward is a plugin that scores the response's text, so
groups have unequal rewards and every step changes the weights (the tiny model earns the env's reward
0 everywhere, which would make the weights' equality empty).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.metrics import read_metrics

from .test_train import _overrides

pytestmark = [pytest.mark.timeout(420)]

STEPS = 4
SEED = 3
TIMING = ("seconds", "_per_s", "time", "idle_fraction", "memory/", "rss_gb")


def _start(model_dir: Path, out: Path, reward: Path, cpu: int, **mode: object) -> subprocess.Popen:
    args = _overrides(model_dir, out, **{
        "trainer.total_steps": STEPS, "seed": SEED, "trainer.max_inflight_generations": 1,
        "trainer.dump_trajectories": 1.0, "env.reward.path": str(reward), "env.reward.name": "by_text",
        "trainer.checkpoint_every": 0, **mode})
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
                            preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))


def _trajectories(out: Path) -> dict[str, dict]:
    """uid (its run id replaced, the one thing that differs by design) -> what was sampled and scored, for
    each trajectory the run trained (the prompts admitted for the version after the last step were being
    sampled when the run ended: timing decides how far)."""
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    trained = {u for line in (out / "trained_uids.jsonl").read_text().splitlines() for u in json.loads(line)["uids"]}
    recs = {}
    for line in (out / "trajectories-w0.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["uid"] not in trained:
            continue
        recs[r["uid"].replace(run_id, "RUN")] = {k: r[k] for k in (
            "data_index", "sample_index", "reward", "response_ids", "loss_mask", "versions", "behavior_logprobs",
            "finish_reason", "num_turns")} | {"text": [m.get("content") for m in r["messages"]]}
    return recs


def _learning(out: Path) -> list[dict]:
    """Each step's learner and batch figures, timings left out."""
    return [{k: v for k, v in r.items() if k.startswith(("learner/", "train/")) and not any(t in k for t in TIMING)}
            for r in read_metrics(out / "metrics.jsonl")]


@pytest.mark.heavy(60)
def test_async_at_staleness_0_and_the_sync_baseline_sample_train_and_end_bit_identical(tiny_model_dir, tmp_path):
    reward = tmp_path / "text_reward.py"
    reward.write_text("def by_text(final_text, **kw):\n    return (sum(map(ord, final_text)) % 5) / 4\n")
    cpus = sorted(os.sched_getaffinity(0))
    outs = {"async": tmp_path / "async", "sync": tmp_path / "sync"}
    procs = {"async": _start(tiny_model_dir, outs["async"], reward, cpus[0], **{"trainer.mode": "async",
                                                                               "algorithm.max_staleness": 0}),
             "sync": _start(tiny_model_dir, outs["sync"], reward, cpus[-1], **{"trainer.mode": "sync"})}
    logs = {}
    try:
        for name, p in procs.items():
            logs[name] = p.communicate(timeout=360)[0]
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait(30)
    for name, p in procs.items():
        assert p.returncode == 0, f"{name}: {logs[name][-3000:]}"

    a, s = _trajectories(outs["async"]), _trajectories(outs["sync"])
    assert len(a) == STEPS * 2 * 2 and a.keys() == s.keys(), (sorted(a), sorted(s))
    for uid in a:
        assert a[uid] == s[uid], f"{uid} differs:\nasync {a[uid]}\nsync  {s[uid]}"
    assert {r["versions"][0] for r in a.values()} == set(range(STEPS))  # each step's batch sampled by its version
    assert len({r["reward"] for r in a.values()}) > 1

    la, ls = _learning(outs["async"]), _learning(outs["sync"])
    assert [r["learner/version"] for r in la] == list(range(1, STEPS + 1))
    assert la == ls  # losses, gradient norms, IS and mismatch figures, advantages: the same floats
    assert all(r["train/staleness_max"] == 0 for r in la)
    assert all(r["learner/grad_norm"] > 0 for r in la), [r["learner/grad_norm"] for r in la]

    weights = {name: (out / "final" / "model.safetensors").read_bytes() for name, out in outs.items()}
    assert weights["async"] == weights["sync"]
    base = (Path(tiny_model_dir) / "model.safetensors").read_bytes()
    assert weights["async"] != base  # the steps changed the weights
