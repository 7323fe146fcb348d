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

import wandb

from asyncrl.secrets import redacted, secret_env_set

log = logging.getLogger(__name__)

_PROGRESS_KEYS = [
    ("step", "step {:d}"), ("version", "v{:d}"), ("train/reward_mean", "reward {:.3f}"),
    ("train/staleness_max", "stale<={:.0f}"), ("rollout/engine_tokens_per_s", "engine {:.0f} tok/s"),
    ("learner/tokens_per_s", "learner {:.0f} tok/s"), ("buffer/size", "buffer {:.0f}"),
]


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


class MetricsLogger:
    def __init__(self, output_dir: str | Path, *, wandb_mode: str = "offline", project: str = "asyncrl",
                 config: dict | None = None, progress: bool = True, total_steps: int | None = None,
                 secret_env: dict[str, str] | None = None):
        """`secret_env`: what `asyncrl.secrets.withhold_env` withheld (WANDB_API_KEY); put back in the
        environment only while an online wandb starts its service, never for offline."""
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        self.total_steps = total_steps
        self.tty = progress and sys.stdout.isatty()
        self.t0 = time.time()
        self._wandb = None
        if wandb_mode != "off":
            try:
                os.environ.setdefault("WANDB_SILENT", "true")
                with secret_env_set(secret_env if wandb_mode == "online" else None):
                    self._wandb = wandb.init(project=project, mode=wandb_mode, dir=str(output_dir),
                                             config=redacted(config or {}), reinit=True)
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
        line = " | ".join(parts) + f" | {rec['time']:.0f}s"
        if self.tty:
            sys.stdout.write("\r\x1b[2K" + line)
            sys.stdout.flush()
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.tty:
            sys.stdout.write("\n")
        self._file.close()
        if self._wandb is not None:
            try:
                self._wandb.finish()
            except Exception:
                pass


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
