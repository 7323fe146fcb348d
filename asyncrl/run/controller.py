"""`asyncrl train`: wire buffer, engines, rollout workers and learner together, then watch versions.

The controller does no heavy work. Per step: the learner's rank 0 takes a batch from the buffer,
all ranks train on it (the step's `StepResult` carries the learner's new version, the trained uids
and the metrics), the new weights go to the engines, and then the version is published to the
buffer and the rollout workers (which admit new prompts by it). Between waits the supervisor checks
that every rollout worker and engine is alive and restarts the ones that are not, the groups the buffer
dropped unserved go back to their workers (their budget returned, their prompts issued again), and
the watchdog (asyncrl/run/watchdog.py) judges progress: a run that trains nothing for
`trainer.stall_timeout_s`, or whose recent episodes fail above `trainer.max_failed_episode_fraction`,
stops with a checkpoint (if a step was trained since the last one) and a diagnosis.

Every run ends with a summary (printed, and `summary.json` in the output dir) and an exit status that
says how it ended: 0 completed, nothing skipped (all `trainer.total_steps`, or the steps that started within
`trainer.max_minutes`, which the summary's exit_reason then counts); 3 completed, but prompts or optimizer steps were skipped; 4 stopped by the
watchdog (the diagnosis is the last line on stderr); 128 + signum interrupted; 1 crashed (an exception);
2 config error (before this module runs) or a run directory this start may not use (held by a live run's
lock, or holding another run's state without `trainer.resume=auto`: asyncrl/run_dir.py), decided before
anything is started.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import ray

from asyncrl import registry
from asyncrl.config import Config
from asyncrl.console_log import LOG_FORMAT, ConsoleLog, write_overrides
from asyncrl.envs.base import resolve_env
from asyncrl.learner.checkpoint import CheckpointDiskFull, checkpoint_version, prune_checkpoints
from asyncrl.learner.memory_estimate import lower_learner_memory
from asyncrl.metrics import MetricsLogger
from asyncrl.run.fleet import Fleet, load_rows
from asyncrl.run.placement import cluster_problems
from asyncrl.run.ray_auth import JOIN_HINT, private_local_ray, readable_token_file
from asyncrl.run.watchdog import Verdict, Watchdog
from asyncrl.run_dir import (
    RunDirError,
    RunLayout,
    RunLock,
    RunStart,
    VersionLog,
    checkpoint_step,
    describe_holder,
    latest_checkpoint,
    make_private,
    prepare_run,
    run_dir,
)
from asyncrl.sandbox.runner import HIDE_ENV as SANDBOX_HIDE_ENV
from asyncrl.sandbox.runner import hide_job_paths
from asyncrl.secrets import shown_config, withhold_env
from asyncrl.sft.warm_start import WarmStartError, warm_start_in_child
from asyncrl.util.auth import ENV as ENGINE_TOKEN_ENV
from asyncrl.util.auth import ensure_token
from asyncrl.util.durable import full_errno
from asyncrl.util.isolated import call_isolated
from asyncrl.util.memory import MemoryBudgetExceeded, check_machine_memory
from asyncrl.util.stop_signals import raise_if_stopping, stop_on_signals

log = logging.getLogger("asyncrl")

EXIT_OK, EXIT_ERROR, EXIT_CONFIG, EXIT_SKIPPED, EXIT_WATCHDOG = 0, 1, 2, 3, 4


class RunStopped(Exception):
    """The watchdog stopped the run; `verdict` says why."""

    def __init__(self, verdict: Verdict):
        super().__init__(verdict.diagnosis)
        self.verdict = verdict


def run(cfg: Config, rows: list[dict] | None = None, overrides: list[str] | None = None) -> int:
    """Train; `rows`: the training rows as preflight checked them (None: load them here); `overrides`: the
    command line as typed, recorded in the run dir with the console log (asyncrl/console_log.py)."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    secret_env = withhold_env()  # before anything is started: no child inherits WANDB_API_KEY
    out = run_dir(cfg.trainer.output_dir, cfg.trainer.run_name)
    make_private(out)  # before ray.init: Ray's processes and files inherit the umask
    # the run owns its directory from here to its exit: a second run on it stops here, before anything
    # expensive; whatever the previous run left is settled by prepare_run (resumed, refused, or moved aside)
    lock = RunLock(out)
    try:
        if (dead := lock.acquire()) is not None:
            log.warning("took over the lock of %s in %s: that process is gone", describe_holder(dead), out)
        wal_dir = Path(cfg.buffer.wal_dir).resolve() if cfg.buffer.wal_dir else RunLayout(out).buffer
        start = prepare_run(out, wal_dir, cfg.trainer.resume)
        lock.set_run_id(start.run_id)
        if start.resume_from is not None:
            log.info("resuming run %s from step %d (version %d) in %s", start.run_id,
                     checkpoint_step(start.resume_from), checkpoint_version(start.resume_from), out)
    except RunDirError as e:
        lock.release()
        print(f"asyncrl train: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    except BaseException:
        lock.release()  # emptied: a crash here is no dead holder for the next start to report
        raise
    # a Ray instance of the run's own: token authentication with a fresh token nobody else holds
    ray_token = None if joins_cluster(cfg) else private_local_ray()
    try:
        write_overrides(out, list(overrides or []))
        with ConsoleLog(out, [*secret_env.values(), *([ray_token] if ray_token else [])]):
            return _run(cfg, rows, out, start, secret_env)
    finally:
        lock.release()


def _run(cfg: Config, rows: list[dict] | None, out: Path, start: RunStart, secret_env: dict) -> int:
    started = time.monotonic()  # trainer.max_minutes counts from here, the warm start included
    # engines load weights from disk only below the run's directories: absolute, whatever an actor's cwd
    cfg.trainer.output_dir = str(out)
    disk_dir = cfg.trainer.weight_sync.disk_dir
    layout = RunLayout(out)
    cfg.trainer.weight_sync.disk_dir = str(Path(disk_dir).resolve() if disk_dir else layout.weight_sync)
    # the run's engine token (the user's ASYNCRL_ENGINE_TOKEN for attached engines, else a fresh one):
    # a local Ray instance's workers inherit this process's environment; a joined cluster's get it
    # through the job's runtime_env (never argv, the config or a log line)
    token = ensure_token()
    # what model-written code in the python tool may never read, wherever it lies (the sandbox reads it)
    hidden = hide_job_paths(cfg, out)
    joins = joins_cluster(cfg)
    if (loose := readable_token_file()) is not None:
        log.warning("%s", loose)
    runtime_env = {"env_vars": {ENGINE_TOKEN_ENV: token, SANDBOX_HIDE_ENV: hidden}} \
        if joins else None
    registry.load_all(cfg.plugins)

    env = resolve_env(cfg.env.name)
    rows = load_rows(cfg, env, "train") if rows is None else rows
    reserve_summary_room(layout)  # a disk that fills later still takes the summary
    stop_signal = stop_on_signals()
    try:  # a machine already that full would have Ray's memory monitor kill the run's workers part-way
        check_machine_memory(cfg.trainer.memory_stop_fraction, "the driver (asyncrl train), before the run "
                             "started", "other processes hold that memory: free it, or raise the setting")
    except MemoryBudgetExceeded as e:
        _report(out, settle(memory_stop(e), {}))
        return EXIT_WATCHDOG
    # a cluster is joined, and checked against the run (placement, addresses, shared storage), before the
    # warm start: what it cannot hold is said before minutes of work
    if joins and (refused := _start_ray(cfg, runtime_env, stop_signal, out)) is not None:
        return refused
    warm, ended = _warm_start(cfg, rows, out, start, stop_signal, tuple(secret_env.values()))
    if ended is not None:
        return ended
    layout.config.write_text(json.dumps(shown_config(cfg), indent=2))  # model.path: what RL starts from
    budget = (f"; time budget {cfg.trainer.max_minutes:g} min from the start, warm start included "
              f"(trainer.max_minutes; 0: none)" if cfg.trainer.max_minutes else "")
    log.info("run %s in %s; %d training prompts; mode %s, max_staleness %d%s", start.run_id, out, len(rows),
             cfg.trainer.mode, cfg.algorithm.max_staleness, budget)
    if not joins:  # a local instance of the run's own starts after the warm start, which needs none of it
        if (refused := _start_ray(cfg, runtime_env, stop_signal, out)) is not None:
            return refused
    deadline = started + 60 * cfg.trainer.max_minutes if cfg.trainer.max_minutes else None
    metrics = MetricsLogger(out, wandb_mode=cfg.trainer.wandb, project=cfg.trainer.wandb_project,
                            config=shown_config(cfg), progress=cfg.trainer.progress, total_steps=cfg.trainer.total_steps,
                            secret_env=secret_env, run_name=start.run_id,
                            budget_ends_at=None if deadline is None else time.time() + deadline - time.monotonic())
    fleet = Fleet(cfg, out, rows, start.run_id)
    ending = {"exit_code": EXIT_ERROR, "exit_reason": "crashed", "diagnosis": "",
              **({"warm_start": warm.summary} if warm is not None else {})}
    try:
        with env.services(cfg.env) as tool_overrides:
            fleet.start(tool_overrides, resume_from=start.resume_from, highest_published=start.record.highest_version,
                        status=metrics.status)
            train_loop(cfg, fleet, metrics, out, VersionLog(out, start.record), deadline)
        ending.update(exit_code=EXIT_OK, exit_reason=completed_reason(cfg, fleet.step))
    except (RunStopped, MemoryBudgetExceeded) as e:
        ending.update(memory_stop(e) if isinstance(e, MemoryBudgetExceeded) else
                      {"exit_code": EXIT_WATCHDOG, "exit_reason": f"stopped by the watchdog ({e.verdict.kind})",
                       "diagnosis": e.verdict.diagnosis})
        log.error("stopping: %s", ending["diagnosis"])
        if fleet.step > fleet.last_checkpoint_step:
            # the stop goes on either way: its reason matters more than this checkpoint
            if missed := _checkpoint_on_the_way_out(fleet, layout, "before stopping"):
                ending["diagnosis"] += f"; {missed}"
    except KeyboardInterrupt:
        log.warning("interrupted: shutting down%s", " after a checkpoint" if cfg.trainer.checkpoint_every else "")
        signum = stop_signal.get("signum", signal.SIGINT)
        ending.update(exit_code=128 + signum, exit_reason=f"interrupted ({signal.Signals(signum).name})")
        if cfg.trainer.checkpoint_every and fleet.step > fleet.last_checkpoint_step:
            ending["diagnosis"] = _checkpoint_on_the_way_out(fleet, layout, "at the interrupt")
    except BaseException as e:
        if not disk_full(e):
            ending.update(exit_reason=f"crashed: {e!r}"[:500])
            raise
        ending.update(disk_full_ending(e, layout))  # the summary's last line says it
    finally:
        try:
            counts = fleet.summary()
        except Exception as e:  # the summary must not keep the run's parts from being stopped
            log.error("could not collect the run's summary: %r", e)
            counts = {}
        summary = settle(ending, counts)
        fleet.shutdown()
        try:
            metrics.close()
        except OSError as e:  # a full disk: the summary still goes out
            log.error("could not close the metrics log: %s", e)
        ray.shutdown()
        _report(out, summary)
    return summary["exit_code"]


def disk_full(e: BaseException) -> bool:
    """Whether `e` is the driver's or a checkpoint's write failing on a full disk (or quota)."""
    return isinstance(e, CheckpointDiskFull) or (isinstance(e, Exception) and full_errno(e) is not None)


def disk_full_ending(e: BaseException, layout: RunLayout) -> dict[str, Any]:
    """How a run whose disk filled ends (exit 1): what failed, what was kept, how to go on."""
    return {"exit_code": EXIT_ERROR, "exit_reason": "stopped: disk full", "diagnosis": _disk_full_diagnosis(e, layout)}


def _disk_full_diagnosis(e: BaseException, layout: RunLayout) -> str:
    return (f"{e if isinstance(e, CheckpointDiskFull) else repr(e)}; "
            f"{_kept(layout, 'free space and resume with trainer.resume=auto')}")


def _kept(layout: RunLayout, then: str = "resume with trainer.resume=auto") -> str:
    ckpt = latest_checkpoint(layout.checkpoints)
    where = f"the last checkpoint is {ckpt}" if ckpt is not None else "no checkpoint was written"
    return f"{where}, and every trajectory the buffer acknowledged is in its log: {then}"


def _checkpoint_on_the_way_out(fleet: Fleet, layout: RunLayout, when: str) -> str:
    """A checkpoint of a run that is stopping anyway: "" once written, else one line saying why not and
    what was kept (a full disk; or the run's processes gone, when a scheduler's signal reached every
    process of the job at once, as slurm's scancel does: Ray's workers stop on it too)."""
    try:
        fleet.checkpoint(layout.checkpoints)
        return ""
    except Exception as e:
        if disk_full(e):
            return _disk_full_diagnosis(e, layout)
        first = (str(e).splitlines() or [repr(e)])[0]
        return f"no checkpoint {when}: {first[:200]}; {_kept(layout)}"


SUMMARY_ROOM = 1 << 20  # bytes held for summary.json and the run's last lines


def reserve_summary_room(layout: RunLayout) -> None:
    """Hold SUMMARY_ROOM bytes in the run dir (`summary.reserve`), released by `_report` just before it writes
    summary.json: a disk that fills during the run (a checkpoint, the buffer's log) still takes the summary."""
    try:
        fd = os.open(layout.summary_reserve, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, SUMMARY_ROOM)
        finally:
            os.close(fd)
    except OSError as e:
        log.warning("could not hold %d bytes for the summary in %s: %s", SUMMARY_ROOM, layout.root, e)


def _start_ray(cfg: Config, runtime_env: dict | None, stop_signal: dict, out: Path) -> int | None:
    """ray.init, then the cluster's check (asyncrl/run/placement.py): None, or the exit code of a refusal (its
    summary written, every problem named)."""
    # a run of its own starts its own instance ("local"): with no address, ray.init would join whatever Ray
    # instance was last started on this machine (its /tmp/ray/ray_current_cluster), another user's included
    address = cfg.ray.address if joins_cluster(cfg) else "local"
    try:
        ray.init(address=address, num_cpus=cfg.ray.num_cpus, include_dashboard=False,
                 ignore_reinit_error=True, log_to_driver=True, logging_level=logging.WARNING, runtime_env=runtime_env)
    except ConnectionError as e:
        if not joins_cluster(cfg):
            raise
        return _refused(out, "the Ray cluster could not be joined",
                        [f"could not join the Ray cluster at {address!r} ({e}); {JOIN_HINT}"])
    stop_on_signals(stop_signal)  # ray.init made SIGTERM call sys.exit: a scheduler's stop would be a crash
    problems = cluster_problems(cfg, out)
    if not problems:
        return None
    code = _refused(out, "the Ray cluster cannot hold this run", problems)
    ray.shutdown()
    return code


def _refused(out: Path, reason: str, problems: list[str]) -> int:
    """A run the cluster refuses: each problem logged, the summary written; the exit code."""
    for p in problems:
        log.error("%s: %s", reason, p)
    _report(out, settle({"exit_code": EXIT_CONFIG, "exit_reason": f"refused: {reason}",
                         "diagnosis": "; ".join(problems)}, {}))
    return EXIT_CONFIG


def memory_stop(e: MemoryBudgetExceeded) -> dict[str, Any]:
    """How a run that stopped at trainer.memory_stop_fraction ends (exit 4); the diagnosis is the message of
    the process that found it (without Ray's traceback around it, where a Ray actor raised it)."""
    cause = getattr(e, "cause", None)
    return {"exit_code": EXIT_WATCHDOG, "exit_reason": "stopped by the watchdog (memory)",
            "diagnosis": str(cause if isinstance(cause, BaseException) else e)}


def joins_cluster(cfg: Config) -> bool:
    """Whether the run joins a Ray cluster (ray.address, or RAY_ADDRESS) rather than starting its own instance."""
    return bool(cfg.ray.address or os.environ.get("RAY_ADDRESS"))


def _warm_start(cfg: Config, rows: Any, out: Path, start: RunStart, stop_signal: dict,
                secrets: tuple[str, ...] = (), runner: Any = call_isolated) -> tuple[Any, int | None]:
    """The warm start before RL (asyncrl/sft/warm_start.py); on success `cfg.model.path` is its model.
    Returns (the WarmStart or None, None), or (None, the exit status) for a run that ends here: the
    warm start failed (1), was interrupted (128 + signum) or crashed (1, re-raised), with a summary.
    `runner` runs it: in a child process of its own (asyncrl/util/isolated.py), so the model, optimizer
    state and activations of SFT go back to the machine when it ends and the driver holds no model for
    the rest of the run; tests of the decisions here pass one that calls in process. With warm_start.mode=off
    no child starts (its interpreter, imports and plugin loading cost seconds of CPU for nothing)."""
    if cfg.warm_start.mode == "off":
        return None, None
    try:
        warm = runner(warm_start_in_child, cfg, rows[: cfg.warm_start.demos], out, start.resume_from is not None,
                      list(secrets), name="warm start")
    except WarmStartError as e:
        ending = {"exit_code": EXIT_ERROR, "exit_reason": "the warm start failed", "diagnosis": str(e)}
    except MemoryBudgetExceeded as e:
        ending = memory_stop(e)
    except KeyboardInterrupt:
        signum = stop_signal.get("signum", signal.SIGINT)
        ending = {"exit_code": 128 + signum, "exit_reason": f"interrupted ({signal.Signals(signum).name}) during "
                  f"the warm start (trainer.resume=auto on {out} resumes its SFT)", "diagnosis": ""}
    except BaseException as e:
        if not disk_full(e):
            _report(out, settle({"exit_code": EXIT_ERROR, "exit_reason": f"crashed in the warm start: {e!r}"[:500],
                                 "diagnosis": ""}, {}))
            raise
        ending = {"exit_code": EXIT_ERROR, "exit_reason": "stopped: disk full in the warm start",
                  "diagnosis": f"{e}; free space and start again with trainer.resume=auto: the warm start resumes "
                               f"its SFT from its last checkpoint"}
    else:
        if warm is not None:
            cfg.model.path = str(warm.model)
        return warm, None
    _report(out, settle(ending, {}))
    return None, ending["exit_code"]


def waiting_line(step: int, total: int, batch_groups: int, buffer: dict[str, Any], states: list[Any]) -> str:
    """What the progress shows while the learner waits for its next batch."""
    episodes = sum(s.episodes for s in states)
    failed = sum(s.episodes_failed for s in states)
    line = (f"step {step}/{total}: waiting for a batch: {min(buffer.get('groups_complete', 0), batch_groups)}/"
            f"{batch_groups} groups complete, {episodes} episodes stored")
    return line + (f", {failed} failed" if failed else "")


def settle(ending: dict[str, Any], counts: dict[str, Any]) -> dict[str, Any]:
    """The run's summary: how it ended and what it did. A run that completed but skipped prompts or optimizer
    steps (non-finite loss or gradient norm) exits 3."""
    summary = {**ending, **counts}
    skipped = [f"{summary[k]} {what} skipped" for k, what in (("prompts_skipped", "prompts"),
                                                               ("optimizer_steps_skipped", "optimizer steps"))
               if summary.get(k)]
    if summary["exit_code"] == EXIT_OK and skipped:
        summary.update(exit_code=EXIT_SKIPPED, exit_reason="completed, " + ", ".join(skipped))
    return summary


def _report(out: Path, summary: dict[str, Any]) -> None:
    """The run's summary as summary.json and one line on stdout; a watchdog's diagnosis last on stderr."""
    layout = RunLayout(out)
    path = layout.summary
    layout.summary_reserve.unlink(missing_ok=True)  # its room is the summary's
    tmp = path.with_name(path.name + ".tmp")
    try:  # whole or not at all: a disk that is full even so leaves no empty summary.json
        tmp.write_text(json.dumps(summary, indent=2))
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        print(f"asyncrl train: could not write {path}: {e}", file=sys.stderr, flush=True)
    n = {k: "?" if summary.get(k) is None else summary[k] for k in ("steps_trained", "episodes", "episodes_failed", "prompts_skipped",
                                         "groups_dropped_stale", "groups_dropped_failed", "worker_restarts",
                                         "engine_restarts")}
    moved = (f" ({summary['engines_replaced']} started anew on another node: theirs was lost)"
             if summary.get("engines_replaced") else "")
    filtered = (f", {summary['groups_filtered_uniform']} of equal rewards (dynamic sampling; "
                f"{summary.get('groups_served_uniform', 0)} trained past its bound)"
                if summary.get("groups_filtered_uniform") or summary.get("groups_served_uniform") else "")
    print(f"asyncrl train: {summary['exit_reason']} (exit {summary['exit_code']}): {n['steps_trained']} steps "
          f"trained; {n['episodes']} episodes stored, {n['episodes_failed']} failed; {n['prompts_skipped']} prompts "
          f"skipped; groups dropped unserved: {n['groups_dropped_stale']} stale, {n['groups_dropped_failed']} all "
          f"failed{filtered}; {n['worker_restarts']} worker and {n['engine_restarts']} engine restarts{moved}; summary in "
          f"{path}", flush=True)
    if memory := summary.get("memory"):
        print("asyncrl train: peak resident memory (GiB): " + ", ".join(
            f"{k.removesuffix('_gb').replace('_', ' ')} {v:.2f}" for k, v in memory.items()), flush=True)
    if summary["diagnosis"]:
        print(f"asyncrl train: stopped: {summary['diagnosis']}", file=sys.stderr, flush=True)


def memory_advice(cfg: Config, peaks: dict[str, float]) -> str:
    """What the driver's memory stop says about the run's processes: the largest each role held so far."""
    if not peaks:
        return "no step has reported its memory yet"
    shown = ", ".join(f"{k.removeprefix('memory/').removesuffix('_gb').replace('_', ' ')} {v:.1f} GiB"
                      for k, v in sorted(peaks.items(), key=lambda kv: -kv[1]))
    learner = lower_learner_memory(cfg.algorithm.micro_batch_tokens, cfg.model.gradient_checkpointing)
    return (f"the run's processes held at most: {shown} (metrics.jsonl memory/*); a learner over its share: "
            f"{learner}; an engine: lower engine.max_running_seqs")


def completed_reason(cfg: Config, steps: int) -> str:
    """How a run that was not stopped ended: all its steps, or as many as trainer.max_minutes allowed."""
    t = cfg.trainer
    if steps >= t.total_steps:
        return "completed"
    return f"completed at the time budget (trainer.max_minutes={t.max_minutes:g}): {steps} of {t.total_steps} steps"


def next_step_fits(now: float, deadline: float | None, step_seconds: list[float]) -> bool:
    """Whether a step started at `now` is expected to end by `deadline` (None: no budget): it takes the median of
    the run's steps so far (the first, which waits for the first rollouts, is an outlier), the first step
    nothing (it always starts while time is left)."""
    if deadline is None:
        return True
    expected = statistics.median(step_seconds) if step_seconds else 0.0
    return now + expected <= deadline and now < deadline


def train_loop(cfg: Config, fleet: Fleet, metrics: MetricsLogger, out: Path, versions: VersionLog,
               deadline: float | None = None) -> None:
    """Train until trainer.total_steps, or until the next step is not expected to end by `deadline`
    (time.monotonic(); `next_step_fits`); then checkpoint and export final/."""
    layout = RunLayout(out)
    ckpt_dir = layout.checkpoints
    t = cfg.trainer
    watchdog = Watchdog(stall_timeout_s=t.stall_timeout_s, max_failed_fraction=t.max_failed_episode_fraction,
                        window=t.failed_episode_window, now=time.monotonic())

    def watch() -> None:
        verdict = watchdog.observe(time.monotonic(), fleet.step, fleet.worker_states())
        if verdict.stop:
            raise RunStopped(verdict)
        check_machine_memory(t.memory_stop_fraction, "the driver (asyncrl train)",
                             memory_advice(cfg, fleet.memory_peaks))
        waiting()

    def waiting() -> None:
        if fleet.step >= t.total_steps:  # the last step is trained: no batch is awaited ("step 4/3: waiting")
            return
        metrics.status(waiting_line(fleet.step + 1, t.total_steps, t.batch_groups, fleet.buffer_stats(),
                                    fleet.worker_states()))

    step_seconds: list[float] = []
    with open(layout.trained_uids, "a") as uids_file, open(layout.learner_logprobs, "a") as logprobs_file:
        while fleet.step < cfg.trainer.total_steps:
            raise_if_stopping()  # a signal whose KeyboardInterrupt a finalizer swallowed
            if not next_step_fits(time.monotonic(), deadline, step_seconds):
                log.info("trainer.max_minutes=%g: %s after %d of %d steps; ending the run", t.max_minutes,
                         "the next step would end past the budget" if step_seconds else "the budget is spent",
                         fleet.step, t.total_steps)
                break
            t0 = time.perf_counter()
            waiting()
            batch, waited = fleet.next_batch(watch)  # restarts dead workers/engines, returns budget, watches
            trained_from = fleet.version  # the policy version the batch's gradients were taken at
            result = fleet.train(batch)
            versions.publishing(result.version)  # durable before any engine holds these weights
            uids_file.write(json.dumps({"step": fleet.step, "version": trained_from, "uids": result.trained_uids})
                            + "\n")
            uids_file.flush()
            logprobs_file.writelines(json.dumps({"step": fleet.step, **rec}) + "\n" for rec in result.token_logprobs)
            logprobs_file.flush()
            stats = {**result.metrics, **fleet.sync_weights()}
            fleet.publish_version(result.version)  # after the sync: engines hold it before anyone admits by it
            step_seconds.append(time.perf_counter() - t0)
            stats.update(fleet.rollout_metrics(), **fleet.memory_metrics(),
                         **{"learner/idle_fraction": waited / step_seconds[-1], "step_seconds": step_seconds[-1],
                            "version": fleet.version})
            fleet.record_memory(stats)
            metrics.log(fleet.step, stats)
            watch()  # failing episodes stop a run that still forms batches too
            if cfg.trainer.eval_every and fleet.step % cfg.trainer.eval_every == 0:
                fleet.start_eval()
            for step, ev in fleet.finished_evals():
                metrics.log(step, ev)
            if cfg.trainer.checkpoint_every and fleet.step % cfg.trainer.checkpoint_every == 0:
                fleet.checkpoint(ckpt_dir)
                prune_checkpoints(ckpt_dir, cfg.trainer.keep_checkpoints)
    if fleet.step > fleet.last_checkpoint_step:
        fleet.checkpoint(ckpt_dir)
    for step, ev in fleet.finished_evals(wait=True):
        metrics.log(step, ev)
    fleet.export(layout.final)
