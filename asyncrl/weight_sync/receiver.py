"""Engine side of a weight sync: join the update group, check, receive and apply broadcast buckets.

Used by the routes (routes.py) over any object with the EngineCore contract (`model`,
`weight_version`, `apply_weights(named_tensors, version)`). Every reply is SGLang-shaped:
{"success": bool, "message": str, "weight_version": int}. Collectives run in a worker thread so
the server's event loop keeps serving /generate, /health and the rest meanwhile.

Checks happen before any byte moves: names must be the served model's state_dict keys, shapes and
dtypes equal to the live tensor's. On a mismatch the receiver still takes part in the bucket's
broadcast (into scratch buffers, thrown away) so that rank 0's collective completes and the group
stays usable; nothing is applied and the reply is success=false naming the tensor.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.weight_sync.bucketing import TensorMeta, flat_groups, metas_from_request, parse_dtype, unpack
from asyncrl.weight_sync.group import destroy_group, init_custom_process_group

log = logging.getLogger(__name__)

DEFAULT_GROUP_TIMEOUT_S = 300.0
CAPABILITIES = {"asyncrl": True, "coalesce": True, "tp_size": 1}


def check_metas(targets: dict[str, torch.Tensor], metas: Sequence[TensorMeta]) -> str | None:
    """None if every meta names a tensor of `targets` with the same shape and dtype, else the
    message naming the first bad tensor."""
    for m in metas:
        dst = targets.get(m.name)
        if dst is None:
            sample = ", ".join(list(targets)[:3])
            return f"weight {m.name!r} is not a tensor of the served model (its names look like: {sample}, ...)"
        if tuple(dst.shape) != m.shape:
            return f"weight {m.name!r}: sender shape {list(m.shape)} != engine shape {list(dst.shape)}"
        if str(dst.dtype).removeprefix("torch.") != m.dtype:
            return f"weight {m.name!r}: sender dtype {m.dtype} != engine dtype {str(dst.dtype).removeprefix('torch.')}"
    return None


def receive_bucket(pg: Any, metas: Sequence[TensorMeta], coalesce: bool, device: str) -> list[torch.Tensor]:
    """Receive one bucket from rank 0 of `pg` (blocking): per dtype group when `coalesce` (the rule
    in bucketing.py), else one broadcast per tensor in order. Returns tensors in `metas` order."""
    out: list[torch.Tensor | None] = [None] * len(metas)
    works = []
    if coalesce:
        for dtype, idx in flat_groups(metas):
            flat = torch.empty(sum(metas[i].numel for i in idx), dtype=parse_dtype(dtype), device=device)
            works.append(dist.broadcast(flat, src=0, group=pg, async_op=True))
            for i, view in zip(idx, unpack(flat, metas, idx)):
                out[i] = view
    else:
        for i, m in enumerate(metas):
            out[i] = torch.empty(m.shape, dtype=parse_dtype(m.dtype, f"weight {m.name!r}"), device=device)
            works.append(dist.broadcast(out[i], src=0, group=pg, async_op=True))
    for w in works:
        w.wait()
    return out  # type: ignore[return-value]


def _reply(success: bool, message: str, core: Any) -> dict:
    return {"success": success, "message": message, "weight_version": int(core.weight_version)}


def _version(body: dict) -> int | None:
    v = body.get("weight_version")
    if v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        raise ValueError(f"weight_version must be an integer, got {v!r}") from None


@dataclass
class _Group:
    pg: Any
    rank: int
    world_size: int
    backend: str
    busy: asyncio.Lock = field(default_factory=asyncio.Lock)  # one bucket at a time per group


class WeightReceiver:
    """The state behind the weight-sync routes of one engine (its groups by name)."""

    def __init__(self, core: Any):
        self.core = core
        self.groups: dict[str, _Group] = {}
        self._apply_lock = asyncio.Lock()  # one apply at a time (a stuck old group never holds it)

    def _device(self) -> str:
        p = next(iter(self.core.model.parameters()), None)
        return str(p.device) if p is not None else "cpu"

    async def init_group(self, body: dict) -> dict:
        try:
            name = str(body["group_name"])
            backend = str(body.get("backend") or "gloo")
            addr, port = str(body["master_address"]), int(body["master_port"])
            rank, world = int(body["rank_offset"]), int(body["world_size"])
            timeout = float(body.get("timeout_s") or DEFAULT_GROUP_TIMEOUT_S)
        except (KeyError, TypeError, ValueError) as e:
            return _reply(False, f"init_weights_update_group: bad or missing field {e}", self.core)
        if name in self.groups:
            return _reply(False, f"weight-update group {name!r} already exists on this engine", self.core)
        try:
            pg = await asyncio.to_thread(
                init_custom_process_group, backend, f"tcp://{addr}:{port}", world, rank, name, timeout
            )
        except Exception as e:  # noqa: BLE001 - reported to the sender, the server keeps serving
            return _reply(False, f"joining weight-update group {name!r} at {addr}:{port} failed: {e}", self.core)
        self.groups[name] = _Group(pg, rank, world, backend)
        return _reply(True, f"joined {name!r} as rank {rank} of {world} ({backend})", self.core)

    async def destroy_group(self, body: dict) -> dict:
        name = str(body.get("group_name", ""))
        g = self.groups.pop(name, None)
        if g is None:
            return _reply(False, f"no weight-update group {name!r} on this engine (have: {sorted(self.groups)})", self.core)
        async with g.busy:  # a receive still running on it ends (or times out) first
            await asyncio.to_thread(destroy_group, g.pg)
        return _reply(True, f"destroyed {name!r}", self.core)

    async def update_from_distributed(self, body: dict) -> dict:
        name = str(body.get("group_name", ""))
        g = self.groups.get(name)
        if g is None:
            return _reply(False, f"no weight-update group {name!r} on this engine (have: {sorted(self.groups)})", self.core)
        try:
            metas = metas_from_request(body.get("names") or [], body.get("dtypes") or [], body.get("shapes") or [])
            for m in metas:
                parse_dtype(m.dtype, f"weight {m.name!r}")
            version = _version(body)
        except ValueError as e:
            return _reply(False, f"update_weights_from_distributed: {e}", self.core)
        async with g.busy:
            problem = check_metas(self.core.model.state_dict(), metas)
            device = self._device()
            try:  # on a mismatch: drain the broadcast into scratch buffers, apply nothing
                tensors = await asyncio.to_thread(receive_bucket, g.pg, metas, bool(body.get("asyncrl_coalesce")),
                                                  "cpu" if problem else device)
            except Exception as e:  # noqa: BLE001 - a broken group: the sender abandons and rebuilds
                self.groups.pop(name, None)
                return _reply(False, f"broadcast on {name!r} failed (group dropped): {e}", self.core)
            if problem:
                return _reply(False, problem, self.core)
            return await self._apply(list(zip([m.name for m in metas], tensors)), version)

    async def update_from_tensor(self, body: dict) -> dict:
        """Colocated GPU: tensors arrive as CUDA-IPC handles, pickled by torch's ForkingPickler and
        base64-encoded, one entry per TP rank (SGLang's MultiprocessingSerializer format)."""
        try:
            payloads = body["serialized_named_tensors"]
            version = _version(body)
            import torch.multiprocessing  # noqa: F401 - registers the CUDA-IPC rebuild reductions

            named = pickle.loads(base64.b64decode(payloads[0]))
            metas = [TensorMeta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in named]
        except Exception as e:  # noqa: BLE001
            return _reply(False, f"update_weights_from_tensor: cannot read the payload: {e}", self.core)
        problem = check_metas(self.core.model.state_dict(), metas)
        if problem:
            return _reply(False, problem, self.core)
        return await self._apply(list(named), version)

    async def _apply(self, named: list[tuple[str, torch.Tensor]], version: int | None) -> dict:
        # SGLang semantics: no weight_version leaves the version unchanged (the core's None means +1).
        target = self.core.weight_version if version is None else version
        try:
            async with self._apply_lock:
                await self.core.apply_weights(named, target)
        except ValueError as e:
            return _reply(False, str(e), self.core)
        return _reply(True, f"applied {len(named)} tensors", self.core)

    async def probe_broadcast(self, body: dict) -> dict:
        """Benchmark aid: receive one flat broadcast of `numel` elements of `dtype` and discard it."""
        g = self.groups.get(str(body.get("group_name", "")))
        if g is None:
            return _reply(False, f"no weight-update group {body.get('group_name')!r}", self.core)
        buf = torch.empty(int(body["numel"]), dtype=parse_dtype(str(body.get("dtype", "float32"))))
        await asyncio.to_thread(lambda: dist.broadcast(buf, src=0, group=g.pg))
        return _reply(True, f"received {buf.numel()} elements", self.core)
