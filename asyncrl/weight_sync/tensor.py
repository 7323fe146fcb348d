"""tensor sender (colocated on one GPU): CUDA-IPC handles through POST /update_weights_from_tensor.

NCCL cannot put two ranks on one GPU, so a learner colocated with its engine hands over tensors
instead: each bucket is pickled with torch's ForkingPickler (CUDA tensors become IPC handles, no
copy) and base64-encoded, which is SGLang's MultiprocessingSerializer format; the engine maps the
handles, copies into its weights and replies. The learner keeps the bucket alive until the reply.
A trailing request with an empty list carries `weight_version`. GPU only.
"""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterable
from typing import Any

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
from asyncrl.weight_sync.bucketing import nbytes


def serialize_named_tensors(named: Bucket) -> str:
    """ForkingPickler + base64 (SGLang's MultiprocessingSerializer.serialize(..., output_str=True))."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers torch's (CUDA-IPC) reductions with ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump(list(named))
    return base64.b64encode(buf.getvalue()).decode("ascii")


class TensorSender(WeightSender):
    transport = "tensor"

    def __init__(self, *, timeout_s: float = 120.0, mode: str = "in_place", device: str = "cuda"):
        self.timeout_s, self.mode, self.device = float(timeout_s), mode, device
        self.http = EngineHTTP(min(5.0, timeout_s))
        self.urls: list[str] = []
        self.tp_size: dict[str, int] = {}

    async def connect(self, engine_urls: list[str]) -> None:
        import torch

        if not torch.cuda.is_available():
            raise WeightSyncError("transport 'tensor' (CUDA-IPC) needs a GPU; use gloo or disk on CPU")
        self.urls = [u.rstrip("/") for u in engine_urls]
        infos = await asyncio.gather(*(self.http.info(u) for u in self.urls))
        self.tp_size = {u: int(i.get("tp_size", 1)) for u, i in zip(self.urls, infos)}

    async def _post(self, urls: list[str], bucket: Bucket, version: Any, report: SyncReport) -> None:
        payload = serialize_named_tensors(bucket)
        res = await asyncio.gather(*(self.http.post(u, "/update_weights_from_tensor", {
            "serialized_named_tensors": [payload] * self.tp_size.get(u, 1), "load_format": None,
            "flush_cache": version is not None, "weight_version": version}, self.timeout_s) for u in urls))
        for u, (ok, why) in zip(urls, res):
            if not ok:
                if names_a_tensor(why):
                    raise WeightMismatchError(f"engine {u} refused the weights: {why}")
                report.engines_failed[u] = why

    async def sync(self, params_iter: Iterable[Bucket], version: int) -> SyncReport:
        if not self.urls:
            raise WeightSyncError("weight sync: sync() before connect()")
        clock = Stopwatch()
        it = iter(params_iter)
        report = SyncReport(version=int(version), transport=self.transport)
        live, dead = await self.http.alive(self.urls)
        report.engines_failed.update(dead)
        try:
            report.engines_failed.update(await self.http.pause(live, self.mode, self.timeout_s))
            while True:
                bucket = await asyncio.to_thread(next, it, None)
                if bucket is None:
                    break
                targets = [u for u in live if u not in report.engines_failed]
                bucket = [(n, t.detach().to(self.device)) for n, t in bucket]
                await self._post(targets, bucket, None, report)
                report.buckets += 1
                report.bytes += sum(nbytes(t) for _, t in bucket)
            targets = [u for u in live if u not in report.engines_failed]
            await self._post(targets, [], str(int(version)), report)
            report.engines_ok = [u for u in live if u not in report.engines_failed]
        finally:
            await self.http.resume(live, self.http.probe_timeout_s * 2)
            await asyncio.to_thread(drain, it)
            report.seconds = clock()
        return report

    async def close(self) -> None:
        await self.http.aclose()
