"""Where the test suite's CPU goes: runs `bash scripts/test.sh ARGS` with every Python process it starts
recording its CPU seconds (scripts/suite_cpu/sitecustomize.py), then prints the total by kind of process
(engine servers, `asyncrl train` drivers, Ray workers with and without torch, Ray's own services, the pytest
workers) and the tests whose child processes cost the most. The suite is CPU-bound on 2 cores: its time is
about this total over 2.

    python scripts/suite_cpu.py [pytest args...]
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def kind(rec: dict) -> str:
    argv = rec["argv"]
    if "cli.py train" in argv:
        return "asyncrl train driver"
    if "engine/cli.py serve" in argv or "asyncrl.engine.cli serve" in argv:
        return "engine server"
    if "default_worker.py" in argv:
        return "Ray worker, torch" if rec["torch"] else "Ray worker, no torch"
    if "/ray/" in argv:
        return "Ray's own services"
    if "asyncrl/cli.py" in argv:
        return f"asyncrl {argv.split()[1]}" if len(argv.split()) > 1 else "asyncrl"
    if not rec["test"]:
        return "pytest (workers, in-process tests)"
    return "other (test subprocesses)"


def main() -> int:
    record = Path(tempfile.mkdtemp(prefix="asyncrl-suite-cpu-"))
    env = {**os.environ, "ASYNCRL_PROC_RECORD": str(record),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "scripts" / "suite_cpu"),
                                                       os.environ.get("PYTHONPATH")]))}
    rc = subprocess.call(["bash", str(ROOT / "scripts" / "test.sh"), *sys.argv[1:]], env=env, cwd=ROOT)
    recs = []
    for p in record.glob("*.json"):
        try:
            recs.append(json.loads(p.read_text()))
        except ValueError:
            pass
    by_kind, count, by_test = collections.Counter(), collections.Counter(), collections.Counter()
    for r in recs:
        by_kind[kind(r)] += r["cpu_s"]
        count[kind(r)] += 1
        if r["test"]:
            by_test[r["test"].split("[")[0]] += r["cpu_s"]
    print(f"\nCPU recorded: {sum(by_kind.values()):.0f} s in {len(recs)} Python processes ({record})")
    for k, v in by_kind.most_common():
        print(f"  {v:7.1f} s  {count[k]:4d} x  {k}")
    print("the tests whose child processes cost the most:")
    for k, v in by_test.most_common(15):
        print(f"  {v:7.1f} s  {k}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
