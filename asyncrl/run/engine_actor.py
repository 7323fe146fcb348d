"""EngineActor: owns one inference server process (embedded or SGLang) on the node Ray placed it on.

The server keeps a fixed port across restarts, so clients need no new address after a crash.
The weight version is the server's own state (what weights it holds, reported in /model_info): the
actor keeps no copy of it; whoever (re)starts the server says which version the weights it loads are.

Liveness (`alive`, `EngineWatch`): the process must run AND answer a real one-token POST /generate
(greedy, max_new_tokens=1) within engine.probe_timeout_s. The embedded engine admits a one-token
request ahead of its queue (it needs no running slot), so a busy engine answers at its next step
boundary. A failed probe does not count while the engine says it is paused for a weight sync
(GET /stats `paused`, the embedded engine's; the supervisor never probes during the controller's own
syncs anyway). After engine.probe_failures failed probes in a row the engine is hung: its process
group is SIGKILLed and `alive` answers False, so the supervisor's DOWN path relaunches it.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Optional

import httpx
import ray

from asyncrl.config import Config
from asyncrl.engine.launcher import EngineProcess, launch_configured
from asyncrl.run_dir import RunLayout
from asyncrl.util.auth import auth_headers
from asyncrl.util.memory import peak_gb
from asyncrl.util.net import free_port

log = logging.getLogger(__name__)
PROBE_BODY = {"input_ids": [0], "sampling_params": {"temperature": 0, "max_new_tokens": 1}}


def probe(url: str, timeout_s: float) -> Optional[str]:
    """One real one-token generate: None if the engine answered it within `timeout_s`, else why not.
    With the run's token: an engine bound beyond loopback wants it on /generate too."""
    try:
        r = httpx.post(f"{url}/generate", json=PROBE_BODY, timeout=timeout_s, headers=auth_headers())
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"
    if r.status_code != 200:
        return f"HTTP {r.status_code}: {r.text[:200]}"
    return None


def paused(url: str, timeout_s: float = 5.0) -> bool:
    """The engine answers that it is paused (for a weight sync). Only the embedded engine says so."""
    try:
        r = httpx.get(f"{url}/stats", timeout=timeout_s, headers=auth_headers())
        return r.status_code == 200 and r.json().get("paused") is True
    except (httpx.HTTPError, ValueError, AttributeError):
        return False


class EngineWatch:
    """Liveness of one launched engine process (see the module docstring)."""

    def __init__(self, proc: EngineProcess, probe_timeout_s: float, max_failures: int):
        self.proc, self.probe_timeout_s, self.max_failures = proc, probe_timeout_s, max_failures
        self.failures = 0

    def check(self) -> bool:
        """True while the engine is up; False once its process is gone or it was found hung and killed."""
        if not self.proc.alive():
            return False
        why = probe(self.proc.url, self.probe_timeout_s)
        if why is None:
            self.failures = 0
            return True
        if paused(self.proc.url):
            log.info("engine %s did not answer a probe while paused for a weight sync (%s): not counted",
                     self.proc.url, why)
            return True
        self.failures += 1
        if self.failures < self.max_failures:
            log.warning("engine %s failed liveness probe %d of %d: %s", self.proc.url, self.failures,
                        self.max_failures, why)
            return True
        log.error("engine %s (pid %s) failed %d liveness probes in a row (last: %s): hung, killing it",
                  self.proc.url, self.proc.pid, self.failures, why)
        self.kill()
        return False

    def kill(self) -> None:
        """SIGKILL the engine's process group (a stopped or hung process cannot ignore it) and reap it."""
        popen = self.proc.proc
        if popen is None or popen.poll() is not None:
            return
        try:
            os.killpg(popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        popen.wait(timeout=60)


@ray.remote
class EngineActor:
    def __init__(self, cfg: Config, model_dir: str, index: int, threads: Optional[int] = None):
        self.cfg, self.model_dir, self.index, self.threads = cfg, model_dir, index, threads
        self.port = free_port(cfg.engine.host)
        self.proc: Optional[EngineProcess] = None
        self.watch: Optional[EngineWatch] = None
        self.restarts = 0

    def start(self, weight_version: int = 0) -> str:
        """Launch the server on `model_dir`, whose weights are policy version `weight_version`."""
        logs = str(RunLayout(self.cfg.trainer.output_dir).engines)  # kept with the run, one dir per launch
        self.proc = launch_configured(self.cfg, self.model_dir, port=self.port, threads=self.threads,
                                      weight_version=weight_version, log_dir=logs)
        e = self.cfg.engine
        self.watch = EngineWatch(self.proc, e.probe_timeout_s, e.probe_failures)
        return self.proc.url

    def url(self) -> Optional[str]:
        return self.proc.url if self.proc is not None else None

    def alive(self) -> bool:
        """Running and answering a one-token generate; a hung engine is killed here (see EngineWatch)."""
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

