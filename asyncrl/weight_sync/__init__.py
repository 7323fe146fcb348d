"""Weight sync from the learner to the inference engines, versioned.

    make_sender(cfg, rank, engine_urls) -> SenderHandle   # what the learner actor calls
    SenderHandle.sync_blocking(worker, version) -> dict    # every learner rank calls it (FSDP gather)
    build_sender(cfg) -> WeightSender                      # the async sender itself (connect/sync/close)
    resolve_transport(requested, cuda_available, colocated) -> "gloo" | "nccl" | "tensor" | "disk"

Transports: gloo (CPU) and nccl (separate GPUs) broadcast over a dedicated group (distributed.py),
tensor passes CUDA-IPC handles to a colocated engine (tensor.py), disk writes safetensors to a
shared path (disk.py). The engine side is routes.make_router(core).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from asyncrl.config import WeightSyncConfig
from asyncrl.weight_sync.base import SyncReport, WeightMismatchError, WeightSender, WeightSyncError, drain

__all__ = ["SenderHandle", "SyncReport", "WeightMismatchError", "WeightSender", "WeightSyncError",
           "build_sender", "make_sender", "resolve_transport"]


def resolve_transport(requested: str, cuda_available: bool, colocated: bool) -> str:
    """auto: CPU -> gloo; GPUs, engines on other GPUs -> nccl; learner and engine on one GPU -> tensor."""
    if requested != "auto":
        if requested not in ("gloo", "nccl", "tensor", "disk"):
            raise ValueError(f"trainer.weight_sync.transport={requested!r}: not auto, gloo, nccl, tensor or disk")
        return requested
    if not cuda_available:
        return "gloo"
    return "tensor" if colocated else "nccl"


def _colocated() -> bool:
    """One visible GPU shared by learner and engine (the only way both can be on a GPU here)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() == 1


def build_sender(cfg: WeightSyncConfig, transport: str | None = None) -> WeightSender:
    import torch

    kind = transport or resolve_transport(cfg.transport, torch.cuda.is_available(), _colocated())
    if kind in ("gloo", "nccl"):
        from asyncrl.weight_sync.distributed import DistributedSender

        return DistributedSender(kind, timeout_s=cfg.timeout_s, mode=cfg.mode)
    if kind == "tensor":
        from asyncrl.weight_sync.tensor import TensorSender

        return TensorSender(timeout_s=cfg.timeout_s, mode=cfg.mode)
    from asyncrl.weight_sync.disk import DiskSender

    return DiskSender(cfg.disk_dir, timeout_s=cfg.timeout_s, mode=cfg.mode)


class SenderHandle:
    """Blocking façade for a (Ray actor) learner rank. Rank 0 owns an event loop thread running the
    async sender; other ranks only walk `worker.iter_full_params` so the collective gathers match."""

    def __init__(self, cfg: WeightSyncConfig, rank: int, engine_urls: list[str]):
        self.cfg, self.rank, self.engine_urls = cfg, rank, list(engine_urls)
        self.bucket_bytes = int(cfg.bucket_mb) << 20
        self.sender: WeightSender | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        if rank == 0:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="weight-sync", daemon=True).start()
            self.sender = build_sender(cfg)
            self._run(self.sender.connect(self.engine_urls))

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def sync_report(self, worker: Any, version: int) -> SyncReport | None:
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


def make_sender(cfg: WeightSyncConfig, rank: int, engine_urls: list[str]) -> SenderHandle:
    return SenderHandle(cfg, rank, engine_urls)
