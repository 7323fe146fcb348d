"""`asyncrl data check FILE [--skip-bad]`: reads every row, a record batch at a time; exit 1 naming the
first bad row's index and field; with --skip-bad, counts the bad rows and exits 0.
`asyncrl data ENV ...` dispatches to the env class's `add_data_arguments(parser)` /
`data_command(args) -> int`; `--demos` writes solved, checked demonstrations instead of rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional

from asyncrl import registry
from asyncrl.data.rows import DataError, iter_file, normalize_row, validate_row
from asyncrl.envs.base import can_demonstrate
from asyncrl.sft.cli import demos_command


def _env_classes() -> dict[str, Any]:
    out = {}
    for name in registry.names("env"):
        cls = registry.get("env", name)
        if hasattr(cls, "add_data_arguments") and hasattr(cls, "data_command"):
            out[name] = cls
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="data_command", metavar="{check,ENV}", required=True)
    check = sub.add_parser("check", help="validate a parquet/jsonl dataset against the verl row schema")
    check.add_argument("file")
    check.add_argument("--skip-bad", action="store_true", help="count bad rows instead of failing on the first")
    for name, cls in _env_classes().items():
        p = sub.add_parser(name, help=(cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else None)
        cls.add_data_arguments(p)
        if can_demonstrate(cls):
            p.add_argument("--demos", action="store_true",
                           help="write solved, checked demonstrations (demos-<split>.jsonl in --out) instead of rows")
            p.add_argument("--split", choices=("train", "val"), default="train", help="--demos: the split to solve")
            p.add_argument("--limit", type=int, default=None, help="--demos: only the first N rows")


def main(args: argparse.Namespace) -> int:
    if args.data_command == "check":
        return _check_command(args.file, skip_bad=args.skip_bad)
    cls = _env_classes()[args.data_command]
    env = cls() if isinstance(cls, type) else cls
    if getattr(args, "demos", False):
        return demos_command(env, args)
    return int(env.data_command(args) or 0)


def _check_command(path: str, *, skip_bad: bool) -> int:
    """Validate every row, a record batch at a time (memory bounded whatever the file's size)."""
    rows = bad = 0
    first: Optional[DataError] = None
    try:
        for i, row in enumerate(iter_file(path)):
            rows += 1
            try:
                validate_row(normalize_row(row) if isinstance(row, dict) else row, i)
            except DataError as e:
                bad += 1
                first = first or e
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if bad and not skip_bad:
        print(f"error: {path}: {first} ({bad} bad of {rows} rows; --skip-bad skips them)", file=sys.stderr)
        return 1
    print(json.dumps({"file": str(path), "rows": rows, "valid": rows - bad, "skipped": bad}))
    if bad:
        print(f"skipped {bad} bad rows; first: {first}", file=sys.stderr)
    return 0 if rows > bad else 1
