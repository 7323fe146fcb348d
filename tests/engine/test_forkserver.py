"""Embedded engines forked by the launching process's fork server (asyncrl/engine/forkserver.py), from a
process's second launch on: real engines on the tiny model, real signals. (A launcher SIGKILLed takes its engines down:
tests/engine/test_launcher.py::test_engine_exits_when_its_launcher_is_killed.)"""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest

from asyncrl.engine import forkserver
from asyncrl.engine.launcher import launch_embedded
from asyncrl.util.auth import ENV, auth_headers

pytestmark = pytest.mark.timeout(180)


def _generate(url: str) -> list[int]:
    r = httpx.post(url + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3,
                                                                                       "temperature": 0.0}},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_each_engine_is_forked_into_a_session_of_its_own_with_the_launchers_environment(engine_model_dir,
                                                                                         monkeypatch):
    """A relaunch: a child of this process's fork server, its own session (its pid is its process group, as
    the launcher's killpg expects), named asyncrl-engine as a first launch is, with the environment of this
    launch (not the one the server started with: here a token of its own, which its control routes then take,
    and this process's token they refuse); a signal that kills it reads as Popen reads it."""
    first = launch_embedded(engine_model_dir, threads=1, startup_timeout_s=120)  # this process's first or not
    try:
        own = "t" * 43
        monkeypatch.setenv(ENV, own)  # launch_embedded gives the engine this process's token: now this one
        second = launch_embedded(engine_model_dir, threads=1, startup_timeout_s=120)
        try:
            server = forkserver.fork_server()
            assert psutil.Process(second.pid).ppid() == server.pid
            for eng in (first, second):
                assert (os.getpgid(eng.pid), psutil.Process(eng.pid).name()) == (eng.pid, "asyncrl-engine")
            assert httpx.post(second.url + "/continue_generation", headers=auth_headers(own), timeout=30).status_code == 200
            assert httpx.post(first.url + "/continue_generation", headers=auth_headers(own), timeout=30).status_code == 401
            assert _generate(first.url) == _generate(second.url)  # the same weights, served by each
            os.kill(second.pid, signal.SIGKILL)
            assert second.proc.wait(timeout=30) == -signal.SIGKILL and second.proc.poll() == -signal.SIGKILL
            assert not second.alive() and first.alive()
        finally:
            second.stop()
    finally:
        first.stop()
    assert first.proc.returncode is not None


def test_engines_exit_with_their_fork_server_and_the_next_launch_starts_a_new_one(engine_model_dir, monkeypatch):
    """On a fork server of this test's own (put in place of the process's, which other tests' engines in this
    process depend on, and put back afterwards): SIGKILLed, its engine exits; the next launch starts another."""
    own = forkserver.ForkServer()
    monkeypatch.setattr(forkserver, "_server", own)
    eng = launch_embedded(engine_model_dir, threads=1, startup_timeout_s=120, fork=True)
    again = None
    try:
        assert psutil.Process(eng.pid).ppid() == own.pid
        os.kill(own.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while psutil.pid_exists(eng.pid) and psutil.Process(eng.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, f"engine {eng.pid} outlived its fork server by 30 s"
            time.sleep(0.2)
        assert not eng.alive() and eng.proc.poll() is not None
        again = launch_embedded(engine_model_dir, threads=1, startup_timeout_s=120, fork=True)
        replacement = forkserver.fork_server()
        assert replacement.pid != own.pid and psutil.Process(again.pid).ppid() == replacement.pid
        assert len(_generate(again.url)) == 3
    finally:
        eng.stop()
        if again is not None:
            again.stop()
        if forkserver._server is not own:
            forkserver._server.close()
