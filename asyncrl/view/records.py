"""What `asyncrl view` shows, read from a run dir, live: trajectories joined with what became of them.

`RunReader.poll()` reads whatever was appended since the last call to the run's `trajectories-w*.jsonl`
(asyncrl/rollout/trajectory_log.py), `trained_uids.jsonl` ({step, version, uids} per step) and
`dropped_groups.jsonl` ({step, group_id, reason}) and `learner_logprobs.jsonl` ({step, uid, proximal_logprobs}:
the learner's log-probs of a trained trajectory's response tokens before its step); a last line without its newline (the writer is mid-line)
is left for the next poll, a line that does not parse is counted in `bad_lines` and skipped. Each trajectory
becomes a `TrajRow`: its status is `trained` (with the step and the staleness it was trained at: the
learner's version minus the oldest version that wrote a token), `dropped` (its group closed unserved: stale
or failed) or `pending` (not trained yet, or dropped alone as stale: the buffer does not report single uids).

`parse_filter(text)` turns the filter box's text into a `Filter` (every term must match):
    reward>=0.5  reward<1  reward=0     the reward's range (>, >=, <, <=, =)
    failed                               finish reason other than stop (length, max_turns, invalid_calls, ...)
    tool_errors                          at least one tool call came back as an error
    trained | dropped | pending          its status
    env=NAME  agent=NAME  finish=REASON  step=N  group=ID
    anything else                        case-insensitive text search in the conversation
"""

from __future__ import annotations

import json
import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from asyncrl.run_dir import RunLayout

TOOL_ERROR_KINDS = ("invalid_json", "unknown_tool", "bad_arguments", "tool_timeout", "tool_error")


@dataclass
class TrajRow:
    record: dict[str, Any]  # the trajectory's line as written
    status: str = "pending"  # trained | dropped | pending
    step: Optional[int] = None  # the step it was trained in (or the step at which its group was dropped)
    staleness: Optional[int] = None  # trained: the learner's version minus the trajectory's min_version
    dropped_reason: str = ""
    proximal_logprobs: Optional[list[float]] = None  # the learner's, per response token (learner_logprobs.jsonl)

    def mismatch_k3(self) -> Optional[float]:
        """The mean over generated tokens of k3 = r - 1 - log r, r = p_learner / p_sampler (0: they agree), from
        the learner's log-probs before its step and the sampler's; None without the learner's."""
        prox, behav = self.proximal_logprobs, self.record.get("behavior_logprobs") or []
        mask = self.record.get("loss_mask") or []
        if prox is None or len(prox) != len(behav):
            return None
        terms = [math.expm1(p - b) - (p - b) for p, b, m in zip(prox, behav, mask) if m]
        return sum(terms) / len(terms) if terms else None

    @property
    def uid(self) -> str:
        return str(self.record.get("uid", ""))

    @property
    def group_id(self) -> str:
        return str(self.record.get("group_id", ""))

    @property
    def reward(self) -> float:
        return float(self.record.get("reward") or 0.0)

    @property
    def metrics(self) -> dict[str, Any]:
        return self.record.get("metrics") or {}

    @property
    def tool_calls(self) -> int:
        return int(self.metrics.get("tool_calls", 0))

    @property
    def tool_errors(self) -> int:
        return int(sum(self.metrics.get(k, 0) for k in TOOL_ERROR_KINDS))

    def reward_parts(self) -> dict[str, float]:
        return {k.split("/", 1)[1]: float(v) for k, v in self.metrics.items()
                if k.startswith("reward/") and isinstance(v, (int, float))}

    def text(self) -> str:
        """Everything a text search looks in: each message's content and tool calls."""
        parts = []
        for m in self.record.get("messages") or []:
            parts.append(str(m.get("content") or ""))
            if m.get("tool_calls"):
                parts.append(json.dumps(m["tool_calls"], default=str))
        return "\n".join(parts)


