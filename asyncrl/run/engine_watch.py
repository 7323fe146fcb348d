"""Liveness of a launched engine, per engine kind (used by EngineActor.alive, asyncrl/run/engine_actor.py).

The process must run AND pass its kind's probe:
- embedded: a real one-token POST /generate (greedy, max_new_tokens=1) within engine.probe_timeout_s.
  It admits a one-token request ahead of its queue (no running slot needed), so a busy engine
  answers at its next step boundary. A failed probe is not counted while GET /stats says `paused`.
- sglang: GET /health, SGLang's own check (http_server.py health_generate): a busy scheduler answers
  it after its next batch, an idle one generates one token; it answers 503 once
  SGLANG_HEALTH_CHECK_TIMEOUT (set to engine.probe_timeout_s at launch) passes with no word from the
  scheduler. A /generate probe would wait for a running slot behind the queue and kill a busy engine.
  While paused SGLang holds every generation, its health check included, at the tokenizer's pause
  gate (503 after the timeout, and its status UnHealthy until the next good check): a failed /health
  is not counted while the scheduler still answers a control request (GET /server_info reads its
  internal state), which a hung scheduler cannot.
The supervisor never probes during the controller's own syncs. After engine.probe_failures counted
failures in a row the engine is hung: its process group is SIGKILLed and `check` answers False, so
the supervisor's DOWN path relaunches it.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from typing import Optional

import httpx

from asyncrl.engine.launcher import EngineProcess
from asyncrl.util.auth import auth_headers

log = logging.getLogger(__name__)
PROBE_BODY = {"input_ids": [0], "sampling_params": {"temperature": 0, "max_new_tokens": 1}}


def probe(url: str, timeout_s: float) -> Optional[str]:
    """The embedded engine's probe: one real one-token generate; None if the engine answered it within
    `timeout_s`, else why not. With the run's token: an engine bound beyond loopback wants it on /generate too."""
    try:
        r = httpx.post(f"{url}/generate", json=PROBE_BODY, timeout=timeout_s, headers=auth_headers())
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"
    if r.status_code != 200:
        return f"HTTP {r.status_code}: {r.text[:200]}"
    return None


def probe_sglang(url: str, timeout_s: float) -> Optional[str]:
    """SGLang's probe: GET /health (SGLang answers it itself within SGLANG_HEALTH_CHECK_TIMEOUT; this
    waits HEALTH_SLACK_S longer for the answer). None if 200, else why not."""
    try:
        r = httpx.get(f"{url}/health", timeout=timeout_s + HEALTH_SLACK_S, headers=auth_headers())
    except httpx.HTTPError as e:
        return f"GET /health: {type(e).__name__}: {e}"
    return None if r.status_code == 200 else f"GET /health: HTTP {r.status_code}"


def paused(url: str, timeout_s: float = 5.0) -> bool:
    """The embedded engine answers that it is paused (for a weight sync): GET /stats `paused`."""
    try:
        r = httpx.get(f"{url}/stats", timeout=timeout_s, headers=auth_headers())
        return r.status_code == 200 and r.json().get("paused") is True
    except (httpx.HTTPError, ValueError, AttributeError):
        return False


def sglang_scheduler_answers(url: str, timeout_s: float = 5.0) -> bool:
    """SGLang's scheduler serves control requests (GET /server_info asks it for its internal state):
    true while it is paused, false when it is hung or gone."""
    try:
        return httpx.get(f"{url}/server_info", timeout=timeout_s, headers=auth_headers()).status_code == 200
    except httpx.HTTPError:
        return False


HEALTH_SLACK_S = 5.0  # beyond SGLANG_HEALTH_CHECK_TIMEOUT: SGLang's own answer (503) arrives first
PROBES: dict[str, Callable[[str, float], Optional[str]]] = {"embedded": probe, "sglang": probe_sglang}
HELD: dict[str, Callable[[str], bool]] = {"embedded": paused, "sglang": sglang_scheduler_answers}


class EngineWatch:
    """Liveness of one launched engine process (see the module docstring)."""

    def __init__(self, proc: EngineProcess, probe_timeout_s: float, max_failures: int, kind: str = "embedded"):
        if kind not in PROBES:
            raise ValueError(f"engine kind {kind!r} is not one of {sorted(PROBES)}")
        self.proc, self.probe_timeout_s, self.max_failures, self.kind = proc, probe_timeout_s, max_failures, kind
        self.failures = 0

    def check(self) -> bool:
        """True while the engine is up; False once its process is gone or it was found hung and killed."""
        if not self.proc.alive():
            return False
        why = PROBES[self.kind](self.proc.url, self.probe_timeout_s)
        if why is None:
            self.failures = 0
            return True
        if HELD[self.kind](self.proc.url):
            log.info("engine %s failed a probe while paused (%s): not counted", self.proc.url, why)
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
