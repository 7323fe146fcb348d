"""`asyncrl data <env> --demos --out DIR [--split train] [--limit N]`: solved, checked demonstrations.

The config is the env's (configs/env/<env>.yaml: its tools) with the default agent (tool_agent) and model
(its tokenizer and chat format); the env's services run (search_r1's retrieval server) so the tools really
answer. Writes DIR/demos-<split>.jsonl (asyncrl/sft/demos.py for the row shape) and prints a JSON line;
rows whose demonstration failed a check are named on stderr and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from asyncrl.config import ConfigError, load_config


def demos_command(env: Any, args: argparse.Namespace) -> int:
    # lazy: imports pyarrow, which this module does not load otherwise
    from asyncrl.sft.demos import demonstrate, write_demos

    if args.limit is not None and args.limit < 1:
        print(f"asyncrl data: --limit must be >= 1, got {args.limit}", file=sys.stderr)
        return 2
    overrides = [f"env={env.name}", f"env.seed={args.seed}", f"env.num_train={args.num_train}",
                 f"env.num_val={args.num_val}"]
    if getattr(args, "difficulty", None):
        overrides.append("env.difficulty=[" + ",".join(str(d) for d in args.difficulty) + "]")
    try:
        cfg = load_config(overrides)
    except ConfigError as e:
        print(f"asyncrl data: config error: {e}", file=sys.stderr)
        return 2
    rows = env.build(cfg.env, args.split)[: args.limit]
    report = demonstrate(cfg, env, list(enumerate(rows)))
    out = Path(args.out) / f"demos-{args.split}.jsonl"
    write_demos(report.rows, out)
    print(json.dumps({"path": str(out), "demos": len(report.rows), "rejected": len(report.rejected),
                      "rows": len(rows), "split": args.split}))
    for i, why in report.rejected[:20]:
        print(f"asyncrl data: row {i} of the {args.split} split has no demonstration: {why}", file=sys.stderr)
    if len(report.rejected) > 20:
        print(f"asyncrl data: ... and {len(report.rejected) - 20} more rows", file=sys.stderr)
    return 1 if report.rejected else 0
