"""python tool: limits enforced on real subprocesses (CPU, memory, wall clock, network, files, output)."""

from __future__ import annotations

import os
import socket
import threading
import uuid

import pytest

from asyncrl.tools.python import PythonTool, netns_available

pytestmark = pytest.mark.timeout(60)


async def _tool(timeout_s: float):
    t = PythonTool({"timeout_s": timeout_s, "cpu_seconds": 1, "memory_mb": 256, "max_output_bytes": 2000})
    await t.create("ep")
    return t


@pytest.fixture
async def tool():
    """CPU, memory and output limits are tight; the wall clock is generous, so that a loaded machine
    (slow interpreter start) never trips it. The wall clock is tested alone, below."""
    t = await _tool(timeout_s=30)
    yield t
    await t.release("ep")


async def test_runs_code_and_keeps_files_between_calls(tool):
    text, reward, m = await tool.execute("ep", {"code": "open('n.txt', 'w').write(str(6 * 7))\nprint('ok')"})
    assert (text, reward, m["exit_code"]) == ("ok\n", 0.0, 0.0)
    text, _, _ = await tool.execute("ep", {"code": "print(open('n.txt').read())"})
    assert text == "42\n"
    wd = tool.workdir("ep")
    assert os.path.isfile(os.path.join(wd, "n.txt"))
    await tool.release("ep")
    assert not os.path.exists(wd)


async def test_infinite_loop_is_killed_by_cpu_limit():
    tool = PythonTool({"timeout_s": 45, "cpu_seconds": 1})  # a generous wall clock: the CPU limit must act
    text, _, m = await tool.execute("ep", {"code": "while True:\n    pass"})
    await tool.release("ep")
    assert text == "[killed by SIGXCPU: CPU time limit exceeded]" and m["exit_code"] == -24.0 and m["timed_out"] == 0.0


async def test_sleeping_code_is_killed_by_wall_clock():
    tool = await _tool(timeout_s=3)  # sleeping uses no CPU: only the wall clock can stop it
    try:
        text, _, m = await tool.execute("ep", {"code": "import time\nprint('start', flush=True)\ntime.sleep(60)"})
    finally:
        await tool.release("ep")
    assert text == "start\n[killed: wall-clock limit of 3 s exceeded]" and m["timed_out"] == 1.0


async def test_memory_bomb_is_stopped(tool):
    text, _, m = await tool.execute("ep", {"code": "a = []\nwhile True:\n    a.append(bytearray(50 * 2**20))"})
    assert "MemoryError" in text and m["exit_code"] == 1.0 and m["timed_out"] == 0.0


async def test_network_is_refused(tool):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(srv.accept()), daemon=True).start()
    code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
    try:
        text, _, m = await tool.execute("ep", {"code": code})
        assert "connected" not in text and m["exit_code"] == 1.0
        assert "network access is disabled" in text or "Network is unreachable" in text or "refused" in text
        # without the namespace, the audit hook alone refuses it
        bare = PythonTool({"network_namespace": False})
        text, _, _ = await bare.execute("x", {"code": code})
        await bare.release("x")
        assert "PermissionError: network access is disabled in this sandbox" in text
        assert accepted == []
    finally:
        srv.close()


async def test_writes_stay_in_the_working_directory(tool, tmp_path):
    target = tmp_path / f"escape-{uuid.uuid4().hex}"
    code = f"open({str(target)!r}, 'w').write('x')"
    text, _, _ = await tool.execute("ep", {"code": code})
    assert "writing outside the working directory is not allowed" in text and not target.exists()
    text, _, _ = await tool.execute("ep", {"code": f"import os\nos.remove({str(tmp_path)!r})"})
    assert "os.remove outside the working directory is not allowed" in text and tmp_path.exists()
    text, _, _ = await tool.execute("ep", {"code": "import subprocess\nsubprocess.run(['true'])"})
    assert "subprocess.Popen is not allowed" in text
    text, _, _ = await tool.execute("ep", {"code": "import tempfile, os\nf = tempfile.NamedTemporaryFile(delete=False)\n"
                                                   "print(os.path.dirname(f.name) == os.getcwd())"})
    assert text == "True\n"


async def test_output_is_capped(tool):
    text, _, m = await tool.execute("ep", {"code": "while True:\n    print('y' * 100)"})
    assert text.endswith("[killed: output exceeded 2000 bytes]") and m["output_capped"] == 1.0
    assert len(text) < 2100


CTYPES_CONNECT = """
import ctypes, struct
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.socket(2, 1, 0)
addr = struct.pack('<H', 2) + struct.pack('!H', {port}) + bytes([127, 0, 0, 1]) + bytes(8)
print('rc', libc.connect(fd, ctypes.c_char_p(addr), 16))
"""


@pytest.mark.skipif(not netns_available(), reason="unshare -n is not permitted here")
async def test_network_namespace_stops_what_the_audit_hook_cannot_see(tool):
    """A raw connect() through ctypes bypasses Python's audit hooks; the empty network namespace still refuses it."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(3)
    try:
        text, _, _ = await tool.execute("ep", {"code": CTYPES_CONNECT.format(port=srv.getsockname()[1])})
        assert text == "rc -1\n"
        with pytest.raises(socket.timeout):
            srv.accept()
    finally:
        srv.close()
