"""The liveness probe against SGLang 0.5.23's real HTTP app (its own /health handler, its auth, its
/server_info), with the recorder backend acting as a busy, a paused and a hung scheduler
(conftest.RecordingTokenizerManager). Each scenario also runs the embedded engine's probe on the
same server, to show what the per-kind probe fixes: a one-token /generate waits for a running slot
behind a busy SGLang's queue, and for the end of a pause.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from asyncrl.engine.launcher import EngineProcess
from asyncrl.run.engine_watch import EngineWatch, paused, probe
from asyncrl.util.auth import auth_headers
from tests.sglang.conftest import SGLangApp, skip_without_sglang
from tests.sglang.weight_recorder import WeightRecorder

pytestmark = [pytest.mark.sglang, skip_without_sglang, pytest.mark.timeout(120)]

PROBE_S = 3.0  # > SGLANG_HEALTH_CHECK_TIMEOUT (2 s, conftest)


def watch(app: SGLangApp) -> EngineWatch:
    return EngineWatch(EngineProcess(app.url, None), probe_timeout_s=PROBE_S, max_failures=1, kind="sglang")


def control(app: SGLangApp, path: str, body: dict) -> None:
    r = httpx.post(app.url + path, json=body, headers=auth_headers(), timeout=30)
    assert r.status_code == 200, r.text


def test_a_busy_engine_passes_its_probe(sglang_config):
    """Every running slot taken and a request queued: SGLang answers /health after its next step."""
    tm = WeightRecorder(sglang_config, None, max_running=1, step_s=0.01)
    with SGLangApp(tm) as app:
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**6}}
        clients = [threading.Thread(target=httpx.post, args=(app.url + "/generate",),
                                    kwargs={"json": body, "timeout": 120}) for _ in range(2)]
        for c in clients:
            c.start()
        try:
            while tm.tokens_out < 5 or len(tm.live) < 2:
                threading.Event().wait(0.01)
            w = watch(app)
            assert w.check() and w.failures == 0
            assert probe(app.url, PROBE_S) is not None  # a /generate probe waits behind the queue
        finally:
            control(app, "/abort_request", {"abort_all": True})
            for c in clients:
                c.join(timeout=30)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_paused_engine_is_not_counted_as_failing(sglang_config, mode):
    """Paused, SGLang holds its own health check at the pause gate (503 after its timeout), while its
    scheduler still answers control requests: not a failure."""
    tm = WeightRecorder(sglang_config, None)
    with SGLangApp(tm) as app:
        control(app, "/pause_generation", {"mode": mode})
        try:
            w = watch(app)
            assert w.check() and w.check() and w.failures == 0  # max_failures=1: one counted failure kills
            assert probe(app.url, PROBE_S) is not None and not paused(app.url)  # what the old probe saw
        finally:
            control(app, "/continue_generation", {})
        assert w.check() and w.failures == 0


def test_a_hung_scheduler_fails_the_probe(sglang_config):
    tm = WeightRecorder(sglang_config, None)
    with SGLangApp(tm) as app:
        w = watch(app)
        assert w.check()
        tm.stuck = True
        try:
            assert not w.check() and w.failures == 1
        finally:
            tm.stuck = False
