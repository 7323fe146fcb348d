"""The python tool's sandbox as an ordinary user: the hostile programs that matter most, run by a real
non-root uid (every other sandbox test runs as root, where `unshare --map-root-user` hides what a user
meets: a non-dumpable init whose nested user namespace's /proc/self files are root's).

The test drops to uid/gid 1000 with `setpriv` and runs `asyncrl.sandbox.runner` (standard library only)
from a world-readable copy, under an interpreter that uid can execute; the attacks and the canary (a
process of the same uid holding a secret, and a listening socket) are real. It needs root to drop
privileges from, so it skips, saying why, where it cannot be set up.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import asyncrl

USER = 1000
SETPRIV = shutil.which("setpriv")
DROP = [SETPRIV or "setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups"]
ENV = {"HOME": "/tmp", "PATH": "/usr/bin:/bin"}

DRIVER = r"""
import asyncio, json, shutil, sys
from asyncrl.sandbox import runner

missing = runner.probe()
if missing:
    print(json.dumps({"missing": missing}))
    sys.exit(0)
out = {}
for name, code in json.loads(sys.argv[1]).items():
    d = runner.new_episode_dir()
    try:
        r = asyncio.run(runner.run(d, code, runner.Limits()))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    out[name] = {"stdout": r.stdout.decode(errors="replace"), "stderr": r.stderr.decode(errors="replace"),
                 "rc": r.returncode, "killed": r.killed}
print(json.dumps(out))
"""


def _interpreter() -> str | None:
    """A python 3 that uid 1000 can execute (the venv's may live under root's 0700 home)."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if candidate and os.path.exists(candidate):
            probe = subprocess.run([*DROP, "env", "-i", *(f"{k}={v}" for k, v in ENV.items()), candidate, "-c", "1"],
                                   capture_output=True, timeout=30)
            if probe.returncode == 0:
                return candidate
    return None


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root to drop to a real non-root uid (setpriv)"
    if SETPRIV is None:
        return "setpriv (util-linux) is not installed"
    if _interpreter() is None:
        return f"no python 3 on this machine that uid {USER} can execute"
    return None


SKIP = _skip_reason()
pytestmark = [pytest.mark.timeout(180), pytest.mark.skipif(SKIP is not None, reason=str(SKIP))]


