"""A corpus of hostile programs, each run through the real python tool in the real sandbox.

Every case asserts that the attack is contained on the host (files, processes, sockets the test made
itself) and that the tool still answers a normal program afterwards. The audit-hook tool this
replaced failed the writes (relative paths after chdir, dir_fd, ctypes), the reads of /proc and
/tmp, the daemon, the disk fill and the fork cases; only the single-process CPU limit held there.
"""

from __future__ import annotations

import ast
import asyncio
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import asyncrl
from asyncrl.sandbox import runner
from asyncrl.tools.python import PythonTool

MISSING = runner.probe()
pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(MISSING is not None, reason=f"no isolation on this kernel: {MISSING}")]
REPO = Path(asyncrl.__file__).resolve().parents[1]
CFG = {"timeout_s": 30, "cpu_seconds": 2, "memory_mb": 256, "max_output_bytes": 4000,
       "scratch_inodes": 2000, "max_processes": 16}


@pytest.fixture
async def tool() -> Iterator[PythonTool]:
    t = PythonTool(CFG)
    await t.create("ep")
    yield t
    await t.release("ep")


@pytest.fixture
def canary() -> Iterator[tuple[subprocess.Popen, str]]:
    """A host process of the same user, holding a secret in its environment."""
    secret = f"canary-secret-{uuid.uuid4().hex}"
    p = subprocess.Popen(["sleep", "600"], env={"CANARY_SECRET": secret}, start_new_session=True)
    yield p, secret
    p.kill()
    p.wait()


async def run(tool: PythonTool, code: str) -> str:
    text, _, _ = await tool.execute("ep", {"code": code})
    return text


async def still_answers(tool: PythonTool) -> None:
    text, _, m = await tool.execute("ep", {"code": "print(6 * 7)"})
    assert (text, m["exit_code"], m["isolated"]) == ("42\n", 0.0, 1.0)


def host_pids_with(marker: str) -> list[int]:
    found = []
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and marker.encode() in Path(f"/proc/{p}/cmdline").read_bytes():
                found.append(int(p))
        except OSError:
            continue
    return found


# --- writes outside the scratch dir, by every route ---------------------------------------------

def _targets(tmp_path: Path) -> list[str]:
    return [str(tmp_path), "/tmp", "/var/tmp", "/dev/shm", os.path.expanduser("~"), os.getcwd(), str(REPO),
            str(REPO / "asyncrl"), "/"]


WRITE_ROUTES: dict[str, Callable[[str], str]] = {
    "absolute_open": lambda p: f"open({p!r}, 'w').write('x')",
    "chdir_then_relative": lambda p: f"os.chdir({os.path.dirname(p)!r}); open({os.path.basename(p)!r}, 'w').write('x')",
    "chdir_root_then_dotdot": lambda p: f"os.chdir('/'); open('..' + {p!r}, 'w').write('x')",
    "dir_fd_of_root": lambda p: (f"fd = os.open('/', os.O_RDONLY); "
                                 f"os.close(os.open({p.lstrip('/')!r}, os.O_WRONLY | os.O_CREAT, dir_fd=fd))"),
    "mkdir": lambda p: f"os.mkdir({p!r})",
    "rename_out": lambda p: f"open('mine', 'w').write('x'); os.rename('mine', {p!r})",
    "shell": lambda p: f"import subprocess; subprocess.run(['sh', '-c', 'echo x > {p}'], check=True)",
    "ctypes_creat": lambda p: f"import ctypes; assert ctypes.CDLL(None).creat({p.encode()!r}, 0o644) >= 0",
}


@pytest.mark.parametrize("route", sorted(WRITE_ROUTES))
async def test_writes_outside_the_scratch_dir_are_contained(tool, tmp_path, route):
    name = f"escape-{uuid.uuid4().hex}"
    paths = [os.path.join(t, name) for t in _targets(tmp_path)]
    lines = ["import os"]
    for p in paths:
        lines += ["try:", f"    {WRITE_ROUTES[route](p)}", f"    print('WROTE', {p!r})",
                  "except BaseException as e:", "    print('refused', type(e).__name__)"]
    lines.append("print('done')")
    try:
        text = await run(tool, "\n".join(lines))
        assert "done" in text and "WROTE" not in text, text
        assert [p for p in paths if os.path.lexists(p)] == []
    finally:
        for p in paths:
            if os.path.isdir(p):
                os.rmdir(p)
            elif os.path.lexists(p):
                os.unlink(p)
    await still_answers(tool)


