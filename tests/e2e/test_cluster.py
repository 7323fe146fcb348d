"""`asyncrl train` across a real multi-node Ray cluster on one machine: `ray.cluster_utils.Cluster`, one raylet
per node, each node with its own resources; roles placed by `ray.placement`, then a node lost mid-run.

The run is a real `asyncrl train` subprocess joining the cluster (ray.address); the cluster is this test's,
and the test ends it (its raylets and gcs by Cluster.shutdown, the run's tree by pid)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from asyncrl.util.net import free_port
from tests.e2e.test_train import (
    _check_layout,
    _finish,
    _kill_tree,
    _overrides,
    _steps,
    _train,
    _trained,
    _wait_record,
    _wait_steps,
)

pytestmark = [pytest.mark.timeout(420)]


def _placed(cluster_address: str, model_dir, out, **extra) -> list[str]:
    return _overrides(model_dir, out, **{
        "ray.address": cluster_address, "ray.num_cpus": "null", "buffer.host": "0.0.0.0", "engine.host": "0.0.0.0",
        "+ray.placement.buffer": "{head: 1}", "+ray.placement.learner": "{learner: 1}",
        "+ray.placement.engine": "{engine: 1}", "+ray.placement.rollout": "{rollout: 1}", **extra})


@pytest.mark.heavy(100)
def test_a_run_across_four_nodes_heals_the_loss_of_its_engine_node_then_its_rollout_node(tiny_model_dir, tmp_path):
    """Head (the buffer and one learner rank), a learner node (the other: a gloo group across nodes), node X
    (the engine), node W (both rollout workers). After step 1 a node Y that can take either joins and X is
    removed: the engine actor and its server die with it, and the run starts a new engine on Y from the
    learner's current weights (a new actor at a new URL, told to the live workers on W, which generate two
    more steps' groups there). Then W is removed: both workers restart on Y at their positions. The run
    finishes: every step trained once at its version, no episode failed, no uid trained twice."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"head": 1, "learner": 1}})
    proc = None
    try:
        cluster.add_node(num_cpus=1, resources={"learner": 1})
        x = cluster.add_node(num_cpus=1, resources={"engine": 1})
        w = cluster.add_node(num_cpus=1, resources={"rollout": 2})
        cluster.wait_for_nodes()
        out, total = tmp_path / "cluster", 10
        proc = _train(_placed(cluster.address, tiny_model_dir, out, **{
            "trainer.total_steps": total, "trainer.learner_ranks": 2, "trainer.rollout_workers": 2,
            "trainer.weight_sync.timeout_s": 20, "engine.probe_timeout_s": 5, "engine.probe_failures": 2}),
            wait=False)
        _wait_steps(out, 1, proc)
        cluster.add_node(num_cpus=2, resources={"engine": 1, "rollout": 2})  # a node that joins mid-run
        cluster.wait_for_nodes()
        lost_at = time.monotonic()
        cluster.remove_node(x)
        engine_healed = _wait_record(out, proc, lambda r: r["faults/engines_replaced"] >= 1, "a new engine served")
        engine_s, lost_at = time.monotonic() - lost_at, time.monotonic()
        # two more steps: with max_staleness 1 they need groups that W's live workers can only have generated on
        # the new engine (told its new URL)
        _wait_steps(out, engine_healed["step"] + 2, proc)
        before = _steps(out)[-1]
        assert before["step"] <= total - 2, "the run was about to end before W was lost"
        assert before["faults/worker_restarts"] == 0  # W's workers went on at the new URL, not restarted into it
        cluster.remove_node(w)
        workers_healed = _wait_record(out, proc, lambda r: r["faults/worker_restarts"] >= 2, "both workers restarted")
        workers_s = time.monotonic() - lost_at
        log = _finish(proc, 300, "finish after its engine node and its rollout node were lost")
        assert proc.returncode == 0, log[-5000:]
        assert "engine 0's actor is gone" in log, log[-5000:]
    finally:
        if proc is not None and proc.poll() is None:
            _kill_tree(proc)
        cluster.shutdown()
    recs = _steps(out)
    assert [r["step"] for r in recs] == list(range(1, total + 1))
    assert [r["version"] for r in recs] == list(range(1, total + 1))
    assert recs[-1]["faults/engines_replaced"] == 1 and recs[-1]["faults/worker_restarts"] >= 2
    assert recs[-1]["rollout/episodes_failed"] == 0
    uids = [u for rec in _trained(out) for u in rec["uids"]]
    assert len(uids) == len(set(uids))  # none trained twice
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["engines_replaced"] == 1 and summary["worker_restarts"] >= 2
    _check_layout(out)
    print(f"engine node lost after step 1: the new engine's first step was {engine_healed['step']}, {engine_s:.1f} s "
          f"later; rollout node lost then: both workers restarted by step {workers_healed['step']}, {workers_s:.1f} s")


