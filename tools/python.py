"""tool `python`: run a code snippet in a sandboxed subprocess.

Each trajectory (instance_id) gets its own temporary working directory (created by `create`,
removed by `release`); files written there persist between the calls of one episode. A call runs
`python -I -B` in that directory with:
  - resource limits set in the child before exec: RLIMIT_CPU (`cpu_seconds`), RLIMIT_AS
    (`memory_mb`), RLIMIT_FSIZE (`max_file_mb`), RLIMIT_NOFILE (64), no core dumps;
  - a wall-clock limit (`timeout_s`): the whole process group is killed;
  - no network: the child runs in a fresh network namespace (`unshare -n`) when that works here,
    and in any case an audit hook refuses socket creation/connection;
  - file writes only inside the working directory: the audit hook refuses opening a path for
    writing, and remove/rename/mkdir/chmod, outside it (TMPDIR points inside it);
  - output capped at `max_output_bytes` per stream (the child is killed past it).
The reply is stdout, then stderr and the exit status if the run failed or was killed.
Audit hooks stop honest mistakes and casual escapes of model-written code, not a determined
attacker with ctypes; run untrusted workloads in a container as well.
"""

from __future__ import annotations

import asyncio
import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Any

from asyncrl.registry import register
from asyncrl.tooling.base import Tool

# Runs inside the child: installs the audit hook, then executes the snippet from main.py.
_BOOTSTRAP = r'''
import os, sys
_root = os.path.realpath(os.getcwd())
_src = open("main.py").read()
_W = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_real = os.path.realpath
def _inside(p):
    if isinstance(p, int):
        return True
    try:
        p = os.fsdecode(p)
    except Exception:
        return False
    r = _real(os.path.join(_root, p))
    return r == _root or r.startswith(_root + os.sep)
_MUT = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.chmod", "os.chown", "os.link",
        "os.symlink", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "os.unlink"}
def _hook(event, args):
    if event.startswith("socket.") and event not in ("socket.gethostname",):
        raise PermissionError("network access is disabled in this sandbox")
    if event == "open":
        path, mode, flags = args
        writing = (mode is not None and any(c in str(mode) for c in "wax+")) or (mode is None and flags & _W)
        if writing and not _inside(path):
            raise PermissionError(f"writing outside the working directory is not allowed: {path}")
    elif event in _MUT:
        for p in args[:2]:
            if isinstance(p, (str, bytes, os.PathLike)) and not _inside(p):
                raise PermissionError(f"{event} outside the working directory is not allowed: {p}")
    elif event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty"):
        raise PermissionError(f"{event} is not allowed in this sandbox")
sys.addaudithook(_hook)
del _hook
_g = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
exec(compile(_src, "main.py", "exec"), _g)
'''


@functools.lru_cache(maxsize=1)
def netns_available() -> bool:
    """Whether `unshare -n` can create a network namespace here (root or user namespaces)."""
    exe = shutil.which("unshare")
    if exe is None:
        return False
    for args in ([exe, "-n", "true"], [exe, "-rn", "true"]):
        try:
            if subprocess.run(args, capture_output=True, timeout=10).returncode == 0:
                return True
        except (OSError, subprocess.TimeoutExpired):
            continue
    return False


@functools.lru_cache(maxsize=1)
def _unshare_args() -> list[str]:
    exe = shutil.which("unshare") or "unshare"
    ok = subprocess.run([exe, "-n", "true"], capture_output=True, timeout=10).returncode == 0
    return [exe, "-n"] if ok else [exe, "-rn"]


def _limits(cpu_s: int, mem_bytes: int, fsize_bytes: int) -> None:  # runs in the child, before exec
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_bytes, fsize_bytes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


_SIGNALS = {signal.SIGXCPU: "CPU time limit exceeded", signal.SIGKILL: "killed", signal.SIGXFSZ: "file size limit exceeded",
            signal.SIGSEGV: "segmentation fault (possibly out of memory)"}


