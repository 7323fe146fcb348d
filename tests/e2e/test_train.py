"""End-to-end `asyncrl train` on a tiny model: real Ray actors, engine server, buffer, learner.

Each run is a real `asyncrl train` subprocess; the checks read what it wrote (metrics.jsonl,
trained_uids.jsonl, checkpoints) rather than trusting its exit code alone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from zmq.utils import z85

from asyncrl.buffer.keys import BufferKeys
from asyncrl.metrics import read_metrics
from asyncrl.run_dir import layout_entry
from asyncrl.view.records import RunReader

pytestmark = [pytest.mark.timeout(420)]

OPENAI_AGENT_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openai_agent" / "agent.py"


def _overrides(model_dir: Path, out: Path, **extra: object) -> list[str]:
    base = {
        "model": "custom", "model.path": str(model_dir), "trainer.output_dir": str(out),
        "trainer.total_steps": 3, "trainer.batch_groups": 2, "algorithm.n_samples": 2,
        "algorithm.max_staleness": 1, "algorithm.lr": 1e-3, "agent.max_turn_tokens": 12,
        "agent.max_response_tokens": 40, "agent.max_assistant_turns": 2, "env.num_train": 64,
        "env.num_val": 4, "trainer.wandb": "off", "trainer.progress": False, "engine.max_running_seqs": 8,
        "algorithm.micro_batch_tokens": 2048, "ray.num_cpus": 4,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _train(args: list[str], *, wait: bool = True, **kw) -> subprocess.Popen | subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0"}
    if wait:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, **kw)


def _trained(out: Path) -> list[dict]:
    with open(out / "trained_uids.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def _tree(proc: subprocess.Popen) -> list[psutil.Process]:
    """Every live descendant of the `asyncrl train` subprocess this test started (Ray's gcs and raylet,
    its actor workers, the engine servers the engine actors launched)."""
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _pgid(p: psutil.Process) -> int | None:
    try:
        return os.getpgid(p.pid)
    except OSError:
        return None


# an engine server's process name: engines are forked from a fork server (asyncrl/engine/forkserver.py), whose
# command line they keep; `_cmdline` ends with the name, so a needle can name either
ENGINE = "[asyncrl-engine]"


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline()) + f" [{p.name()}]"
    except psutil.Error:
        return ""


def _environ(p: psutil.Process) -> dict[str, str]:
    try:
        return p.environ()
    except psutil.Error:
        return {}


def _find(proc: subprocess.Popen, needle: str, n: int = 1) -> list[psutil.Process]:
    """The `n` processes under `proc` whose command line contains `needle` (asserted: exactly n).
    Never looks outside the run's own process tree, so no other process on the host is touched."""
    found = [p for p in _tree(proc) if needle in _cmdline(p)]
    assert len(found) == n, f"expected exactly {n} {needle!r} under pid {proc.pid}, found " \
                            f"{[(p.pid, _cmdline(p)) for p in found]}"
    return found


