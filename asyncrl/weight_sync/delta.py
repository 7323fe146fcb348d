"""Delta weight sync: after the first sync only the values that changed travel (an asyncrl extension of
the group transports, gloo and nccl; a real SGLang always gets whole tensors). The rules live here, for
both sides: the sender's GroupTransport (broadcast.py) and the engine's WeightReceiver (receiver.py).

Why it pays: engines serve bf16 (on a GPU, and on a CPU with native bf16) while the learner keeps fp32
masters. One step at the default learning rate moves a weight by about lr, far less than one bf16 step
(2^-8 of the weight), so few bf16 values change per step (docs/benchmarks.md "Delta weight sync"). An
fp32 engine sees every value change each step (measured on the tiny model: all of them, a tied embedding's
rows included, since the output softmax gives every row a gradient), so deltas are used only with engines
serving a 16-bit dtype (MAX_ITEMSIZE); fp32 engines get full syncs and the sender keeps no base.

Base and tokens
    The sender keeps `base`: every tensor as it last sent it, in the wire dtype (memory: the model once in
    the engines' dtype, on learner rank 0's device). A sync's token names what it sends:
    "<sender id>:<version>". An engine says in GET /weight_sync_info `delta_base`: the token its weights
    equal as a whole, or null (never synced by this sender, a sync it did not finish, an update of any
    other kind, a relaunch). A sync is a delta only when every engine of the group reports the base's
    token; else it is full (first contact, a relaunch, a new sender, a failed or abandoned sync, a
    checksum mismatch), and it sets the base again.
Per tensor (`plan`)
    changed = the positions whose bits differ between the new wire tensor and the base (bitwise, so -0.0
    against 0.0 and NaN payloads count as changes);
    none changed: the tensor is left out of the sync;
    k changed and k * (4 + itemsize) < numel * itemsize (and numel < 2^31): sparse, int32 positions and
    their values; else whole, as in a full sync.
Wire layout of one delta bucket
    request field `asyncrl_delta`: {"base": token the engine must hold, "counts": per tensor in `names`
    order k (sparse) or -1 (whole), "checksums": per tensor, `checksum` of the new tensor ("" for whole)};
    every bucket of a tracked sync (delta or full) carries `asyncrl_track`: the sync's token.
    Broadcasts, in order (`wire_specs` is the receiver's list of them, `wire_buffers` the sender's):
      1. the whole tensors, in bucketing.py's coalesced layout over them;
      2. one int32 buffer: every sparse tensor's positions, concatenated in `names` order;
      3. per dtype group of the sparse tensors (bucketing.flat_groups over them): their values.
    The receiver rebuilds each sparse tensor from its live parameter (a copy with the positions set) and
    it must then hash to the sender's checksum; else nothing of the bucket is applied, the engine's
    delta_base stays cleared and it answers a refusal marked `asyncrl_delta_mismatch` (errors.py code
    delta_mismatch): the sender abandons that sync, and the next one is full.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from asyncrl.weight_sync.bucketing import (
    TensorMeta,
    flat_groups,
    flat_specs,
    metas_of,
    pack_groups,
    parse_dtype,
    unpack,
)

POSITION_DTYPE = torch.int32
POSITION_BYTES = 4
MAX_SPARSE_NUMEL = 2 ** 31 - 1  # int32 positions
WHOLE = -1  # `counts` entry of a tensor sent whole
MAX_ITEMSIZE = 2  # deltas only for engines serving bf16 or fp16 (module docstring)
CHECKSUM_BLOCK = 64  # int64 words per block sum (checksum)
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t` flattened and viewed as integers of its element size (no copy when contiguous)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    return flat.view(_INT_OF_SIZE[flat.element_size()])


def changed_positions(new: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Flat positions (int64, ascending) where `new` and `base` differ bit for bit."""
    return torch.nonzero(bits(new) != bits(base)).reshape(-1)


def sparse_pays(changed: int, numel: int, itemsize: int) -> bool:
    """THE rule: positions + values of `changed` elements cost fewer bytes than the whole tensor."""
    return numel <= MAX_SPARSE_NUMEL and changed * (POSITION_BYTES + itemsize) < numel * itemsize


def checksum(t: torch.Tensor) -> str:
    """A digest of `t`'s bytes, shape and dtype: blake2b over the sums of its bytes read as int64 words, in
    blocks of CHECKSUM_BLOCK words (512 bytes; sums wrap modulo 2^64, so any summation order gives the same
    figure). A flipped bit changes its block's sum; so does a value moved to another lane or block. Both
    sides compute it on the tensor's own device; only the block sums leave it. (Summing int64 words takes
    about 0.03 s for the 135M model in bf16 on one CPU core, where int16 elements summed into int64 took 0.55 s.)"""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    words = raw.numel() // 8
    full = words - words % CHECKSUM_BLOCK
    parts = [raw[:full * 8].view(torch.int64).view(-1, CHECKSUM_BLOCK).sum(1)] if full else []
    rest = raw[full * 8:]
    if rest.numel():
        tail = torch.zeros(CHECKSUM_BLOCK * 8, dtype=torch.uint8, device=raw.device)
        tail[:rest.numel()] = rest
        parts.append(tail.view(torch.int64).sum().reshape(1))
    sums = torch.cat(parts).cpu() if parts else torch.zeros(0, dtype=torch.int64)
    h = hashlib.blake2b(digest_size=8)
    h.update(repr((tuple(t.shape), str(t.dtype))).encode())
    h.update(sums.numpy().tobytes())
    return h.hexdigest()


