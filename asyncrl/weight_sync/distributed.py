"""gloo / nccl sender: rank 0 of a dedicated update group, broadcasting bucket by bucket.

Per bucket: POST /update_weights_from_distributed to every engine (not awaited) -> broadcast the
bucket's tensors in `names` order (coalesced per dtype when every engine advertises it, see
bucketing.py; one broadcast per tensor for a real SGLang) -> await the replies. After the last
bucket, one more request with empty `names` carries `weight_version`, so an engine never reports
the new version while holding half of the new weights.

Failure handling: the group's collectives time out after `timeout_s` (gloo/nccl option), and the
whole sync is bounded by the same timeout. A sync that fails on an engine (dead, hung, refusing)
is abandoned: the group is retired (destroyed once its in-flight collective returns) and the next
sync probes /health, leaves out the engines that do not answer and builds a new group under a new
name and port. The engines that did answer keep serving; their next sync brings them up to date.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from collections.abc import Iterable
from ipaddress import ip_address
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from asyncrl.net import free_port
from asyncrl.weight_sync.base import (
    Bucket,
    EngineHTTP,
    Stopwatch,
    SyncReport,
    WeightMismatchError,
    WeightSender,
    WeightSyncError,
    drain,
    names_a_tensor,
)
from asyncrl.weight_sync.bucketing import dtype_name, flat_groups, metas_of, nbytes, pack
from asyncrl.weight_sync.group import destroy_group, init_custom_process_group

log = logging.getLogger(__name__)


def master_address_for(urls: list[str]) -> str:
    """127.0.0.1 when every engine is on loopback, else this host's address as the others see it."""
    hosts = [urlparse(u).hostname or "" for u in urls]
    try:
        if all(h == "localhost" or ip_address(h).is_loopback for h in hosts):
            return "127.0.0.1"
    except ValueError:
        pass
    return socket.gethostbyname(socket.gethostname())


class _Abandon(Exception):
    """This sync cannot finish: {url: why}."""

    def __init__(self, failed: dict[str, str], why: str = ""):
        super().__init__(failed, why)
        self.failed, self.why = failed, why


