"""gloo / nccl transport: rank 0 of a dedicated update group, broadcasting bucket by bucket.

Group: GET /server_info gives each engine's tp_size (dp_size > 1 is refused: SGLang's update routes
assert it is 1) and the dtype it serves (floating tensors are cast to it before they are sent); every TP rank of an engine joins (SGLang's
rank is rank_offset + tp_rank), so world_size = 1 + sum(tp_size) and engine k gets
rank_offset = 1 + sum(tp_size of the engines before it). POST /init_weights_update_group to every
engine while this process hosts the rendezvous (group.py builds it the way SGLang does).

Per bucket: POST /update_weights_from_distributed to every engine (not awaited) -> broadcast the
bucket's tensors in `names` order (one broadcast per tensor, SGLang's format; one flat buffer per
dtype when every engine advertises `coalesce` in GET /weight_sync_info, see bucketing.py) -> await
the replies. An engine that answers success=false and whose broadcast completed (our side ends
within a grace period of its answer) received the bucket and refused to load it: WeightMismatchError. An engine that fails before (dead, or no session, or
no group: it will never join the broadcast) or a broadcast that fails breaks the group for all: the
sync is abandoned, the group retired (destroyed once its in-flight collective returns), and the next
sync builds a new one under a new name and port with the engines that answer.

Delta syncs (delta.py), when every engine offers them (GET /weight_sync_info "delta": the embedded
engine) and serves a 16-bit dtype, and (delta="auto") one of them is on another host: every bucket is
tracked (`asyncrl_track`), the transport keeps the base (the tensors as last sent, in the wire dtype) and,
when every member reports holding it, sends only what changed. A sync that does not end with every member
ok leaves no base: the next one is full.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

import asyncrl.weight_sync.delta as deltas
from asyncrl.config import WeightSyncConfig
from asyncrl.models import sglang_served_dtype
from asyncrl.util.net import free_port, is_loopback
from asyncrl.weight_sync.bucketing import dtype_name, metas_of, pack_groups, parse_dtype
from asyncrl.weight_sync.engine_http import EngineHTTP
from asyncrl.weight_sync.errors import WeightMismatchError, WeightSyncError
from asyncrl.weight_sync.group import destroy_group, init_custom_process_group
from asyncrl.weight_sync.sender import Bucket, SyncAbandoned, SyncReport, Transport

log = logging.getLogger(__name__)


def master_address_for(urls: list[str]) -> str:
    """127.0.0.1 when every engine is on loopback, else this host's address as the others see it (its Ray
    node's IP inside a Ray worker: the address the cluster's other nodes reach it at)."""
    hosts = [urlparse(u).hostname or "" for u in urls]
    if all(is_loopback(h) for h in hosts):
        return "127.0.0.1"
    try:
        import ray  # lazy: the sender runs without Ray too (tests, benches); inside a Ray worker it is loaded

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


async def server_info_of(http: EngineHTTP, url: str) -> tuple[dict, WeightSyncError | None]:
    """GET /server_info (SGLang and the embedded engine), with its tensor-parallel size checked. An
    engine with data-parallel replicas raises: SGLang 0.5.23 asserts dp_size == 1 in every
    weight-update route (managers/tokenizer_control_mixin.py) and answers HTTP 500, which would read as
    a dead engine, left out of every sync without a word."""
    data, err = await http.get(url, "/server_info")
    if err is not None:
        return {}, err
    info = data if isinstance(data, dict) else {}
    tp = info.get("tp_size")
    if not isinstance(tp, int) or tp < 1:
        return {}, WeightSyncError("config", f"/server_info: tp_size must be an integer >= 1, got {tp!r}", url)
    dp = info.get("dp_size", 1)
    if dp != 1:
        raise WeightSyncError(
            "config", f"/server_info: dp_size={dp!r}: SGLang's weight-update routes take one data-parallel "
            "replica only (they assert dp_size == 1 and answer HTTP 500); run one engine per replica "
            "(engine.num_engines, or one engine.urls entry each) instead of --dp-size", url)
    return info, None


async def extensions_of(http: EngineHTTP, url: str) -> dict:
    """The embedded engine's extensions (GET /weight_sync_info); {} for a real SGLang."""
    data, err = await http.get(url, "/weight_sync_info")
    return data if err is None and isinstance(data, dict) and data.get("asyncrl") else {}