@dataclass
class Planned:
    """One tensor of a delta bucket: sent whole (positions None) or as `positions` (int32) and `values`."""

    name: str
    tensor: torch.Tensor  # the new wire tensor (whole)
    positions: torch.Tensor | None = None
    values: torch.Tensor | None = None

    @property
    def count(self) -> int:
        return WHOLE if self.positions is None else int(self.positions.numel())

    @property
    def nbytes(self) -> int:
        if self.positions is None:
            return self.tensor.numel() * self.tensor.element_size()
        return self.count * (POSITION_BYTES + self.tensor.element_size())


def plan(name: str, new: torch.Tensor, base: torch.Tensor | None) -> Planned | None:
    """How `new` travels against `base` (None: no base for it, so whole); None when nothing changed."""
    if base is None or base.shape != new.shape or base.dtype != new.dtype:
        return Planned(name, new)
    pos = changed_positions(new, base)
    if pos.numel() == 0:
        return None
    if not sparse_pays(pos.numel(), new.numel(), new.element_size()):
        return Planned(name, new)
    return Planned(name, new, pos.to(POSITION_DTYPE), bits(new)[pos].view(new.dtype))


def metas_of_plan(items: Sequence[Planned]) -> list[TensorMeta]:
    return metas_of([(p.name, p.tensor) for p in items])


def wire_buffers(items: Sequence[Planned]) -> list[torch.Tensor]:
    """The sender's broadcasts of one delta bucket, in the layout's order (module docstring)."""
    metas = metas_of_plan(items)
    whole = [i for i, p in enumerate(items) if p.positions is None]
    sparse = [i for i, p in enumerate(items) if p.positions is not None]
    bufs = pack_groups([items[i].tensor for i in whole], [metas[i] for i in whole])
    if sparse:
        bufs.append(torch.cat([items[i].positions for i in sparse]))  # type: ignore[misc]
        values = [items[i].values for i in sparse]
        bufs += [torch.cat([values[j] for j in idx]) for _, idx in flat_groups([metas[i] for i in sparse])]  # type: ignore[misc]
    return bufs


def wire_specs(metas: Sequence[TensorMeta], counts: Sequence[int]) -> list[tuple[int, torch.dtype]]:
    """The receiver's broadcasts of one delta bucket: (numel, dtype) each, in the layout's order."""
    whole = [m for m, c in zip(metas, counts) if c == WHOLE]
    sparse = [(m, c) for m, c in zip(metas, counts) if c != WHOLE]
    specs = flat_specs(whole)
    if sparse:
        specs.append((sum(c for _, c in sparse), POSITION_DTYPE))
        specs += [(sum(sparse[i][1] for i in idx), parse_dtype(d)) for d, idx in flat_groups([m for m, _ in sparse])]
    return specs


def unpack_wire(metas: Sequence[TensorMeta], counts: Sequence[int], bufs: Sequence[torch.Tensor]
                ) -> list[torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
    """The receiver's view of the broadcasts: per tensor, in `metas` order, the whole tensor or
    (positions, values). The inverse of `wire_buffers`."""
    whole = [i for i, c in enumerate(counts) if c == WHOLE]
    sparse = [i for i, c in enumerate(counts) if c != WHOLE]
    out: list = [None] * len(metas)
    bi = 0
    whole_metas = [metas[i] for i in whole]
    for _, idx in flat_groups(whole_metas):
        for j, view in zip(idx, unpack(bufs[bi], whole_metas, idx)):
            out[whole[j]] = view
        bi += 1
    if sparse:
        positions, off = bufs[bi], 0
        bi += 1
        pos_of = {}
        for i in sparse:
            pos_of[i] = positions[off:off + counts[i]]
            off += counts[i]
        sparse_metas = [metas[i] for i in sparse]
        for _, idx in flat_groups(sparse_metas):
            flat, voff = bufs[bi], 0
            bi += 1
            for j in idx:
                i = sparse[j]
                out[i] = (pos_of[i], flat[voff:voff + counts[i]])
                voff += counts[i]
    return out


def rebuilt(live: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A copy of `live` with `values` (of its dtype) at its flat `positions`, bit for bit (IndexError for a
    position out of range)."""
    out = live.detach().clone()
    target = bits(out)  # a view of the copy
    if positions.numel():
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= target.numel():
            raise IndexError(f"delta position {lo if lo < 0 else hi} outside a tensor of {target.numel()} elements")
        target[positions.to(device=target.device, dtype=torch.int64)] = bits(values).to(target.device)
    return out
