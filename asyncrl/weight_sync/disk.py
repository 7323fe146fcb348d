"""disk transport: safetensors shards in a shared directory, then POST /update_weights_from_disk.

Layout of one sync: <disk_dir>/v<version>/model-00001.safetensors ... plus
model.safetensors.index.json (HF's sharded-checkpoint index: {"weight_map": {name: file}}), written
under a temporary name and renamed, so an engine never sees half a version. Then every engine gets
{model_path, weight_version (string), flush_cache: true}; version directories beyond `keep` are
deleted afterwards. SGLang loads from disk without a weight-update session (uses_session False:
end_weight_update would post-process the freshly loaded weights a second time).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from asyncrl.config import WeightSyncConfig
from asyncrl.weight_sync.bucketing import nbytes
from asyncrl.weight_sync.engine_http import EngineHTTP
from asyncrl.weight_sync.errors import WeightMismatchError, WeightSyncError
from asyncrl.weight_sync.sender import Bucket, SyncReport, Transport

INDEX = "model.safetensors.index.json"


def write_shard(bucket: Bucket, out_dir: Path, n: int, weight_map: dict[str, str]) -> int:
    """Write bucket `n` (1-based) as one safetensors file into `out_dir`; its bytes."""
    # lazy: imports safetensors, which this module does not load otherwise
    from safetensors.torch import save_file

    fname = f"model-{n:05d}.safetensors"
    # safetensors refuses tensors sharing storage (tied embeddings): save private copies
    save_file({k: t.detach().cpu().clone() for k, t in bucket}, str(out_dir / fname), metadata={"format": "pt"})
    weight_map.update({k: fname for k, _ in bucket})
    return sum(nbytes(t) for _, t in bucket)


class DiskTransport(Transport):
    name = "disk"
    uses_session = False
    shared_fate = False

    def __init__(self, disk_dir: str | None = None, *, timeout_s: float = WeightSyncConfig.timeout_s, keep: int = 2,
                 config_dir: str | None = None):
        self.root = Path(disk_dir or tempfile.mkdtemp(prefix="asyncrl-weights-"))
        self.timeout_s, self.keep = float(timeout_s), max(1, keep)
        self.config_dir = config_dir  # copy its *.json / tokenizer files so a real SGLang can load the dir
        self._tmp: Path | None = None
        self._weight_map: dict[str, str] = {}
        self._shards = self._total = 0

    async def prepare(self, http: EngineHTTP, engines: list[str]) -> dict[str, WeightSyncError]:
        self.root.mkdir(parents=True, exist_ok=True)
        return {}

    async def start(self, version: str) -> None:
        await self.retire(None)
        self._tmp = Path(tempfile.mkdtemp(prefix=f".v{version}-", dir=self.root))

    async def send_bucket(self, http: EngineHTTP, bucket: Bucket, engines: list[str], version: str | None,
                          report: SyncReport) -> dict[str, WeightSyncError]:
        assert self._tmp is not None, "send_bucket before start"
        self._shards += 1
        self._total += await asyncio.to_thread(write_shard, bucket, self._tmp, self._shards, self._weight_map)
        report.bytes += self.wire_nbytes(bucket)
        return {}

    async def finish(self, http: EngineHTTP, engines: list[str], version: str) -> dict[str, WeightSyncError]:
        assert self._tmp is not None, "finish before start"
        tmp, final = self._tmp, self.root / f"v{version}"
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": self._total}, "weight_map": self._weight_map}, indent=1))
        if self.config_dir:
            for f in Path(self.config_dir).iterdir():
                if f.is_file() and not f.name.endswith((".safetensors", ".bin")) and f.name != INDEX:
                    shutil.copy2(f, tmp / f.name)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        self._tmp = None
        body: dict[str, Any] = {"model_path": str(final), "weight_version": version, "flush_cache": True,
                                "load_format": None}
        errs = await http.post_all(engines, "/update_weights_from_disk", body, self.timeout_s)
        self._prune(keep=final)
        return {u: WeightMismatchError(e.message, u, e.status) if e.code == "refused" else e for u, e in errs.items()}

    def _prune(self, keep: Path) -> None:
        versions = sorted((int(p.name[1:]), p) for p in self.root.glob("v*") if p.name[1:].isdigit())
        for _, p in versions[:-self.keep]:
            if p != keep:
                shutil.rmtree(p, ignore_errors=True)

    async def retire(self, http: EngineHTTP | None) -> None:
        """Throw away a half-written version."""
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
        self._tmp, self._weight_map, self._shards, self._total = None, {}, 0, 0
