"""How a long-running asyncrl command stops on Ctrl-C (SIGINT) and on SIGTERM: both raise KeyboardInterrupt
in the main thread, so `finally` blocks and context managers (engines, Ray, output files) shut down, and
the signal is recorded for the exit status 128 + signum.

Installed explicitly because a process started in the background of a non-interactive shell inherits
SIGINT as ignored (Ctrl-C and `kill -INT` would do nothing), and SIGTERM's default action would end the
process without any shutdown. Used by `asyncrl train`, `eval`, `generate` and `sft`.

Python runs a signal handler between bytecodes of the main thread, and that may be inside a finalizer
(a weakref callback, a `__del__`) whose exceptions the interpreter prints and drops ("Exception ignored
in ..."): the KeyboardInterrupt is then lost and the command would run on to its end. So the signal is
also kept as pending, and long loops call `raise_if_stopping()` at their progress points (a finished
row), which raises it again there.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_pending: list[int] = []  # signals received while a handler is installed (see the module docstring)


def stop_on_signals(got: dict | None = None) -> dict:
    """Install the handler for the rest of the process; returns a dict that records which signal arrived
    (`signum`) and the handlers it replaced (`previous`). Given the dict of an earlier call, installs the
    handler again into it: for after a library replaced it (`ray.init` sets SIGTERM to `sys.exit`, which
    would end the run as a crash, with no checkpoint and no summary)."""
    if got is None:
        got = {"previous": {sig: signal.getsignal(sig) for sig in SIGNALS}}

    def handler(signum: int, frame: object) -> None:
        got["signum"] = signum
        _pending.append(signum)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for sig in SIGNALS:
        signal.signal(sig, handler)
    return got


@contextmanager
def stopping_on_signals() -> Iterator[dict]:
    """`stop_on_signals` for the duration of a command run in-process (the CLI, or a test calling its
    main): the handlers it replaced are put back afterwards."""
    got = stop_on_signals()
    try:
        yield got
    finally:
        for sig, previous in got["previous"].items():
            signal.signal(sig, previous)
        _pending.clear()


def raise_if_stopping() -> None:
    """Raise KeyboardInterrupt if a stop signal arrived whose own raise may have been lost in a finalizer."""
    if _pending:
        raise KeyboardInterrupt(signal.Signals(_pending[-1]).name)


def interrupted(prog: str, got: dict, detail: str) -> int:
    """Say on stderr that `prog` was interrupted and what of its work is kept; the exit status 128 + signum."""
    signum = got.get("signum", signal.SIGINT)
    print(f"{prog}: interrupted ({signal.Signals(signum).name}): {detail}", file=sys.stderr, flush=True)
    return 128 + signum
