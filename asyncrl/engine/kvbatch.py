"""The running batch's KV cache: a fixed set of row slots per layer, written in place.

Layout per layer: key/value buffers [S, H, C, D] (S = the engine's max running sequences, C = capacity
in columns). Rows 0..rows-1 are the running sequences, in the scheduler's `running` order; columns
0..length-1 are in use. Every row's real tokens are right-aligned to `length`: row r holds them in
columns [length - real[r], length), where `mask[r]` is true, so one decode step writes one column,
`length`, for every row, and a row's next position is its count of real tokens.

What each change costs (the old layout copied every layer's whole slab whenever a row joined or left):
- `add` (after a request's own prefill): its K/V are written into row `rows`, at
  [length - p, length); a prompt longer than `length` rebuilds the slab first (`_rebuild`);
- `remove(i)`: the last row moves into row i (one row's live columns copied); the scheduler moves
  its request list the same way (`running[i] = running.pop()`);
- a decode step: the forward writes column `length` of rows 0..rows-1 (`SlabLayer.update`), then
  `appended()` advances `length` and every row's `real`;
- `_rebuild`: one copy of the live columns into a fresh buffer with `_GROW` spare columns, when the
  slab is full, when a longer prompt joins, or when the columns no running row uses (left of every
  row's first token) reach half of `length` (`trim`), so attention never runs over much dead width.
  With `fixed_buffers` (the CUDA-graph decode of engine/graphs.py, whose captured kernels read these
  buffers' addresses) the live columns move left inside the same buffers instead, and new buffers
  (twice the columns) are made only when the live columns would not fit: `generation` counts the
  buffers made, so a captured graph knows when it reads stale ones.

The model sees a `transformers` Cache whose layers are `SlabLayer`s (views of rows 0..rows-1, columns
0..length-1), a 2-D attention mask [rows, length + 1] and per-row position ids, exactly as `generate`
drives a left-padded batch. Buffers start zeroed and only ever hold real K/V, so masked columns are
finite (a masked NaN would still poison softmax(.) @ V).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

_GROW = 128  # spare columns allocated whenever the slab is (re)built
_TRIM_MIN = 64  # dead columns on the left worth a rebuild (and at least half of `length`)


class SlabLayer(DynamicLayer):
    """One layer's view of the slots: rows 0..rows-1, columns 0..length-1; `update` writes in place."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        super().__init__()
        self.kbuf, self.vbuf, self.rows, self.length = k, v, 0, 0
        self.dtype, self.device = k.dtype, k.device
        self.is_initialized = True
        self.view(0, 0)

    def view(self, rows: int, length: int) -> None:
        self.rows, self.length = rows, length
        self.keys = self.kbuf[:rows, :, :length]
        self.values = self.vbuf[:rows, :, :length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n = key_states.shape[-2]
        if key_states.shape[0] != self.rows or self.length + n > self.kbuf.shape[2]:
            raise RuntimeError(f"KV slots: a forward of {key_states.shape[0]} rows x {n} new columns does not fit "
                               f"{self.rows} rows at length {self.length} of capacity {self.kbuf.shape[2]}")
        self.kbuf[: self.rows, :, self.length : self.length + n] = key_states
        self.vbuf[: self.rows, :, self.length : self.length + n] = value_states
        self.view(self.rows, self.length + n)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length


class KVSlots:
    """The running rows' caches (see the module docstring). `slots` bounds the rows. Its tensors are
    inference tensors (the engine's forwards make them): every method that writes them runs under
    inference mode, wherever it is called from (`remove` runs in the scheduler's reap, outside a forward)."""

    def __init__(self, slots: int, *, fixed_buffers: bool = False, min_capacity: int = 0):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self.fixed_buffers = fixed_buffers  # rebuild in place (see the module docstring)
        self.min_capacity = min_capacity  # columns of the first buffers, at least
        self.generation = 0  # buffers made so far (their addresses change with it)
        self.rows = 0
        self.length = 0
        self.layers: list[SlabLayer] = []
        self.mask: torch.Tensor | None = None  # [S, C] bool: column holds a real token of the row
        self.real: torch.Tensor | None = None  # [S] long: real tokens per row (its next position)
        self.rebuilds = 0  # how many times the slab was copied whole (a measure of the layout's cost)

    @property
    def capacity(self) -> int:
        return self.mask.shape[1] if self.mask is not None else 0

    def clear(self) -> None:
        """Drop every row (the buffers stay for the next rows)."""
        self.rows, self.length = 0, 0

    @torch.inference_mode()
    def add(self, cache: Cache) -> int:
        """Append the one-row cache of a prefill as the last row; returns its index."""
        if self.rows >= self.slots:
            raise RuntimeError(f"KV slots: all {self.slots} rows are in use")
        keys = [layer.keys for layer in cache.layers]
        values = [layer.values for layer in cache.layers]
        p = keys[0].shape[2]
        if not self.layers:
            self._allocate(keys[0], len(keys), p + _GROW)
        if self.rows == 0:
            self.length = 0
        if p > self.length or self.length >= self.capacity:
            self._rebuild(min_length=p)
        r, end = self.rows, self.length
        for layer, k, v in zip(self.layers, keys, values):
            layer.kbuf[r, :, end - p : end] = k[0]
            layer.vbuf[r, :, end - p : end] = v[0]
        self._place_row(r, p, end)
        self.rows += 1
        return r

    @torch.inference_mode()
    def remove(self, i: int) -> None:
        """Drop row i: the last row moves into it (the caller moves its own list the same way)."""
        if not 0 <= i < self.rows:
            raise IndexError(f"KV slots: row {i} is not one of the {self.rows} running rows")
        last = self.rows - 1
        if i != last:
            start = self.length - int(self.real[last])
            for layer in self.layers:
                layer.kbuf[i, :, start : self.length] = layer.kbuf[last, :, start : self.length]
                layer.vbuf[i, :, start : self.length] = layer.vbuf[last, :, start : self.length]
            self.mask[i] = self.mask[last]
            self.real[i] = self.real[last]
        self.rows = last
        if self.rows == 0:
            self.length = 0
        elif self._dead_columns() >= max(_TRIM_MIN, self.length // 2):
            self._rebuild()

    def cache(self) -> Cache:
        for layer in self.layers:
            layer.view(self.rows, self.length)
        return Cache(layers=self.layers)

    @torch.inference_mode()
    def step_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(attention_mask [rows, length+1], position_ids [rows, 1], cache_position [1]) for one decode
        step of every row; makes room for the column it writes."""
        if self.length + 1 > self.capacity:
            self._rebuild()
        n, L = self.rows, self.length
        self.mask[:n, L] = True
        return (self.mask[:n, : L + 1], self.real[:n].unsqueeze(1).clone(),
                torch.tensor([L], dtype=torch.long, device=self.mask.device))

    @torch.inference_mode()
    def appended(self) -> None:
        """Record that a decode step wrote column `length` for every row."""
        self.length += 1
        self.real[: self.rows] += 1

    # ---- the fused step (asyncrl/engine/fused.py) -------------------------------------------
    @torch.inference_mode()
    def begin_step(self, new_lengths: list[int], like: torch.Tensor, n_layers: int) -> tuple[int, torch.Tensor | None]:
        """Prepare one step in which rows 0..rows-1 each write one column and new rows (prompt lengths
        `new_lengths`) take rows rows.. with their K/V right-aligned to the step's end. Returns the
        decode column and the decode rows' mask [rows, 1, 1, column + 1]. `like` [1, Hkv, 1, D] gives
        the buffers' head shape, dtype and device the first time."""
        n = self.rows
        if n + len(new_lengths) > self.slots:
            raise RuntimeError(f"KV slots: {n} running + {len(new_lengths)} new rows exceed {self.slots}")
        if not self.layers:
            self._allocate(like, n_layers, max(new_lengths, default=0) + _GROW)
        need = max(new_lengths, default=0)  # the step's end column must be at least the longest new prompt
        if n == 0:
            if need > self.capacity:
                self._rebuild(min_length=need)
            self.length = max(need - 1, 0)  # no row writes the decode column: the step ends at `need`
        elif need > self.length + 1 or self.length + 1 > self.capacity:
            # one rebuild for both: a rebuild only for room would trim the dead columns on the left and
            # could leave fewer columns before the step's end than the longest new prompt needs
            self._rebuild(min_length=need - 1)
        col = self.length
        self.mask[:n, col] = True
        for j, p in enumerate(new_lengths):
            self._place_row(n + j, p, col + 1)
        for layer in self.layers:
            layer.view(n, col)
        return col, (self.mask[:n, : col + 1].view(n, 1, 1, col + 1) if n else None)

    @torch.inference_mode()
    def end_step(self, new_rows: int) -> None:
        """The step of `begin_step` ran: the decode rows gained a column, the new rows are running."""
        self.real[: self.rows] += 1
        self.length += 1  # with no decode rows, begin_step put the step's end (the longest new prompt) here
        self.rows += new_rows

    # ---- internals -------------------------------------------------------------------------
    def _allocate(self, like: torch.Tensor, n_layers: int, capacity: int) -> None:
        capacity = max(capacity, self.min_capacity)
        self.generation += 1
        _, h, _, d = like.shape
        self.layers = [SlabLayer(like.new_zeros((self.slots, h, capacity, d)), like.new_zeros((self.slots, h, capacity, d)))
                       for _ in range(n_layers)]
        self.mask = torch.zeros((self.slots, capacity), dtype=torch.bool, device=like.device)
        self.real = torch.zeros((self.slots,), dtype=torch.long, device=like.device)

    def _place_row(self, r: int, p: int, end: int) -> None:
        """Row r holds `p` real tokens in the columns just before `end`."""
        self.mask[r] = False
        self.mask[r, end - p : end] = True
        self.real[r] = p

    def _dead_columns(self) -> int:
        """Columns on the left that no running row uses."""
        if self.rows == 0:
            return self.length
        return self.length - int(self.real[: self.rows].max())

    def _rebuild(self, min_length: int = 0) -> None:
        """Copy the live columns right-aligned into fresh buffers of length max(live, min_length) with
        `_GROW` spare columns."""
        start = self._dead_columns()  # the first column a running row uses (length when none runs)
        live = self.length - start
        new_len = max(live, min_length)
        cap = new_len + _GROW
        off = new_len - live
        n = self.rows
        self.rebuilds += 1
        if self.fixed_buffers:
            if new_len + _GROW // 4 <= self.capacity:  # in place: the buffers keep their addresses
                self._compact(start, off, new_len)
                return
            cap = max(cap, 2 * self.capacity)
        self.generation += 1
        for layer in self.layers:
            for name in ("kbuf", "vbuf"):
                old = getattr(layer, name)
                s, h, _, d = old.shape
                new = old.new_zeros((s, h, cap, d))
                new[:n, :, off:new_len] = old[:n, :, start : self.length]
                setattr(layer, name, new)
        mask = torch.zeros((self.slots, cap), dtype=torch.bool, device=self.mask.device)
        mask[:n, off:new_len] = self.mask[:n, start : self.length]
        self.mask = mask
        self.length = new_len

    def _compact(self, start: int, off: int, new_len: int) -> None:
        """`_rebuild` inside the same buffers: the live columns [start, length) of the running rows move
        to [off, new_len). What stays right of them is K/V some row wrote earlier (finite), masked."""
        n = self.rows
        if n and (start != off or new_len != self.length):
            for layer in self.layers:
                for buf in (layer.kbuf, layer.vbuf):
                    buf[:n, :, off:new_len] = buf[:n, :, start : self.length].clone()
            kept = self.mask[:n, start : self.length].clone()
            self.mask[:n] = False
            self.mask[:n, off:new_len] = kept
        self.length = new_len
