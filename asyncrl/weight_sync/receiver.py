"""Engine side of a weight sync: join the update group, check, receive and apply broadcast buckets.

Used by the routes (routes.py) over any object with the EngineCore contract (`model`,
`weight_version` (int), `apply_weights(named_tensors, version)`). Every answer is SGLang 0.5's:
HTTP 200 {"success": true, "message"} or HTTP 400 {"success": false, "message"}, and HTTP 400 with
an error object (no "success") for a request that fails validation. Distributed and tensor updates
are refused outside a session (begin_weight_update ... end_weight_update), before any broadcast.
`weight_version` travels as a string; the core keeps an int. Collectives run in a worker thread so
the server's event loop keeps serving /generate and the rest meanwhile.

Checks happen before any byte moves: names must be the served model's state_dict keys, shapes
equal to the live tensor's, dtypes equal or both floating point (converted on apply, as SGLang
does). On a mismatch the receiver still takes part in the bucket's
broadcast (into scratch buffers, thrown away) so that rank 0's collective completes and the group
stays usable; nothing is applied and the answer is HTTP 400 "Failed to update parameter online: ..."
naming the tensor (SGLang receives first and fails in load_weights: the same answer, the same order).
`flush_cache` is accepted and changes nothing here: this engine has no prefix cache, and its running
requests keep their KV caches whatever the pause mode (it treats retract as in_place).

Delta syncs (delta.py, an extension): `delta_base` is the token of the tracked sync whose every bucket
this engine applied (None after any other update, an unfinished or failed sync, or a relaunch); a delta
bucket is applied only over the base it names, and only if every rebuilt tensor hashes as the sender's.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

import asyncrl.weight_sync.delta as deltas
from asyncrl.weight_sync.bucketing import (
    TensorMeta,
    dtype_name,
    flat_groups,
    flat_specs,
    is_float_dtype,
    metas_from_request,
    metas_of,
    parse_dtype,
    unpack,
)
from asyncrl.weight_sync.group import destroy_group, init_custom_process_group
from asyncrl.weight_sync.safe_unpickle import load_named_tensors

log = logging.getLogger(__name__)

DEFAULT_GROUP_TIMEOUT_S = 300.0
CAPABILITIES = {"asyncrl": True, "coalesce": True, "delta": True}  # GET /weight_sync_info: the extensions (+ "dtype")


def check_metas(targets: dict[str, torch.Tensor], metas: Sequence[TensorMeta]) -> str | None:
    """None if every meta names a tensor of `targets` with the same shape and a dtype it can take, else
    the message naming the first bad tensor. A floating-point tensor may arrive in another floating
    dtype (an fp32 learner into a bf16 engine): it is converted when applied, as SGLang's load_weights
    copies into its parameters; any other dtype must be the engine's own."""
    for m in metas:
        dst = targets.get(m.name)
        if dst is None:
            sample = ", ".join(list(targets)[:3])
            return f"weight {m.name!r} is not a tensor of the served model (its names look like: {sample}, ...)"
        if tuple(dst.shape) != m.shape:
            return f"weight {m.name!r}: sender shape {list(m.shape)} != engine shape {list(dst.shape)}"
        if dtype_name(dst.dtype) != m.dtype and not (dst.is_floating_point() and is_float_dtype(m.dtype)):
            return f"weight {m.name!r}: sender dtype {m.dtype} != engine dtype {dtype_name(dst.dtype)}"
    return None


def receive_bucket(pg: Any, metas: Sequence[TensorMeta], coalesce: bool, device: str) -> list[torch.Tensor]:
    """Receive one bucket from rank 0 of `pg` (blocking): per dtype group when `coalesce` (the rule
    in bucketing.py), else one broadcast per tensor in order. Returns tensors in `metas` order."""
    if not coalesce:
        specs = [(m.numel, parse_dtype(m.dtype, f"weight {m.name!r}")) for m in metas]
        return [b.view(m.shape) for b, m in zip(receive_buffers(pg, specs, device), metas)]
    out: list[torch.Tensor | None] = [None] * len(metas)
    for (_, idx), flat in zip(flat_groups(metas), receive_buffers(pg, flat_specs(metas), device)):
        for i, view in zip(idx, unpack(flat, metas, idx)):
            out[i] = view
    return out  # type: ignore[return-value]


