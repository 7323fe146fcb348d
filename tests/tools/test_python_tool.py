"""python tool: its reply format and limits (CPU, memory, wall clock, output), on real sandboxed runs.
The hostile corpus (escapes of the sandbox) is test_python_sandbox.py."""

from __future__ import annotations

import asyncio
import os

import pytest

from asyncrl.sandbox import runner
from asyncrl.tools.python import PythonTool

MISSING = runner.probe()
pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(MISSING is not None, reason=f"no isolation on this kernel: {MISSING}")]


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


def test_config_is_checked_before_anything_runs():
    with pytest.raises(ValueError, match=r"unknown keys \['timeout'\]"):
        PythonTool({"timeout": 3})
    with pytest.raises(ValueError, match="network_namespace=False: the sandbox always runs in its own empty network"):
        PythonTool({"network_namespace": False})


async def test_stderr_and_exit_status_follow_stdout(tool):
    text, _, m = await tool.execute("ep", {"code": "import sys\nprint('out')\nsys.exit('bad input')"})
    assert text == "out\nbad input\n[exit code 1]" and m["exit_code"] == 1.0


async def test_concurrent_calls_of_one_episode_keep_all_their_files(tool):
    codes = [f"open('f{i}', 'w').write('{i}')" for i in range(3)]
    await asyncio.gather(*(tool.execute("ep", {"code": c}) for c in codes))
    assert sorted(os.listdir(tool.workdir("ep"))) == ["f0", "f1", "f2", "main.py"]


async def test_output_is_capped(tool):
    text, _, m = await tool.execute("ep", {"code": "while True:\n    print('y' * 100)"})
    assert text.endswith("[killed: output exceeded 2000 bytes]") and m["output_capped"] == 1.0
    assert len(text) < 2100
