"""Imported by every Python process started with this folder on PYTHONPATH (scripts/suite_cpu.py): records
the process's CPU seconds, argv, the test that started it and whether it imported torch into
$ASYNCRL_PROC_RECORD/<pid>.json, every 1.5 s and at exit (a process killed by a signal keeps its last record).
A measuring aid only: never on the path of a normal run."""

import json
import os
import resource
import sys
import threading
import time

_DIR = os.environ.get("ASYNCRL_PROC_RECORD")
_PID = os.getpid()


def _record() -> None:
    if os.getpid() != _PID:  # a fork of this process: not its record
        return
    use = resource.getrusage(resource.RUSAGE_SELF)
    rec = {"pid": _PID, "argv": " ".join(sys.argv)[:300], "cpu_s": use.ru_utime + use.ru_stime,
           "torch": "torch" in sys.modules, "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
           "xdist_worker": os.environ.get("PYTEST_XDIST_WORKER", "")}
    try:
        with open(os.path.join(_DIR, f"{_PID}.json"), "w") as f:
            json.dump(rec, f)
    except OSError:
        pass


def _loop() -> None:
    while True:
        time.sleep(1.5)
        _record()


if _DIR:
    threading.Thread(target=_loop, daemon=True, name="asyncrl-cpu-record").start()
    import atexit

    atexit.register(_record)