class DistributedSender(WeightSender):
    def __init__(self, backend: str = "gloo", *, timeout_s: float = 120.0, mode: str = "in_place",
                 master_address: str | None = None, probe_timeout_s: float = 5.0, coalesce: bool = True):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"DistributedSender: backend must be gloo or nccl, got {backend!r}")
        if mode not in ("in_place", "abort"):
            raise ValueError(f"DistributedSender: mode must be in_place or abort, got {mode!r}")
        self.transport = backend
        self.backend, self.timeout_s, self.mode = backend, float(timeout_s), mode
        self.master_address = master_address
        self.coalesce_wanted = coalesce
        self.device = "cuda" if backend == "nccl" else "cpu"
        self.http = EngineHTTP(min(probe_timeout_s, timeout_s))
        self.urls: list[str] = []
        self.members: list[str] = []  # engines of the current group, rank 1.. in this order
        self.pg: Any = None
        self.group_name = ""
        self.coalesce = False
        self._inflight: asyncio.Future | None = None  # the broadcast thread of the current bucket

    # ------------------------------------------------------------------ group

    async def connect(self, engine_urls: list[str]) -> None:
        self.urls = [u.rstrip("/") for u in engine_urls]
        if not self.urls:
            raise WeightSyncError("weight sync: no engine urls to connect to")
        live, dead = await self.http.alive(self.urls)
        if dead:
            log.warning("weight sync: engines not answering, left out of the group: %s", dead)
        await self._build_group(live)

    async def _retire_group(self) -> None:
        """Drop the current group on both sides (best effort; never blocks on a stuck collective)."""
        pg, name, members = self.pg, self.group_name, self.members
        self.pg, self.group_name, self.members = None, "", []
        if pg is None:
            return
        if members:
            await self.http.post_all(members, "/destroy_weights_update_group", {"group_name": name},
                                     self.http.probe_timeout_s)
        inflight = self._inflight
        if inflight is not None and not inflight.done():  # destroy once the stuck collective returns
            inflight.add_done_callback(lambda _f: destroy_group(pg))
        else:
            await asyncio.to_thread(destroy_group, pg)

    async def _build_group(self, live: list[str]) -> dict[str, str]:
        """A fresh group of rank 0 + `live` (each one rank). Returns {url: why} for engines that failed."""
        await self._retire_group()
        if not live:
            return {}
        infos = await asyncio.gather(*(self.http.info(u) for u in live))
        ours = all(i.get("asyncrl") for i in infos)
        self.coalesce = self.coalesce_wanted and all(i.get("coalesce") for i in infos)
        tp = [int(i.get("tp_size", 1)) for i in infos]
        world = 1 + sum(tp)
        addr = self.master_address or master_address_for(live)
        port = free_port(addr if addr != "0.0.0.0" else "")
        name = f"asyncrl_weights_{uuid.uuid4().hex[:10]}"
        offsets = [1 + sum(tp[:k]) for k in range(len(live))]
        posts = []
        for u, off in zip(live, offsets):
            body = {"master_address": addr, "master_port": port, "rank_offset": off, "world_size": world,
                    "group_name": name, "backend": self.backend}
            if ours:
                body["timeout_s"] = self.timeout_s
            posts.append(asyncio.ensure_future(self.http.post(u, "/init_weights_update_group", body, self.timeout_s + 5)))
        try:
            pg = await asyncio.wait_for(asyncio.to_thread(
                init_custom_process_group, self.backend, f"tcp://{addr}:{port}", world, 0, name, self.timeout_s),
                self.timeout_s + 5)
        except Exception as e:  # noqa: BLE001 - some engine never joined
            replies = await asyncio.gather(*posts)
            failed = {u: why for u, (ok, why) in zip(live, replies) if not ok} or {u: f"rendezvous: {e}" for u in live}
            log.warning("weight sync: building group %s failed: %s", name, failed)
            return failed
        replies = await asyncio.gather(*posts)
        failed = {u: why for u, (ok, why) in zip(live, replies) if not ok}
        self.pg, self.group_name, self.members = pg, name, list(live)
        if failed:  # a rank that joined the store but reported failure: the group is unusable
            await self._retire_group()
        return failed

    async def _group_lost(self, live: list[str]) -> bool:
        """Whether an asyncrl engine no longer holds our group (restarted on the same address)."""
        infos = await asyncio.gather(*(self.http.info(u) for u in live))
        return any(i.get("asyncrl") and self.group_name not in i.get("groups", []) for i in infos)

    # ------------------------------------------------------------------ sync

    async def sync(self, params_iter: Iterable[Bucket], version: int) -> SyncReport:
        if not self.urls:
            raise WeightSyncError("weight sync: sync() before connect()")
        it = iter(params_iter)
        clock = Stopwatch()
        report = SyncReport(version=int(version), transport=self.transport)
        try:
            live, dead = await self.http.alive(self.urls)
            report.engines_failed.update(dead)
            if self.pg is None or live != self.members or await self._group_lost(live):
                report.engines_failed.update(await self._build_group(live))
            if self.pg is None:
                return report
            members = list(self.members)
            try:
                await asyncio.wait_for(self._transfer(it, int(version), members, report), self.timeout_s)
                report.engines_ok = members
            except (_Abandon, asyncio.TimeoutError) as e:
                # nobody holds the whole new version: no engine is ok; blame the named ones, else
                # whoever does not answer /health now, else all of them
                why = e.why if isinstance(e, _Abandon) else f"sync did not finish within {self.timeout_s}s"
                failed = e.failed if isinstance(e, _Abandon) else {}
                if not failed:
                    _, failed = await self.http.alive(members)
                    failed = failed or {u: why for u in members}
                report.engines_failed.update(failed)
                log.warning("weight sync v%d abandoned (%s): %s", version, why, failed)
                await self._retire_group()
            finally:
                still = [u for u in members if u not in report.engines_failed]
                await self.http.resume(still, self.http.probe_timeout_s * 2)
        finally:
            await asyncio.to_thread(drain, it)
            report.seconds = clock()
        return report

    async def _transfer(self, it: Any, version: int, members: list[str], report: SyncReport) -> None:
        failed = await self.http.pause(members, self.mode, self.timeout_s)
        if failed:
            raise _Abandon(failed)
        while True:
            bucket = await asyncio.to_thread(next, it, None)
            if bucket is None:
                break
            await self._send_bucket(bucket, None, members, report)
        await self._send_bucket([], version, members, report)

    async def _send_bucket(self, bucket: Bucket, version: int | None, members: list[str], report: SyncReport) -> None:
        metas = metas_of(bucket)
        body: dict[str, Any] = {"names": [m.name for m in metas], "dtypes": [m.dtype for m in metas],
                                "shapes": [list(m.shape) for m in metas], "group_name": self.group_name,
                                "flush_cache": version is not None,
                                "weight_version": None if version is None else (version if self.coalesce else str(version))}
        if self.coalesce:
            body["asyncrl_coalesce"] = True
        posts = {u: asyncio.ensure_future(self.http.post(u, "/update_weights_from_distributed", body, None))
                 for u in members}
        if bucket:
            self._inflight = asyncio.ensure_future(asyncio.to_thread(self._broadcast, self.pg, bucket))
            self._inflight.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even if abandoned
            pending = set(posts.values()) | {self._inflight}
            while self._inflight in pending:  # a reply that fails early must not wait out the collective
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                early = {u: p.result()[1] for u, p in posts.items() if p in done and not p.result()[0]}
                if early:
                    _raise_or_abandon(early)
            if self._inflight.exception() is not None:  # e.g. gloo: "Connection closed by peer"
                raise _Abandon({}, f"broadcast failed: {self._inflight.exception()}")
            report.collectives += self._inflight.result()
            report.bytes += sum(nbytes(t) for _, t in bucket)
            report.buckets += 1
        replies = {u: await p for u, p in posts.items()}
        bad = {u: why for u, (ok, why) in replies.items() if not ok}
        if bad:
            _raise_or_abandon(bad)

    def _broadcast(self, pg: Any, bucket: Bucket) -> int:
        """Rank 0's side of one bucket (blocking, in a worker thread). Returns the collective count."""
        tensors = [t.detach().to(self.device) for _, t in bucket]
        if self.coalesce:
            bufs = [pack(tensors, idx) for _, idx in flat_groups(metas_of(bucket))]
        else:
            bufs = [t.contiguous() for t in tensors]
        works = [dist.broadcast(b, src=0, group=pg, async_op=True) for b in bufs]
        for w in works:
            w.wait()
        return len(bufs)

    async def broadcast_flat(self, numel: int, dtype: torch.dtype = torch.float32) -> float:
        """Benchmark ceiling: one flat broadcast of `numel` elements to the current group; seconds."""
        buf = torch.zeros(numel, dtype=dtype, device=self.device)
        clock = Stopwatch()
        body = {"group_name": self.group_name, "numel": numel, "dtype": dtype_name(dtype)}
        posts = [asyncio.ensure_future(self.http.post(u, "/weight_sync_probe_broadcast", body, None)) for u in self.members]
        await asyncio.to_thread(lambda: dist.broadcast(buf, src=0, group=self.pg))
        res = await asyncio.gather(*posts)
        if not all(ok for ok, _ in res):
            raise WeightSyncError(f"probe broadcast failed: {res}")
        return clock()

    async def close(self) -> None:
        await self._retire_group()
        await self.http.aclose()


def _raise_or_abandon(bad: dict[str, str]) -> None:
    """A refused bucket (the engine answered success=false about a tensor) is a configuration error;
    anything else (connection refused, broken group) abandons the sync for those engines."""
    refused = {u: why for u, why in bad.items() if names_a_tensor(why)}
    if refused:
        url, why = next(iter(refused.items()))
        raise WeightMismatchError(f"engine {url} refused the weights: {why}")
    raise _Abandon(bad)
