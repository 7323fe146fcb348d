"""An epoch-aware, resumable, shardable stream of prompts.

Position p (0, 1, 2, ...) is global across epochs: epoch = p // N, and the row is the
(p % N)-th entry of that epoch's seeded permutation. Worker r of R takes positions p with
p % R == r. The group id is derived from the run's id, the position and the retry number alone
(`<run_id>-g<p>`, then `<run_id>-g<p>r<k>` for the k-th retry of a prompt whose group the buffer
dropped unserved), so a prompt issued again after a crash or on resume produces the same trajectory
uids and the buffer stores them once, while a retry is a new group (the buffer has closed the old one)
and another run's prompts never share an id with this run's (the run id is asyncrl/run_dir.py's).

Rows come from a `Dataset` (asyncrl/data/dataset.py; a plain list is wrapped as rows built in memory),
read one at a time: only the current epoch's permutation is held, an int64 array of N entries
(8 MB at a million rows). A row that fails validation when drawn gives a draw with `error` set
(the worker fails that group's episodes with it, naming the file and row), or, when the dataset
skips bad rows (`env.skip_bad_rows`), its position is passed over by `next()` and counted in
`rows_skipped`; validity is a property of the row, so a resumed source passes over the same ones.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from asyncrl.data.dataset import Dataset
from asyncrl.data.group_ids import group_id
from asyncrl.data.rows import DataError
from asyncrl.run_dir import check_run_id

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptDraw:
    position: int
    epoch: int
    data_index: int
    row: Optional[dict[str, Any]]  # None when the row is bad (then `error` says why)
    retry: int = 0  # 0: first issue; k: the k-th re-issue after its group was dropped unserved
    run_id: str = ""  # the run that draws it (PromptSource's); part of the group id
    error: str = ""  # the row failed validation: the DataError's text (file, row, field)

    @property
    def group_id(self) -> str:
        return group_id(self.run_id, self.position, self.retry)


class PromptSource:
    def __init__(self, rows: Dataset | list[dict[str, Any]], *, run_id: str, seed: int, shuffle: bool = True,
                 shard: int = 0, num_shards: int = 1, start_position: int | None = None):
        self.run_id = check_run_id(run_id, "PromptSource run_id")
        if not isinstance(rows, Dataset):
            rows = Dataset.from_rows(rows)
        if not len(rows):
            raise ValueError("the training dataset is empty")
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} out of range for {num_shards} shards")
        self.rows, self.seed, self.shuffle = rows, seed, shuffle
        self.rows_skipped = 0  # bad rows passed over by next() (skip_bad datasets)
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
        try:
            return PromptDraw(position, epoch, idx, self.rows[idx], retry, run_id=self.run_id)
        except DataError as e:
            return PromptDraw(position, epoch, idx, None, retry, run_id=self.run_id, error=str(e))

    def next(self) -> PromptDraw:
        """The next position's draw; a bad row's position is passed over when the dataset skips bad rows
        (DataError once a whole dataset's worth of positions in a row were bad)."""
        for _ in range(len(self.rows)):
            draw = self.at(self.next_position)
            self.next_position += self.num_shards
            if not (draw.error and self.rows.skip_bad):
                return draw
            self.rows_skipped += 1
            log.warning("position %d skipped (env.skip_bad_rows): %s", draw.position, draw.error)
        raise DataError(f"{len(self.rows)} positions in a row drew bad rows; last: {draw.error}",
                        source=self.rows.source)
