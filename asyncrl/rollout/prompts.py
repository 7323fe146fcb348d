"""An epoch-aware, resumable, shardable stream of prompts.

Position p (0, 1, 2, ...) is global across epochs: epoch = p // N, and the row is the
(p % N)-th entry of that epoch's seeded permutation. Worker r of R takes positions p with
p % R == r. The group id is derived from the position alone, so a prompt issued again (after a
crash, or on resume) produces the same trajectory uids and the buffer stores them once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class PromptDraw:
    position: int
    epoch: int
    data_index: int
    row: dict[str, Any]

    @property
    def group_id(self) -> str:
        return f"g{self.position}"


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

    def at(self, position: int) -> PromptDraw:
        n = len(self.rows)
        epoch, offset = divmod(position, n)
        idx = int(self._perm(epoch)[offset])
        return PromptDraw(position, epoch, idx, self.rows[idx])

    def next(self) -> PromptDraw:
        draw = self.at(self.next_position)
        self.next_position += self.num_shards
        return draw
