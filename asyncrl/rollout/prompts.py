"""An epoch-aware, resumable, shardable stream of prompts.

Position p (0, 1, 2, ...) is global across epochs: epoch = p // N, and the row is the
(p % N)-th entry of that epoch's seeded permutation. Worker r of R takes positions p with
p % R == r. The group id is derived from the position and the retry number alone (`g<p>`, then
`g<p>r<k>` for the k-th retry of a prompt whose group the buffer dropped unserved), so a prompt issued
again after a crash or on resume produces the same trajectory uids and the buffer stores them once,
while a retry is a new group (the buffer has closed the old one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np


@dataclass(frozen=True)
class PromptDraw:
    position: int
    epoch: int
    data_index: int
    row: dict[str, Any]
    retry: int = 0  # 0: first issue; k: the k-th re-issue after its group was dropped unserved

    @property
    def group_id(self) -> str:
        return f"g{self.position}" if self.retry == 0 else f"g{self.position}r{self.retry}"


_GROUP_ID = re.compile(r"g(0|[1-9]\d*)(?:r([1-9]\d*))?")


def parse_group_id(group_id: str) -> tuple[int, int]:
    """(position, retry) of a training group id (`PromptDraw.group_id`); ValueError naming it otherwise."""
    m = _GROUP_ID.fullmatch(group_id)
    if m is None:
        raise ValueError(f"group id {group_id!r} is not a training group id (g<position> or g<position>r<retry>)")
    return int(m.group(1)), int(m.group(2) or 0)


class GroupKey(NamedTuple):
    run_id: str
    position: int
    retry: int


_RUN_GROUP_ID = re.compile(r"([0-9a-z]{1,16})-g(0|[1-9]\d*)(?:r([1-9]\d*))?")


def parse_group_key(group_id: str) -> GroupKey:
    """GroupKey of a run-scoped training group id (`<run_id>-g<position>[r<retry>]`); ValueError otherwise.
    Local copy for the buffer's dedupe (branch bufscale): the `runs` change makes this `parse_group_id`."""
    m = _RUN_GROUP_ID.fullmatch(group_id) if isinstance(group_id, str) else None
    if m is None:
        raise ValueError(f"group id {group_id!r} is not a training group id (<run_id>-g<position> or "
                         "<run_id>-g<position>r<retry>)")
    return GroupKey(m.group(1), int(m.group(2)), int(m.group(3) or 0))


class PromptSource:
    def __init__(self, rows: list[dict[str, Any]], *, seed: int, shuffle: bool = True,
                 shard: int = 0, num_shards: int = 1, start_position: int | None = None):
        if not rows:
            raise ValueError("the training dataset is empty")
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} out of range for {num_shards} shards")
        self.rows, self.seed, self.shuffle = rows, seed, shuffle
        self.shard, self.num_shards = shard, num_shards
        self._perms: dict[int, np.ndarray] = {}
        first = shard if start_position is None else start_position
        if first % num_shards != shard:
            raise ValueError(f"start position {first} does not belong to shard {shard} of {num_shards}")
        self.next_position = first

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            n = len(self.rows)
            self._perms = {epoch: np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)}
        return self._perms[epoch]

    def at(self, position: int, retry: int = 0) -> PromptDraw:
        n = len(self.rows)
        epoch, offset = divmod(position, n)
        idx = int(self._perm(epoch)[offset])
        return PromptDraw(position, epoch, idx, self.rows[idx], retry)

    def next(self) -> PromptDraw:
        draw = self.at(self.next_position)
        self.next_position += self.num_shards
        return draw
