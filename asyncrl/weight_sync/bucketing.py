"""Buckets and the flat-buffer layout shared by sender and receiver (the one place the rule lives).

A *bucket* is an ordered list of named full tensors, at most `bucket_bytes` in total (a tensor
larger than that travels alone). One bucket is one POST /update_weights_from_distributed; its
`names`, `dtypes` (torch names without the "torch." prefix, as SGLang sends them) and `shapes`
list the tensors in broadcast order.

Coalesced layout (used when every receiver advertises it; SGLang gets one broadcast per tensor):
    groups = dtypes of the bucket in order of first appearance;
    for each group d: flat_d = concat(t.reshape(-1) for t in bucket if dtype(t) == d), in `names` order;
    one broadcast of flat_d per group, groups in that order.
The receiver allocates flat_d of length sum(numel(shape_i)) and splits it back into views of
`shapes` by the same offsets. So a bucket of k tensors over m dtypes costs m collectives, not k.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (SGLang's wire spelling)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str, where: str = "dtype") -> torch.dtype:
    """"bfloat16" or "torch.bfloat16" -> torch.bfloat16; ValueError naming `where` otherwise."""
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"{where}: unknown dtype {name!r} (known: {', '.join(_DTYPES)})")
    return _DTYPES[key]


def is_float_dtype(name: str) -> bool:
    """Whether `name` is a known floating-point dtype (a tensor in it may load into any floating parameter)."""
    key = str(name).removeprefix("torch.")
    return key in _DTYPES and _DTYPES[key].is_floating_point


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def metas_of(bucket: Sequence[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
    return [TensorMeta(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in bucket]


def metas_from_request(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[TensorMeta]:
    """The metas of one update request; ValueError if the three lists disagree in length."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names/dtypes/shapes have lengths {len(names)}/{len(dtypes)}/{len(shapes)}; they must match")
    return [TensorMeta(str(n), str(d).removeprefix("torch."), tuple(int(x) for x in s))
            for n, d, s in zip(names, dtypes, shapes)]


def flat_groups(metas: Sequence[TensorMeta]) -> list[tuple[str, list[int]]]:
    """THE coalescing rule: [(dtype, indices into metas)] with dtypes in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for i, m in enumerate(metas):
        groups.setdefault(m.dtype, []).append(i)
    return list(groups.items())


def flat_specs(metas: Sequence[TensorMeta]) -> list[tuple[int, torch.dtype]]:
    """The receiver's flat buffers of the coalesced layout: (numel, dtype) per dtype group, in order."""
    return [(sum(metas[i].numel for i in idx), parse_dtype(d)) for d, idx in flat_groups(metas)]


def pack_groups(tensors: Sequence[torch.Tensor], metas: Sequence[TensorMeta]) -> list[torch.Tensor]:
    """The sender's flat buffers of the coalesced layout: one per dtype group, in order (`flat_specs`'s)."""
    return [pack(tensors, idx) for _, idx in flat_groups(metas)]


def pack(tensors: Sequence[torch.Tensor], indices: Sequence[int]) -> torch.Tensor:
    """One flat contiguous buffer holding tensors[indices] back to back."""
    parts = [tensors[i].detach().reshape(-1) for i in indices]
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)


def unpack(flat: torch.Tensor, metas: Sequence[TensorMeta], indices: Sequence[int]) -> list[torch.Tensor]:
    """Views of `flat` shaped like metas[indices] (the inverse of `pack`)."""
    out, off = [], 0
    for i in indices:
        n = metas[i].numel
        out.append(flat[off:off + n].view(metas[i].shape))
        off += n
    if off != flat.numel():
        raise ValueError(f"flat buffer holds {flat.numel()} elements, the metas need {off}")
    return out


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def iter_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream of named tensors into buckets of at most `bucket_bytes` (one oversized tensor
    forms a bucket by itself). Order is preserved; no tensor is copied; `named` is read lazily.
    A bad `bucket_bytes` raises here, not at the first bucket."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    return _buckets(named, bucket_bytes)


def _buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        b = nbytes(t)
        if bucket and size + b > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += b
    if bucket:
        yield bucket
