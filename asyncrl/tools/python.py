"""tool `python`: run a Python program in the sandbox of `asyncrl.sandbox` and return what it prints.

Each trajectory (instance_id) gets its own episode directory (created by `create`, removed by
`release`); the files the program leaves in its working directory persist between the calls of one
episode. A call runs `python -I -B main.py` isolated (own user, mount, PID, network, IPC and UTS
namespaces; read-only view of the system; a capped scratch tmpfs as the only writable place;
uid 65534, no_new_privs, rlimits; every process of the call killed when it ends): see
`asyncrl/sandbox/__init__.py` for the boundary. Limits: `cpu_seconds` (RLIMIT_CPU), `memory_mb`
(RLIMIT_AS, per process), `memory_total_mb` (the resident memory of all of a call's processes together,
watched every 20 ms; the call is killed past it), `max_concurrent_calls` (calls of one tool object, i.e.
one rollout worker, at once: the worker's sandboxes hold at most that times `memory_total_mb`, plus what
one 20 ms poll lets through), `max_file_mb` (RLIMIT_FSIZE), `max_processes` (RLIMIT_NPROC), `scratch_mb` and
`scratch_inodes` (the tmpfs), `timeout_s` (wall clock), `max_output_bytes` (per stream; the run is
killed past it); `hide` lists more host paths to cover with an empty read-only tmpfs (e.g. a run's
output directory that lies outside /tmp, /home, /root), and `hide_cwd` (default true) covers the
process's working directory at construction (where `outputs/` lies) unless it is / or a system tree.
`network_namespace` is kept for old configs: only true is accepted.

If isolation cannot be set up here, constructing the tool fails with what is missing, unless
`allow_unisolated: true` (off by default), which runs the program as a plain child process with the
same limits but RLIMIT_NPROC, and logs a warning: then nothing but rlimits stands between the program
and the host.
The reply is stdout, then stderr and the exit status if the run failed or was killed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
from typing import Any

from asyncrl.registry import register
from asyncrl.sandbox import runner
from asyncrl.tools.base import Tool, ToolError

log = logging.getLogger(__name__)

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
    defaults = {"timeout_s": 10.0, "cpu_seconds": 5, "memory_mb": 512, "memory_total_mb": 1024,
                "max_concurrent_calls": 4, "max_file_mb": 16,
                "max_output_bytes": 8192, "network_namespace": True, "allow_unisolated": False,
                "scratch_mb": 64, "scratch_inodes": 4096, "max_processes": 16, "hide": [], "hide_cwd": True}

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        super().__init__(config, tool_schema)
        unknown = set(self.config) - set(self.defaults)
        if unknown:
            raise ValueError(f"python tool config: unknown keys {sorted(unknown)}; valid: {sorted(self.defaults)}")
        self.opts = o = {**self.defaults, **self.config}
        if o["network_namespace"] is not True:
            raise ValueError(f"python tool config: network_namespace={o['network_namespace']!r}: the sandbox always "
                             "runs in its own empty network namespace; there is no way to turn that off")
        self.limits = runner.Limits(timeout_s=float(o["timeout_s"]), cpu_s=int(o["cpu_seconds"]),
                                    memory_mb=int(o["memory_mb"]), memory_total_mb=int(o["memory_total_mb"]),
                                    max_file_mb=int(o["max_file_mb"]),
                                    max_processes=int(o["max_processes"]), max_output_bytes=int(o["max_output_bytes"]),
                                    scratch_mb=int(o["scratch_mb"]), scratch_inodes=int(o["scratch_inodes"]),
                                    hide=list(o["hide"]) + _cwd_to_hide(o["hide_cwd"]))
        missing = runner.probe()
        self.isolated = missing is None
        if missing is not None:
            if not o["allow_unisolated"]:
                raise runner.SandboxUnavailable(
                    f"python tool: isolation cannot be set up here: {missing}. Fix that, or set "
                    "allow_unisolated: true in the tool's config to run model-written code unisolated")
            log.warning("python tool: isolation cannot be set up here (%s); running model-written code UNISOLATED "
                        "because allow_unisolated is true", missing)
        if not (isinstance(o["max_concurrent_calls"], int) and o["max_concurrent_calls"] > 0):
            raise ValueError(f"python tool config: max_concurrent_calls={o['max_concurrent_calls']!r}: must be an "
                             "integer > 0")
        self._calls = asyncio.Semaphore(o["max_concurrent_calls"])  # bounds the worker's sandboxes' memory
        self._dirs: dict[str, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}  # calls of one episode share its files: one at a time

    async def create(self, instance_id: str, **create_kwargs: Any) -> str:
        if instance_id not in self._dirs:
            self._dirs[instance_id] = runner.new_episode_dir()
            self._locks[instance_id] = asyncio.Lock()
        return instance_id

    async def release(self, instance_id: str) -> None:
        d = self._dirs.pop(instance_id, None)
        self._locks.pop(instance_id, None)
        if d:
            shutil.rmtree(d, ignore_errors=True)

    def workdir(self, instance_id: str) -> str:
        """The host directory holding the episode's files between calls."""
        return self._dirs[instance_id] + "/files"

    async def execute(self, instance_id: str, params: dict[str, Any]) -> tuple[str, float, dict[str, Any]]:
        if instance_id not in self._dirs:
            await self.create(instance_id)
        try:
            async with self._locks[instance_id], self._calls:
                r = await runner.run(self._dirs[instance_id], params["code"], self.limits, isolate=self.isolated)
        except runner.SandboxError as e:
            raise ToolError(f"the sandbox failed: {e}") from e
        timed_out, capped = r.killed == "timeout", r.killed == "output"
        metrics = {"exit_code": float(r.returncode), "timed_out": float(timed_out), "output_capped": float(capped),
                   "memory_killed": float(r.killed == "memory"), "isolated": float(self.isolated)}
        return _format(r.stdout, r.stderr, r.returncode, r.killed, self.opts), 0.0, metrics


def _cwd_to_hide(hide_cwd: bool) -> list[str]:
    """The rollout worker's cwd (where a run's outputs/ usually lie), unless hiding it would hide the system."""
    cwd = os.getcwd()
    return [cwd] if hide_cwd and runner.can_hide(cwd) else []


def _format(out: bytes, err: bytes, rc: int, killed: str | None, o: dict[str, Any]) -> str:
    text = out.decode("utf-8", "replace")
    problems = []
    if killed == "timeout":
        problems.append(f"killed: wall-clock limit of {o['timeout_s']} s exceeded")
    elif killed == "output":
        problems.append(f"killed: output exceeded {o['max_output_bytes']} bytes")
    elif killed == "memory":
        problems.append(f"killed: its processes together held over {o['memory_total_mb']} MB")
    elif rc < 0:
        sig = signal.Signals(-rc)
        problems.append(f"killed by {sig.name}: {_SIGNALS.get(sig, 'signal')}")
    elif rc != 0:
        problems.append(f"exit code {rc}")
    e = err.decode("utf-8", "replace").strip()
    if problems or rc != 0:
        parts = [text.rstrip()] if text.strip() else []
        if e:
            parts.append(e)
        parts.append("[" + "; ".join(problems) + "]")
        return "\n".join(parts)
    if e:
        return (text.rstrip() + "\n" + e).strip()
    return text if text.strip() else "(no output)"
