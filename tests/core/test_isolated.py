"""`call_isolated` (asyncrl/util/isolated.py) on real child processes: the answer and the exception come back,
a child that dies says how, and a caller stopped by SIGTERM or killed outright leaves no child behind.

The callers that get signals are `python -c` subprocesses (signals to the test's own process would hit
pytest); the functions their children run are this module's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from asyncrl.util.isolated import ChildFailed, call_isolated

ROOT = Path(__file__).parents[2]


def double(x: int) -> tuple[int, int]:
    return 2 * x, os.getpid()


def refuse(message: str) -> None:
    raise ValueError(message)


class Unpicklable(Exception):
    def __init__(self, a: str, b: str):  # rebuilt from args (a,): fails on the way back
        super().__init__(a)


def refuse_oddly() -> None:
    raise Unpicklable("first", "second")


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def wait_forever(marks: str, ignore_sigint: bool = False) -> None:
    """Write this process's pid to `marks`/pid and sleep; on KeyboardInterrupt write `marks`/stopped."""
    if ignore_sigint:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    d = Path(marks)
    (d / "pid.tmp").write_text(str(os.getpid()))
    (d / "pid.tmp").replace(d / "pid")
    try:
        while True:
            time.sleep(0.05)
    finally:
        (d / "stopped").write_text("cleanly")


def test_the_value_and_the_exception_come_back_from_another_process():
    value, pid = call_isolated(double, 21, name="doubler")
    assert value == 42 and pid != os.getpid()
    with pytest.raises(ValueError, match="no such thing"):
        call_isolated(refuse, "no such thing")
    with pytest.raises(ChildFailed, match="cannot be read back"):
        call_isolated(refuse_oddly)


def test_a_child_that_dies_without_answering_is_named_with_its_signal():
    with pytest.raises(ChildFailed, match=r"the sft process \(pid \d+\) ended by SIGKILL \(SIGKILL: out of memory"):
        call_isolated(die, name="sft")


def _caller(marks: Path, grace_s: float = 60.0, ignore_sigint: bool = False) -> subprocess.Popen:
    code = (
        "import sys\n"
        "from asyncrl.util.stop_signals import stop_on_signals\n"
        "from asyncrl.util.isolated import call_isolated\n"
        "from tests.core.test_isolated import wait_forever\n"
        "stop_on_signals()\n"
        "try:\n"
        f"    call_isolated(wait_forever, {str(marks)!r}, {ignore_sigint}, grace_s={grace_s})\n"
        "except KeyboardInterrupt:\n"
        "    print('caller interrupted', flush=True)\n"
        "    sys.exit(3)\n"
    )
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def _child_pid(marks: Path, caller: subprocess.Popen) -> int:
    while not (marks / "pid").exists():
        assert caller.poll() is None, "the caller ended before its child started"
        time.sleep(0.05)
    return int((marks / "pid").read_text())


def _gone(pid: int, within_s: float = 30.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("ignore_sigint", [False, True], ids=["child stops", "child ignores SIGINT"])
def test_sigterm_to_the_caller_alone_stops_the_child_then_the_caller(tmp_path, ignore_sigint):
    """What slurm or systemd do: SIGTERM to the main process only. The child is stopped (SIGINT, then
    SIGKILL once the grace is over) before the caller's interrupt goes on."""
    caller = _caller(tmp_path, grace_s=1.0, ignore_sigint=ignore_sigint)
    try:
        child = _child_pid(tmp_path, caller)
        caller.send_signal(signal.SIGTERM)
        out, _ = caller.communicate(timeout=60)
        assert caller.returncode == 3 and "caller interrupted" in out
        assert _gone(child, within_s=1.0), "the caller returned while its child still ran"
        assert (tmp_path / "stopped").exists() != ignore_sigint  # stopped cleanly, or killed
    finally:
        caller.kill()
        _kill_child(tmp_path)


def test_a_caller_killed_outright_takes_its_child_with_it(tmp_path):
    caller = _caller(tmp_path)
    try:
        child = _child_pid(tmp_path, caller)
        caller.kill()
        caller.wait(timeout=30)
        assert _gone(child), f"the child {child} outlived its killed caller"
    finally:
        caller.kill()
        _kill_child(tmp_path)


def _kill_child(marks: Path) -> None:
    """A failed test leaves no child of its caller running."""
    try:
        os.kill(int((marks / "pid").read_text()), signal.SIGKILL)
    except (OSError, ValueError):
        pass
