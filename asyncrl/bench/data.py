"""Dataset start-up and rollout-worker memory: a streamed `Dataset` against reading the rows whole.

Writes a `--rows`-row parquet (default a million) and a `--small`-row one into a temporary directory
(removed afterwards; never kept): `--distinct` arithmetic problems from the env's generator
(asyncrl/envs/arithmetic.py), cycled to the size wanted, in row groups of `asyncrl.data.rows.ROW_GROUP_ROWS`.
Each measurement runs in a fresh Python process, as a rollout actor would:
  - stream: the driver's `open_dataset` (footer only), the handle pickled and unpickled (what Ray ships
    to each actor), `PromptSource(shard 0 of --workers)`, the first prompt drawn: `startup_s`; then
    `--draws` more draws; the process's RSS growth over the baseline after its imports;
  - whole (the baseline, what asyncrl did before): `read_rows` (to_pylist of the file, every row
    validated), the rows pickled and unpickled, the same first draw; the same RSS measure.
`startup_ratio` is whole / stream on the large file. `worker_rss_growth_mb` is the streamed worker's RSS
with the large file minus with the small one: what the dataset's size costs a worker.
"""

from __future__ import annotations

import argparse
import json
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from asyncrl.data.dataset import open_dataset
from asyncrl.data.rows import ROW_GROUP_ROWS, read_rows
from asyncrl.envs.arithmetic import generate, to_row
from asyncrl.rollout.prompts import PromptSource


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the large file")
    parser.add_argument("--small", type=int, default=10_000, help="rows of the small file (the RSS baseline)")
    parser.add_argument("--distinct", type=int, default=20_000, help="distinct generated problems, cycled")
    parser.add_argument("--workers", type=int, default=4, help="rollout workers: the shard count")
    parser.add_argument("--draws", type=int, default=2_000, help="prompts drawn after the first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-baseline", action="store_true", help="skip reading the large file whole")


def write_dataset(path: Path, rows: int, distinct: int, seed: int) -> Path:
    """`rows` rows: `distinct` generated problems cycled, written a row group at a time (bounded memory)."""
    base = pa.Table.from_pylist([to_row(p, "train", i) for i, p in
                                 enumerate(generate(seed, "train", min(distinct, rows), [1, 2, 3, 4]))])
    with pq.ParquetWriter(path, base.schema) as writer:
        done = 0
        while done < rows:
            for start in range(0, base.num_rows, ROW_GROUP_ROWS):
                n = min(ROW_GROUP_ROWS, base.num_rows - start, rows - done)
                if n <= 0:
                    break
                writer.write_table(base.slice(start, n), row_group_size=ROW_GROUP_ROWS)
                done += n
    return path


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def child(mode: str, path: str, workers: int, draws: int, seed: int) -> dict[str, Any]:
    """One measurement in this (fresh) process; see the module doc."""
    rss0 = _rss_mb()
    t0 = time.perf_counter()
    if mode == "stream":
        blob = pickle.dumps(open_dataset(path))
    else:
        blob = pickle.dumps(read_rows(path))
    rows = pickle.loads(blob)
    src = PromptSource(rows, run_id="bench", seed=seed, shard=0, num_shards=workers)
    first = src.next()
    startup_s = time.perf_counter() - t0
    assert first.row is not None, first.error
    del blob
    t1 = time.perf_counter()
    for _ in range(draws):
        src.next()
    return {"startup_s": startup_s, "draw_ms": 1000 * (time.perf_counter() - t1) / max(draws, 1),
            "rss_growth_mb": _rss_mb() - rss0, "shipped_bytes": len(pickle.dumps(rows))}


def _measure(mode: str, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    code = (f"import json; from asyncrl.bench.data import child; "
            f"print(json.dumps(child({mode!r}, {str(path)!r}, {args.workers}, {args.draws}, {args.seed})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"the {mode} measurement of {path} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-data-") as tmp:
        t = time.perf_counter()
        large = write_dataset(Path(tmp) / "large.parquet", args.rows, args.distinct, args.seed)
        small = write_dataset(Path(tmp) / "small.parquet", args.small, args.distinct, args.seed)
        generate_s = time.perf_counter() - t
        big, little = _measure("stream", large, args), _measure("stream", small, args)
        whole = None if args.no_baseline else _measure("whole", large, args)
        size_mb = large.stat().st_size / 2**20
    out = {"rows": args.rows, "small_rows": args.small, "workers": args.workers, "draws": args.draws,
           "file_mb": round(size_mb, 1), "generate_s": round(generate_s, 1),
           "startup_s": round(big["startup_s"], 3), "startup_s_small": round(little["startup_s"], 3),
           "draw_ms": round(big["draw_ms"], 3), "handle_bytes": big["shipped_bytes"],
           "worker_rss_mb": round(big["rss_growth_mb"], 1), "worker_rss_mb_small": round(little["rss_growth_mb"], 1),
           "worker_rss_growth_mb": round(big["rss_growth_mb"] - little["rss_growth_mb"], 1)}
    if whole is not None:
        out.update({"baseline": "read_rows whole (to_pylist + validate), rows pickled to the worker",
                    "baseline_startup_s": round(whole["startup_s"], 2),
                    "baseline_worker_rss_mb": round(whole["rss_growth_mb"], 1),
                    "baseline_shipped_mb": round(whole["shipped_bytes"] / 2**20, 1),
                    "startup_ratio": round(whole["startup_s"] / big["startup_s"], 1)})
    return out
