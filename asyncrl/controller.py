"""`asyncrl train`: wire buffer, engines, rollout workers and learner together, then watch versions.

The controller does no heavy work. Per step: the learner's rank 0 takes a batch from the buffer,
all ranks train on it (the step's `StepResult` carries the learner's new version, the trained uids
and the metrics), the new weights go to the engines, and then the version is published to the
buffer and the rollout workers (which admit new prompts by it). Between waits the supervisor checks
that every rollout worker and engine is alive and restarts the ones that are not.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from pathlib import Path

import ray

from asyncrl import registry
from asyncrl.config import Config
from asyncrl.fleet import Fleet, load_rows
from asyncrl.learner.checkpoint import checkpoints_root, latest_checkpoint, prune_checkpoints
from asyncrl.metrics import MetricsLogger
from asyncrl.secrets import shown_config, withhold_env

log = logging.getLogger("asyncrl")


def run(cfg: Config) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    secret_env = withhold_env()  # before anything is started: no child inherits WANDB_API_KEY
    out = Path(cfg.trainer.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(shown_config(cfg), indent=2))
    registry.load_all(cfg.plugins)
    from asyncrl.env_api import resolve_env

    env = resolve_env(cfg.env.name)
    rows = load_rows(cfg, env, "train")
    log.info("output dir %s; %d training prompts; mode %s, max_staleness %d", out, len(rows),
             cfg.trainer.mode, cfg.algorithm.max_staleness)
    ray.init(address=cfg.ray.address, num_cpus=cfg.ray.num_cpus, include_dashboard=False,
             ignore_reinit_error=True, log_to_driver=True, logging_level=logging.WARNING)
    stop_signal = _stop_on_signals()
    metrics = MetricsLogger(out, wandb_mode=cfg.trainer.wandb, project=cfg.trainer.wandb_project,
                            config=shown_config(cfg), progress=cfg.trainer.progress, total_steps=cfg.trainer.total_steps,
                            secret_env=secret_env)
    fleet = Fleet(cfg, out, rows)
    try:
        with env.services(cfg.env) as tool_overrides:
            resume_from = latest_checkpoint(checkpoints_root(out)) if cfg.trainer.resume == "auto" else None
            fleet.start(tool_overrides, resume_from=resume_from)
            train_loop(cfg, fleet, metrics, out)
        return 0
    except KeyboardInterrupt:
        log.warning("interrupted: shutting down%s", " after a checkpoint" if cfg.trainer.checkpoint_every else "")
        if cfg.trainer.checkpoint_every and fleet.step > fleet.last_checkpoint_step:
            fleet.checkpoint(checkpoints_root(out))
        return 128 + stop_signal.get("signum", signal.SIGINT)
    finally:
        fleet.shutdown()
        metrics.close()
        ray.shutdown()


def _stop_on_signals() -> dict:
    """Ctrl-C (SIGINT) and SIGTERM (a scheduler, `kill`) both stop the run cleanly via KeyboardInterrupt.

    Installed explicitly because a process started in the background of a non-interactive shell
    inherits SIGINT as ignored, and SIGTERM would otherwise kill the controller without shutdown.
    Returns a dict that records which signal arrived (for the exit code 128 + signum).
    """
    got: dict = {}

    def handler(signum: int, frame: object) -> None:
        got["signum"] = signum
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
    return got


def train_loop(cfg: Config, fleet: Fleet, metrics: MetricsLogger, out: Path) -> None:
    ckpt_dir = checkpoints_root(out)
    with open(out / "trained_uids.jsonl", "a") as uids_file:
        while fleet.step < cfg.trainer.total_steps:
            t0 = time.perf_counter()
            batch, waited = fleet.next_batch()  # restarts dead workers/engines while it waits
            result = fleet.train(batch)
            uids_file.write(json.dumps({"step": fleet.step, "uids": result.trained_uids}) + "\n")
            uids_file.flush()
            stats = {**result.metrics, **fleet.sync_weights()}
            fleet.publish_version(result.version)  # after the sync: engines hold it before anyone admits by it
            stats.update(fleet.rollout_metrics(), **{"learner/idle_fraction": waited / (time.perf_counter() - t0),
                                                     "step_seconds": time.perf_counter() - t0,
                                                     "version": fleet.version})
            metrics.log(fleet.step, stats)
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
    fleet.export(out / "final")
