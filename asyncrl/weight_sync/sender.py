"""The one weight-sync protocol, over any transport (SGLang 0.5's weight-update contract).

One sync of `version`, whatever moves the bytes:

    probe      GET /model_info on every engine (SGLang's /health generates a token and answers 503
               while paused, so it would blame a paused engine); the silent ones are left out
    prepare    the transport builds what it needs (the update group: /server_info tp_size ...)
    pause      POST /pause_generation {mode}: "retract" for trainer.weight_sync.mode=in_place
               (requests are kept; SGLang retracts them so the KV cache can be flushed), "abort"
    begin      POST /begin_weight_update (SGLang refuses distributed and tensor updates outside it)
    names      before an engine's first bucket from this sender (a relaunched engine gets a new
               sender): every tensor of each bucket is one the engine loads (verify.py), else
               WeightMismatchError before that bucket moves
    buckets    one transport call per bucket; the last carries weight_version (a string) and
               flush_cache: true, so no engine reports the version while holding half the weights
    version    the transport's finish step (disk: POST /update_weights_from_disk)
    end        POST /end_weight_update, in a `finally`: also after an abandoned or refused sync
    continue   POST /continue_generation, always
    drain      the bucket iterator is consumed to the end, always (the FSDP gather behind it is collective)
    values     every `verify_every`-th sync: one tensor (rotating) read back from every engine that took
               it must be what was sent (verify.py), else WeightMismatchError

An engine that is dead, hangs or times out is left out and reported in the SyncReport (and the next
sync builds its group without it), as is one that loaded the tensors and refused to flush its cache
(errors.py flush_refused: it holds the weights, not the version); a refusal (the engine answered and
said no) raises: a refused bucket is a WeightMismatchError. Errors carry codes (errors.py), found by HTTP status and reply
structure, never by message wording.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncrl.config import WeightSyncConfig
from asyncrl.weight_sync.bucketing import nbytes
from asyncrl.weight_sync.engine_http import PROBE_TIMEOUT_S, EngineHTTP
from asyncrl.weight_sync.errors import WeightMismatchError, WeightSyncError
from asyncrl.weight_sync.verify import check_names, check_values, sample_of

log = logging.getLogger(__name__)

Bucket = list[tuple[str, torch.Tensor]]
PAUSE_MODE = {"in_place": "retract", "retract": "retract", "abort": "abort"}  # config mode -> SGLang pause mode


@dataclass
class SyncReport:
    version: int
    transport: str
    engines_ok: list[str] = field(default_factory=list)
    engines_failed: dict[str, WeightSyncError] = field(default_factory=dict)  # url -> why (code, message)
    seconds: float = 0.0
    bytes: int = 0  # moved by the transport
    full_bytes: int = 0  # a full sync's: every tensor whole in the wire dtype
    delta: bool = False  # only what changed since the engines' last version moved (delta.py)
    buckets: int = 0
    collectives: int = 0

    @property
    def ok(self) -> bool:
        return bool(self.engines_ok) and not self.engines_failed

    def metrics(self) -> dict[str, float]:
        return {"sync/ok": float(self.ok), "sync/engines_ok": float(len(self.engines_ok)),
                "sync/engines_failed": float(len(self.engines_failed)), "sync/bytes": float(self.bytes),
                "sync/full_bytes": float(self.full_bytes), "sync/delta": float(self.delta),
                "sync/buckets": float(self.buckets), "sync/collectives": float(self.collectives),
                "sync/transfer_seconds": self.seconds}


class SyncAbandoned(Exception):
    """A transport cannot finish this sync for anyone (a broken collective): {url: why}, maybe empty."""

    def __init__(self, failed: dict[str, WeightSyncError], why: str = ""):
        super().__init__(failed, why)
        self.failed, self.why = failed, why


class Transport(abc.ABC):
    """Moves the bytes; the protocol around it is WeightSender's."""

    name: str = ""
    uses_session = True  # POST /begin_weight_update ... /end_weight_update around the buckets
    shared_fate = False  # one engine's failure breaks the transfer for all (a collective group)

    async def prepare(self, http: EngineHTTP, engines: list[str]) -> dict[str, WeightSyncError]:
        """Before the pause: build or keep what the transfer needs; {url: why} for engines left out of
        this sync (reported, never raised: the next sync tries them again)."""
        return {}

    async def start(self, version: str) -> None:
        """A sync of `version` begins (after pause and begin)."""
        return None

    @abc.abstractmethod
    async def send_bucket(self, http: EngineHTTP, bucket: Bucket, engines: list[str], version: str | None,
                          report: SyncReport) -> dict[str, WeightSyncError]:
        """Move one bucket to `engines`; `version` is set on the last bucket only; adds what it moved to
        `report.bytes`. Returns {url: why} for engines that failed; a refused bucket is a
        WeightMismatchError in that dict."""

    def wire_nbytes(self, bucket: Bucket) -> int:
        """The bytes a full sync moves for `bucket` (a transport that casts counts the cast)."""
        return sum(nbytes(t) for _, t in bucket)

    async def finish(self, http: EngineHTTP, engines: list[str], version: str) -> dict[str, WeightSyncError]:
        """After the last bucket: make `version` the engines' weights (disk: load them)."""
        return {}

    async def retire(self, http: EngineHTTP) -> None:
        """The sync was abandoned: drop what is broken (the group), so the next sync rebuilds it."""
        return None

    async def close(self, http: EngineHTTP) -> None:
        await self.retire(http)


