"""EngineActor: owns one inference server process (embedded or SGLang) on the node Ray placed it on.

The server keeps a fixed port across restarts, so clients need no new address after a crash.
The weight version is the server's own state (what weights it holds, reported in /model_info): the
actor keeps no copy of it; whoever (re)starts the server says which version the weights it loads are.
Liveness (`alive`) is asyncrl/run/engine_watch.py's EngineWatch, per engine kind.
"""

from __future__ import annotations

import logging
from typing import Optional

import ray

from asyncrl.config import Config
from asyncrl.engine.launcher import EngineProcess, launch_configured
from asyncrl.run.engine_watch import EngineWatch
from asyncrl.run_dir import RunLayout
from asyncrl.util.memory import peak_gb
from asyncrl.util.net import advertised, free_port

log = logging.getLogger(__name__)


@ray.remote
class EngineActor:
    def __init__(self, cfg: Config, model_dir: str, index: int, threads: Optional[int] = None):
        self.cfg, self.model_dir, self.index, self.threads = cfg, model_dir, index, threads
        self.port = free_port(cfg.engine.host)
        self.proc: Optional[EngineProcess] = None
        self.watch: Optional[EngineWatch] = None
        self.restarts = 0

    def start(self, weight_version: int = 0) -> str:
        """Launch the server on `model_dir`, whose weights are policy version `weight_version`; returns the URL
        the run's other processes reach it at (a wildcard host: this node's IP)."""
        logs = str(RunLayout(self.cfg.trainer.output_dir).engines)  # kept with the run, one dir per launch
        self.proc = launch_configured(self.cfg, self.model_dir, port=self.port, threads=self.threads,
                                      weight_version=weight_version, log_dir=logs)
        e = self.cfg.engine
        self.watch = EngineWatch(self.proc, e.probe_timeout_s, e.probe_failures, e.type)
        return self.url()

    def url(self) -> Optional[str]:
        if self.proc is None:
            return None
        return advertised(self.proc.url, ray.util.get_node_ip_address())

    def alive(self) -> bool:
        """Running and passing its kind's probe; a hung engine is killed here (see EngineWatch)."""
        return self.watch is not None and self.watch.check()

    def pid(self) -> int:
        return self.proc.pid

    def peak_gb(self) -> float:
        """The engine server's peak resident memory since it started (0.0: attached, or gone)."""
        pid = self.proc.pid if self.proc is not None else None
        return peak_gb(pid) if pid is not None else 0.0

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

