"""`asyncrl eval [MODEL] [key=value ...] [-k K] [--split val] [--seed S] [--limit N] [--out DIR]`: measure a model.

MODEL is a run dir (its final/), a training checkpoint, a Hugging Face dir or hub id (asyncrl/offline/
checkpoints.py); none: the configured model (the base model). The dataset split's rows run through the
configured agent loop and engine, K samples each with seeds fixed by (--seed, row, sample), scored by the
env's reward (asyncrl/offline/scores.py: mean@K, pass@1, pass@K, tool-call rate, the reward's parts, per
data source). Written to --out: episodes.jsonl (every episode, as it finishes) and summary.json; the summary
is printed as one JSON line at the end. Exit 0; 1 when an episode failed (each counted as reward 0, and
named); 2 for a mistake found before anything started (a bad MODEL, override or row). `--against EVAL_DIR`
pairs this eval's episodes with an earlier one's (asyncrl/offline/paired.py) and adds the changed episodes
and their sign test to the summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from asyncrl.config import ConfigError
from asyncrl.metrics import StatusLine, eta_seconds, format_duration
from asyncrl.offline.paired import against, read_episodes
from asyncrl.offline.scores import summarize
from asyncrl.util.stop_signals import interrupted, raise_if_stopping, stopping_on_signals

RAW_ARGS = True  # Hydra overrides mix with the flags: parsed here (parse_intermixed_args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asyncrl eval", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Examples:\n  asyncrl eval -k 4                       # the base model\n"
                                       "  asyncrl eval outputs/<run> -k 4          # that run's final/\n"
                                       "  asyncrl eval outputs/<run>/checkpoints/step_000010 env=search_r1")
    p.add_argument("items", nargs="*", metavar="MODEL | key=value",
                   help="MODEL (a run dir, checkpoint, HF dir or hub id; default: the configured model) and "
                        "Hydra overrides as for asyncrl train")
    p.add_argument("-k", type=int, default=4, help="samples per prompt (default: %(default)s)")
    p.add_argument("--split", choices=("val", "train"), default="val", help="dataset split (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="fixes every episode's sampling seed (default: %(default)s)")
    p.add_argument("--limit", type=int, default=None, help="only the first N rows of the split")
    p.add_argument("--threshold", type=float, default=1.0,
                   help="a reward >= this is a success for pass@k (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="episodes at once (default: engine.max_running_seqs)")
    p.add_argument("--out", default=None, help="output dir (default: outputs/eval/<UTC time>); must be empty")
    p.add_argument("--dry-run", action="store_true",
                   help="check the model, overrides, split and --against, print what would run, start nothing")
    p.add_argument("--against", default=None, metavar="EVAL_DIR",
                   help="an earlier eval's --out dir with the same split, -k, --seed and --limit: pair the episodes "
                        "and report the changes with a sign test (asyncrl/offline/paired.py) in summary.json")
    return p


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def split_items(items: list[str]) -> tuple[str | None, list[str]]:
    """MODEL (the one item without '=') and the overrides; two MODELs are a usage error."""
    models = [x for x in items if "=" not in x]
    if len(models) > 1:
        raise ValueError(f"one MODEL at most, got {models}; overrides are key=value")
    return (models[0] if models else None), [x for x in items if "=" in x]


def fresh_dir(out: str | None, default_parent: str) -> Path:
    """The output dir, created; an existing non-empty one is refused (results are never mixed)."""
    path = Path(out) if out else Path(default_parent) / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ValueError(f"--out {str(path)!r} exists and is not an empty directory; name a new one")
    path.mkdir(parents=True, exist_ok=True)
    return path


def main(args: argparse.Namespace) -> int:
    # lazy: imports torch, which this module does not load otherwise
    from asyncrl.offline.checkpoints import CheckpointPathError, resolve_model_source
    from asyncrl.offline.session import OfflineError, compose_config, load_split

    a = build_parser().parse_intermixed_args(args.argv)
    try:
        if a.k < 1:
            raise ValueError(f"-k must be >= 1, got {a.k}")
        if a.limit is not None and a.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {a.limit}")
        if a.concurrency is not None and a.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {a.concurrency}")
        spec, overrides = split_items(a.items)
        source = resolve_model_source(spec)
        cfg = compose_config(source, overrides)
        rows = load_split(cfg, a.split, a.limit)
        baseline = read_episodes(a.against) if a.against else None
        if a.dry_run:
            print(json.dumps({"dry_run": True, "model": source.label, "model_dir": cfg.model.path or "(default model)",
                              "env": cfg.env.name, "agent": cfg.agent.name, "split": a.split, "rows": len(rows),
                              "k": a.k, "seed": a.seed, "against": a.against}))
            return 0
        out = fresh_dir(a.out, "outputs/eval")
    except (ValueError, ConfigError, CheckpointPathError, OfflineError) as e:
        print(f"asyncrl eval: {e}", file=sys.stderr)
        return 2
    with stopping_on_signals() as got:
        try:
            return run_eval(cfg, source, rows, out, a, baseline)
        except KeyboardInterrupt:
            return interrupted("asyncrl eval", got,
                               f"the episodes finished so far are in {out / 'episodes.jsonl'}; no summary was written")


def run_eval(cfg: Any, source: Any, rows: list[tuple[int, dict]], out: Path, a: argparse.Namespace,
             baseline: list[dict[str, Any]] | None = None) -> int:
    # lazy: imports torch, which this module does not load otherwise
    from asyncrl.offline.session import agent_context, prepare_model, run_rows

    line = StatusLine()
    cfg = prepare_model(cfg, source, out, line.status)
    records: list[dict[str, Any]] = []
    total = len(rows) * a.k
    t0 = time.time()
    hidden = [a.against] if a.against else []  # the baseline's episodes, answers included: kept from the sandbox
    with open(out / "episodes.jsonl", "w") as f, agent_context(cfg, out, line.status, hidden) as ctx:
        def on_row(i: int, results: list) -> None:
            raise_if_stopping()  # a signal whose KeyboardInterrupt a finalizer swallowed
            for r in results:
                rec = r.record()
                records.append(rec)
                f.write(json.dumps(rec, default=str) + "\n")
            f.flush()
            done = len(records)
            eta = eta_seconds(done, total, (0, t0, 0.0), time.time()) if done else None
            line.status(f"eval: {done}/{total} episodes ({done // a.k}/{len(rows)} prompts)"
                        + (f" | eta {format_duration(eta)}" if eta else ""))

        line.status(f"eval: 0/{total} episodes ({len(rows)} prompts x {a.k} samples)")
        asyncio.run(run_rows(ctx, cfg.agent.name, rows, a.k, a.seed, a.concurrency or cfg.engine.max_running_seqs,
                             on_row))
    line.close()
    summary = {"model": source.label, "model_dir": cfg.model.path or "(default model)", "env": cfg.env.name,
               "agent": cfg.agent.name, "split": a.split, "k": a.k, "seed": a.seed, "threshold": a.threshold,
               "temperature": cfg.agent.sampling.temperature, "seconds": round(time.time() - t0, 1),
               **summarize(records, a.k, a.threshold)}
    if baseline is not None:
        summary["against"], said = against(baseline, records, a.threshold, str(a.against), source.label)
        print(f"asyncrl eval: {said}", file=sys.stderr)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    print(f"episodes: {out / 'episodes.jsonl'}\nsummary: {out / 'summary.json'}", file=sys.stderr)
    failed = [r for r in records if r["error"]]
    if failed:
        print(f"asyncrl eval: {len(failed)} of {len(records)} episodes failed (scored 0); the first: data_index "
              f"{failed[0]['data_index']} sample {failed[0]['sample_index']}: {failed[0]['error']}", file=sys.stderr)
        return 1
    return 0