def drain(it: Iterator[Any]) -> None:
    """Consume the rest of an iterator (the other FSDP ranks wait on its gathers)."""
    for _ in it:
        pass


class WeightSender:
    """Pushes the learner's full weights to inference engines (learner rank 0 only)."""

    def __init__(self, transport: Transport, *, timeout_s: float = WeightSyncConfig.timeout_s,
                 mode: str = WeightSyncConfig.mode, probe_timeout_s: float = PROBE_TIMEOUT_S,
                 verify_every: int = WeightSyncConfig.verify_every):
        if mode not in PAUSE_MODE:
            raise WeightSyncError("config", f"weight sync mode {mode!r} is not one of {sorted(PAUSE_MODE)}")
        if timeout_s <= 0:
            raise WeightSyncError("config", f"weight sync timeout_s must be > 0, got {timeout_s}")
        if verify_every < 0:
            raise WeightSyncError("config", f"weight sync verify_every must be >= 0, got {verify_every}")
        self.transport, self.timeout_s, self.pause_mode = transport, float(timeout_s), PAUSE_MODE[mode]
        self.verify_every = int(verify_every)
        self.http = EngineHTTP(min(probe_timeout_s, timeout_s))
        self.urls: list[str] = []
        self.verified: set[str] = set()  # engines whose names were checked (verify.check_names)
        self.syncs = 0  # sync() calls so far: which of them read a tensor back
        self.n_tensors = 0  # tensors in the last full sync: the rotation of the one read back
        self._sample: tuple[str, torch.Tensor] | None = None

    async def connect(self, engine_urls: list[str]) -> dict[str, WeightSyncError]:
        """Remember the engines and prepare the transport with the live ones; {url: why} left out."""
        self.urls = [u.rstrip("/") for u in engine_urls]
        if not self.urls:
            raise WeightSyncError("config", "weight sync: no engine urls to connect to")
        live, failed = await self.probe(self.urls)
        failed.update(await self.transport.prepare(self.http, live))
        if failed:
            log.warning("weight sync: engines left out: %s", {u: str(e) for u, e in failed.items()})
        return failed

    async def probe(self, urls: list[str]) -> tuple[list[str], dict[str, WeightSyncError]]:
        """(engines answering GET /model_info, {url: why} for the others)."""
        res = await asyncio.gather(*(self.http.get(u, "/model_info") for u in urls))
        return [u for u, (_, e) in zip(urls, res) if e is None], {u: e for u, (_, e) in zip(urls, res) if e is not None}

    # ------------------------------------------------------------------ one sync

    async def sync(self, params_iter: Iterable[Bucket], version: int) -> SyncReport:
        """Send every bucket, then make `version` the engines' weight version. `params_iter` is always
        consumed to the end. Raises WeightSyncError for refusals; dead engines are in the report."""
        if not self.urls:
            raise WeightSyncError("config", "weight sync: sync() before connect()")
        it = iter(params_iter)
        t0 = time.perf_counter()
        report = SyncReport(version=int(version), transport=self.transport.name)
        try:
            live, dead = await self.probe(self.urls)
            report.engines_failed.update(dead)
            left_out = await self.transport.prepare(self.http, live)  # a group it cannot build: left out
            report.engines_failed.update(left_out)
            live = [u for u in live if u not in left_out]
            self._sample = None
            if live:
                await self._paused(it, str(int(version)), live, report)
            if self._sample is not None and report.engines_ok:
                unasked = await check_values(self.http, report.engines_ok, *self._sample)
                for u, e in unasked.items():
                    log.warning("weight sync v%s: could not read %s back from %s: %s", version, self._sample[0], u, e)
        finally:
            await asyncio.to_thread(drain, it)
            report.seconds = time.perf_counter() - t0
            self.syncs += 1
        return report

    def _sample_index(self) -> int | None:
        """Which tensor of this sync is read back after it (None: no check this time)."""
        if not self.verify_every or self.syncs % self.verify_every:
            return None
        return (self.syncs // self.verify_every) % max(self.n_tensors, 1)

    async def _check_names(self, bucket: Bucket, engines: list[str]) -> None:
        shapes = {n: tuple(t.shape) for n, t in bucket}
        await asyncio.gather(*(check_names(self.http, u, shapes) for u in engines))

    async def _paused(self, it: Iterator[Bucket], version: str, live: list[str], report: SyncReport) -> None:
        errs = await self.http.post_all(live, "/pause_generation", {"mode": self.pause_mode}, self.timeout_s)
        paused = [u for u in live if u not in errs]
        try:
            self._record(errs, live, report)
            opened = await self._begin(paused, report) if self.transport.uses_session else paused
            try:
                if opened:
                    await self._transfer_bounded(it, version, opened, report)
            finally:
                if self.transport.uses_session and opened:
                    self._lost(await self.http.post_all(opened, "/end_weight_update", {}, self.http.probe_timeout_s * 2),
                               report)
        finally:
            self._lost(await self.http.post_all(paused, "/continue_generation", {}, self.http.probe_timeout_s * 2),
                       report)

    async def _begin(self, engines: list[str], report: SyncReport) -> list[str]:
        """Open a session on each engine. One left open (a sender that died mid-sync) is closed and
        opened again once; a second refusal raises."""
        errs = await self.http.post_all(engines, "/begin_weight_update", {}, self.timeout_s)
        stale = [u for u, e in errs.items() if e.code == "refused"]
        if stale:
            await self.http.post_all(stale, "/end_weight_update", {}, self.timeout_s)
            retry = await self.http.post_all(stale, "/begin_weight_update", {}, self.timeout_s)
            errs = {**{u: e for u, e in errs.items() if u not in stale}, **retry}
        opened = [u for u in engines if u not in errs]
        try:
            self._record(errs, engines, report)
        except WeightSyncError:
            if opened:
                await self.http.post_all(opened, "/end_weight_update", {}, self.http.probe_timeout_s * 2)
            raise
        return opened

    async def _transfer_bounded(self, it: Iterator[Bucket], version: str, engines: list[str], report: SyncReport) -> None:
        try:
            await asyncio.wait_for(self._transfer(it, version, engines, report), self.timeout_s)
            return
        except SyncAbandoned as e:
            failed, why = dict(e.failed), e.why or "the transfer broke"
        except asyncio.TimeoutError:
            failed, why = {}, f"sync did not finish within {self.timeout_s}s"
        # nobody holds the whole new version: no engine is ok; blame the named ones, else whoever
        # does not answer the probe now, else all of them
        if not failed:
            _, failed = await self.probe(engines)
            failed = failed or {u: WeightSyncError("timeout", why, u) for u in engines}
        report.engines_ok = []
        report.engines_failed.update(failed)
        log.warning("weight sync v%s abandoned (%s): %s", version, why, {u: str(x) for u, x in failed.items()})
        await self.transport.retire(self.http)

    async def _transfer(self, it: Iterator[Bucket], version: str, engines: list[str], report: SyncReport) -> None:
        await self.transport.start(version)
        bucket = await asyncio.to_thread(next, it, None)
        if bucket is None:
            raise WeightSyncError("config", "the learner yielded no tensors to send")
        index, sample_at = 0, self._sample_index()
        while bucket is not None:
            unverified = [u for u in engines if u not in self.verified]
            if unverified:
                await self._check_names(bucket, unverified)
            if sample_at is not None and index <= sample_at < index + len(bucket):
                name, t = bucket[sample_at - index]
                self._sample = (name, sample_of(t))
            index += len(bucket)
            after = await asyncio.to_thread(next, it, None)  # look ahead: the last bucket carries the version
            errs = await self.transport.send_bucket(self.http, bucket, engines, version if after is None else None, report)
            report.buckets += 1
            report.full_bytes += self.transport.wire_nbytes(bucket)
            engines = self._after_step(errs, engines, report)
            bucket = after
        engines = self._after_step(await self.transport.finish(self.http, engines, version), engines, report)
        report.engines_ok = engines
        self.n_tensors = index
        self.verified.update(engines)

    # ------------------------------------------------------------------ failures

    def _after_step(self, errs: dict[str, WeightSyncError], engines: list[str], report: SyncReport) -> list[str]:
        for e in errs.values():
            if isinstance(e, WeightMismatchError):
                raise e
        if self.transport.shared_fate and any(e.code != "flush_refused" for e in errs.values()):
            raise SyncAbandoned(errs)  # (a refused flush came after a complete transfer: the group is fine;
            # a delta that did not match leaves that engine's weights mixed: the sync ends for all)
        return self._record(errs, engines, report)

    @staticmethod
    def _keep_down(errs: dict[str, WeightSyncError]) -> dict[str, WeightSyncError]:
        """The failures of dead or hung engines (and refused flushes); raises the first refusal or
        configuration error."""
        for e in errs.values():
            if not e.left_out:
                raise e
        return errs

    def _record(self, errs: dict[str, WeightSyncError], engines: list[str], report: SyncReport) -> list[str]:
        """Report down engines, raise refusals; the engines that remain."""
        report.engines_failed.update(self._keep_down(errs))
        return [u for u in engines if u not in errs]

    @staticmethod
    def _lost(errs: dict[str, WeightSyncError], report: SyncReport) -> None:
        """Closing steps (end, continue): an engine that fails them is not ok, whatever the cause."""
        for u, e in errs.items():
            log.warning("weight sync: %s", e)
            report.engines_failed.setdefault(u, e)
            if u in report.engines_ok:
                report.engines_ok.remove(u)

    async def close(self) -> None:
        """Release the transport's group and the connections (idempotent)."""
        await self.transport.close(self.http)
        await self.http.aclose()
