"""The running batch's KV cache: one left-padded slab per layer that grows in place.

Layout per layer: keys/values buffers [B, H, capacity, D]; the first `length` columns are in use,
and row b's real tokens are the columns where `mask[b] == 1` (its tokens are right-aligned: a row
that joined with a shorter history has zeros on its left). A decode step appends one column for
every row by writing into spare capacity (no copy of the whole cache per step, unlike
transformers' DynamicLayer which concatenates). Rows join (`merge`, after their own prefill) and
leave (`select`) between steps; both copy the slab once. After rows leave, columns that are
padding in every remaining row are dropped (`select` trims them).

The model sees a `transformers` Cache whose layers are `SlabLayer`s, with a 2-D attention mask
[B, length + 1] and per-row position ids, exactly as `generate` drives a left-padded batch.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

_GROW = 128  # spare columns allocated whenever the slab is (re)built or full


class SlabLayer(DynamicLayer):
    """A DynamicLayer that appends into preallocated capacity instead of concatenating."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, length: int):
        super().__init__()
        self.kbuf, self.vbuf, self.length = k, v, length
        self.dtype, self.device = k.dtype, k.device
        self.is_initialized = True
        self._sync()

    def _sync(self) -> None:
        self.keys = self.kbuf[:, :, : self.length]
        self.values = self.vbuf[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n = key_states.shape[-2]
        if self.length + n > self.kbuf.shape[2]:
            self.kbuf = _grow(self.kbuf, self.length, self.length + n + _GROW)
            self.vbuf = _grow(self.vbuf, self.length, self.length + n + _GROW)
        self.kbuf[:, :, self.length : self.length + n] = key_states
        self.vbuf[:, :, self.length : self.length + n] = value_states
        self.length += n
        self._sync()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length


def _grow(buf: torch.Tensor, used: int, capacity: int) -> torch.Tensor:
    b, h, _, d = buf.shape
    out = buf.new_zeros((b, h, capacity, d))
    out[:, :, :used] = buf[:, :, :used]
    return out


class KVBatch:
    """The running batch's cache and attention mask. Row order is the caller's row order."""

    def __init__(self, layers: list[SlabLayer], mask: torch.Tensor):
        self.layers = layers
        self.mask = mask  # [B, length] long, 1 = real token

    @property
    def rows(self) -> int:
        return self.mask.shape[0]

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    @classmethod
    def from_cache(cls, cache: Cache) -> KVBatch:
        """Adopt the cache of a one-row prefill (no padding)."""
        layers = []
        for layer in cache.layers:
            k, v = layer.keys, layer.values
            n = k.shape[2]
            layers.append(SlabLayer(_grow(k, n, n + _GROW), _grow(v, n, n + _GROW), n))
        n = layers[0].length
        return cls(layers, torch.ones((k.shape[0], n), dtype=torch.long, device=k.device))

    def cache(self) -> Cache:
        return Cache(layers=self.layers)

    def merge(self, other: KVBatch) -> KVBatch:
        """Rows of self followed by rows of other, right-aligned to the longer of the two."""
        n = max(self.length, other.length)
        layers = []
        for a, b in zip(self.layers, other.layers):
            layers.append(
                SlabLayer(_stack(a.kbuf, a.length, b.kbuf, b.length, n), _stack(a.vbuf, a.length, b.vbuf, b.length, n), n)
            )
        mask = torch.zeros((self.rows + other.rows, n), dtype=torch.long, device=self.mask.device)
        mask[: self.rows, n - self.length :] = self.mask
        mask[self.rows :, n - other.length :] = other.mask
        return KVBatch(layers, mask)

    def select(self, keep: list[int]) -> KVBatch | None:
        """Keep only rows `keep` (in that order), dropping columns that are padding in all of them."""
        if not keep:
            return None
        idx = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, idx)
        used = mask.any(dim=0).nonzero()
        start = int(used[0].item()) if used.numel() else mask.shape[1]
        mask = mask[:, start:].contiguous()
        n = mask.shape[1]
        layers = []
        for layer in self.layers:
            k = layer.kbuf.index_select(0, idx)[:, :, start : layer.length]
            v = layer.vbuf.index_select(0, idx)[:, :, start : layer.length]
            layers.append(SlabLayer(_grow(k, n, n + _GROW), _grow(v, n, n + _GROW), n))
        return KVBatch(layers, mask)

    def step_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(attention_mask [B, L+1], position_ids [B, 1], cache_position [1]) for one decode step.

        A row's position is its number of real cached tokens (positions count real tokens only)."""
        ones = torch.ones((self.rows, 1), dtype=self.mask.dtype, device=self.mask.device)
        attn = torch.cat([self.mask, ones], dim=1)
        pos = self.mask.sum(dim=1, keepdim=True)
        cache_pos = torch.tensor([self.length], dtype=torch.long, device=self.mask.device)
        return attn, pos, cache_pos

    def appended(self) -> None:
        """Record that a decode step appended one real column to every row."""
        ones = torch.ones((self.rows, 1), dtype=self.mask.dtype, device=self.mask.device)
        self.mask = torch.cat([self.mask, ones], dim=1)


def _stack(a: torch.Tensor, la: int, b: torch.Tensor, lb: int, n: int) -> torch.Tensor:
    ba, h, _, d = a.shape
    bb = b.shape[0]
    out = a.new_zeros((ba + bb, h, n + _GROW, d))
    out[:ba, :, n - la : n] = a[:, :, :la]
    out[ba:, :, n - lb : n] = b[:, :, :lb]
    return out
