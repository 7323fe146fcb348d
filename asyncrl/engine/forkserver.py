"""Embedded engines forked from a process that has imported them once.

An engine server spends about 6 s of CPU importing torch, transformers (whose model registry scan alone is
a second) and fastapi before it loads its model; a process that launches engines again and again (a run's
engine actor restarting a crashed engine, a test session) pays that at every launch. From a process's
second launch on, `launch_embedded` (asyncrl/engine/launcher.py) therefore asks this module's fork server,
one per launching process, to fork each engine from a process that has done those imports once: such a
launch costs the model load and the fork (0.6 s of CPU on the tiny model instead of 6 s). The server holds
its imports for as long as the launching process lives (about 170 MB of memory of its own).

The contract, for the launcher:
- `ForkServer.spawn(argv, env, log_path)` forks a child that starts a session of its own (so its pid is its
  process group, as `subprocess.Popen(start_new_session=True)` gives), writes stdout and stderr to
  `log_path`, takes `env` as its whole environment, and runs `python -m asyncrl.engine.cli <argv>`'s main;
  the answer is a `ForkedProcess`, which has the part of `subprocess.Popen` the launcher uses (`pid`,
  `poll`, `wait`, `returncode`, the exit status as Popen reports it: negative for a signal).
- The fork server is this process's child and the engines are its children: it reaps them and reports
  each exit on its stdout. It takes requests only on its stdin, a pipe from the launching process (no
  socket: nothing else can ask it for anything). When that pipe closes (the launcher exited or was
  killed), it exits; each engine exits once the fork server is no longer its parent (`--exit-with-parent`,
  set to the fork server's pid), removing its scratch dir as it did when the launcher was its parent.
- The server never runs a torch operation or starts a thread before it forks (its OpenMP pool does not
  exist yet, so each child starts its own, with the `--threads` it is given).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import traceback
from typing import IO, Any, Optional

from asyncrl.engine import cli


class ForkedProcess:
    """An engine the fork server forked: what the launcher uses of `subprocess.Popen`."""

    def __init__(self, pid: int, server: ForkServer):
        self.pid = pid
        self._server = server

    @property
    def returncode(self) -> Optional[int]:
        return self._server.exit_status(self.pid)

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        code = self._server.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"engine pid {self.pid}", timeout or 0.0)
        return code


class ForkServer:
    """The launching process's side: starts the server, sends it requests, keeps the exits it reports."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "asyncrl.engine.forkserver"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, start_new_session=True)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._in: IO[bytes] = self._proc.stdin
        self._out: IO[bytes] = self._proc.stdout
        self._lock = threading.Lock()  # one request at a time, and its answer
        self._exits: dict[int, int] = {}
        self._changed = threading.Condition()
        self._answers: list[dict[str, Any]] = []
        ready = self._out.readline()
        if json.loads(ready or b"{}").get("ready") is not True:
            self._proc.kill()
            raise RuntimeError(f"the engine fork server (pid {self._proc.pid}) did not start: {ready!r}")
        threading.Thread(target=self._read, name="engine-forkserver-reader", daemon=True).start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def alive(self) -> bool:
        return self._proc.poll() is None

    def close(self, timeout_s: float = 30.0) -> None:
        """Close its pipe: the server exits (its engines then exit too, having lost their parent)."""
        self._in.close()
        self._proc.wait(timeout=timeout_s)

    def spawn(self, argv: list[str], env: dict[str, str], log_path: str) -> ForkedProcess:
        with self._lock:
            self._in.write(json.dumps({"argv": argv, "env": env, "log": log_path}).encode() + b"\n")
            self._in.flush()
            with self._changed:
                if not self._changed.wait_for(lambda: self._answers or not self.alive(), timeout=60):
                    raise RuntimeError(f"the engine fork server (pid {self.pid}) did not answer a launch in 60 s")
                if not self._answers:
                    raise RuntimeError(f"the engine fork server (pid {self.pid}) exited "
                                       f"({self._proc.returncode}) instead of forking")
                answer = self._answers.pop(0)
        if "error" in answer:
            raise RuntimeError(f"the engine fork server could not fork: {answer['error']}")
        return ForkedProcess(int(answer["pid"]), self)

    def exit_status(self, pid: int) -> Optional[int]:
        with self._changed:
            if pid in self._exits:
                return self._exits[pid]
            if not self.alive():  # the server is gone: so is every engine it forked (they exit with it)
                return self._exits.setdefault(pid, -signal.SIGKILL)
            return None

    def wait_exit(self, pid: int, timeout: Optional[float]) -> Optional[int]:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or not self.alive(), timeout=timeout)
        return self.exit_status(pid)

    def _read(self) -> None:
        for line in self._out:
            msg = json.loads(line)
            with self._changed:
                if "exit" in msg:
                    self._exits[int(msg["exit"])] = int(msg["code"])
                else:
                    self._answers.append(msg)
                self._changed.notify_all()
        self._proc.wait()
        with self._changed:
            self._changed.notify_all()


_server: Optional[ForkServer] = None
_server_lock = threading.Lock()


def fork_server() -> ForkServer:
    """This process's fork server, started (seconds: its imports) at the first call or after it died."""
    global _server
    with _server_lock:
        if _server is None or not _server.alive():
            _server = ForkServer()
        return _server


# ---------------------------------------------------------------------------------------------- the server side


def _child(argv: list[str], env: dict[str, str], log_path: str) -> None:
    """In the forked child: a session of its own, its log, its environment, the engine's main; never returns."""
    code = 1
    try:
        os.setsid()
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        os.environ.clear()
        os.environ.update(env)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        sys.argv = ["python -m asyncrl.engine.cli", *argv]
        code = cli.main(cli.standalone_parser().parse_args(argv))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _send(msg: dict[str, Any]) -> None:
    sys.stdout.buffer.write(json.dumps(msg).encode() + b"\n")
    sys.stdout.buffer.flush()


def serve() -> None:
    """The fork server's loop: fork on each request from stdin, report each child's exit on stdout."""
    # lazy: imports torch, transformers, fastapi, uvicorn (every engine's imports, done here once before any fork),
    # which the launching side of this module does not load
    import transformers.models.llama.modeling_llama  # noqa: F401

    # lazy: the engine server itself (the same reason)
    import asyncrl.engine.server  # noqa: F401

    children: set[int] = set()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *a: None)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _send({"ready": True, "pid": os.getpid()})
    stdin = sys.stdin.buffer
    pending = b""
    while True:
        readable, _, _ = select.select([stdin, wake_r], [], [], 1.0)
        if wake_r in readable:
            os.read(wake_r, 4096)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            _send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        if stdin in readable:
            chunk = os.read(stdin.fileno(), 1 << 20)
            if not chunk:  # the launcher is gone: each engine sees its parent go, removes its scratch dir, exits
                os._exit(0)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                req = json.loads(line)
                try:
                    pid = os.fork()
                except OSError as e:
                    _send({"error": repr(e)})
                    continue
                if pid == 0:
                    os.close(wake_r)
                    os.close(wake_w)
                    _child(req["argv"], req["env"], req["log"])
                children.add(pid)
                _send({"pid": pid})


if __name__ == "__main__":
    serve()