@pytest.mark.heavy(15)
def test_a_local_run_starts_its_own_instance_whatever_ray_start_left_on_the_machine(tiny_model_dir, tmp_path):
    """`ray start` (or a Cluster in a test) leaves its address in <tmp>/ray/ray_current_cluster, and a bare
    ray.init() joins it: a run meant to use its own instance would join another user's cluster, or fail on a
    stale address. Here the file names an address nothing listens at; the run starts its own instance and
    gets as far as its cluster check (a placement a local instance cannot offer: exit 2, naming it)."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    from asyncrl.util.net import free_port

    tmp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: Ray's socket paths live under it
    try:
        (tmp / "ray").mkdir()
        (tmp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{free_port()}")
        out = tmp_path / "local"
        args = _overrides(tiny_model_dir, out, **{"+ray.placement.engine": "{gpu_node: 1}"})
        env = {**os.environ, "TMPDIR": str(tmp), "RAY_TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"}
        env.pop("RAY_ADDRESS", None)
        r = subprocess.run([sys.executable, "-m", "asyncrl.cli", "train", *args], capture_output=True, text=True,
                           env=env, timeout=300)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = r.stdout + r.stderr
    assert r.returncode == 2, text[-4000:]
    assert "ray.placement.engine={'gpu_node': 1} for each of 1 engine actor(s): no alive node offers that" in text


def _ray_cli() -> str:
    return str(Path(sys.executable).parent / "ray")


def _wait_nodes(address: str, env: dict, resource: str | None, timeout_s: float = 90) -> None:
    """Until `ray status` at `address` answers (and lists `resource`, when given)."""
    deadline = time.time() + timeout_s
    while True:
        r = subprocess.run([_ray_cli(), "status", f"--address={address}"], capture_output=True, text=True, env=env,
                           timeout=60)
        if r.returncode == 0 and (resource is None or resource in r.stdout):
            return
        assert time.time() < deadline, f"the cluster at {address} is not ready: {r.stdout[-2000:]}{r.stderr[-2000:]}"
        time.sleep(1)


@pytest.mark.heavy(40)
def test_a_run_joins_a_cluster_made_with_ray_start_and_is_refused_until_its_node_joins(tiny_model_dir, tmp_path):
    """As a user would: `ray start --head`, then `asyncrl train ray.address=...` asking for a node kind the
    cluster lacks is refused before anything starts, naming it; `ray start --address` adds that node and the
    same command trains. Ray 2.60 turns token authentication on for `ray start --head` when a token file
    exists (as here, in this test's own HOME); the other node and the run join with RAY_AUTH_MODE=token, as
    docs/cluster.md says. The test ends the `ray start` processes it started, with all they started (by pid)."""
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    token_file = home / ".ray" / "auth_token"
    token_file.write_text(secrets.token_hex(32))
    token_file.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ADDRESS")}
    env.update(HOME=str(home), PYTHONUNBUFFERED="1", RAY_AUTH_MODE="token")
    port = free_port("127.0.0.1")
    address = f"127.0.0.1:{port}"
    ray_tmp = tempfile.mkdtemp(prefix="asyncrl-ray-")  # short: Ray's socket paths below it must fit 107 bytes
    started = []
    try:
        started.append(subprocess.Popen(
            [_ray_cli(), "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=2",
             f"--temp-dir={ray_tmp}", "--include-dashboard=false", "--disable-usage-stats"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True))
        _wait_nodes(address, env, None)
        out = tmp_path / "run"
        args = [sys.executable, "-m", "asyncrl.cli", "train", *_overrides(tiny_model_dir, out, **{
            "ray.address": address, "ray.num_cpus": "null", "buffer.host": "0.0.0.0", "engine.host": "0.0.0.0",
            "+ray.placement.rollout": "{rollout_node: 1}", "trainer.total_steps": 2})]
        refused = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
        assert refused.returncode == 2, refused.stdout[-3000:] + refused.stderr[-3000:]
        assert "rollout_node" in refused.stderr and "no alive node offers that" in refused.stderr, refused.stderr[-3000:]
        started.append(subprocess.Popen(
            [_ray_cli(), "start", "--block", f"--address={address}", "--node-ip-address=127.0.0.1", "--num-cpus=1",
             '--resources={"rollout_node": 1}', "--disable-usage-stats"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
            start_new_session=True))
        _wait_nodes(address, env, "rollout_node")
        shutil.rmtree(out)  # the refused run's summary: the same command, a fresh directory
        done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["exit_code"] == 0 and [r["step"] for r in _trained(out)] == [1, 2]
        assert _steps(out)[-1]["rollout/episodes_failed"] == 0
    finally:
        for proc in reversed(started):
            _kill_tree(proc)
        shutil.rmtree(ray_tmp, ignore_errors=True)