def _kill_one(proc: subprocess.Popen, needle: str) -> int:
    """SIGKILL the one process under `proc` whose command line contains `needle`; its pid."""
    found = _find(proc, needle)
    found[0].kill()
    found[0].wait(timeout=30)
    return found[0].pid


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the run and every process it started (by pid: children in other sessions included)."""
    tree = _tree(proc)
    if proc.poll() is None:
        proc.kill()
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=30)
    proc.wait(timeout=30)


def _check_layout(out: Path) -> None:
    """Every file and folder the run wrote at its directory's top level is a name the layout declares
    (asyncrl/run_dir.py `LAYOUT`), of the kind it declares: a name spelled anywhere else fails here."""
    names = {p.name: p.is_dir() for p in out.iterdir()}
    undeclared = sorted(n for n in names if layout_entry(n) is None)
    assert not undeclared, f"{out} holds names asyncrl/run_dir.py's LAYOUT does not declare: {undeclared}"
    kind = sorted(n for n, is_dir in names.items() if layout_entry(n).is_dir != is_dir)
    assert not kind, f"{out}: a file where the layout declares a folder, or the reverse: {kind}"


def _check_run(out: Path, steps: int, max_staleness: int, stale_drops_allowed: bool = False) -> list[dict]:
    """Every step trained once, at its version, on 2 groups x 2 samples; no episode failed. With
    `stale_drops_allowed`, a batch may be short by members the buffer dropped as stale (a group whose
    members were generated on either side of a fault: the bound is kept, the drop counted), and by no more."""
    recs = [r for r in read_metrics(out / "metrics.jsonl") if "train/reward_mean" in r]
    assert [r["step"] for r in recs] == list(range(1, steps + 1))
    assert [r["version"] for r in recs] == list(range(1, steps + 1))  # one version per step
    shortfall = 0
    for r in recs:
        assert r["train/staleness_max"] <= max_staleness
        assert 1 <= r["train/num_trajectories"] <= 4
        shortfall += 4 - r["train/num_trajectories"]
    assert shortfall <= (recs[-1]["buffer/dropped_stale"] if stale_drops_allowed else 0), recs[-1]
    assert recs[-1]["rollout/episodes_failed"] == 0 and recs[-1]["buffer/groups_dropped_failed"] == 0
    assert (out / "checkpoints" / f"step_{steps:06d}").is_dir()
    assert (out / "final" / "config.json").is_file()
    _check_layout(out)
    dumped = list(out.glob("trajectories-w*.jsonl"))
    assert dumped and sum(1 for _ in open(dumped[0])) >= 4
    uids = [u for rec in _trained(out) for u in rec["uids"]]
    assert len(uids) == len(set(uids)) == 4 * steps - shortfall  # nothing trained twice
    # what `asyncrl view` reads: every line whole, token arrays aligned, trained rows at the step that trained them
    view = RunReader(out)
    view.poll()
    assert view.bad_lines == 0 and view.rows
    step_of = {u: rec["step"] for rec in _trained(out) for u in rec["uids"]}
    decoupled = json.loads((out / "config.json").read_text())["algorithm"]["decoupled"]
    for row in view.rows:
        r = row.record
        assert len(r["response_ids"]) == len(r["loss_mask"]) == len(r["versions"]) == len(r["behavior_logprobs"])
        if row.status == "trained" and decoupled:  # the learner's log-probs of the same tokens, before its step
            assert len(row.proximal_logprobs) == len(r["behavior_logprobs"]) and row.mismatch_k3() >= 0
        assert row.step == step_of.get(row.uid) if row.status == "trained" else row.uid not in step_of
        assert row.staleness is None or 0 <= row.staleness <= max_staleness
    return recs


def _steps(out: Path) -> list[dict]:
    metrics = out / "metrics.jsonl"
    return [r for r in read_metrics(metrics) if "train/reward_mean" in r] if metrics.exists() else []


def _wait_until(proc: subprocess.Popen, cond, what: str, timeout_s: float = 300):
    """`cond()`'s first truthy value, polled until `timeout_s`; fails at once if the run exits first."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if got := cond():
            return got
        if proc.poll() is not None:
            pytest.fail(f"the run exited ({proc.returncode}) before {what}; its log ends:\n{proc.communicate()[0][-6000:]}")
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s:.0f}s: {what}")


def _wait_record(out: Path, proc: subprocess.Popen, cond, what: str) -> dict:
    """The first step record of the run that satisfies `cond`."""
    return _wait_until(proc, lambda: next((r for r in _steps(out) if cond(r)), None), what)


def _uids_recorded(out: Path) -> int:
    return len(_trained(out)) if (out / "trained_uids.jsonl").exists() else 0


def _wait_steps(out: Path, n: int, proc: subprocess.Popen) -> None:
    _wait_record(out, proc, lambda r: r["step"] >= n, f"step {n} was trained")


