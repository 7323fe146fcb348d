"""How a long-running asyncrl command stops on Ctrl-C (SIGINT) and on SIGTERM: both raise KeyboardInterrupt
in the main thread, so `finally` blocks and context managers (engines, Ray, output files) shut down, and
the signal is recorded for the exit status 128 + signum.

Installed explicitly because a process started in the background of a non-interactive shell inherits
SIGINT as ignored (Ctrl-C and `kill -INT` would do nothing), and SIGTERM's default action would end the
process without any shutdown. Used by `asyncrl train`, `eval`, `generate` and `sft`.
"""

from __future__ import annotations

import signal
import sys


def stop_on_signals() -> dict:
    """Install the handler; returns a dict that records which signal arrived (`signum`)."""
    got: dict = {}

    def handler(signum: int, frame: object) -> None:
        got["signum"] = signum
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
    return got


def interrupted(prog: str, got: dict, detail: str) -> int:
    """Say on stderr that `prog` was interrupted and what of its work is kept; the exit status 128 + signum."""
    signum = got.get("signum", signal.SIGINT)
    print(f"{prog}: interrupted ({signal.Signals(signum).name}): {detail}", file=sys.stderr, flush=True)
    return 128 + signum
