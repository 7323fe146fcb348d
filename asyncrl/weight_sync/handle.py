"""The one factory: what the learner actor calls on every rank.

    make_sender(cfg, rank, engine_urls) -> SenderHandle
    SenderHandle.sync_blocking(worker, version) -> dict[str, float]   # every learner rank calls it
    SenderHandle.close()

Rank 0 owns an event-loop thread running the async WeightSender over the transport that
`trainer.weight_sync.transport` names (auto: CPU -> gloo; engines on other GPUs -> nccl; learner
and engine on one GPU -> tensor); other ranks only walk `worker.iter_full_params` so the
collective gathers match.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import torch

from asyncrl.config import WeightSyncConfig
from asyncrl.weight_sync.broadcast import GroupTransport
from asyncrl.weight_sync.disk import DiskTransport
from asyncrl.weight_sync.errors import WeightSyncError
from asyncrl.weight_sync.sender import SyncReport, Transport, WeightSender, drain
from asyncrl.weight_sync.tensor import TensorTransport

TRANSPORTS = ("gloo", "nccl", "tensor", "disk")


def resolve_transport(requested: str, cuda_available: bool, colocated: bool) -> str:
    """auto: CPU -> gloo; GPUs, engines on other GPUs -> nccl; learner and engine on one GPU -> tensor."""
    if requested != "auto":
        if requested not in TRANSPORTS:
            raise WeightSyncError("config", f"trainer.weight_sync.transport={requested!r}: not auto, gloo, nccl, tensor or disk")
        return requested
    if not cuda_available:
        return "gloo"
    return "tensor" if colocated else "nccl"


def _transport(cfg: WeightSyncConfig, kind: str) -> Transport:
    if kind in ("gloo", "nccl"):
        return GroupTransport(kind, timeout_s=cfg.timeout_s, delta=cfg.delta)
    if kind == "tensor":
        return TensorTransport(timeout_s=cfg.timeout_s)

    return DiskTransport(cfg.disk_dir, timeout_s=cfg.timeout_s)


class SenderHandle:
    """Blocking façade for a (Ray actor) learner rank."""

    def __init__(self, cfg: WeightSyncConfig, rank: int, engine_urls: list[str], transport: str | None = None):
        self.cfg, self.rank, self.engine_urls = cfg, rank, list(engine_urls)
        self.bucket_bytes = int(cfg.bucket_mb) << 20
        self.sender: WeightSender | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        if rank != 0:
            return
        colocated = torch.cuda.is_available() and torch.cuda.device_count() == 1
        kind = transport or resolve_transport(cfg.transport, torch.cuda.is_available(), colocated)
        self.sender = WeightSender(_transport(cfg, kind), timeout_s=cfg.timeout_s, mode=cfg.mode,
                                   verify_every=cfg.verify_every)
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="weight-sync", daemon=True).start()
        self._run(self.sender.connect(self.engine_urls))

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def sync_report(self, worker: Any, version: int) -> SyncReport | None:
        """Push `worker`'s weights as `version` (None on ranks > 0, which only walk the gather)."""
        buckets = worker.iter_full_params(self.bucket_bytes)
        if self.sender is None:
            drain(buckets)
            return None
        return self._run(self.sender.sync(buckets, version))

    def sync_blocking(self, worker: Any, version: int) -> dict[str, float]:
        """Push `worker`'s weights as `version`; metrics for the log ({} on ranks > 0)."""
        report = self.sync_report(worker, version)
        return report.metrics() if report is not None else {}

    def close(self) -> None:
        if self.sender is not None and self._loop is not None:
            self._run(self.sender.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self.sender = None


def make_sender(cfg: WeightSyncConfig, rank: int, engine_urls: list[str], transport: str | None = None) -> SenderHandle:
    """THE factory. `transport` overrides cfg.transport (tests, benchmarks)."""
    return SenderHandle(cfg, rank, engine_urls, transport)
