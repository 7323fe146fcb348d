"""The progress watchdog: decides, from what the controller sees, whether a run should stop (pure; no I/O).

The controller feeds it, between waits and after each step, the time, the steps trained so far and the
rollout workers' last `RolloutState`s (the outcomes of their last episodes and their episodes' errors
counted by message). It answers one of:
- ``ok``;
- ``stall``: no step was trained for `stall_timeout_s` (0: never), counted from the first observation
  or the last step;
- ``failing``: more than `max_failed_fraction` of the workers' recent episodes failed, judged once
  the windows hold at least `window` episodes in all.
A stop carries a diagnosis built from what was seen: the recent failures and the most common error with
the dataset row it first came from, e.g. ``no step trained in 1800 s (trainer.stall_timeout_s=1800);
64 of the last 64 episodes failed; most common error (64x): ValueError('boom') from row 17``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from asyncrl.data.job_state import RolloutState


@dataclass(frozen=True)
class Verdict:
    kind: Literal["ok", "stall", "failing"]
    diagnosis: str = ""

    @property
    def stop(self) -> bool:
        return self.kind != "ok"


OK = Verdict("ok")


class Watchdog:
    def __init__(self, *, stall_timeout_s: float, max_failed_fraction: float, window: int, now: float):
        if stall_timeout_s < 0 or not 0.0 < max_failed_fraction <= 1.0 or window < 1:
            raise ValueError(f"watchdog: stall_timeout_s={stall_timeout_s} must be >= 0, max_failed_fraction="
                             f"{max_failed_fraction} in (0, 1], window={window} >= 1")
        self.stall_timeout_s, self.max_failed_fraction, self.window = stall_timeout_s, max_failed_fraction, window
        self.steps, self.progress_at = 0, now

    def observe(self, now: float, steps: int, states: list[RolloutState]) -> Verdict:
        if steps != self.steps:
            self.steps, self.progress_at = steps, now
        recent = sum(s.recent_episodes for s in states)
        failed = sum(s.recent_failed for s in states)
        if recent >= self.window and failed > self.max_failed_fraction * recent:
            return Verdict("failing", f"episodes fail above trainer.max_failed_episode_fraction="
                                      f"{self.max_failed_fraction:g}: " + describe(states))
        idle = now - self.progress_at
        if self.stall_timeout_s and idle >= self.stall_timeout_s:
            what = "no step trained" if steps == 0 else f"no step trained after step {steps}"
            return Verdict("stall", f"{what} in {idle:.0f} s (trainer.stall_timeout_s={self.stall_timeout_s:g}); "
                                    + describe(states))
        return OK


def describe(states: list[RolloutState]) -> str:
    """What the rollout side did: recent outcomes, the most common error and its first row, skips, drops."""
    recent = sum(s.recent_episodes for s in states)
    failed = sum(s.recent_failed for s in states)
    parts = [f"{failed} of the last {recent} episodes failed" if recent else "no episode has finished"]
    errors: dict[str, list[int]] = {}  # message -> [count, first data_index]
    for s in states:
        for e in s.errors:
            errors.setdefault(e.message, [0, e.data_index])[0] += e.count
    if errors:
        msg, (count, row) = max(errors.items(), key=lambda kv: kv[1][0])
        parts.append(f"most common error ({count}x): {msg} from row {row}")
    skipped = sum(s.position.prompts_skipped for s in states)
    dropped = sum(s.groups_dropped for s in states)
    if dropped or skipped:
        parts.append(f"{dropped} groups dropped unserved, {skipped} prompts skipped")
    return "; ".join(parts)