# --- reads of other processes and of files outside the view -------------------------------------

async def test_environment_of_other_processes_is_unreadable(tool, canary):
    proc, secret = canary
    own = Path(f"/proc/{os.getpid()}/environ").read_bytes().split(b"\0")[0].decode()
    code = f"""
import os, glob
for path in ['/proc/{os.getpid()}/environ', '/proc/{proc.pid}/environ', f'/proc/{{os.getppid()}}/environ',
             '/proc/1/environ', *glob.glob('/proc/*/environ')]:
    try:
        print(path, open(path, 'rb').read())
    except OSError as e:
        print(path, 'refused', e.errno)
print(sorted(os.environ))
print('pids', [p for p in os.listdir('/proc') if p.isdigit()])
"""
    text = await run(tool, code)
    assert "pids" in text and secret not in text and (not own or own not in text), text
    visible = ast.literal_eval(text.split("pids ")[1].strip())
    assert str(proc.pid) not in visible and str(os.getpid()) not in visible
    await still_answers(tool)


async def test_files_outside_the_view_are_unreadable(tool, tmp_path):
    secret = f"file-secret-{uuid.uuid4().hex}"
    host_file = tmp_path / "secret.txt"
    host_file.write_text(secret)
    await tool.create("other")
    other = Path(tool.workdir("other")) / "theirs.txt"
    other.write_text(secret)
    code = "\n".join(["for p in [" + ", ".join(repr(str(p)) for p in (host_file, other, "/etc/shadow")) + "]:",
                      "    try:", "        print(p, open(p).read())",
                      "    except OSError as e:", "        print(p, 'refused', e.errno)", "print('done')"])
    try:
        text = await run(tool, code)
    finally:
        await tool.release("other")
    assert "done" in text and secret not in text and "root:" not in text, text
    await still_answers(tool)


async def test_configured_paths_are_hidden():
    """`hide` covers a host directory outside the default masks (here: one in the repository's .venv),
    named through a symlink: the real directory is what gets covered."""
    secret = f"hidden-secret-{uuid.uuid4().hex}"
    d = Path(tempfile.mkdtemp(dir=REPO / ".venv", prefix="hide-test-"))
    link = d.with_name(d.name + "-link")
    try:
        link.symlink_to(d)
        d.chmod(0o755)  # readable by anyone: only the mask can keep it from the program
        (d / "out.txt").write_text(secret)
        t = PythonTool({**CFG, "hide": [str(link)]})
        try:
            text, _, _ = await t.execute("ep", {"code": f"import os\nprint(os.listdir({str(d)!r}))\n"
                                                         f"print(open({str(d / 'out.txt')!r}).read())"})
        finally:
            await t.release("ep")
        assert text.startswith("[]\n") and "FileNotFoundError" in text and secret not in text, text
        with pytest.raises(ValueError, match="is not the absolute path of an existing directory"):
            PythonTool({"hide": ["relative/dir"]})
    finally:
        shutil.rmtree(d)
        link.unlink(missing_ok=True)