def receive_buffers(pg: Any, specs: Sequence[tuple[int, torch.dtype]], device: str) -> list[torch.Tensor]:
    """Receive flat buffers of (numel, dtype) from rank 0 of `pg`, in order (blocking): a delta bucket."""
    bufs = [torch.empty(n, dtype=d, device=device) for n, d in specs]
    works = [dist.broadcast(b, src=0, group=pg, async_op=True) for b in bufs]
    for w in works:
        w.wait()
    return bufs


@dataclass(frozen=True)
class DeltaRequest:
    """`asyncrl_delta` of one bucket (delta.py): the base it applies over, per tensor its count and checksum."""

    base: str
    counts: list[int]
    checksums: list[str]


def parse_delta(raw: Any, metas: Sequence[TensorMeta]) -> DeltaRequest | None:
    """The request's delta fields checked against its tensors (Invalid otherwise); None when absent."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("base"), str):
        raise Invalid("asyncrl_delta must be an object with base (a string), counts and checksums")
    counts, sums = raw.get("counts"), raw.get("checksums")
    if not isinstance(counts, list) or not isinstance(sums, list) or not (len(counts) == len(sums) == len(metas)):
        raise Invalid(f"asyncrl_delta: counts and checksums must be lists of {len(metas)} entries, one per name")
    for m, c, h in zip(metas, counts, sums):
        if not isinstance(c, int) or isinstance(c, bool) or not (c == deltas.WHOLE or 0 <= c <= min(m.numel, deltas.MAX_SPARSE_NUMEL)):
            raise Invalid(f"asyncrl_delta: count of {m.name!r} must be -1 (whole) or 0..{m.numel}, got {c!r:.40}")
        if not isinstance(h, str) or (c != deltas.WHOLE and not h):
            raise Invalid(f"asyncrl_delta: checksum of {m.name!r} must be a string (non-empty for a sparse tensor)")
    return DeltaRequest(raw["base"], list(counts), list(sums))


class Answer(NamedTuple):
    """An HTTP answer: status and JSON body, shaped as SGLang 0.5 shapes it."""

    status: int
    body: dict


def ok(message: str, **extra: Any) -> Answer:
    return Answer(200, {"success": True, "message": message, **extra})


def refused(message: str, **extra: Any) -> Answer:
    """SGLang's failure of a weight-update call: HTTP 400 {"success": false, "message"}."""
    return Answer(400, {"success": False, "message": message, **extra})


def invalid(message: str) -> Answer:
    """SGLang's answer to a request that fails validation: HTTP 400 with an error object, no "success"."""
    return Answer(400, {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400})


def forbidden(message: str) -> Answer:
    """A disk load outside the engine's weight roots (an asyncrl check SGLang lacks): HTTP 403 with
    an error object, no "success" (the sender reads it as a configuration error, not a refused load)."""
    return Answer(403, {"error": f"Forbidden: {message}"})


def resolve_roots(roots: Sequence[str | os.PathLike]) -> tuple[Path, ...]:
    """The directories disk loads may read from, symlinks resolved."""
    return tuple(Path(os.path.realpath(r)) for r in roots)


class OutsideRoots(ValueError):
    """A disk load that would read outside the engine's weight roots."""


def weight_files(path: str, roots: Sequence[Path]) -> list[Path]:
    """The *.safetensors files a disk load of `path` (a checkpoint directory or one file) reads, each
    with symlinks and `..` resolved; OutsideRoots if the directory or a file lies outside `roots`."""
    real = Path(os.path.realpath(path))
    files = [real] if real.is_file() else [Path(os.path.realpath(f)) for f in sorted(real.glob("*.safetensors"))]
    for p in [real, *files]:
        if not any(p.is_relative_to(r) for r in roots):
            raise OutsideRoots(f"model_path {path!r} resolves to {str(p)!r}, outside the directories this engine "
                               f"loads weights from ({', '.join(map(str, roots)) or 'none'}; the launcher's "
                               f"--weights-dir)")
    return files


class Invalid(ValueError):
    """A request field has the wrong type (answered with `invalid`)."""