def _served_dtype(exts: list[dict], infos: list[dict]) -> torch.dtype | None:
    """The one dtype every engine serves, else None (also when one cannot tell): the embedded engine says
    it (GET /weight_sync_info "dtype"), SGLang's follows from its /server_info (asyncrl.models.sglang_served_dtype)."""
    served = set()
    for x, info in zip(exts, infos):
        if x:
            try:
                served.add(parse_dtype(x["dtype"]) if isinstance(x.get("dtype"), str) else None)
            except ValueError:
                served.add(None)
        else:
            name = sglang_served_dtype(info.get("dtype"), info.get("model_path"))
            served.add(parse_dtype(name) if name else None)
    return served.pop() if len(served) == 1 and None not in served else None


class GroupTransport(Transport):
    uses_session = True
    shared_fate = True

    def __init__(self, backend: str = "gloo", *, timeout_s: float = WeightSyncConfig.timeout_s,
                 master_address: str | None = None, coalesce: bool = True, delta: str = "auto"):
        if backend not in ("gloo", "nccl"):
            raise WeightSyncError("config", f"group transport: backend must be gloo or nccl, got {backend!r}")
        if delta not in ("auto", "on", "off"):
            raise WeightSyncError("config", f"group transport: delta must be auto, on or off, got {delta!r}")
        self.name = self.backend = backend
        self.timeout_s, self.master_address, self.coalesce_wanted = float(timeout_s), master_address, coalesce
        self.device = "cuda" if backend == "nccl" else "cpu"
        self.members: list[str] = []  # engines of the current group, in rank order
        self.pg: Any = None
        self.group_name = ""
        self.coalesce = False
        self.cast_to: torch.dtype | None = None  # every engine serves this dtype (asyncrl extension): send in it
        self._inflight: asyncio.Future | None = None  # the broadcast thread of the current bucket
        self.delta_wanted = delta
        self.delta = False  # negotiated with the group: syncs are tracked and may be deltas (delta.py)
        self.sender_id = uuid.uuid4().hex[:12]
        self.base: dict[str, torch.Tensor] = {}  # every tensor as last sent, in the wire dtype
        self.base_token: str | None = None  # the sync `base` is (None: none complete, or one in flight)
        self._exts: list[dict] = []  # the members' GET /weight_sync_info, read when this sync was prepared
        self._token, self._from, self._delta_now = "", None, False  # this sync's token, base, kind

    # ------------------------------------------------------------------ group

    async def prepare(self, http: EngineHTTP, engines: list[str]) -> dict[str, WeightSyncError]:
        if self.pg is not None and engines == self.members:
            exts = list(await asyncio.gather(*(extensions_of(http, u) for u in engines)))
            # an embedded engine restarted on the same address no longer holds our group
            if not any(x and self.group_name not in x.get("groups", []) for x in exts):
                self._exts = exts
                return {}
        return await self._build_group(http, engines)

    async def retire(self, http: EngineHTTP) -> None:
        """Drop the current group on both sides (best effort; never blocks on a stuck collective).
        Destroying our rank closes its connections: a gloo receiver still waiting in this group's
        broadcast (an SGLang scheduler joins with torch's 30-minute default and no way to set another)
        fails at once, so the survivors of an abandoned sync serve on within timeout_s."""
        pg, name, members = self.pg, self.group_name, self.members
        self.pg, self.group_name, self.members = None, "", []
        if pg is None:
            return
        if members:
            await http.post_all(members, "/destroy_weights_update_group", {"group_name": name}, http.probe_timeout_s)
        inflight, self._inflight = self._inflight, None
        if inflight is not None and not inflight.done():  # destroy once the stuck collective returns
            inflight.add_done_callback(lambda _f: destroy_group(pg))  # (within the group's timeout_s)
        else:
            await asyncio.to_thread(destroy_group, pg)

    async def _build_group(self, http: EngineHTTP, engines: list[str]) -> dict[str, WeightSyncError]:
        """A fresh group of rank 0 + every TP rank of `engines`. Returns {url: why} for engines left out."""
        await self.retire(http)
        answers = await asyncio.gather(*(server_info_of(http, u) for u in engines))
        failed = {u: e for u, (_, e) in zip(engines, answers) if e is not None}
        live = [u for u in engines if u not in failed]
        infos = [info for u, (info, _) in zip(engines, answers) if u in live]
        tp = [info["tp_size"] for info in infos]
        if not live:
            return failed
        exts = await asyncio.gather(*(extensions_of(http, u) for u in live))
        ours = all(exts)
        self.coalesce = self.coalesce_wanted and all(x.get("coalesce") for x in exts)
        self.cast_to = _served_dtype(exts, infos)
        wanted = self.delta_wanted == "on" or (
            self.delta_wanted == "auto" and not all(is_loopback(urlparse(u).hostname or "") for u in live))
        self.delta = (wanted and self.coalesce and self.cast_to is not None
                      and self.cast_to.itemsize <= deltas.MAX_ITEMSIZE and all(x.get("delta") for x in exts))
        self._exts = list(exts)
        if self.cast_to is None and not ours:
            log.warning("weight sync: the engines' served dtype is unknown (%s): tensors go in the learner's "
                        "dtype", [i.get("dtype") for i in infos])
        world = 1 + sum(tp)
        addr = self.master_address or master_address_for(live)
        port = free_port(addr if addr != "0.0.0.0" else "")
        name = f"asyncrl_weights_{uuid.uuid4().hex[:10]}"
        offsets = [1 + sum(tp[:k]) for k in range(len(live))]
        posts = []
        for u, off in zip(live, offsets):
            body: dict[str, Any] = {"master_address": addr, "master_port": port, "rank_offset": off,
                                    "world_size": world, "group_name": name, "backend": self.backend}
            if ours:
                body["timeout_s"] = self.timeout_s  # extension: the group's collective timeout
            posts.append(asyncio.ensure_future(http.post(u, "/init_weights_update_group", body, self.timeout_s + 5)))
        try:
            pg = await asyncio.wait_for(asyncio.to_thread(
                init_custom_process_group, self.backend, f"tcp://{addr}:{port}", world, 0, name, self.timeout_s),
                self.timeout_s + 5)
        except Exception as e:  # noqa: BLE001 - some engine never joined: leave out those that say so, else all
            replies = await asyncio.gather(*posts)
            bad = {u: err for u, err in zip(live, replies) if err is not None}
            failed.update(bad or
                          {u: WeightSyncError("timeout", f"rendezvous of {name}: {e}", u) for u in live})
            log.warning("weight sync: building group %s failed: %s", name, {u: str(x) for u, x in failed.items()})
            return failed
        replies = await asyncio.gather(*posts)
        bad = {u: err for u, err in zip(live, replies) if err is not None}
        self.pg, self.group_name, self.members = pg, name, list(live)
        if bad:  # a rank that joined the store but reported failure: the group is unusable
            await self.retire(http)
        return {**failed, **bad}

    # ------------------------------------------------------------------ delta (delta.py)

    async def start(self, version: str) -> None:
        """A sync begins: a delta when every member holds the base, else full (the base is rebuilt)."""
        self._token, self._from = f"{self.sender_id}:{version}", self.base_token
        self._delta_now = (self.delta and self._from is not None and len(self._exts) == len(self.members)
                           and all(x.get("delta_base") == self._from for x in self._exts))
        if not self._delta_now:
            self.base = {}
        self.base_token = None  # the base is in flux until every member has taken every bucket

    async def finish(self, http: EngineHTTP, engines: list[str], version: str) -> dict[str, WeightSyncError]:
        if self.delta and engines == self.members:
            self.base_token = self._token
        else:  # someone missed a bucket: no base the next sync could trust
            self.base = {}
        return {}

    def _plan(self, bucket: Bucket) -> list[deltas.Planned]:
        """(Worker thread.) How each tensor of `bucket` travels in this sync, the base moved along with it:
        every tensor in the wire dtype, whole in a full sync, else what delta.plan says (unchanged ones
        left out). Checksums of the sparse ones are filled in."""
        items = []
        for name, t in bucket:
            w = t.detach()
            cast = self.cast_to is not None and w.is_floating_point() and w.dtype != self.cast_to
            w = w.to(self.cast_to) if cast else w
            p = deltas.plan(name, w, self.base.get(name)) if self._delta_now else deltas.Planned(name, w)
            if p is None:
                continue
            if p.positions is None:
                self.base[name] = w if cast else w.clone()  # never the learner's own storage
            else:
                deltas.bits(self.base[name])[p.positions.long()] = deltas.bits(p.values)
            items.append(p)
        return items

    async def _send_tracked(self, http: EngineHTTP, bucket: Bucket, engines: list[str], version: str | None,
                            report: SyncReport) -> dict[str, WeightSyncError]:
        items = await asyncio.to_thread(self._plan, bucket)
        report.delta = self._delta_now
        if not items and version is None:
            return {}  # nothing of this bucket changed (the last one still goes: it carries the version)
        metas = deltas.metas_of_plan(items)
        body = self._body(metas, version)
        body["asyncrl_track"] = self._token
        if self._delta_now:
            sums = await asyncio.to_thread(lambda: [deltas.checksum(p.tensor) if p.positions is not None else ""
                                                    for p in items])
            body["asyncrl_delta"] = {"base": self._from, "counts": [p.count for p in items], "checksums": sums}
            make = lambda: deltas.wire_buffers(items)  # noqa: E731
        else:
            make = lambda: self._buffers([p.tensor for p in items], metas)  # noqa: E731
        report.bytes += sum(p.nbytes for p in items)
        return await self._send(http, body, make, engines, report)

    # ------------------------------------------------------------------ buckets

    def wire_nbytes(self, bucket: Bucket) -> int:
        cast = self.cast_to
        return sum(t.numel() * (cast.itemsize if cast is not None and t.is_floating_point() else t.element_size())
                   for _, t in bucket)

    async def send_bucket(self, http: EngineHTTP, bucket: Bucket, engines: list[str], version: str | None,
                          report: SyncReport) -> dict[str, WeightSyncError]:
        if self.pg is None or engines != self.members:
            raise SyncAbandoned({}, f"the update group does not hold exactly {engines}")
        if self.delta:
            return await self._send_tracked(http, bucket, engines, version, report)
        if self.cast_to is not None:  # floating tensors in the engines' dtype: bf16 engines take half the bytes
            bucket = [(n, t.to(self.cast_to) if t.is_floating_point() and t.dtype != self.cast_to else t)
                      for n, t in bucket]
        metas = metas_of(bucket)
        report.bytes += self.wire_nbytes(bucket)
        return await self._send(http, self._body(metas, version),
                                lambda: self._buffers([t for _, t in bucket], metas), engines, report)

    def _body(self, metas: list, version: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {"names": [m.name for m in metas], "dtypes": [m.dtype for m in metas],
                                "shapes": [list(m.shape) for m in metas], "group_name": self.group_name,
                                "flush_cache": version is not None, "weight_version": version, "load_format": None}
        if self.coalesce:
            body["asyncrl_coalesce"] = True  # extension, negotiated through /weight_sync_info
        return body

    def _buffers(self, tensors: list[torch.Tensor], metas: list) -> list[torch.Tensor]:
        """(Worker thread.) A full bucket's broadcasts: per dtype group when coalesced, else per tensor."""
        tensors = [t.detach().to(self.device) for t in tensors]
        return pack_groups(tensors, metas) if self.coalesce else [t.contiguous() for t in tensors]

    async def _send(self, http: EngineHTTP, body: dict[str, Any], make: Callable[[], list[torch.Tensor]],
                    engines: list[str], report: SyncReport) -> dict[str, WeightSyncError]:
        """POST `body` to every engine while broadcasting the buffers `make` builds; {url: why}."""
        posts = {u: asyncio.ensure_future(http.post(u, "/update_weights_from_distributed", body, None)) for u in engines}
        self._inflight = asyncio.ensure_future(asyncio.to_thread(self._broadcast, self.pg, make))
        self._inflight.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even if abandoned
        pending = set(posts.values()) | {self._inflight}
        while self._inflight in pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            early = {u: p.result() for u, p in posts.items() if p in done and p.result() is not None}
            if early and not await self._broadcast_ends(http.probe_timeout_s):
                return early  # failed before the broadcast, which then never ends: it never joined
        if isinstance(self._inflight.result(), str):  # e.g. gloo: "Connection closed by peer"
            raise SyncAbandoned({}, f"broadcast failed: {self._inflight.result()}")
        report.collectives += self._inflight.result()
        errs = {u: err for u, err in zip(posts, await asyncio.gather(*posts.values())) if err is not None}
        # the bytes arrived: a refusal now is about the tensors
        return {u: WeightMismatchError(e.message, u, e.status) if e.code == "refused" else e for u, e in errs.items()}

    async def _broadcast_ends(self, grace_s: float) -> bool:
        """Whether our side of the bucket's broadcast ends within `grace_s`. A failure answer can
        overtake the end of our side even when the engine received every byte (then it refused
        the tensors); an engine that failed before joining leaves our side waiting."""
        try:
            await asyncio.wait_for(asyncio.shield(self._inflight), grace_s)
        except asyncio.TimeoutError:
            return False
        except Exception:  # noqa: BLE001 - the broadcast itself failed: handled by the caller
            return True
        return True

    def _broadcast(self, pg: Any, make: Callable[[], list[torch.Tensor]]) -> int | str:
        """Rank 0's side of one bucket (blocking, in a worker thread): the buffers `make` builds, in order.
        Returns the collective count, or the failure as text: it never raises, because a traceback held by
        the future would keep `pg` alive, and only destroying `pg` closes its connections, which is what
        ends the survivors' receives (retire)."""
        try:
            bufs = [b.to(self.device) for b in make()]
            works = [dist.broadcast(b, src=0, group=pg, async_op=True) for b in bufs]
            for w in works:
                w.wait()
            return len(bufs)
        except Exception as e:  # noqa: BLE001 - reported as text, see above
            return f"{type(e).__name__}: {e}"

    async def broadcast_flat(self, http: EngineHTTP, numel: int, dtype: torch.dtype = torch.float32) -> float:
        """Benchmark ceiling (extension /weight_sync_probe_broadcast): one flat broadcast of `numel`
        elements to the current group; seconds."""
        buf = torch.zeros(numel, dtype=dtype, device=self.device)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        body = {"group_name": self.group_name, "numel": numel, "dtype": dtype_name(dtype)}
        posts = [asyncio.ensure_future(http.post(u, "/weight_sync_probe_broadcast", body, None)) for u in self.members]
        await asyncio.to_thread(lambda: dist.broadcast(buf, src=0, group=self.pg))
        errs = [e for e in await asyncio.gather(*posts) if e is not None]
        if errs:
            raise errs[0]
        return loop.time() - t0

