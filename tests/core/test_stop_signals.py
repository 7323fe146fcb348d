"""`asyncrl train` stops cleanly on Ctrl-C (SIGINT) and on SIGTERM: both go through one handler
(asyncrl/util/stop_signals.py), which raises KeyboardInterrupt and records the signal (exit status 128 + signum).

The whole stop on SIGTERM (checkpoint, summary, every child stopped, exit 128 + SIGTERM) is proven on a
real run by tests/e2e/test_train.py; this proves, in a real process started with SIGINT ignored (as a
background job of a script inherits it), that SIGINT and SIGTERM (whose default actions would do nothing
and end the controller without any shutdown) both take that one path, with the signal recorded for the
exit status."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from asyncrl.util.stop_signals import raise_if_stopping, stopping_on_signals

CHILD = """
import signal
from asyncrl.util.stop_signals import stop_on_signals
got = stop_on_signals()
try:
    print("ready", flush=True)
    signal.pause()
except KeyboardInterrupt as e:
    print(f"interrupted by {got['signum']}: {e}", flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_sigint_and_sigterm_interrupt_even_when_sigint_started_ignored(sig):
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        ready = proc.stdout.readline()
        assert ready == "ready\n", ready + proc.stdout.read()
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (proc.returncode, out) == (0, f"interrupted by {int(sig)}: {sig.name}\n")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped interrupt, on purpose
def test_a_signal_whose_interrupt_a_finalizer_swallowed_still_stops_the_command():
    """The handler's KeyboardInterrupt can land inside a finalizer, which drops it ("Exception ignored in"):
    the command's next progress point raises it again, and nothing is left pending afterwards."""
    import gc

    class RaisesInItsFinalizer:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # bytecodes after the kill: the handler runs here, inside __del__
                pass

    with stopping_on_signals() as got:
        obj = RaisesInItsFinalizer()
        del obj  # the handler's KeyboardInterrupt is raised and dropped inside __del__
        gc.collect()
        assert got.get("signum") == signal.SIGINT
        with pytest.raises(KeyboardInterrupt, match="SIGINT"):
            raise_if_stopping()
    raise_if_stopping()  # the pending signal does not outlive the command
