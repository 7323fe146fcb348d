"""`asyncrl train` stops cleanly on Ctrl-C (SIGINT) and on SIGTERM: both go through one handler
(asyncrl/util/stop_signals.py), which raises KeyboardInterrupt and records the signal (exit status 128 + signum).

The whole stop on SIGINT (checkpoint, every child stopped, exit 128 + SIGINT, in a run started with
SIGINT ignored) is proven on a real run by tests/e2e/test_train.py; this proves, in a real process,
that SIGTERM (whose default action would end the controller without any shutdown) takes the same path,
with the signal recorded for the exit status."""

from __future__ import annotations

import signal
import subprocess
import sys

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


def test_sigterm_interrupts_like_ctrl_c_and_is_recorded():
    sig = signal.SIGTERM
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