def _finish(proc: subprocess.Popen, timeout_s: float, what: str) -> str:
    """The run's log once it exits by itself within `timeout_s` (else it is killed and the test fails)."""
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        log, _ = proc.communicate()
        pytest.fail(f"the run did not {what} within {timeout_s:.0f} s; its log ends:\n{log[-6000:]}")
    return log


@pytest.mark.heavy(95)
def test_async_run_survives_a_killed_worker_a_killed_engine_and_a_hung_engine(tiny_model_dir, tmp_path):
    """One async run, three faults on its real processes, each injected once the previous one healed:
    a SIGKILLed rollout worker (restarted at its position), a SIGKILLed engine server (relaunched), then
    a hung one: the replacement SIGSTOPped (its process lives, its socket accepts, nothing answers) fails
    its one-token liveness probes, is SIGKILLed and relaunched. The run completes; no episode fails, and a
    batch is short only by members the buffer dropped as stale."""
    out, total = tmp_path / "faults", 8
    # a sync caught by an engine's death or hang mid-collective is abandoned after weight_sync.timeout_s
    proc = _train(_overrides(tiny_model_dir, out, **{"trainer.total_steps": total, "trainer.weight_sync.timeout_s": 20,
                                                     "engine.probe_timeout_s": 5, "engine.probe_failures": 2}),
                  wait=False)
    try:
        _wait_steps(out, 1, proc)
        _kill_one(proc, "ray::RolloutActor")
        _wait_steps(out, 2, proc)
        killed = _kill_one(proc, ENGINE)
        # the relaunch is synchronous: a step recorded with the restart counted ran on the replacement
        healed = _wait_record(out, proc, lambda r: r["faults/engine_restarts"] >= 1, "the engine was relaunched")
        # with staleness 1, steps step+2.. need groups that only a replacement of the hung engine can generate
        assert healed["step"] <= total - 3, f"the run reached step {healed['step']} before the hang was injected"
        hung = _find(proc, ENGINE)[0]
        assert hung.pid != killed
        hung.send_signal(signal.SIGSTOP)
        log = _finish(proc, 300, "finish after the kills and the hang")
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
    assert proc.returncode == 0, log[-4000:]
    assert "failed 2 liveness probes in a row" in log, log[-4000:]
    assert not hung.is_running() or hung.status() == psutil.STATUS_ZOMBIE  # killed, not left stopped
    # no episode was given up on: a batch is short only by a member dropped as stale (its group's other
    # member waited out the hang while the learner moved on), counted by the buffer
    recs = _check_run(out, total, max_staleness=1, stale_drops_allowed=True)
    assert recs[-1]["faults/worker_restarts"] >= 1
    assert recs[-1]["faults/engine_restarts"] >= 2


@pytest.mark.heavy(35)
def test_a_killed_learner_rank_stops_the_run_with_a_resume_hint(tiny_model_dir, tmp_path):
    out = tmp_path / "lost_rank"
    proc = _train(_overrides(tiny_model_dir, out, **{"trainer.learner_ranks": 2, "trainer.total_steps": 50}),
                  wait=False)
    try:
        _wait_steps(out, 1, proc)
        _find(proc, "ray::LearnerActor", n=2)[-1].kill()
        log = _finish(proc, 300, "stop after a learner rank was killed")
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
    assert proc.returncode not in (0, None), log[-4000:]
    assert re.search(r"LearnerRankLost: learner rank [01] died \(.*\): the run stops; resume from the last "
                     r"checkpoint with trainer.resume=auto", log), log[-4000:]