async def test_the_runs_own_paths_are_hidden_wherever_they_lie(monkeypatch):
    """`asyncrl train` names its own paths in ASYNCRL_SANDBOX_HIDE (its output dir, the buffer's WAL and keys,
    its data files, ...: asyncrl/sandbox/runner.py job_paths): a directory among them is covered whole, a file
    alone reads empty while the files beside it stay visible, a missing path is skipped; no tool config
    is needed. (Issue 36: with the output dir outside /tmp, /home and the cwd, model-written code read the
    run's config, every episode's trajectories and rewards, and the WAL.)"""
    secret = f"run-secret-{uuid.uuid4().hex}"
    out = Path(tempfile.mkdtemp(dir=REPO / ".venv", prefix="run-out-"))
    data = Path(tempfile.mkdtemp(dir=REPO / ".venv", prefix="run-data-"))
    try:
        for d in (out, data):
            d.chmod(0o755)  # readable by anyone: only the masks can keep them from the program
        (out / "trajectories-w0.jsonl").write_text(secret)
        (data / "train.jsonl").write_text(secret)
        (data / "other.txt").write_text("visible")
        monkeypatch.setenv(runner.HIDE_ENV, os.pathsep.join([str(out), str(data / "train.jsonl"),
                                                             str(out / "not-yet-written")]))
        t = PythonTool(CFG)
        code = (f"import os\nprint(os.listdir({str(out)!r}))\nprint(repr(open({str(data / 'train.jsonl')!r}).read()))\n"
                f"print(open({str(data / 'other.txt')!r}).read())\nprint(open({str(out / 'trajectories-w0.jsonl')!r}).read())")
        try:
            text, _, _ = await t.execute("ep", {"code": code})
        finally:
            await t.release("ep")
        assert text.startswith("[]\n''\nvisible\n") and "FileNotFoundError" in text and secret not in text, text
    finally:
        shutil.rmtree(out)
        shutil.rmtree(data)


async def test_eval_and_generate_hide_their_output_and_the_baseline_they_compare_to(monkeypatch, tiny_model_dir):
    """`asyncrl eval` and `asyncrl generate` run the agent loop in their own process (asyncrl/offline/session.py
    agent_context): the sandbox hides their output dir (episodes with rewards and answers) and the dirs they are
    given to read (eval's --against) as a run's, wherever they lie. (Issue 36: only `asyncrl train` set them.)"""
    from asyncrl.config import load_config
    from asyncrl.offline.session import agent_context

    secret = f"eval-secret-{uuid.uuid4().hex}"
    out = Path(tempfile.mkdtemp(dir=REPO / ".venv", prefix="eval-out-"))
    base = Path(tempfile.mkdtemp(dir=REPO / ".venv", prefix="eval-base-"))
    monkeypatch.setenv(runner.HIDE_ENV, "")  # restored after the test: the context sets it for its process
    try:
        for d in (out, base):
            d.chmod(0o755)  # readable by anyone: only the masks can keep them from the program
            (d / "episodes.jsonl").write_text(secret)
        # engine.urls: the context attaches to an engine instead of launching one (none is called here)
        cfg = load_config(["model=custom", f"model.path={tiny_model_dir}", "engine.urls=[http://127.0.0.1:9]"])
        code = "\n".join(f"print(os.path.exists({str(d / 'episodes.jsonl')!r}))" for d in (out, base))
        with agent_context(cfg, out, lambda text: None, [base]):
            t = PythonTool(CFG)
            try:
                text, _, _ = await t.execute("ep", {"code": "import os\n" + code})
            finally:
                await t.release("ep")
        assert text.startswith("False\nFalse") and secret not in text, text
    finally:
        shutil.rmtree(out)
        shutil.rmtree(base)


async def test_the_workers_cwd_is_hidden(monkeypatch):
    """The rollout worker's cwd (where a run's outputs/ lie) is covered by default; hide_cwd: false shows it."""
    secret = f"cwd-secret-{uuid.uuid4().hex}"
    d = Path(tempfile.mkdtemp(dir=REPO / ".venv", prefix="cwd-test-"))
    try:
        d.chmod(0o755)  # readable by anyone: only the mask can keep it from the program
        (d / "checkpoint.txt").write_text(secret)
        monkeypatch.chdir(d)
        code = f"print(open({str(d / 'checkpoint.txt')!r}).read())"
        for config, shown in (({}, False), ({"hide_cwd": False}, True)):
            t = PythonTool({**CFG, **config})
            try:
                text, _, _ = await t.execute("ep", {"code": code})
            finally:
                await t.release("ep")
            assert (secret in text) == shown, (config, text)
    finally:
        shutil.rmtree(d)


