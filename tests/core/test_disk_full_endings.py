"""What a run writes on its way out when the disk is full, on a real full disk (tests/tmpfs.py): the summary
(room held for it from the start), the console record, and what counts as "disk full"."""

from __future__ import annotations

import errno
import json
import os
import traceback

from torch.distributed.checkpoint.api import CheckpointException

from asyncrl.console_log import ConsoleLog
from asyncrl.util.durable import full_errno
from tests.tmpfs import python_on_tmpfs

# fill the tmpfs (after the reserve, when asked), then write the summary as a run ends
REPORT_ON_A_FULL_DISK = r"""
import json, os, sys
from pathlib import Path
from asyncrl.run.controller import _report, reserve_summary_room
from asyncrl.run_dir import RunLayout
d = Path(sys.argv[1])
layout = RunLayout(d)
if sys.argv[2] == "reserve":
    reserve_summary_room(layout)
    assert layout.summary_reserve.stat().st_size == 1 << 20
with open(d / "filler", "wb") as f:  # the disk fills: nothing more fits
    try:
        while True:
            f.write(b"x" * 65536)
            f.flush()
    except OSError:
        pass
summary = {"exit_code": 1, "exit_reason": "stopped: disk full", "diagnosis": "x" * 400, "steps_trained": 2}
_report(d, summary)
ok = layout.summary.exists() and json.loads(layout.summary.read_text()) == summary
print("FOUND " + json.dumps({"summary_written": ok, "reserve_left": layout.summary_reserve.exists(),
                             "names": sorted(p.name for p in d.iterdir())}))
"""


def _found(res) -> dict:
    line = next((x for x in res.stdout.splitlines() if x.startswith("FOUND ")), None)
    assert line is not None, res.stdout[-2000:] + res.stderr[-3000:]
    return json.loads(line[len("FOUND "):])


def test_the_summary_is_written_on_a_full_disk_in_the_room_held_for_it(tmp_path):
    held = python_on_tmpfs(tmp_path / "a", "2m", REPORT_ON_A_FULL_DISK, "reserve")
    assert _found(held) == {"summary_written": True, "reserve_left": False, "names": ["filler", "summary.json"]}
    assert "asyncrl train: stopped: disk full (exit 1)" in held.stdout
    # the control: without the room, the same summary does not fit; the line still goes out, with why
    bare = python_on_tmpfs(tmp_path / "b", "2m", REPORT_ON_A_FULL_DISK, "none")
    assert _found(bare) == {"summary_written": False, "reserve_left": False, "names": ["filler"]}  # none half-written
    assert "could not write" in bare.stderr and "No space left on device" in bare.stderr
    assert "asyncrl train: stopped: disk full (exit 1)" in bare.stdout


def test_the_console_record_stops_once_on_a_full_disk_and_the_console_goes_on(tmp_path, capsys):
    """train.log on /dev/full (every write: ENOSPC): the lines reach the console, the record's failure is said
    once, and nothing raises into the code that printed."""
    if not os.path.exists("/dev/full"):
        import pytest
        pytest.skip("no /dev/full here")
    (tmp_path / "train.log").symlink_to("/dev/full")
    with ConsoleLog(tmp_path, []):
        for i in range(3):
            print(f"line {i}")
    out = capsys.readouterr().out
    assert [x for x in out.splitlines() if x.startswith("line ")] == ["line 0", "line 1", "line 2"]
    assert out.count("the console record (train.log) stops here") == 1, out


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as e:
        return e


def test_disk_full_is_found_behind_torch_and_dcp_wrappers_and_nothing_else_is():
    enospc = OSError(errno.ENOSPC, "No space left on device")
    assert full_errno(enospc) == errno.ENOSPC
    assert full_errno(OSError(errno.EDQUOT, "Disk quota exceeded")) == errno.EDQUOT
    caused = RuntimeError("wal write failed")
    caused.__cause__ = enospc
    assert full_errno(caused) == errno.ENOSPC
    during = RuntimeError("unexpected pos 704 vs 598")  # raised while handling the OSError
    during.__context__ = enospc
    # DCP's: a BaseException whose per-rank failures are (exception, its stack) pairs
    dcp = CheckpointException("write", {0: (during, traceback.extract_stack()), 1: (ValueError("other"), [])})
    assert full_errno(dcp) == errno.ENOSPC
    assert full_errno(CheckpointException("write", {0: (RuntimeError("unexpected pos"), [])})) is None
    assert full_errno(OSError(errno.EIO, "I/O error")) is None
    assert full_errno(ValueError("no")) is None
    loop = RuntimeError("a")  # a cycle of contexts ends
    other = RuntimeError("b")
    loop.__context__, other.__context__ = other, loop
    assert full_errno(loop) is None
    assert full_errno(_raised(caused)) == errno.ENOSPC
