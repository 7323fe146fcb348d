"""Start (or attach to) engine servers and wait until they answer /health (attach: /model_info).

`launch_configured(cfg, ...)` starts the engine a run's config describes (`cfg.engine`: embedded or
SGLang); it is the one place an engine is configured from the run's config (the EngineActor of
`asyncrl train`, `asyncrl eval` and `asyncrl generate`). The engine's settings have one owner,
`asyncrl.config.EngineConfig`: the launchers take one whole (`engine`, plus keyword overrides of its
fields for tests and benchmarks) and pass it on, never a default of their own.
`launch_embedded(model_dir, engine)` spawns `python -m asyncrl.engine.cli serve ...` with the settings as
flags (`cli.settings_argv`; the server and its scheduler get them back as one EngineConfig); from a
process's second launch on, its fork server (asyncrl/engine/forkserver.py) forks that main instead, from
a process that imported the engine once (`_relaunching`). With port 0 the server picks a free port and
writes it to a port file that the launcher reads. `launch_sglang(model_dir, engine)` spawns `python -m sglang.launch_server ...` on a
given (or free) port. Both return an `EngineProcess` with `.url`, `.pid`, `.alive()`, `.stop()`
(SIGTERM, then SIGKILL after a grace period; the port is free once it returns). `attach(urls)` wraps
running servers (stop is a no-op).

The token (asyncrl/util/auth.py): both launchers give the server this process's run token
(`ensure_token`: the environment's, else a fresh one put into os.environ, so this process's senders
and clients hold it too), never in argv. The embedded engine reads ASYNCRL_ENGINE_TOKEN from the
environment it inherits; SGLang 0.5.23 reads keys only from its arguments (--api-key,
--admin-api-key; no environment variable), so it gets them in a YAML file named by `--config`
(SGLang's ConfigArgumentMerger reads it into its argument list in memory), mode 0600 in a 0700
directory, deleted as soon as the server is up or has failed.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

import httpx

from asyncrl.config import Config, EngineConfig
from asyncrl.engine.cli import settings_argv
from asyncrl.engine.forkserver import ForkedProcess, fork_server
from asyncrl.models import precision
from asyncrl.util.auth import ENV, auth_headers, ensure_token
from asyncrl.util.net import free_port, is_loopback


class EngineLaunchError(RuntimeError):
    """The engine process exited or did not become healthy; the message carries its log tail."""


class EngineProcess:
    """A launched (or attached: `proc` None) server. `scratch`: a temporary directory of the launch (its
    port file and log when no log_dir was given), removed once the process has exited on `stop`."""

    def __init__(self, url: str, proc: subprocess.Popen | ForkedProcess | None, log_path: str | None = None,
                 scratch: Path | None = None):
        self.url = url
        self.proc = proc
        self.log_path = log_path
        self.scratch = scratch

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        if self.proc is None:
            return answers(self.url, timeout=2.0)
        return self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])

    def stop(self, grace_s: float = 10.0) -> None:
        """Terminate the process group, kill it after `grace_s`; returns when it has exited."""
        try:
            self._end(grace_s)
        finally:
            if self.scratch is not None and (self.proc is None or self.proc.poll() is not None):
                shutil.rmtree(self.scratch, ignore_errors=True)
                self.scratch = None

    def _end(self, grace_s: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EngineProcess(url={self.url!r}, pid={self.pid})"


def _healthy(url: str, timeout: float = 5.0) -> bool:
    """Ready to serve (startup only): SGLang's /health generates one token, so it is 503 until the
    server is up, and also while it is paused (after 20 s): never a liveness probe."""
    try:
        return httpx.get(f"{url}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def answers(url: str, timeout: float = 5.0) -> bool:
    """Alive: GET /model_info answers 200, paused or not (it touches no scheduler). With the token:
    an engine bound beyond loopback wants it on every route but /health."""
    try:
        return httpx.get(f"{url}/model_info", timeout=timeout, headers=auth_headers()).status_code == 200
    except httpx.HTTPError:
        return False


def sglang_dtype(name: str) -> str:
    """engine.dtype -> SGLang's --dtype: the engine's dtype on a GPU (SGLang runs only there) by the precision
    rule (asyncrl.models.precision; auto: bf16), always explicit: SGLang's own `auto` would serve an fp32
    checkpoint in fp16."""
    try:
        return precision("engine", name, "cuda", native_bf16=False).weights  # the CPU probe: unused on cuda
    except ValueError as e:
        raise EngineLaunchError(str(e)) from None


def _die_with_parent() -> None:  # runs in the child between fork and exec (Linux only)
    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _spawn(cmd: list[str], log_path: str, extra_env: dict | None = None, die_with_parent: bool = False) -> subprocess.Popen:
    """Start a server in its own session. `die_with_parent` (for servers we cannot give a watchdog,
    i.e. SGLang) asks Linux to SIGTERM it when the spawning thread dies."""
    env = dict(os.environ)
    env.update(extra_env or {})
    preexec = _die_with_parent if die_with_parent and sys.platform.startswith("linux") else None
    with open(log_path, "ab") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=preexec)


def _wait(proc: subprocess.Popen | ForkedProcess, url_of: Any, timeout_s: float, what: str, log_path: str) -> str:
    """Poll until `url_of()` gives a URL that answers /health; fail if the process exits first."""
    deadline = time.monotonic() + timeout_s
    ep = EngineProcess("", proc, log_path)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EngineLaunchError(f"{what} exited with code {proc.returncode} before it was healthy; "
                                    f"log {log_path}:\n{ep.log_tail()}")
        url = url_of()
        if url and _healthy(url, timeout=5.0):
            return url
        time.sleep(0.2)
    ep.stop()
    raise EngineLaunchError(f"{what} was not healthy after {timeout_s:.0f}s; log {log_path}:\n{ep.log_tail()}")


# A launch given no `engine` (tests, benchmarks): EngineConfig's defaults, but on the CPU in fp32 whatever the
# machine (the config's device=None/dtype=auto would pick a GPU or bf16), so its numbers match a CPU fp32 reference.
BARE_EMBEDDED = EngineConfig(device="cpu", dtype="float32")


def engine_settings(engine: EngineConfig | None, overrides: dict[str, Any], default: EngineConfig) -> EngineConfig:
    """`engine` (None: `default`) with `overrides` (EngineConfig field names) replaced, checked as the config is."""
    fields = [f.name for f in dataclasses.fields(EngineConfig)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise TypeError(f"{unknown} are not engine settings; the settings are asyncrl.config.EngineConfig's fields: "
                        f"{', '.join(fields)}")
    return dataclasses.replace(engine if engine is not None else default, **overrides)


_launches = 0
_launches_lock = threading.Lock()


def _relaunching() -> bool:
    """True from this process's second embedded launch on. The first is a plain subprocess; a process that
    launches again (an engine actor restarting its engine, `asyncrl eval` of several checkpoints, a test
    session) has the later ones forked by its fork server, which costs its imports once (about 170 MB of
    its own memory for as long as this process lives) and saves them at every launch after."""
    global _launches
    with _launches_lock:
        _launches += 1
        return _launches > 1


def launch_embedded(
    model_dir: str | Path,
    engine: EngineConfig | None = None,
    *,
    port: int = 0,
    weight_version: int = 0,
    threads: int | None = None,
    extra_env: dict | None = None,
    startup_timeout_s: float | None = None,
    log_dir: str | None = None,
    weights_dirs: Sequence[str | Path] = (),
    fork: bool | None = None,
    **overrides: Any,
) -> EngineProcess:
    """Start the embedded engine server as a subprocess and wait for /health (up to `startup_timeout_s`,
    default engine.launch_timeout_s). `engine`: its settings, passed whole (None: BARE_EMBEDDED);
    `overrides`: EngineConfig fields replaced in it (`max_running_seqs=4`, `dtype="bfloat16"`, `host=...`).
    It holds this process's run token (`ensure_token`) and loads weights from disk only below `model_dir`
    and `weights_dirs`. `fork`: forked by this process's fork server (None: from its second launch on,
    `_relaunching`; `asyncrl bench startup` sets it to compare the two)."""
    engine = engine_settings(engine, overrides, BARE_EMBEDDED)
    if not (Path(model_dir) / "config.json").is_file():
        raise EngineLaunchError(f"model_dir={str(model_dir)!r} is not a Hugging Face checkpoint (no config.json)")
    host = engine.host
    token_env = {ENV: ensure_token()}  # in the child's environment, never its argv
    work = Path(tempfile.mkdtemp(prefix="asyncrl-engine-", dir=log_dir))
    port_file, log_path = work / "port", str(work / "server.log")
    relaunch = _relaunching()
    server = fork_server() if (relaunch if fork is None else fork) else None  # asyncrl/engine/forkserver.py
    parent = server.pid if server is not None else os.getpid()
    argv = ["serve", "--model-path", str(model_dir), *settings_argv(engine), "--port", str(port), "--port-file",
            str(port_file), "--weight-version", str(weight_version), "--exit-with-parent", str(parent)]
    if threads:
        argv += ["--threads", str(threads)]
    for d in weights_dirs:
        argv += ["--weights-dir", str(d)]
    scratch = work if log_dir is None else None  # a temp dir of ours: removed by whoever outlives the other
    if scratch is not None:
        argv += ["--scratch-dir", str(scratch)]
    env = {**(extra_env or {}), **token_env}
    if server is not None:
        proc: subprocess.Popen | ForkedProcess = server.spawn(argv, {**os.environ, **env}, log_path)
    else:
        proc = _spawn([sys.executable, "-m", "asyncrl.engine.cli", *argv], log_path, env)

    def url_of() -> str | None:
        if port_file.is_file():
            return f"http://{host}:{int(port_file.read_text())}"
        return None

    timeout_s = engine.launch_timeout_s if startup_timeout_s is None else startup_timeout_s
    try:
        url = _wait(proc, url_of, timeout_s, f"embedded engine (pid {proc.pid})", log_path)
    except EngineLaunchError:
        if scratch is not None:  # the error carries the log's tail; the temp dir would only be litter
            shutil.rmtree(scratch, ignore_errors=True)
        raise
    return EngineProcess(url, proc, log_path, scratch=scratch)


def sglang_command(model_dir: str | Path, engine: EngineConfig, port: int, *, weight_version: int = 0,
                   extra_args: Sequence[str] = ()) -> list[str]:
    """The `python -m sglang.launch_server` command line for `engine`'s host, dtype, mem_fraction_static and
    extra_args, then `extra_args` (flags as in SGLang 0.5.23's arg_groups: --dtype in fields/model.py,
    --weight-version (a string there; asyncrl's int) in fields/serving.py)."""
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--host", engine.host,
            "--port", str(port), "--dtype", sglang_dtype(engine.dtype),
            "--mem-fraction-static", str(engine.mem_fraction_static),
            "--weight-version", str(weight_version), "--skip-server-warmup", *engine.extra_args, *extra_args]


KEY_FLAGS = ("--api-key", "--admin-api-key", "--config")  # asyncrl sets these; engine.extra_args may not


def sglang_key_config(work: Path, host: str, token: str) -> Path:
    """The YAML file (0600) that gives SGLang its keys without argv: `admin-api-key` (SGLang then
    requires it on every control route, ADMIN_OPTIONAL in its http_server, and leaves /generate and
    /model_info open); beyond loopback `api-key` too (every route but /health needs it)."""
    keys = {"admin-api-key": token, **({} if is_loopback(host) else {"api-key": token})}
    path = work / "keys.yaml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("".join(f"{k}: {json.dumps(v)}\n" for k, v in keys.items()))  # a JSON string is a YAML string
    return path


def launch_sglang(
    model_dir: str | Path,
    engine: EngineConfig | None = None,
    *,
    port: int = 0,
    weight_version: int = 0,
    extra_env: dict | None = None,
    startup_timeout_s: float | None = None,
    log_dir: str | None = None,
    **overrides: Any,
) -> EngineProcess:
    """Start a real SGLang server (GPU) at `weight_version` and wait for /health (up to `startup_timeout_s`,
    default engine.launch_timeout_s). `engine`: its settings (host, dtype, mem_fraction_static, extra_args;
    None: EngineConfig's defaults); `overrides`: EngineConfig fields replaced in it."""
    engine = engine_settings(engine, overrides, EngineConfig(type="sglang"))
    host, extra_args = engine.host, engine.extra_args
    startup_timeout_s = engine.launch_timeout_s if startup_timeout_s is None else startup_timeout_s
    clash = sorted({a.split("=", 1)[0] for a in extra_args} & set(KEY_FLAGS))  # flag names only, never values
    if clash:
        raise EngineLaunchError(f"engine.extra_args has {clash}: asyncrl gives SGLang the run's token itself "
                                f"(ASYNCRL_ENGINE_TOKEN, through a --config file); remove them")
    if importlib.util.find_spec("sglang") is None:
        raise EngineLaunchError("engine.type=sglang needs the 'sglang' package (pip install 'sglang[all]'); "
                                "it is not installed in this Python")
    port = port or free_port(host)
    work = Path(tempfile.mkdtemp(prefix="asyncrl-sglang-", dir=log_dir))
    log_path = str(work / "server.log")
    keys = sglang_key_config(work, host, ensure_token())
    cmd = sglang_command(model_dir, engine, port, weight_version=weight_version, extra_args=["--config", str(keys)])
    # SGLang's /health answers 503 after this many seconds without a word from its scheduler: the
    # liveness probe's limit (asyncrl/run/engine_actor.py probe_sglang)
    env = {"SGLANG_HEALTH_CHECK_TIMEOUT": str(math.ceil(engine.probe_timeout_s)), **(extra_env or {})}
    proc = _spawn(cmd, log_path, env, die_with_parent=True)
    url = f"http://{host}:{port}"
    try:
        _wait(proc, lambda: url, startup_timeout_s, f"sglang server (pid {proc.pid})", log_path)
    finally:
        keys.unlink(missing_ok=True)  # read at startup (a restart writes a new one)
    return EngineProcess(url, proc, log_path, scratch=work if log_dir is None else None)


def attach(urls: Sequence[str], timeout_s: float = 60.0) -> list[EngineProcess]:
    """Wrap already running servers; fails if one does not answer /model_info within `timeout_s`
    (not /health: a server attached while paused is alive)."""
    out = []
    for url in urls:
        url = url.rstrip("/")
        deadline = time.monotonic() + timeout_s
        while not answers(url):
            if time.monotonic() > deadline:
                raise EngineLaunchError(f"engine at {url} did not answer /model_info within {timeout_s:.0f}s")
            time.sleep(0.5)
        out.append(EngineProcess(url, None))
    return out


def launch_configured(cfg: Config, model_dir: str, *, port: int, threads: int | None, weight_version: int = 0,
                      log_dir: str) -> EngineProcess:
    """Launch the server `cfg.engine` describes (embedded or SGLang) on `model_dir`, whose weights are
    policy version `weight_version`, with `cfg.engine` passed whole; its logs go below `log_dir`. The one
    place an engine is configured from the run's config (asyncrl/run/engine_actor.py's EngineActor,
    `asyncrl eval` and `asyncrl generate` without Ray)."""
    e = cfg.engine
    os.makedirs(log_dir, exist_ok=True)
    if e.type == "sglang":
        return launch_sglang(model_dir, e, port=port, weight_version=weight_version, log_dir=log_dir)
    return launch_embedded(model_dir, e, port=port, weight_version=weight_version, threads=threads,
                           extra_env={"OMP_NUM_THREADS": str(threads)} if threads else None,
                           weights_dirs=run_weight_dirs(cfg), log_dir=log_dir)


def run_weight_dirs(cfg: Config) -> list[str]:
    """Where the run writes weights an engine may load from disk: its output dir (restart exports)
    and the disk transport's directory (the controller resolves both to absolute paths)."""
    return [d for d in (cfg.trainer.output_dir, cfg.trainer.weight_sync.disk_dir) if d]