async def test_kernel_knobs_in_proc_are_read_only(tool):
    """EROFS, not EACCES: the read-only bind stops a program even where its uid is the host's root."""
    code = ("for p in ['/proc/sys/kernel/hostname', '/proc/sys/vm/drop_caches']:\n    try:\n"
            "        open(p, 'w').write('x')\n        print('WROTE', p)\n    except OSError as e:\n"
            "        print('refused', e.errno)")
    assert await run(tool, code) == "refused 30\nrefused 30\n"
    await still_answers(tool)


# --- signals ------------------------------------------------------------------------------------

async def test_signals_reach_no_host_process(tool, canary):
    proc, _ = canary
    code = f"""
import os, signal
for target in (-1, {proc.pid}, 1, {os.getpid()}):
    try:
        os.kill(target, signal.SIGKILL)
        print('sent', target)
    except OSError as e:
        print('refused', target, e.errno)
try:
    os.killpg({proc.pid}, signal.SIGKILL)
except OSError as e:
    print('refused pg', e.errno)
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
for target in (1, {proc.pid}):   # PTRACE_ATTACH: the sandbox's PID 1, a host pid
    print('ptrace', target, libc.ptrace(16, target, 0, 0), ctypes.get_errno())
print('done')
"""
    text, _, m = await tool.execute("ep", {"code": code})
    assert proc.poll() is None  # the canary lives (and so does this test process)
    assert "done" in text, text
    assert "ptrace 1 -1 1\n" in text and f"ptrace {proc.pid} -1 3\n" in text  # EPERM, ESRCH
    await still_answers(tool)


# --- resource bombs -----------------------------------------------------------------------------

async def test_fork_bomb_is_capped(tool):
    code = """
import os, time
n = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(600)
            os._exit(0)
        n += 1
except OSError as e:
    print('stopped after', n, 'errno', e.errno)
"""
    text = await run(tool, code)
    assert text.startswith("stopped after") and "errno 11" in text, text
    assert int(text.split()[2]) < CFG["max_processes"]
    await still_answers(tool)


async def test_memory_bomb_in_every_process_is_stopped(tool):
    code = """
import os
for _ in range(3):
    if os.fork() == 0:
        a = []
        try:
            while True:
                a.append(bytearray(32 * 2**20))
        except MemoryError:
            os._exit(7)
        os._exit(0)
codes = [os.waitstatus_to_exitcode(os.wait()[1]) for _ in range(3)]
a = []
try:
    while True:
        a.append(bytearray(32 * 2**20))
except MemoryError:
    print('parent MemoryError at', len(a) * 32, 'MiB; children', codes)
"""
    text = await run(tool, code)
    assert text.startswith("parent MemoryError") and "children [7, 7, 7]" in text, text
    assert int(text.split()[3]) <= CFG["memory_mb"]
    await still_answers(tool)


HOLD_RESIDENT = """
import os, time
kids = []
for _ in range({n}):
    pid = os.fork()
    if pid == 0:
        block = bytearray(120 * 2**20)
        block[::4096] = b"x" * len(block[::4096])  # every page resident, each process under its own cap
        time.sleep(1.5)
        os._exit(0)
    kids.append(pid)
print("children", [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in kids])
"""


async def test_the_resident_total_of_a_calls_processes_is_bounded():
    """Four processes of 120 MiB each, every one under its own `memory_mb` (RLIMIT_AS): 480 MiB together,
    over `memory_total_mb=300`: the call is killed, saying why. One such process alone runs to the end."""
    t = PythonTool({**CFG, "memory_mb": 256, "memory_total_mb": 300})
    await t.create("ep")
    try:
        text, _, m = await t.execute("ep", {"code": HOLD_RESIDENT.format(n=4)})
        assert "[killed: its processes together held over 300 MB]" in text, text
        assert m["memory_killed"] == 1.0 and m["timed_out"] == 0.0, m
        text, _, m = await t.execute("ep", {"code": HOLD_RESIDENT.format(n=1)})
        assert (text, m["memory_killed"]) == ("children [0]\n", 0.0), (text, m)
    finally:
        await t.release("ep")


