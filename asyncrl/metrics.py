"""Where numbers go: a JSONL file (always), wandb (offline by default), and the terminal.

On a terminal the progress is one line rewritten in place; elsewhere (CI, a log file) each step is
printed as a plain line. Nothing here is needed for correctness; failures of wandb are reported
once and then ignored so that a logging problem never stops a training run. The config given to
wandb goes through `asyncrl.secrets.redacted`; wandb reads its own key from WANDB_API_KEY.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from asyncrl.run_dir import RunLayout
from asyncrl.secrets import redacted, secret_env_set

log = logging.getLogger(__name__)

_PROGRESS_KEYS = [
    ("step", "step {:d}"), ("version", "v{:d}"), ("train/reward_mean", "reward {:.3f}"),
    ("train/staleness_max", "stale<={:.0f}"), ("rollout/engine_tokens_per_s", "engine {:.0f} tok/s"),
    ("learner/tokens_per_s", "learner {:.0f} tok/s"), ("buffer/size", "buffer {:.0f}"),
    ("sft/epoch", "epoch {:d}"), ("sft/train_loss", "loss {:.4f}"), ("sft/val_loss", "val loss {:.4f}"),
    ("sft/tokens_per_s", "{:.0f} tok/s"),
]


def format_duration(seconds: float) -> str:
    """12s, 4m05s, 1h02m: the way the progress line shows an ETA or an elapsed time."""
    s = max(int(round(seconds)), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def eta_seconds(step: int, total: int, first: tuple[int, float, float], now: float) -> float | None:
    """Time left for steps step+1..total. `first` = (the first step this process logged, when, and how long
    it took from the start): the pace is the mean time per step since that first step (which alone carries
    the start-up and the first batch's wait), or the first step's own time while it is the only one. None
    once no step is left."""
    first_step, first_at, first_seconds = first
    if step >= total or step < first_step:
        return None
    per_step = (now - first_at) / (step - first_step) if step > first_step else first_seconds
    return per_step * (total - step)


def shown_eta(eta: float | None, budget_left: float | None) -> str:
    """The progress line's ETA: the steps' `eta`, or the time budget's `budget_left` (trainer.max_minutes) where
    the budget ends the run first, said so; "" once no step is left."""
    if eta is None:
        return ""
    if budget_left is not None and budget_left < eta:
        return f" | eta {format_duration(max(budget_left, 0.0))} (time budget)"
    return f" | eta {format_duration(eta)}"


def _clean(metrics: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in metrics.items():
        if isinstance(v, bool):
            v = int(v)
        if isinstance(v, (int, float)) and not (isinstance(v, float) and not math.isfinite(v)):
            out[k] = v
        elif isinstance(v, str):
            out[k] = v
    return out


class StatusLine:
    """One line of progress: on a terminal rewritten in place; elsewhere (CI, a log file) printed as plain
    lines, a repeated status text at most every `every_s` seconds (a heartbeat, not a flood)."""

    def __init__(self, enabled: bool = True, stream: Any = None):
        self.stream = stream or sys.stdout
        self.tty = enabled and self.stream.isatty()
        self.t0 = time.time()
        self._last_status = ("", 0.0)  # the last status text printed, and when

    def status(self, text: str, *, every_s: float = 30.0) -> None:
        now = time.time()
        line = f"{text} | {format_duration(now - self.t0)}"
        if self.tty:
            self.emit(line)
        elif text != self._last_status[0] or now - self._last_status[1] >= every_s:
            self.emit(line)
        else:
            return
        self._last_status = (text, now)

    def emit(self, line: str) -> None:
        if self.tty:
            self.stream.write("\r\x1b[2K" + line)
            self.stream.flush()
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


class MetricsLogger:
    def __init__(self, output_dir: str | Path, *, wandb_mode: str = "offline", project: str = "asyncrl",
                 config: dict | None = None, progress: bool = True, total_steps: int | None = None,
                 secret_env: dict[str, str] | None = None, run_name: str | None = None, label: str = "",
                 budget_ends_at: float | None = None):
        """`label`: put before every step line (a phase of a longer command, e.g. "warm start: ").
        `budget_ends_at`: when (time.time()) trainer.max_minutes ends the run; the ETA is never past it.
        `secret_env`: what `asyncrl.secrets.withhold_env` withheld (WANDB_API_KEY); put back in the
        environment only while an online wandb starts its service, never for offline."""
        self.path = RunLayout(Path(output_dir)).metrics
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        self.total_steps = total_steps
        self.label = label
        self.budget_ends_at = budget_ends_at
        self.line = StatusLine(enabled=progress)
        self.t0 = self.line.t0
        self._first_step: tuple[int, float, float] | None = None  # the first step logged, when, its duration
        self._wandb = None
        self.wandb_mode = wandb_mode
        if wandb_mode != "off":
            try:  # imported here: a run with trainer.wandb=off neither needs nor pays for it
                # lazy: optional: the except below reports a missing package
                import wandb

                os.environ.setdefault("WANDB_SILENT", "true")
                with secret_env_set(secret_env if wandb_mode == "online" else None):
                    self._wandb = wandb.init(project=project, mode=wandb_mode, dir=str(output_dir),
                                             config=redacted(config or {}), reinit=True, name=run_name)
            except Exception as e:  # logging must never stop training
                log.warning("wandb disabled: %r", e)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        rec = {"step": step, "time": round(time.time() - self.t0, 3), **_clean(metrics)}
        self._file.write(json.dumps(rec) + "\n")
        if self._wandb is not None:
            try:
                self._wandb.log(rec, step=step)
            except Exception as e:
                log.warning("wandb log failed, disabling: %r", e)
                self._wandb = None
        self._print(rec)

    def _print(self, rec: dict[str, Any]) -> None:
        parts = []
        for key, fmt in _PROGRESS_KEYS:
            if key in rec:
                try:
                    parts.append(fmt.format(rec[key]))
                except (ValueError, TypeError):
                    pass
        if self.total_steps and "step" in rec:
            parts[0] = f"step {rec['step']}/{self.total_steps}"
        line = self.label + " | ".join(parts) + f" | {format_duration(rec['time'])}"
        step = rec.get("step")
        if isinstance(step, int) and ("train/reward_mean" in rec or "sft/train_loss" in rec):  # a training step
            now = time.time()
            if self._first_step is None:  # step 1, or the first step after a resume
                self._first_step = (step, now, now - self.t0)
            eta = eta_seconds(step, self.total_steps or 0, self._first_step, now)
            line += shown_eta(eta, None if self.budget_ends_at is None else self.budget_ends_at - now)
        self._emit(line)

    def status(self, text: str, *, every_s: float = 30.0) -> None:
        """What the run is doing between steps (starting its parts, waiting for a batch): `StatusLine.status`."""
        self.line.status(text, every_s=every_s)

    def _emit(self, line: str) -> None:
        self.line.emit(line)

    def close(self) -> None:
        self.line.close()
        self._file.close()
        if self._wandb is not None:
            run_dir = getattr(self._wandb, "dir", None)  # .../wandb/offline-run-<time>-<id>/files
            try:
                self._wandb.finish()
            except Exception:
                pass
            if self.wandb_mode == "offline" and run_dir:
                offline = Path(run_dir).parent
                print(f"wandb: offline run in {offline}; upload it with: wandb sync {offline}", flush=True)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
