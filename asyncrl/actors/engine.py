"""EngineActor: owns one inference server process (embedded or SGLang) on the node Ray placed it on.

The server keeps a fixed port across restarts, so clients need no new address after a crash.
"""

from __future__ import annotations

from typing import Optional

import ray

from asyncrl.config import Config
from asyncrl.net import free_port


@ray.remote
class EngineActor:
    def __init__(self, cfg: Config, model_dir: str, index: int, weight_version: int = 0,
                 threads: Optional[int] = None):
        self.cfg, self.model_dir, self.index, self.threads = cfg, model_dir, index, threads
        self.port = free_port(cfg.engine.host)
        self.version = weight_version
        self.proc = None
        self.restarts = 0

    def start(self) -> str:
        e = self.cfg.engine
        if e.type == "sglang":
            from asyncrl.engine.launcher import launch_sglang

            self.proc = launch_sglang(self.model_dir, host=e.host, port=self.port, cfg=e, weight_version=self.version)
        else:
            from asyncrl.engine.launcher import launch_embedded

            self.proc = launch_embedded(
                self.model_dir, host=e.host, port=self.port, device=e.device or _default_device(),
                dtype=_dtype(e.dtype), max_running_seqs=e.max_running_seqs, weight_version=self.version,
                startup_timeout_s=e.launch_timeout_s, threads=self.threads,
                extra_env={"OMP_NUM_THREADS": str(self.threads)} if self.threads else None,
            )
        return self.proc.url

    def url(self) -> Optional[str]:
        return self.proc.url if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def pid(self) -> int:
        return self.proc.pid

    def restart(self, model_dir: Optional[str] = None, weight_version: Optional[int] = None) -> str:
        """Start again on the same port, from `model_dir` (e.g. the latest export) if given."""
        if self.proc is not None:
            self.proc.stop()
        if model_dir:
            self.model_dir = model_dir
        if weight_version is not None:
            self.version = weight_version
        self.restarts += 1
        return self.start()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None


def _default_device() -> str:
    from asyncrl.models import default_device

    return default_device()


def _dtype(name: str) -> str:
    if name != "auto":
        return name
    return "bfloat16" if _default_device().startswith("cuda") else "float32"