async def test_calls_of_one_worker_beyond_max_concurrent_calls_wait_their_turn():
    """`max_concurrent_calls=1`: while one call runs, a second call has not begun (a call writes its program
    into the episode's files before it launches anything); it runs and answers once the first ends."""
    t = PythonTool({**CFG, "max_concurrent_calls": 1})
    await t.create("a")
    await t.create("b")
    try:
        first = asyncio.create_task(t.execute("a", {"code": "import time; time.sleep(3); print('a')"}))
        for _ in range(200):  # until a's sandbox is up
            if host_pids_with(t._dirs["a"].encode().hex()):
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("the first call's sandbox never started")
        second = asyncio.create_task(t.execute("b", {"code": "print('b')"}))
        await asyncio.sleep(0.2)  # the event loop runs the second call up to where it waits
        assert not second.done() and not (Path(t.workdir("b")) / "main.py").exists()
        assert (await first)[0] == "a\n" and (await second)[0] == "b\n"
    finally:
        await t.release("a")
        await t.release("b")
    with pytest.raises(ValueError, match=r"max_concurrent_calls=0: must be an integer > 0"):
        PythonTool({"max_concurrent_calls": 0})


async def test_disk_fill_by_many_small_files_is_capped(tool):
    code = """
import os
n = 0
try:
    for n in range(100_000):
        open(f'f{n}', 'w').write('x')
except OSError as e:
    print('stopped after', n, 'errno', e.errno)
"""
    text = await run(tool, code)
    assert text.startswith("stopped after") and "errno 28" in text, text  # ENOSPC: the inode cap
    kept = os.listdir(tool.workdir("ep"))
    assert len(kept) <= CFG["scratch_inodes"]
    await run(tool, "import os\nfor f in os.listdir():\n    os.remove(f)")
    await still_answers(tool)


async def test_infinite_loop_is_stopped(tool):
    text, _, m = await tool.execute("ep", {"code": "while True:\n    pass"})
    assert text == "[killed by SIGXCPU: CPU time limit exceeded]" and m["timed_out"] == 0.0
    await still_answers(tool)


async def test_a_child_that_outlives_the_call_is_killed(tool):
    marker = f"daemon-{uuid.uuid4().hex}"
    code = f"""
import ctypes, os, sys
libc = ctypes.CDLL(None)
if libc.fork() == 0:          # a raw fork, then a new session, then a second fork: a daemon
    os.setsid()
    if libc.fork() == 0:
        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(600)', {marker!r}])
    os._exit(0)
os.wait()
print('daemon started')
"""
    text = await run(tool, code)
    assert text == "daemon started\n", text
    assert host_pids_with(marker) == []
    await still_answers(tool)


async def test_cancelling_a_call_kills_every_process_of_it(tool):
    """The caller's own timeout (a cancelled execute) ends the namespace: nothing of the call survives."""
    marker = f"cancelled-{uuid.uuid4().hex}"
    code = (f"import os, sys\nif os.fork() == 0:\n    os.execv(sys.executable, [sys.executable, '-c', "
            f"'import time; time.sleep(600)', {marker!r}])\nimport time\ntime.sleep(600)")
    call = asyncio.ensure_future(tool.execute("ep", {"code": code}))
    deadline = time.monotonic() + 60
    while not host_pids_with(marker):  # the program is running once its child is visible from the host
        assert time.monotonic() < deadline and not call.done(), "the program never started"
        await asyncio.sleep(0.05)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    while host_pids_with(marker):
        assert time.monotonic() < deadline, "a process of the cancelled call survived"
        await asyncio.sleep(0.05)
    await still_answers(tool)


# --- network ------------------------------------------------------------------------------------

CTYPES_SOCKET = """
import ctypes, struct
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
fd = libc.syscall(41, 2, 1, 0)   # SYS_socket(AF_INET, SOCK_STREAM) on x86_64
addr = struct.pack('<H', 2) + struct.pack('!H', {port}) + bytes([127, 0, 0, 1]) + bytes(8)
rc = libc.syscall(42, fd, ctypes.c_char_p(addr), 16)   # SYS_connect
print('raw connect', rc, ctypes.get_errno())
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the raw syscall numbers are x86_64's")
async def test_network_is_unreachable_by_socket_and_raw_syscalls(tool):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    abstract = socket.socket(socket.AF_UNIX)
    name = f"\0asyncrl-test-{uuid.uuid4().hex}"
    abstract.bind(name)
    abstract.listen(8)
    code = f"""
