"""disk sender: safetensors shards in a shared directory, then POST /update_weights_from_disk.

Layout of one sync: <disk_dir>/v<version>/model-00001.safetensors ... plus
model.safetensors.index.json (HF's sharded-checkpoint index: {"weight_map": {name: file}}), written
under a temporary name and renamed, so an engine never sees half a version. Engines get
{model_path, weight_version}; older version directories beyond `keep` are deleted afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
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


def write_shards(buckets: Iterable[Bucket], out_dir: Path) -> tuple[int, int]:
    """Write one safetensors file per bucket plus the index into `out_dir`; (buckets, bytes)."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    n = total = 0
    for bucket in buckets:
        n += 1
        fname = f"model-{n:05d}.safetensors"
        # safetensors refuses tensors sharing storage (tied embeddings): save private copies
        save_file({k: t.detach().cpu().clone() for k, t in bucket}, str(out_dir / fname), metadata={"format": "pt"})
        for k, t in bucket:
            weight_map[k] = fname
            total += nbytes(t)
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return n, total


class DiskSender(WeightSender):
    transport = "disk"

    def __init__(self, disk_dir: str | None = None, *, timeout_s: float = 120.0, mode: str = "in_place",
                 keep: int = 2, config_dir: str | None = None):
        self.root = Path(disk_dir or tempfile.mkdtemp(prefix="asyncrl-weights-"))
        self.timeout_s, self.mode, self.keep = float(timeout_s), mode, max(1, keep)
        self.config_dir = config_dir  # copy its *.json / tokenizer files so a real SGLang can load the dir
        self.http = EngineHTTP(min(5.0, timeout_s))
        self.urls: list[str] = []

    async def connect(self, engine_urls: list[str]) -> None:
        self.urls = [u.rstrip("/") for u in engine_urls]
        if not self.urls:
            raise WeightSyncError("weight sync: no engine urls to connect to")
        self.root.mkdir(parents=True, exist_ok=True)

    async def sync(self, params_iter: Iterable[Bucket], version: int) -> SyncReport:
        if not self.urls:
            raise WeightSyncError("weight sync: sync() before connect()")
        clock = Stopwatch()
        it = iter(params_iter)
        report = SyncReport(version=int(version), transport=self.transport)
        final = self.root / f"v{int(version)}"
        tmp = Path(tempfile.mkdtemp(prefix=f".v{int(version)}-", dir=self.root))
        try:
            report.buckets, report.bytes = await asyncio.to_thread(write_shards, it, tmp)
            if self.config_dir:
                for f in Path(self.config_dir).iterdir():
                    if f.is_file() and not f.name.endswith((".safetensors", ".bin")) and f.name != "model.safetensors.index.json":
                        shutil.copy2(f, tmp / f.name)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        finally:
            await asyncio.to_thread(drain, it)
            shutil.rmtree(tmp, ignore_errors=True)
        live, dead = await self.http.alive(self.urls)
        report.engines_failed.update(dead)
        report.engines_failed.update(await self.http.pause(live, self.mode, self.timeout_s))
        targets = [u for u in live if u not in report.engines_failed]
        body: dict[str, Any] = {"model_path": str(final), "weight_version": int(version)}
        res = await self.http.post_all(targets, "/update_weights_from_disk", body, self.timeout_s)
        report.engines_ok = [u for u, (ok, _) in res.items() if ok]
        report.engines_failed.update({u: why for u, (ok, why) in res.items() if not ok})
        await self.http.resume(live, self.http.probe_timeout_s * 2)
        refused = {u: why for u, why in report.engines_failed.items() if names_a_tensor(why)}
        if refused:
            raise WeightMismatchError(f"engine refused the weights in {final}: {refused}")
        self._prune(keep_version=int(version))
        report.seconds = clock()
        return report

    def _prune(self, keep_version: int) -> None:
        versions = sorted((int(p.name[1:]), p) for p in self.root.glob("v*") if p.name[1:].isdigit())
        for v, p in versions[:-self.keep]:
            if v != keep_version:
                shutil.rmtree(p, ignore_errors=True)

    async def close(self) -> None:
        await self.http.aclose()
