"""EngineActor: owns one inference server process (embedded or SGLang) on the node Ray placed it on.

The server keeps a fixed port across restarts, so clients need no new address after a crash.
The weight version is the server's own state (what weights it holds, reported in /model_info): the
actor keeps no copy of it; whoever (re)starts the server says which version the weights it loads are.
"""

from __future__ import annotations

from typing import Optional

import ray

from asyncrl.config import Config
from asyncrl.engine.launcher import launch_embedded, launch_sglang
from asyncrl.models import default_device
from asyncrl.net import free_port


@ray.remote
class EngineActor:
    def __init__(self, cfg: Config, model_dir: str, index: int, threads: Optional[int] = None):
        self.cfg, self.model_dir, self.index, self.threads = cfg, model_dir, index, threads
        self.port = free_port(cfg.engine.host)
        self.proc = None
        self.restarts = 0

    def start(self, weight_version: int = 0) -> str:
        """Launch the server on `model_dir`, whose weights are policy version `weight_version`."""
        e = self.cfg.engine
        if e.type == "sglang":
            self.proc = launch_sglang(self.model_dir, host=e.host, port=self.port, cfg=e, weight_version=weight_version)
        else:
            self.proc = launch_embedded(
                self.model_dir, host=e.host, port=self.port, device=e.device or default_device(),
                dtype=_dtype(e.dtype), max_running_seqs=e.max_running_seqs, weight_version=weight_version,
                startup_timeout_s=e.launch_timeout_s, threads=self.threads,
                extra_env={"OMP_NUM_THREADS": str(self.threads)} if self.threads else None,
                weights_dirs=run_weight_dirs(self.cfg),
            )
        return self.proc.url

    def url(self) -> Optional[str]:
        return self.proc.url if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def pid(self) -> int:
        return self.proc.pid

    def restart(self, model_dir: str, weight_version: int) -> str:
        """Start again on the same port from `model_dir` (the learner's export), holding `weight_version`."""
        if self.proc is not None:
            self.proc.stop()
        self.model_dir = model_dir
        self.restarts += 1
        return self.start(weight_version)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None


def run_weight_dirs(cfg: Config) -> list[str]:
    """Where the run writes weights an engine may load from disk: its output dir (restart exports)
    and the disk transport's directory (the controller resolves both to absolute paths)."""
    return [d for d in (cfg.trainer.output_dir, cfg.trainer.weight_sync.disk_dir) if d]


def _dtype(name: str) -> str:
    if name != "auto":
        return name
    return "bfloat16" if default_device().startswith("cuda") else "float32"