class RunReader:
    """Incremental reader of a run dir's trajectory, trained and dropped files (see the module docstring)."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        if not self.run_dir.is_dir():
            raise FileNotFoundError(f"{self.run_dir}: no such directory (is it the output dir of an asyncrl train run?)")
        self.rows: list[TrajRow] = []
        self.by_uid: dict[str, TrajRow] = {}
        self.trained: dict[str, tuple[int, int]] = {}  # uid -> (step, version)
        self.dropped: dict[str, tuple[int, str]] = {}  # group_id -> (step, reason)
        self.proximal: dict[str, list[float]] = {}  # uid -> the learner's log-probs of its response tokens
        self.bad_lines = 0
        self._offsets: dict[Path, int] = {}

    def _new_lines(self, path: Path) -> list[dict[str, Any]]:
        try:
            with open(path, "rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # a torn last line waits for its newline
        self._offsets[path] = self._offsets.get(path, 0) + end
        out = []
        for line in data[:end].splitlines():
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                self.bad_lines += 1
                continue
            if isinstance(rec, dict):
                out.append(rec)
            else:
                self.bad_lines += 1
        return out

    def poll(self) -> int:
        """Read what was appended since the last poll; the number of new trajectories."""
        layout = RunLayout(self.run_dir)
        for rec in self._new_lines(layout.trained_uids):
            for uid in rec.get("uids") or []:
                self.trained[str(uid)] = (int(rec.get("step", 0)), int(rec.get("version", rec.get("step", 1) - 1)))
        for rec in self._new_lines(layout.learner_logprobs):
            lps = rec.get("proximal_logprobs")
            if isinstance(lps, list) and all(isinstance(x, (int, float)) for x in lps):
                self.proximal[str(rec.get("uid"))] = [float(x) for x in lps]
            else:
                self.bad_lines += 1
        for rec in self._new_lines(layout.dropped_groups):
            self.dropped[str(rec.get("group_id"))] = (int(rec.get("step", 0)), str(rec.get("reason", "")))
        new = 0
        for path in layout.trajectory_files():
            for rec in self._new_lines(path):
                if "uid" not in rec or str(rec["uid"]) in self.by_uid:
                    continue
                row = TrajRow(rec)
                self.rows.append(row)
                self.by_uid[row.uid] = row
                new += 1
        for row in self.rows:  # statuses may change with every poll
            self._settle(row)
        return new

    def _settle(self, row: TrajRow) -> None:
        row.proximal_logprobs = self.proximal.get(row.uid)
        if row.uid in self.trained:
            step, version = self.trained[row.uid]
            row.status, row.step, row.dropped_reason = "trained", step, ""
            mv = row.record.get("min_version")
            row.staleness = version - int(mv) if isinstance(mv, int) and mv >= 0 else None
        elif row.group_id in self.dropped:
            step, why = self.dropped[row.group_id]
            row.status, row.step, row.dropped_reason = "dropped", step, why

    def group(self, group_id: str) -> list[TrajRow]:
        return sorted((r for r in self.rows if r.group_id == group_id), key=lambda r: r.record.get("sample_index", 0))


# ---------------------------------------------------------------------------------------------- filters

_CMP = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "=": operator.eq}
_REWARD = re.compile(r"^reward(>=|<=|>|<|=)(-?[0-9.]+(?:e-?\d+)?)$")
_FIELDS: dict[str, Callable[[TrajRow], str]] = {
    "env": lambda r: str(r.record.get("env", "")), "agent": lambda r: str(r.record.get("agent", "")),
    "finish": lambda r: str(r.record.get("finish_reason", "")), "step": lambda r: str(r.step),
    "group": lambda r: r.group_id,
}


@dataclass
class Filter:
    terms: list[Callable[[TrajRow], bool]] = field(default_factory=list)
    text: str = ""

    def matches(self, row: TrajRow) -> bool:
        return all(t(row) for t in self.terms)


class FilterError(ValueError):
    """A filter term that looks like a comparison but is not one (e.g. reward>abc)."""


def parse_filter(text: str) -> Filter:
    """See the module docstring for the terms."""
    f = Filter(text=text)
    words = []
    for term in text.split():
        low = term.lower()
        if low.startswith("reward") and any(c in low for c in "<>="):
            m = _REWARD.match(low)
            if m is None:
                raise FilterError(f"{term!r}: expected reward>=X, reward<X, ... with a number X")
            op, x = _CMP[m.group(1)], float(m.group(2))
            f.terms.append(lambda r, op=op, x=x: op(r.reward, x))
        elif low == "failed":
            f.terms.append(lambda r: r.record.get("finish_reason", "stop") != "stop")
        elif low == "tool_errors":
            f.terms.append(lambda r: r.tool_errors > 0)
        elif low in ("trained", "dropped", "pending"):
            f.terms.append(lambda r, s=low: r.status == s)
        elif "=" in low and low.split("=", 1)[0] in _FIELDS:
            key, value = term.split("=", 1)
            get = _FIELDS[key.lower()]
            f.terms.append(lambda r, get=get, v=value: get(r) == v)
        else:
            words.append(low)
    if words:
        f.terms.append(lambda r: all(w in r.text().lower() for w in words))
    return f
