"""`call_isolated(fn, *args)`: run one heavy call in a child process of its own, so that whatever it
allocates (a model, its optimizer state, activations) goes back to the machine when it returns.

Used where a long-running process would otherwise keep a peak it reached once: `asyncrl train`'s driver
runs the warm start's SFT this way (asyncrl/sft/warm_start.py), and holds no model for the rest of the run.
glibc's allocator and torch's CPU caching keep freed memory in the process; only the process's end returns it.

The contract, for the caller:
- the child is a fresh interpreter (multiprocessing's spawn), not a fork: torch's OpenMP pool is not
  fork-safe, and a fork of a process that has run one parallel torch op hangs in its first one. So `fn`
  must be importable by name and `args` picklable; the child has none of the caller's state beyond them
  and `sys.path` (no registered plugins, logging set-up or monkeypatches: `fn` sets up what it needs).
- `fn` returns: its value is returned. `fn` raises: the same exception is raised here (as a ChildFailed
  naming it when it cannot be pickled). KeyboardInterrupt in the child (Ctrl-C, or SIGTERM under
  `stop_on_signals`) is KeyboardInterrupt here.
- the caller is interrupted while it waits (KeyboardInterrupt: Ctrl-C, or SIGTERM sent to the caller
  alone, as schedulers do): the child gets SIGINT, `grace_s` to stop cleanly, then SIGKILL; then
  KeyboardInterrupt is raised here. The child never outlives the caller: it gets SIGKILL when the caller's
  thread that started it ends (PR_SET_PDEATHSIG), even if the caller is killed with SIGKILL.
- the child dies without answering (SIGKILL, the kernel's OOM killer, a segfault): ChildFailed naming
  its exit status or signal.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import pickle
import signal
from collections.abc import Callable
from typing import Any

PR_SET_PDEATHSIG = 1


class ChildFailed(RuntimeError):
    """The child ended without an answer, or raised an exception that cannot be sent back."""


def call_isolated(fn: Callable[..., Any], *args: Any, name: str = "child", grace_s: float = 60.0) -> Any:
    """`fn(*args)` in a child process of its own; its value, or its exception raised here (module docstring)."""
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_main, args=(send, os.getpid(), fn, args), name=name, daemon=False)
    proc.start()
    send.close()  # the child's end: EOF here when the child dies without answering
    try:
        try:
            outcome = _answer(receive)
        except KeyboardInterrupt:
            _stop(proc, grace_s)
            raise
        proc.join()
    finally:
        receive.close()
    if outcome is None:
        raise ChildFailed(f"the {name} process (pid {proc.pid}) ended {_how(proc.exitcode)} before it answered")
    kind, value = outcome
    if kind == "ok":
        return value
    if kind == "interrupted":
        raise KeyboardInterrupt(f"the {name} process was interrupted")
    raise value


def _answer(receive: Any) -> tuple[str, Any] | None:
    try:
        payload = receive.recv_bytes()
    except EOFError:
        return None
    try:
        return pickle.loads(payload)
    except Exception as e:  # an exception class that cannot be rebuilt from its args
        return "raised", ChildFailed(f"the child's answer cannot be read back: {e!r}")


def _stop(proc: Any, grace_s: float) -> None:
    """The caller was interrupted: SIGINT to the child, then SIGKILL after `grace_s`; waits for its end
    (a second interrupt here kills it at once)."""
    try:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGINT)
            proc.join(grace_s)
    except KeyboardInterrupt:
        pass
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()


def _how(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        sig = signal.Signals(-exitcode).name
        return f"by {sig}" + (" (SIGKILL: out of memory, or killed)" if sig == "SIGKILL" else "")
    return f"with exit status {exitcode}"


def _child_main(send: Any, parent: int, fn: Callable[..., Any], args: tuple) -> None:
    _die_with(parent)
    try:
        outcome: tuple[str, Any] = ("ok", fn(*args))
    except KeyboardInterrupt:
        outcome = ("interrupted", None)
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller, which raises it
        outcome = ("raised", e)
    try:
        payload = pickle.dumps(outcome)
    except Exception as e:  # noqa: BLE001
        payload = pickle.dumps(("raised", ChildFailed(f"the answer of {fn.__name__} cannot be sent back "
                                                      f"({e!r}): {outcome[1]!r}"[:2000])))
    send.send_bytes(payload)
    send.close()


def _die_with(parent: int) -> None:
    """SIGKILL when the parent's starting thread ends; the parent may already be gone (then exit now)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:  # not Linux's libc: the caller's interrupt handling still stops the child
        pass
    if os.getppid() != parent:
        os._exit(1)