@pytest.mark.heavy(45)
def test_a_stopped_learner_stops_the_run_naming_it_within_the_learner_timeout(tiny_model_dir, tmp_path):
    """A learner whose process is alive but never answers (SIGSTOP, as an operator or a debugger does): the
    driver's wait is bounded by trainer.learner_timeout_s, the run stops naming the rank, the call and the
    setting, and no process of it is left (the stopped one included)."""
    out = tmp_path / "stopped_learner"
    proc = _train(_overrides(tiny_model_dir, out, **{"trainer.total_steps": 50, "trainer.learner_timeout_s": 15}),
                  wait=False)
    try:
        _wait_steps(out, 1, proc)
        ours = _tree(proc)
        _find(proc, "ray::LearnerActor", n=1)[0].suspend()  # SIGSTOP
        log = _finish(proc, 240, "stop after the learner was stopped")
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
    assert proc.returncode == 1, log[-4000:]
    assert re.search(r"learner rank 0 did not answer \w+ within [\d.]+ s \(trainer.learner_timeout_s=15\): its "
                     r"process is stopped or wedged", log), log[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert "LearnerRankStalled" in summary["exit_reason"], summary
    _, left = psutil.wait_procs(ours, timeout=30)
    assert not left, f"processes of the run still alive: {[(p.pid, _cmdline(p)) for p in left]}"


@pytest.mark.heavy(70)
def test_resume_after_a_crash_loses_nothing_and_sigterm_checkpoints_then_stops_every_child(tiny_model_dir, tmp_path):
    """A crash (SIGKILL of the run's whole tree) once step 3 is trained, after checkpoint 2: the run resumed
    with trainer.resume=auto trains only the batches checkpoint 2 did not commit, and loses none. That
    resumed run is then sent what k8s (to the container's PID 1) and systemd send: SIGTERM to the `asyncrl
    train` process alone. ray.init replaces SIGTERM's handler with sys.exit (the run then died as a crash: no
    checkpoint, no summary, Ray's agents orphaned); the controller installs its own again, so the run
    checkpoints, writes its summary, stops every child and exits 128 + SIGTERM. (SIGINT takes the same
    handler, also when the run started with SIGINT ignored: tests/core/test_stop_signals.py; SIGTERM to the
    process group, which holds Ray's gcs_server and raylet too, and to every process of the job, as slurm
    sends it: the test after this one.)"""
    out = tmp_path / "resume"
    args = _overrides(tiny_model_dir, out, **{"trainer.total_steps": 8, "trainer.checkpoint_every": 2,
                                               "trainer.keep_checkpoints": 5})
    proc = _train(args, wait=False)
    try:  # kill once step 3 is trained: after checkpoint 2, before 4
        _wait_until(proc, lambda: _uids_recorded(out) >= 3, "step 3 was trained")
        _kill_tree(proc)  # the crash: the run and everything it started, nothing else on the host
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
    first = _trained(out)
    ckpts = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert ckpts and ckpts[-1] == "step_000002", ckpts
    committed = {u for rec in first if rec["step"] <= 2 for u in rec["uids"]}
    lost = {u for rec in first if rec["step"] > 2 for u in rec["uids"]}  # trained but not checkpointed
    assert len(committed) == 8 and lost

    # resumed: checkpoint_every=100 is never reached, so a checkpoint past step 2 is the signal's
    resumed = [*args, "trainer.resume=auto", "trainer.total_steps=50", "trainer.checkpoint_every=100"]
    proc = _train(resumed, wait=False)
    try:
        # steps 3, 4 and 5 trained again (as many as a resume to total_steps=5 would train)
        _wait_until(proc, lambda: _uids_recorded(out) >= len(first) + 3, "the resumed run trained 3 steps")
        ours = _tree(proc)  # the run's own processes, found from its pid: no other process is looked at
        names = " ".join(_cmdline(p) for p in ours)
        for part in ("ray::LearnerActor", "ray::RolloutActor", "ray::EngineActor", "ray::BufferActor",
                     ENGINE, "raylet"):
            assert part in names, f"{part!r} is not among the run's processes: {names[:2000]}"
        os.kill(proc.pid, signal.SIGTERM)
        log, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
    assert proc.returncode == 128 + signal.SIGTERM, log[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exit_code"] == 128 + signal.SIGTERM and summary["exit_reason"] == "interrupted (SIGTERM)", summary
    again = _trained(out)[len(first):]
    after = [u for rec in again for u in rec["uids"]]
    assert [rec["step"] for rec in again] == list(range(3, 3 + len(again))) and len(again) >= 3, again
    assert not committed & set(after), "a batch committed with checkpoint 2 was trained again"
    assert len(after) == len(set(after))
    assert lost <= set(after), "a batch trained after the checkpoint was not served again after resume"
    steps = sorted(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*"))
    assert steps[-1] >= 5, steps  # checkpoint_every=100 was never reached: the signal wrote it
    _, left = psutil.wait_procs(ours, timeout=30)  # by pid and start time: a reused pid is not ours
    assert not left, f"processes of the run still alive after SIGTERM: {[(p.pid, _cmdline(p)) for p in left]}"


@pytest.mark.heavy(35)
def test_sigterm_to_every_process_of_the_job_ends_the_run_as_one_clean_interrupt(tiny_model_dir, tmp_path):
    """What slurm's scancel (and a k8s pod's stop, with a shared process namespace) does: SIGTERM to every
    process of the job at once, Ray's own and the actors' workers included; first to the process group of
    `asyncrl train` (what a terminal, `timeout` or systemd's KillMode=mixed send: it holds Ray's gcs_server
    and raylet), then to every other process of the run. Ray's processes stop on it, so the interrupt's
    checkpoint may find the run's parts gone: the run still ends as one interrupt (exit 143, summary, no
    traceback), its last line says whether a checkpoint was written and what was kept, and no process of the
    run is left. (Before: a crash, exit 1, with the buffer's traceback.)"""
    out = tmp_path / "run"
    proc = _train(_overrides(tiny_model_dir, out, **{"trainer.total_steps": 50, "trainer.checkpoint_every": 100}),
                  wait=False)
    try:
        _wait_until(proc, lambda: _uids_recorded(out) >= 1, "step 1 was trained")
        ours = _tree(proc)
        group = " ".join(_cmdline(p) for p in ours if _pgid(p) == proc.pid)
        assert "gcs_server" in group and "raylet" in group, group[:2000]
        os.killpg(proc.pid, signal.SIGTERM)
        for p in ours:  # by pid: this run's processes, nothing else on the host
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        log, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
    assert proc.returncode == 128 + signal.SIGTERM, log[-4000:]
    assert "Traceback" not in log, log[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exit_reason"] == "interrupted (SIGTERM)", summary
    written = sorted(p.name for p in (out / "checkpoints").glob("step_*")) if (out / "checkpoints").exists() else []
    if written:  # Ray's parts outlived the signal long enough: the interrupt's checkpoint, as for one process
        assert summary["diagnosis"] == "", summary
    else:
        assert summary["diagnosis"].startswith("no checkpoint at the interrupt: "), summary
        assert "no checkpoint was written, and every trajectory the buffer acknowledged is in its log: resume " \
               "with trainer.resume=auto" in summary["diagnosis"], summary
        assert f"asyncrl train: stopped: {summary['diagnosis']}" in log
    assert not [p for p in (out / "checkpoints").glob("*.tmp")] if (out / "checkpoints").exists() else True
    _, left = psutil.wait_procs(ours, timeout=30)
    assert not left, f"processes of the run still alive after SIGTERM: {[(p.pid, _cmdline(p)) for p in left]}"


@pytest.mark.heavy(30)
def test_a_disk_that_fills_at_a_checkpoint_stops_the_run_with_one_line_and_its_summary(tiny_model_dir, tmp_path):
    """The run's directory on a 96 MiB tmpfs of its own (a user + mount namespace, `unshare -rm`, as the
    sandbox makes): the buffer's 64 MiB reserve and the run's files fit, the first checkpoint (about 50 MiB)
    does not. torch's writer fails with "unexpected pos" (no errno), DCP wraps it in a BaseException. The run
    stops with exit 1 and one line naming the checkpoint, what was kept and how to go on; the summary is
    written (its room was held from the start); the half-written step dir is gone. (Before: four tracebacks,
    step_N.tmp left, and the summary's own write failing.)"""
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    out = tmp_path / "run"
    out.mkdir()
    args = _overrides(tiny_model_dir, out, **{"trainer.total_steps": 50, "trainer.checkpoint_every": 1})
    # the tmpfs lives as long as the namespace: the run's files are read inside it, then printed
    show = ('import json, pathlib, sys; d = pathlib.Path(sys.argv[1]); print("RUNDIR " + json.dumps('
            '{"summary": json.loads((d / "summary.json").read_text()), "ckpts": sorted(p.name for p in '
            '(d / "checkpoints").iterdir()), "names": sorted(p.name for p in d.iterdir())}))')
    script = ('mount -t tmpfs -o size=96m tmpfs "$0" || exit 97; "$@"; rc=$?; '
              f'{sys.executable} -c \'{show}\' "$0"; exit $rc')
    cmd = ["unshare", "-rm", "sh", "-c", script, str(out), sys.executable, "-m", "asyncrl.cli", "train", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400)
    log = res.stdout + res.stderr
    if res.returncode == 97:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {res.stderr[-500:]}")
    assert res.returncode == 1, log[-4000:]
    assert "Traceback" not in log, log[-4000:]
    seen = json.loads(next(x for x in res.stdout.splitlines() if x.startswith("RUNDIR "))[len("RUNDIR "):])
    summary = seen["summary"]
    assert summary["exit_code"] == 1 and summary["exit_reason"] == "stopped: disk full", summary
    assert re.fullmatch(r"no space left on the device of \S+/checkpoints writing checkpoint step_000001 \([\d.]+ MiB "
                        r"free after removing what it had written\); nothing of it was kept; no checkpoint was "
                        r"written, and every trajectory the buffer acknowledged is in its log: free space and "
                        r"resume with trainer.resume=auto", summary["diagnosis"]), summary["diagnosis"]
    assert f"asyncrl train: stopped: {summary['diagnosis']}" in res.stderr
    assert seen["ckpts"] == [], seen  # no step_000001.tmp
    assert "summary.reserve" not in seen["names"], seen  # its room went to the summary


@pytest.mark.heavy(30)
def test_a_spent_time_budget_starts_no_step_and_ends_the_run_as_completed_with_its_final_model(tiny_model_dir,
                                                                                               tmp_path):
    """trainer.max_minutes=0.0001 (6 ms) has passed before the first batch can exist: no step starts, and the
    run ends as a completed one does (exit 0, final/ exported), its summary counting the steps it trained."""
    out = tmp_path / "budget"
    res = _train(_overrides(tiny_model_dir, out, **{"trainer.max_minutes": 0.0001}))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exit_reason"] == "completed at the time budget (trainer.max_minutes=0.0001): 0 of 3 steps", summary
    assert summary["steps_trained"] == 0, summary
    assert (out / "final" / "config.json").is_file() and not _trained(out)
    _check_layout(out)
    assert "trainer.max_minutes=0.0001: the budget is spent after 0 of 3 steps; ending the run" in res.stderr


def test_a_machine_already_past_the_memory_stop_starts_nothing_and_says_why(tiny_model_dir, tmp_path):
    """trainer.memory_stop_fraction at half of what the machine uses now (and at least 0.5 GiB, so the preflight's
    estimate of the tiny model's step, 0.3 GiB, fits it): the machine is past it before anything starts. The run
    stops at once (exit 4, before Ray or any model), its summary naming the process that found it and the
    setting."""
    from asyncrl.util.memory import machine_used

    used, total = machine_used()
    fraction = round(max(used / 2, 0.5 / total), 4)
    assert fraction < used, f"this machine uses {used:.1%} of {total:.0f} GiB: too little to be past any stop"
    out = tmp_path / "full"
    res = _train(_overrides(tiny_model_dir, out, **{"trainer.memory_stop_fraction": fraction}))
    assert res.returncode == 4, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exit_reason"] == "stopped by the watchdog (memory)", summary
    assert summary["diagnosis"].startswith("the driver (asyncrl train), before the run started: the machine's "
                                           "memory is "), summary
    assert f"trainer.memory_stop_fraction={fraction:g}" in summary["diagnosis"]
    assert "asyncrl train: stopped: the driver" in res.stderr and not (out / "final").exists()


@pytest.mark.heavy(45)
def test_every_episode_failing_stops_the_run_with_a_diagnosis(tiny_model_dir, tmp_path):
    """A reward plugin that raises on every episode: no batch can form. The watchdog stops the run (exit 4)
    once its window of 8 episodes is all failures (the stall timeout is the backstop), and the last line
    on stderr names the error and the row it came from."""
    reward = tmp_path / "broken_reward.py"
    reward.write_text("def score(**kw):\n    raise RuntimeError('reward backend unreachable')\n")
    out = tmp_path / "failing"
    res = _train(_overrides(tiny_model_dir, out, **{"env.reward.path": str(reward), "env.reward.name": "score",
                                                     "trainer.stall_timeout_s": 120,
                                                     "trainer.failed_episode_window": 8}))
    assert res.returncode == 4, res.stdout[-3000:] + res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("asyncrl train: stopped: "), res.stderr[-3000:]
    assert "episodes failed; most common error" in last and "RuntimeError('reward backend unreachable') from row" in last
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["exit_code"], summary["steps_trained"], summary["episodes"]) == (4, 0, 0), summary
    assert summary["episodes_failed"] > 0 and summary["groups_dropped_failed"] > 0, summary
    assert "stopped by the watchdog (failing)" in res.stdout, res.stdout[-2000:]
    _check_layout(out)


@pytest.mark.heavy(40)
def test_sync_baseline_of_an_openai_client_agent_with_curve_on_trains_and_writes_no_secret(
        tiny_model_dir, tmp_path, monkeypatch):
    """The sync baseline runs on the same components (every step's batch generated by the version it
    trains: staleness 0), here with the example OpenAI-client agent (a registered function, loaded from
    examples/openai_agent/agent.py through `plugins`): every trained episode went through the proxy. The
    same run has CURVE on (keys in a 0700 dir outside the output dir) and a wandb key in its environment,
    wandb offline (issue 13): no file under the output dir (binary included) and no command line of the
    run's own process tree, sampled while it runs, holds a secret key or the wandb key, and no process the
    run started inherited the wandb key."""
    keys_dir = tmp_path / "keys"
    keys = BufferKeys.load(keys_dir)
    wandb_key = "local-" + os.urandom(20).hex()
    monkeypatch.setenv("WANDB_API_KEY", wandb_key)  # the run inherits it (_train copies os.environ)
    out = tmp_path / "sync"
    typed = ["agent=openai_agent", f"plugins=[{OPENAI_AGENT_EXAMPLE}]", *_overrides(tiny_model_dir, out, **{
        "trainer.mode": "sync", "buffer.curve": "on", "buffer.keys_dir": str(keys_dir), "trainer.wandb": "offline",
        "agent.openai.function": "arithmetic_calculator", "agent.openai.timeout_s": 120})]
    proc = _train(typed, wait=False)
    cmdlines: set[str] = set()  # every command line seen (a Ray worker renames itself once it hosts an actor)
    inherited: set[str] = set()  # command lines of the run's children whose environment held the wandb key
    chunks = []
    try:
        deadline = time.time() + 360
        while time.time() < deadline:
            try:
                tree = [psutil.Process(proc.pid), *_tree(proc)]
            except psutil.NoSuchProcess:  # the run just ended
                tree = []
            cmdlines.update(_cmdline(p) for p in tree)
            # /proc/<pid>/environ is the environment a process was exec'd with; a fork of the driver
            # (same command line, no exec) shows the driver's and holds all of its memory anyway
            driver = _cmdline(tree[0]) if tree else None
            inherited.update(c for p in tree[1:] if (c := _cmdline(p)) != driver
                             and _environ(p).get("WANDB_API_KEY") == wandb_key)
            try:
                chunks.append(proc.communicate(timeout=0.5)[0])  # also drains the pipe; loses no output
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            pytest.fail("the run did not finish within 360 s")
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
    log = "".join(c for c in chunks if c)
    assert proc.returncode == 0, log[-4000:]
    # the progress from the start (issue 19): what is starting, the wait for a batch, then steps with an ETA;
    # the offline wandb run's directory and the command that uploads it
    for needle in ("starting the replay buffer |", "launching 1 engine(s)", "rollout worker(s) |",
                   "step 1/3: waiting for a batch: ", "step 1/3 | ", "| eta ", "; upload it with: wandb sync "):
        assert needle in log, (needle, log[-3000:])
    assert "step 4/3" not in log, log[-3000:]  # no wait announced for a step past the last
    recs = _check_run(out, 3, max_staleness=0)  # checkpoint, final model, trajectories, uids: all scanned below
    assert all(r["train/staleness_max"] == 0 for r in recs)
    for r in recs:  # every trained episode went through the proxy: one chain of >= 1 call
        assert r["train/proxy/calls"] >= 1 and r["train/proxy/chains"] == 1, r
    names = " ".join(cmdlines)
    for part in ("asyncrl.cli train", "ray::BufferActor", "ray::RolloutActor", "ray::LearnerActor"):
        assert part in names, f"{part!r} was never seen among the run's processes: {names[:2000]}"
    secrets = {"server secret": keys.server.secret, "producer secret": keys.producer.secret,
               "consumer secret": keys.consumer.secret, "wandb key": wandb_key}
    assert not inherited, f"processes the run started inherited WANDB_API_KEY: {sorted(inherited)[:5]}"
    for name, text in secrets.items():
        assert text not in log, f"the {name} was printed"
        assert not [c for c in cmdlines if text in c], f"the {name} was on a command line of the run"
    needles = {**{n: s.encode() for n, s in secrets.items()},  # as text, and the CURVE keys as raw bytes
               **{f"{n} (raw)": z85.decode(s.encode()) for n, s in secrets.items() if n != "wandb key"}}
    files = [p for p in out.rglob("*") if p.is_file()]
    assert list(out.glob("wandb/offline-run-*/run-*.wandb"))
    # Ray's logs of this run: its own session directory, named on its gcs_server's command line
    sessions = {Path(a.split("=", 1)[1]) for c in cmdlines for a in c.split() if a.startswith("--session-dir=")}
    assert len(sessions) == 1, sessions
    ray_logs = [p for p in (sessions.pop() / "logs").rglob("*") if p.is_file() and not p.is_symlink()]
    assert ray_logs
    # the run's files are its user's alone (issue 36: they were world-readable): no group or other bit on
    # the run dir, anything under it, or Ray's session files, which the run's processes wrote
    for where, paths in (("the output dir", [out, *out.rglob("*")]), ("Ray's logs", ray_logs)):
        loose = [(oct(p.lstat().st_mode & 0o777), str(p)) for p in paths if not p.is_symlink()
                 and p.lstat().st_mode & 0o077]
        assert not loose, f"files of the run in {where} readable by others: {loose[:5]}"
    for where, paths in (("the output dir", files), ("Ray's logs", ray_logs)):
        for p in paths:
            data = p.read_bytes()  # once: the checkpoint's files are the big ones
            assert not [n for n, needle in needles.items() if needle in data], \
                f"{[n for n, needle in needles.items() if needle in data]} in {where}: {p}"
    # the run's record (issue 23): the overrides as typed, and the console's lines in train.log (scanned above)
    assert yaml.safe_load((out / "overrides.yaml").read_text()) == typed
    record = (out / "train.log").read_text()
    assert "asyncrl train: completed (exit 0)" in record and "INFO" in record, record[-2000:]
    shown = json.loads((out / "config.json").read_text())["buffer"]
    assert shown["curve"] == "on" and shown["keys_dir"] == str(keys_dir)  # a reference to the keys, not the keys
