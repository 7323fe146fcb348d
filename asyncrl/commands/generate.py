"""`asyncrl generate [MODEL] [key=value ...] --out FILE.parquet [-n N] [--split train|val | --data FILE]`.

Runs every row of a dataset through the configured agent loop (N samples each, seeds fixed by --seed, row
and sample: asyncrl/offline/session.py) and writes a parquet with one row per input row: `data_index`,
`data_source`, `prompt` (JSON), `ground_truth` (JSON), `responses` (the final assistant text of each
sample), `rewards` (the env's reward of each), `finish_reasons`, `num_turns` and `messages` (each sample's
conversation, JSON) -- verl's generation entry point, with the agent loop's multi-turn conversations.

Resumable. Finished rows are written in chunks of --chunk-rows to `FILE.parquet.parts/` (each chunk a new
file, written to a temp name and renamed), beside `job.json` naming what the job is (model, data, N, seed):
run the same command again after an interruption and only the rows no chunk holds run; a different job
in the same parts dir is refused. When every row is written the chunks are merged by data_index into
FILE.parquet (temp + rename) and the parts dir is removed. A row with a failed sample is not written:
the exit status is 1, naming the first error, and running the command again retries exactly those rows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from asyncrl.commands.eval import split_items
from asyncrl.config import ConfigError
from asyncrl.metrics import StatusLine
from asyncrl.util.stop_signals import interrupted, raise_if_stopping, stopping_on_signals

RAW_ARGS = True  # Hydra overrides mix with the flags: parsed here (parse_intermixed_args)
JOB_FILE = "job.json"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asyncrl generate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Example:\n  asyncrl generate outputs/<run> --out responses.parquet -n 4")
    p.add_argument("items", nargs="*", metavar="MODEL | key=value",
                   help="MODEL (a run dir, checkpoint, HF dir or hub id; default: the configured model) and "
                        "Hydra overrides as for asyncrl train")
    p.add_argument("--out", required=True, help="the parquet file to write (FILE.parquet)")
    p.add_argument("-n", type=int, default=1, help="samples per row (default: %(default)s)")
    p.add_argument("--split", choices=("train", "val"), default="train", help="the env's split (default: %(default)s)")
    p.add_argument("--data", default=None, help="a parquet/jsonl of rows instead of the env's split")
    p.add_argument("--limit", type=int, default=None, help="only the first N rows")
    p.add_argument("--seed", type=int, default=0, help="fixes every sample's sampling seed (default: %(default)s)")
    p.add_argument("--chunk-rows", type=int, default=16, help="rows per chunk written (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=None, help="episodes at once (default: engine.max_running_seqs)")
    return p


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def parts_dir(out: Path) -> Path:
    return out.with_name(out.name + ".parts")


def done_indices(parts: Path) -> set[int]:
    """data_index of every row the chunks in `parts` hold (a temp file of an interrupted write is not a chunk)."""
    # lazy: imports pyarrow, which this module does not load otherwise
    import pyarrow.parquet as pq

    done: set[int] = set()
    for f in sorted(parts.glob("chunk-*.parquet")):
        done.update(pq.read_table(f, columns=["data_index"]).column("data_index").to_pylist())
    return done


def claim_job(parts: Path, job: dict[str, Any]) -> None:
    """Create `parts` for `job`, or check that the job already there is the same one."""
    f = parts / JOB_FILE
    if f.is_file():
        old = json.loads(f.read_text())
        if old != job:
            diff = {k: (old.get(k), job.get(k)) for k in set(old) | set(job) if old.get(k) != job.get(k)}
            raise ValueError(f"{parts} holds the chunks of a different job (differs in {diff}); use another --out "
                             "or remove that directory")
        return
    parts.mkdir(parents=True, exist_ok=True)
    tmp = f.with_suffix(".tmp")
    tmp.write_text(json.dumps(job, indent=2, sort_keys=True))
    os.replace(tmp, f)


def row_record(i: int, results: list) -> dict[str, Any]:
    row = results[0].row
    return {
        "data_index": i, "data_source": str(row.get("data_source") or ""),
        "prompt": json.dumps(row.get("prompt"), default=str),
        "ground_truth": json.dumps((row.get("reward_model") or {}).get("ground_truth"), default=str),
        "responses": [r.response() for r in results],
        "rewards": [float(r.trajectory.reward) for r in results],
        "finish_reasons": [r.trajectory.finish_reason for r in results],
        "num_turns": [int(r.trajectory.num_turns) for r in results],
        "messages": [json.dumps(r.trajectory.messages, default=str) for r in results],
    }


def write_chunk(parts: Path, records: list[dict[str, Any]]) -> Path:
    # lazy: imports pyarrow, which this module does not load otherwise
    import pyarrow as pa
    import pyarrow.parquet as pq

    first = min(r["data_index"] for r in records)
    dest = parts / f"chunk-{first:09d}-{time.time_ns()}.parquet"
    tmp = parts / f".{dest.name}.tmp"
    pq.write_table(pa.Table.from_pylist(records), tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, dest)
    return dest


def merge(parts: Path, out: Path) -> int:
    """The chunks as one parquet sorted by data_index at `out` (temp + rename); the number of rows."""
    # lazy: imports pyarrow, which this module does not load otherwise
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = [pq.read_table(f) for f in sorted(parts.glob("chunk-*.parquet"))]
    table = pa.concat_tables(tables).sort_by("data_index")
    tmp = out.with_name(f".{out.name}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, out)
    shutil.rmtree(parts)
    return table.num_rows


def main(args: argparse.Namespace) -> int:
    # lazy: imports torch, which this module does not load otherwise
    from asyncrl.offline.checkpoints import CheckpointPathError, resolve_model_source
    from asyncrl.offline.session import OfflineError, compose_config, load_split

    a = build_parser().parse_intermixed_args(args.argv)
    out = Path(a.out)
    try:
        for name in ("n", "chunk_rows", "limit", "concurrency"):
            v = getattr(a, name)
            if v is not None and v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
        if out.suffix != ".parquet":
            raise ValueError(f"--out {a.out!r} must name a .parquet file")
        if out.exists() and not parts_dir(out).exists():
            print(f"asyncrl generate: {out} is already complete; nothing to do (remove it to generate again)")
            return 0
        spec, overrides = split_items(a.items)
        source = resolve_model_source(spec)
        cfg = compose_config(source, overrides)
        rows = load_split(cfg, a.split, a.limit, data_file=a.data)
        job = {"model": source.label, "data": str(Path(a.data).resolve()) if a.data else f"{cfg.env.name}:{a.split}",
               "rows": len(rows), "n": a.n, "seed": a.seed, "agent": cfg.agent.name, "overrides": overrides}
        parts = parts_dir(out)
        claim_job(parts, job)
    except (ValueError, ConfigError, CheckpointPathError, OfflineError) as e:
        print(f"asyncrl generate: {e}", file=sys.stderr)
        return 2
    with stopping_on_signals() as got:
        try:
            return run_generate(cfg, source, rows, out, parts, a)
        except KeyboardInterrupt:
            return interrupted("asyncrl generate", got,
                               f"the rows written so far are kept in {parts}; the same command resumes from them")


def run_generate(cfg: Any, source: Any, rows: list[tuple[int, dict]], out: Path, parts: Path,
                 a: argparse.Namespace) -> int:
    # lazy: imports torch, which this module does not load otherwise
    from asyncrl.offline.session import agent_context, prepare_model, run_rows

    line = StatusLine()
    done = done_indices(parts)
    todo = [(i, row) for i, row in rows if i not in done]
    failed: list[tuple[int, str]] = []
    if todo:
        line.status(f"generate: {len(done)} of {len(rows)} rows already written; {len(todo)} to run")
        cfg = prepare_model(cfg, source, parts, line.status)
        pending: list[dict[str, Any]] = []
        written = [len(done)]

        def flush() -> None:
            if pending:
                write_chunk(parts, pending)
                written[0] += len(pending)
                pending.clear()

        def on_row(i: int, results: list) -> None:
            raise_if_stopping()  # a signal whose KeyboardInterrupt a finalizer swallowed
            errors = [r.error for r in results if r.error]
            if errors:
                failed.append((i, errors[0]))
            else:
                pending.append(row_record(i, results))
                if len(pending) >= a.chunk_rows:
                    flush()
            line.status(f"generate: {written[0] + len(pending)}/{len(rows)} rows"
                        + (f", {len(failed)} failed" if failed else ""))

        with agent_context(cfg, parts, line.status) as ctx:
            try:
                asyncio.run(run_rows(ctx, cfg.agent.name, todo, a.n, a.seed,
                                     a.concurrency or cfg.engine.max_running_seqs, on_row))
            finally:
                flush()  # rows finished before an interruption are kept
        line.close()
    if failed:
        print(f"asyncrl generate: {len(failed)} row(s) had a failed sample and were not written (the first: "
              f"data_index {failed[0][0]}: {failed[0][1]}); run the same command again to retry them", file=sys.stderr)
        return 1
    n = merge(parts, out)
    print(json.dumps({"out": str(out), "rows": n, "samples_per_row": a.n}))
    return 0