@pytest.fixture(scope="module")
def staged() -> Iterator[Path]:
    """asyncrl's sandbox package in a directory uid 1000 can read."""
    d = Path(tempfile.mkdtemp(prefix="asyncrl-nonroot-"))
    try:
        src = Path(asyncrl.__file__).resolve().parent
        (d / "asyncrl" / "sandbox").mkdir(parents=True)
        shutil.copy(src / "__init__.py", d / "asyncrl" / "__init__.py")
        for f in (src / "sandbox").glob("*.py"):
            shutil.copy(f, d / "asyncrl" / "sandbox" / f.name)
        (d / "driver.py").write_text(DRIVER)
        for p in [d, *d.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def canary() -> Iterator[tuple[subprocess.Popen, str, int]]:
    """A process of the same non-root uid holding a secret in its environment, and a socket listening on
    the host's loopback."""
    secret = f"canary-{uuid.uuid4().hex}"
    proc = subprocess.Popen([*DROP, "env", "-i", f"CANARY_SECRET={secret}", "sleep", "600"], start_new_session=True)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    try:
        yield proc, secret, listener.getsockname()[1]
    finally:
        listener.close()
        os.killpg(proc.pid, 9)
        proc.wait()


def run_as_user(staged: Path, programs: dict[str, str], extra_env: dict[str, str] | None = None) -> dict:
    env = [f"{k}={v}" for k, v in {**ENV, "PYTHONPATH": str(staged), **(extra_env or {})}.items()]
    p = subprocess.run([*DROP, "env", "-i", *env, _interpreter(), str(staged / "driver.py"), json.dumps(programs)],
                       capture_output=True, text=True, timeout=150, cwd=staged)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert "missing" not in out, f"the sandbox refused to run for uid {USER}: {out.get('missing')}"
    return out


def test_an_ordinary_user_runs_the_python_tool_isolated_and_the_attacks_are_contained(staged, canary):
    proc, secret, port = canary
    programs = {
        "identity": "import os; print(os.getuid(), os.getgid(), os.getpid())",
        "write": "open('/etc/asyncrl-nonroot', 'w')",
        "environ": (
            "import os\n"
            "hits = []\n"
            "for p in os.listdir('/proc'):\n"
            "    try:\n"
            f"        hits += [p] if {secret!r}.encode() in open(f'/proc/{{p}}/environ', 'rb').read() else []\n"
            "    except OSError:\n"
            "        pass\n"
            "print('pids', len([p for p in os.listdir('/proc') if p.isdigit()]), 'hits', hits)"),
        "signal": f"import os\ntry:\n    os.kill({proc.pid}, 9)\n    print('sent')\nexcept OSError as e:\n    print('refused', e.errno)",
        "network": (f"import socket\ns = socket.socket()\ns.settimeout(2)\ntry:\n    s.connect(('127.0.0.1', {port}))\n"
                    "    print('connected')\nexcept OSError as e:\n    print('refused', e.errno)"),
        "normal": "print(6 * 7)",
        # 5 processes of 240 MiB resident, each under its own 512 MiB: 1.2 GiB over the call's 1 GiB total
        "resident": ("import os, time\nfor _ in range(5):\n    if os.fork() == 0:\n        b = bytearray(240 << 20)\n"
                     "        b[::4096] = b'x' * len(b[::4096])\n        time.sleep(3)\n        os._exit(0)\n"
                     "os.wait()\nprint('all held')"),
    }
    out = run_as_user(staged, programs)
    assert out["identity"]["rc"] == 0, out["identity"]["stderr"]
    uid, gid, pid = map(int, out["identity"]["stdout"].split())
    assert (uid, gid) == (65534, 65534) and pid < 10  # nobody, in its own PID namespace
    assert out["write"]["rc"] != 0 and "Read-only file system" in out["write"]["stderr"]
    assert not Path("/etc/asyncrl-nonroot").exists()
    assert "hits []" in out["environ"]["stdout"], out["environ"]
    assert out["signal"]["stdout"].startswith("refused") and proc.poll() is None  # the canary lives
    assert out["network"]["stdout"].startswith("refused"), out["network"]
    assert (out["normal"]["stdout"], out["normal"]["rc"]) == ("42\n", 0)
    assert out["resident"]["killed"] == "memory" and "all held" not in out["resident"]["stdout"], out["resident"]


def test_an_ordinary_users_run_files_are_hidden_from_its_programs(staged):
    """The paths a run names in ASYNCRL_SANDBOX_HIDE (its output dir, its data files) are covered for an
    ordinary user too: the directory by a tmpfs, the file alone by /dev/null (a bind mount made in the
    sandbox's own user namespace), while a file beside it stays readable."""
    from asyncrl.sandbox.runner import HIDE_ENV

    secret = f"run-secret-{uuid.uuid4().hex}"
    # outside every default mask (the repository may lie under /tmp, which the sandbox covers whole), so only
    # the run's list can hide them: /var/lib, which the test's root can write
    out = Path(tempfile.mkdtemp(dir="/var/lib", prefix="asyncrl-nonroot-out-"))
    data = Path(tempfile.mkdtemp(dir="/var/lib", prefix="asyncrl-nonroot-data-"))
    try:
        for d in (out, data):
            d.chmod(0o755)
        (out / "config.json").write_text(secret)
        (data / "train.jsonl").write_text(secret)
        (data / "other.txt").write_text("visible")
        for f in (out / "config.json", data / "train.jsonl", data / "other.txt"):
            f.chmod(0o644)  # readable by uid 1000 on the host: only the masks keep them from the program
        code = (f"import os\nprint(os.listdir({str(out)!r}), repr(open({str(data / 'train.jsonl')!r}).read()), "
                f"open({str(data / 'other.txt')!r}).read())")
        out_json = run_as_user(staged, {"read": code},
                               {HIDE_ENV: os.pathsep.join([str(out), str(data / "train.jsonl")])})
    finally:
        shutil.rmtree(out)
        shutil.rmtree(data)
    assert out_json["read"]["rc"] == 0, out_json["read"]["stderr"]
    assert out_json["read"]["stdout"] == "[] '' visible\n" and secret not in str(out_json), out_json