import socket
for family, addr in ((socket.AF_INET, ('127.0.0.1', {port})), (socket.AF_UNIX, {name!r})):
    try:
        socket.socket(family).connect(addr)
        print('CONNECTED', addr)
    except OSError as e:
        print('refused', e.errno)
""" + CTYPES_SOCKET.format(port=port)
    try:
        text = await run(tool, code)
        assert "CONNECTED" not in text and "raw connect -1 101" in text, text  # ENETUNREACH
        for s in (srv, abstract):  # a connection would be queued by now: nothing may be pending
            assert select.select([s], [], [], 0)[0] == []
    finally:
        srv.close()
        abstract.close()
    await still_answers(tool)


async def test_links_and_special_files_are_not_copied_back(tool):
    code = "import os\nos.symlink('/etc/passwd', 'link')\nos.mkfifo('fifo')\nos.mkdir('d')\nopen('d/f', 'w').write('ok')"
    assert await run(tool, code) == "(no output)"
    wd = Path(tool.workdir("ep"))
    assert sorted(p.name for p in wd.iterdir()) == ["d", "main.py"] and (wd / "d" / "f").read_text() == "ok"
    await still_answers(tool)


# --- when isolation cannot be set up --------------------------------------------------------------

NO_USERNS = """
import asyncio, sys
from asyncrl.sandbox.runner import SandboxUnavailable
from asyncrl.tools.python import PythonTool
try:
    PythonTool()
    print('NOT REFUSED')
except SandboxUnavailable as e:
    print('REFUSED:', e)
t = PythonTool({'allow_unisolated': True})
print('UNISOLATED:', asyncio.run(t.execute('x', {'code': 'print(6 * 7)'}))[0].strip())
asyncio.run(t.release('x'))
"""


ONE_UID = """
import asyncio
from asyncrl.tools.python import PythonTool
t = PythonTool()
code = "import os\\nopen('kept', 'w').write('k')\\nprint(os.getuid(), os.getcwd())\\nopen('/etc/x', 'w')"
print('FIRST:', asyncio.run(t.execute('x', {'code': code}))[0])
print('SECOND:', asyncio.run(t.execute('x', {'code': 'print(open(\\'kept\\').read())'}))[0])
asyncio.run(t.release('x'))
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare is needed to make the outer namespace")
def test_an_unprivileged_user_gets_the_nested_identity(tmp_path):
    """Inside a user namespace that maps one uid (what an ordinary user has), 65534 cannot be mapped:
    the program gets it from a nested user namespace instead, and is as contained."""
    script = tmp_path / "one_uid.py"
    script.write_text(ONE_UID)
    p = subprocess.run(["unshare", "--user", "--map-root-user", sys.executable, str(script)],
                       capture_output=True, text=True, timeout=90)
    assert p.returncode == 0, p.stderr
    assert "FIRST: 65534 /tmp/work\n" in p.stdout and "OSError: [Errno 30] Read-only file system: '/etc/x'" in p.stdout
    assert "SECOND: k\n" in p.stdout, p.stdout


@pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare is needed to make the outer namespace")
def test_refuses_without_user_namespaces_unless_allowed(tmp_path):
    """A real kernel refusal: a user namespace whose user.max_user_namespaces is 0 can create none."""
    script = tmp_path / "no_userns.py"
    script.write_text(NO_USERNS)
    cmd = ["unshare", "--user", "--map-root-user", "sh", "-c",
           f'echo 0 > /proc/sys/user/max_user_namespaces && exec "{sys.executable}" "{script}"']
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert p.returncode == 0, p.stderr
    assert "REFUSED: python tool: isolation cannot be set up here: user namespaces are disabled " \
           "(user.max_user_namespaces=0)" in p.stdout, p.stdout
    assert "allow_unisolated: true" in p.stdout
    assert "UNISOLATED: 42" in p.stdout
    assert "running model-written code UNISOLATED" in p.stderr