def wire_version(body: dict) -> int | None:
    """`weight_version` of a request: a string (SGLang) holding an integer (the embedded engine's
    versions are ints), or absent/null (the version stays as it is)."""
    v = body.get("weight_version")
    if v is None:
        return None
    if not isinstance(v, str):
        raise Invalid(f"weight_version must be a string or null, got {type(v).__name__} {v!r}")
    try:
        return int(v)
    except ValueError:
        raise Invalid(f"weight_version {v!r}: this engine keeps integer versions (e.g. \"12\")") from None


def flag(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise Invalid(f"{key} must be a boolean, got {type(v).__name__} {v!r}")
    return v


@dataclass
class _Group:
    pg: Any
    rank: int
    world_size: int
    backend: str
    busy: asyncio.Lock = field(default_factory=asyncio.Lock)  # one bucket at a time per group


OUTSIDE = "{} must run between begin_weight_update() and end_weight_update()"


class WeightReceiver:
    """The state behind the weight-sync routes of one engine: its groups by name and its session."""

    def __init__(self, core: Any, weights_roots: Sequence[str | os.PathLike] = ()):
        self.core = core
        self.weights_roots = resolve_roots(weights_roots)  # /update_weights_from_disk reads only below these
        self.groups: dict[str, _Group] = {}
        self.session_open = False
        self.delta_base: str | None = None  # the tracked sync these weights equal (delta.py)
        self._sync: str | None = None  # the tracked sync being received
        self._from: str | None = None  # delta_base when it began
        self._sync_ok = False  # every bucket of it applied so far
        self._apply_lock = asyncio.Lock()  # one apply at a time (a stuck old group never holds it)

    def _device(self) -> str:
        p = next(iter(self.core.model.parameters()), None)
        return str(p.device) if p is not None else "cpu"

    # ------------------------------------------------------------------ session

    async def begin(self, body: dict) -> Answer:
        if self.session_open:
            return refused("a weight-update session is already open; call end_weight_update() first")
        self.session_open = True
        return ok("Success")

    async def end(self, body: dict) -> Answer:
        if not self.session_open:
            return refused("no weight-update session is open; call begin_weight_update() first")
        self.session_open = False
        return ok("Success")

    # ------------------------------------------------------------------ group

    async def init_group(self, body: dict) -> Answer:
        try:
            name = str(body.get("group_name", "weight_update_group"))
            backend = str(body.get("backend") or "nccl")
            addr, port = str(body["master_address"]), int(body["master_port"])
            rank, world = int(body["rank_offset"]), int(body["world_size"])
            timeout = float(body.get("timeout_s") or DEFAULT_GROUP_TIMEOUT_S)  # extension
        except (KeyError, TypeError, ValueError) as e:
            return invalid(f"init_weights_update_group: bad or missing field {e}")
        if name in self.groups:
            return refused(f"Failed to initialize custom process group: {name!r} already exists on this engine")
        try:
            pg = await asyncio.to_thread(
                init_custom_process_group, backend, f"tcp://{addr}:{port}", world, rank, name, timeout
            )
        except Exception as e:  # noqa: BLE001 - reported to the sender, the server keeps serving
            return refused(f"Failed to initialize custom process group {name!r} at {addr}:{port}: {e}")
        self.groups[name] = _Group(pg, rank, world, backend)
        return ok(f"Succeeded to initialize custom process group {name!r} as rank {rank} of {world} ({backend})")

    async def destroy_group(self, body: dict) -> Answer:
        name = str(body.get("group_name", "weight_update_group"))
        g = self.groups.pop(name, None)
        if g is None:
            return refused(f"Failed to destroy group: {name!r} not in {sorted(self.groups)}")
        async with g.busy:  # a receive still running on it ends (or times out) first
            await asyncio.to_thread(destroy_group, g.pg)
        return ok(f"Succeeded to destroy custom process group {name!r}")

    # ------------------------------------------------------------------ updates

    async def update_from_distributed(self, body: dict) -> Answer:
        try:
            metas = metas_from_request(body["names"], body["dtypes"], body["shapes"])
            for m in metas:
                parse_dtype(m.dtype, f"weight {m.name!r}")
            version = wire_version(body)
            flag(body, "flush_cache", True)
            coalesce = flag(body, "asyncrl_coalesce", False)  # extension, see /weight_sync_info
            track = body.get("asyncrl_track")  # extension (delta.py): the token of the sync this bucket is of
            if track is not None and not isinstance(track, str):
                raise Invalid(f"asyncrl_track must be a string, got {type(track).__name__}")
            delta = parse_delta(body.get("asyncrl_delta"), metas)
            if delta is not None and (track is None or not coalesce):
                raise Invalid("asyncrl_delta needs asyncrl_track and asyncrl_coalesce")
        except (KeyError, TypeError, ValueError) as e:
            return invalid(f"update_weights_from_distributed: {type(e).__name__}: {e}")
        if not self.session_open:  # refused before the broadcast: this engine does not join it
            return refused(OUTSIDE.format("update_weights_from_distributed"))
        name = str(body.get("group_name", "weight_update_group"))
        g = self.groups.get(name)
        if g is None:
            return refused(f"Failed to receive weights: Group {name} not in {sorted(self.groups)}. "
                           "Please call `init_weights_update_group` first.")
        async with g.busy:
            self._track(track)
            targets = self.core.model.state_dict()
            problem = check_metas(targets, metas)
            mismatch = None if problem or delta is None else self._delta_problem(delta, metas, targets)
            device = "cpu" if problem or mismatch else self._device()
            try:  # on a mismatch: drain the broadcast into scratch buffers, apply nothing
                if delta is None:
                    tensors = await asyncio.to_thread(receive_bucket, g.pg, metas, coalesce, device)
                else:
                    bufs = await asyncio.to_thread(receive_buffers, g.pg, deltas.wire_specs(metas, delta.counts), device)
            except Exception as e:  # noqa: BLE001 - a broken group: the sender abandons and rebuilds
                self.groups.pop(name, None)
                self._sync_ok = False
                return refused(f"Failed to receive weights: broadcast on {name!r} failed (group dropped): {e}")
            if problem:
                self._sync_ok = False
                return refused(f"Failed to update parameter online: {problem}")
            if delta is not None:
                if mismatch is None:
                    tensors, mismatch = await asyncio.to_thread(self._rebuild, metas, delta, bufs, targets)
                if mismatch is not None:
                    self._sync_ok = False
                    return refused(f"Failed to update parameter online: delta {mismatch}", asyncrl_delta_mismatch=True)
            return await self._apply(list(zip([m.name for m in metas], tensors)), version, track)

    # ------------------------------------------------------------------ delta tracking (delta.py)

    def _track(self, token: str | None) -> None:
        """Before a bucket of the sync `token` (None: an untracked update) is received."""
        if token is None:
            self.delta_base = self._sync = None
        elif token != self._sync:  # the sync's first bucket: the weights leave their base
            self._from, self.delta_base, self._sync, self._sync_ok = self.delta_base, None, token, True

    def _delta_problem(self, delta: DeltaRequest, metas: Sequence[TensorMeta], targets: dict) -> str | None:
        if delta.base != self._from:
            return f"base {delta.base!r}: this engine's weights are {self._from!r}"
        for m, c in zip(metas, delta.counts):
            if c != deltas.WHOLE and dtype_name(targets[m.name].dtype) != m.dtype:
                return f"weight {m.name!r}: sparse values in {m.dtype}, the engine serves {dtype_name(targets[m.name].dtype)}"
        return None

    @staticmethod
    def _rebuild(metas: Sequence[TensorMeta], delta: DeltaRequest, bufs: list[torch.Tensor],
                 targets: dict) -> tuple[list[torch.Tensor], str | None]:
        """The bucket's new tensors (sparse ones rebuilt from the live parameters), or the first that does
        not hash as the sender's."""
        out = []
        for m, c, want, got in zip(metas, delta.counts, delta.checksums, deltas.unpack_wire(metas, delta.counts, bufs)):
            if c == deltas.WHOLE:
                out.append(got)
                continue
            try:
                t = deltas.rebuilt(targets[m.name], *got)
            except IndexError as e:
                return [], f"weight {m.name!r}: {e}"
            if deltas.checksum(t) != want:
                return [], f"checksum mismatch: weight {m.name!r} rebuilt from its {c} changed values is not the sender's"
            out.append(t)
        return out, None

    async def update_from_tensor(self, body: dict) -> Answer:
        """Colocated GPU: tensors arrive as CUDA-IPC handles, pickled by torch's ForkingPickler and
        base64-encoded, one entry per TP rank (SGLang's MultiprocessingSerializer format); this
        engine is TP rank 0 and reads entry 0 only, with the tensor-only unpickler (safe_unpickle.py)."""
        try:
            payloads = body["serialized_named_tensors"]
            if not isinstance(payloads, list) or not payloads or not all(isinstance(p, str) for p in payloads):
                raise Invalid("serialized_named_tensors must be a non-empty list of base64 strings, one per TP rank")
            version = wire_version(body)
            flag(body, "flush_cache", True)
        except (KeyError, ValueError) as e:
            return invalid(f"update_weights_from_tensor: {type(e).__name__}: {e}")
        if not self.session_open:
            return refused(OUTSIDE.format("update_weights_from_tensor"))
        try:
            named = load_named_tensors(payloads[0])
            metas = metas_of(named)
        except Exception as e:  # noqa: BLE001
            return refused(f"Failed to update parameter online: cannot read the payload: {e}")
        problem = check_metas(self.core.model.state_dict(), metas)
        if problem:
            return refused(f"Failed to update parameter online: {problem}")
        return await self._apply(list(named), version)

    async def update_from_disk(self, body: dict) -> Answer:
        """SGLang loads from disk without a session; its answers carry num_paused_requests. Only from
        below the engine's weight roots (its model directory and the launcher's --weights-dir)."""
        path = body.get("model_path")
        try:
            if not isinstance(path, str) or not path:
                raise Invalid(f"update_weights_from_disk needs model_path (a string), got {path!r}")
            version = wire_version(body)
            flag(body, "flush_cache", True)
        except ValueError as e:
            return invalid(str(e))
        try:
            files = weight_files(path, self.weights_roots)
        except OutsideRoots as e:
            return forbidden(str(e))
        try:
            named = await asyncio.to_thread(load_safetensors_files, files, path)
            problem = check_metas(self.core.model.state_dict(), metas_of(named))
        except (OSError, ValueError) as e:
            return refused(f"Failed to load weights from {path}: {e}", num_paused_requests=0)
        if problem:
            return refused(f"Failed to update model weights from {path}: {problem}", num_paused_requests=0)
        answer = await self._apply(named, version)
        return Answer(answer.status, {**answer.body, "num_paused_requests": 0})

    async def _apply(self, named: list[tuple[str, torch.Tensor]], version: int | None,
                     track: str | None = None) -> Answer:
        # SGLang semantics: no weight_version leaves the version unchanged (the core's None means +1).
        target = self.core.weight_version if version is None else version
        if track is None:
            self._track(None)
        try:
            async with self._apply_lock:
                await self.core.apply_weights(named, target)
        except ValueError as e:
            self._sync_ok = False
            return refused(f"Failed to update parameter online: {e}")
        if track is not None and version is not None and self._sync == track and self._sync_ok:
            self.delta_base, self._sync = track, None  # every bucket of the sync applied: the new base
        return ok(f"Succeeded to update parameter online ({len(named)} tensors).")

    async def probe_broadcast(self, body: dict) -> Answer:
        """Extension (benchmark aid): receive one flat broadcast of `numel` elements and discard it."""
        try:
            numel, dtype = int(body["numel"]), parse_dtype(str(body.get("dtype", "float32")))
        except (KeyError, TypeError, ValueError) as e:
            return invalid(f"weight_sync_probe_broadcast: {type(e).__name__}: {e}")
        g = self.groups.get(str(body.get("group_name", "")))
        if g is None:
            return refused(f"no weight-update group {body.get('group_name')!r}")
        buf = torch.empty(numel, dtype=dtype)
        await asyncio.to_thread(lambda: dist.broadcast(buf, src=0, group=g.pg))
        return ok(f"received {buf.numel()} elements")


def load_safetensors_files(files: Sequence[Path], model_path: str) -> list[tuple[str, torch.Tensor]]:
    """All tensors of `files` (weight_files' list for `model_path`, named in the error)."""
    # lazy: imports safetensors, which this module does not load otherwise
    from safetensors.torch import load_file

    if not files:
        raise ValueError(f"model_path={model_path!r}: no *.safetensors files there")
    out: list[tuple[str, torch.Tensor]] = []
    for f in files:
        out.extend(load_file(str(f)).items())
    return out
