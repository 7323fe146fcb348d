"""tensor transport (colocated on one GPU): CUDA-IPC handles through POST /update_weights_from_tensor.

NCCL cannot put two ranks on one GPU, so a learner colocated with its engine hands over tensors
instead: each bucket is pickled with torch's ForkingPickler (CUDA tensors become IPC handles, no
copy) and base64-encoded, SGLang's MultiprocessingSerializer format. `serialized_named_tensors` holds
one entry per TP rank of the engine (GET /server_info tp_size), each serialized on its own: SGLang's
rank r deserializes only entry r, and reading another rank's copy would break CUDA-IPC refcounting.
The learner keeps the bucket alive until the reply. The last bucket carries `weight_version` and
`flush_cache: true`. Engines are independent: one failing leaves the others going. GPU only.
"""

from __future__ import annotations

import asyncio
import base64
import io
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing

from asyncrl.config import WeightSyncConfig
from asyncrl.weight_sync.broadcast import server_info_of
from asyncrl.weight_sync.engine_http import EngineHTTP
from asyncrl.weight_sync.errors import WeightMismatchError, WeightSyncError
from asyncrl.weight_sync.sender import Bucket, SyncReport, Transport


def serialize_named_tensors(named: Bucket) -> str:
    """ForkingPickler + base64 (SGLang's MultiprocessingSerializer.serialize(..., output_str=True))."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(list(named))
    return base64.b64encode(buf.getvalue()).decode("ascii")


class TensorTransport(Transport):
    name = "tensor"
    uses_session = True
    shared_fate = False

    def __init__(self, *, timeout_s: float = WeightSyncConfig.timeout_s, device: str = "cuda"):
        self.timeout_s, self.device = float(timeout_s), device
        self.tp_size: dict[str, int] = {}

    async def prepare(self, http: EngineHTTP, engines: list[str]) -> dict[str, WeightSyncError]:
        if not torch.cuda.is_available():
            raise WeightSyncError("config", "transport 'tensor' (CUDA-IPC) needs a GPU; use gloo or disk on CPU")
        infos = await asyncio.gather(*(server_info_of(http, u) for u in engines))
        self.tp_size.update({u: info["tp_size"] for u, (info, e) in zip(engines, infos) if e is None})
        return {u: e for u, (_, e) in zip(engines, infos) if e is not None}

    async def send_bucket(self, http: EngineHTTP, bucket: Bucket, engines: list[str], version: str | None,
                          report: SyncReport) -> dict[str, WeightSyncError]:
        bucket = [(n, t.detach().to(self.device)) for n, t in bucket]

        async def one(url: str) -> WeightSyncError | None:
            body = {"serialized_named_tensors": [serialize_named_tensors(bucket) for _ in range(self.tp_size.get(url, 1))],
                    "load_format": None, "flush_cache": version is not None, "weight_version": version}
            return await http.post(url, "/update_weights_from_tensor", body, self.timeout_s)

        errs = {u: e for u, e in zip(engines, await asyncio.gather(*(one(u) for u in engines))) if e is not None}
        report.bytes += self.wire_nbytes(bucket)
        return {u: WeightMismatchError(e.message, u, e.status) if e.code == "refused" else e for u, e in errs.items()}
