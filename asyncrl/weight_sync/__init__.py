"""Weight sync from the learner to the inference engines, versioned (SGLang 0.5's contract).

    make_sender(cfg, rank, engine_urls, transport=None) -> SenderHandle   # the one factory
    SenderHandle.sync_blocking(worker, version) -> dict[str, float]        # every learner rank calls it
    SenderHandle.close()
    WeightSender(transport, timeout_s=, mode=)   # the protocol (sender.py): connect / sync / close
    WeightSyncError.code in errors.CODES (refused, flush_refused, delta_mismatch, unreachable, timeout,
    config); WeightMismatchError

Transports (move the bytes only): GroupTransport gloo/nccl (broadcast.py; deltas: delta.py), TensorTransport
CUDA-IPC (tensor.py), DiskTransport (disk.py). The engine side is routes.make_router(core).
"""

from __future__ import annotations

from asyncrl.weight_sync.errors import CODES, WeightMismatchError, WeightSyncError
from asyncrl.weight_sync.handle import SenderHandle, make_sender, resolve_transport
from asyncrl.weight_sync.sender import SyncReport, Transport, WeightSender

__all__ = ["CODES", "SenderHandle", "SyncReport", "Transport", "WeightMismatchError", "WeightSender",
           "WeightSyncError", "make_sender", "resolve_transport"]