@register("tool", "python")
class PythonTool(Tool):
    name = "python"
    description = "Run a Python 3 program and return what it prints (no network; files stay in a scratch directory)."
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the Python program; print the results you need"}},
        "required": ["code"],
    }
    defaults = {"timeout_s": 10.0, "cpu_seconds": 5, "memory_mb": 512, "max_file_mb": 16,
                "max_output_bytes": 8192, "network_namespace": True}

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        super().__init__(config, tool_schema)
        unknown = set(self.config) - set(self.defaults)
        if unknown:
            raise ValueError(f"python tool config: unknown keys {sorted(unknown)}; valid: {sorted(self.defaults)}")
        self.opts = {**self.defaults, **self.config}
        self._dirs: dict[str, str] = {}

    async def create(self, instance_id: str, **create_kwargs: Any) -> str:
        if instance_id not in self._dirs:
            self._dirs[instance_id] = tempfile.mkdtemp(prefix="asyncrl-py-")
        return instance_id

    async def release(self, instance_id: str) -> None:
        d = self._dirs.pop(instance_id, None)
        if d:
            shutil.rmtree(d, ignore_errors=True)

    def workdir(self, instance_id: str) -> str:
        return self._dirs[instance_id]

    async def execute(self, instance_id: str, params: dict[str, Any]) -> tuple[str, float, dict[str, Any]]:
        if instance_id not in self._dirs:
            await self.create(instance_id)
        wd, o = self._dirs[instance_id], self.opts
        with open(os.path.join(wd, "main.py"), "w") as f:
            f.write(params["code"])
        cmd = [sys.executable, "-I", "-B", "-c", _BOOTSTRAP]
        if o["network_namespace"] and netns_available():
            cmd = _unshare_args() + cmd
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TMPDIR": wd, "HOME": wd, "LANG": "C.UTF-8",
               "PYTHONIOENCODING": "utf-8", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        preexec = functools.partial(_limits, int(o["cpu_seconds"]), int(o["memory_mb"]) << 20, int(o["max_file_mb"]) << 20)
        proc = await asyncio.create_subprocess_exec(
            *cmd, cwd=wd, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, preexec_fn=preexec, start_new_session=True)
        cap = int(o["max_output_bytes"])
        overflow = asyncio.Event()

        async def read(stream: asyncio.StreamReader) -> bytes:
            buf = bytearray()
            while chunk := await stream.read(4096):
                if len(buf) < cap:
                    buf += chunk[: cap - len(buf)]
                else:
                    overflow.set()
            return bytes(buf)

        timed_out = False
        readers = asyncio.gather(read(proc.stdout), read(proc.stderr))
        waiter = asyncio.ensure_future(overflow.wait())
        try:
            done, _ = await asyncio.wait({readers, waiter}, timeout=float(o["timeout_s"]),
                                         return_when=asyncio.FIRST_COMPLETED)
            if readers not in done:
                timed_out = not overflow.is_set()
                _kill_group(proc.pid)
            out, err = await readers
            rc = await proc.wait()
        except asyncio.CancelledError:  # the caller's timeout: never leave the child running
            _kill_group(proc.pid)
            raise
        finally:
            waiter.cancel()
        metrics = {"exit_code": float(rc), "timed_out": float(timed_out), "output_capped": float(overflow.is_set())}
        return _format(out, err, rc, timed_out, overflow.is_set(), o), 0.0, metrics


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _format(out: bytes, err: bytes, rc: int, timed_out: bool, capped: bool, o: dict[str, Any]) -> str:
    text = out.decode("utf-8", "replace")
    problems = []
    if timed_out:
        problems.append(f"killed: wall-clock limit of {o['timeout_s']} s exceeded")
    elif capped:
        problems.append(f"killed: output exceeded {o['max_output_bytes']} bytes")
    elif rc < 0:
        sig = signal.Signals(-rc)
        problems.append(f"killed by {sig.name}: {_SIGNALS.get(sig, 'signal')}")
    elif rc != 0:
        problems.append(f"exit code {rc}")
    # drop the sandbox bootstrap's own frames (File "<string>") from tracebacks: the model did not write them
    e = "\n".join(ln for ln in err.decode("utf-8", "replace").splitlines()
                  if not ln.startswith('  File "<string>"')).strip()
    if problems or rc != 0:
        parts = [text.rstrip()] if text.strip() else []
        if e:
            parts.append(e)
        parts.append("[" + "; ".join(problems) + "]")
        return "\n".join(parts)
    if e:
        return (text.rstrip() + "\n" + e).strip()
    return text if text.strip() else "(no output)"
