"""`asyncrl view RUN_DIR [--filter TEXT] [--print] [--no-live]`: browse a run's trajectories (asyncrl/view/app.py).

On a terminal it opens the viewer; `--print` (or no terminal) prints the filtered table as tab-separated
lines instead. Tokens are decoded with the run's tokenizer (the model in the run's config.json); without one
the token view shows ids.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from asyncrl.view.records import FilterError, RunReader, parse_filter


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run's output dir (outputs/<run>)")
    parser.add_argument("--filter", default="", help="start with this filter, e.g. 'reward>=1 tool_errors'")
    parser.add_argument("--print", action="store_true", help="print the filtered table and exit (no UI)")
    parser.add_argument("--no-live", action="store_true", help="do not follow the files as the run writes them")


def run_decoder(run_dir: Path) -> tuple[Optional[Callable[[int], str]], str]:
    """A one-token decoder from the run's model, or None and why not."""
    try:
        # lazy: optional: the except below reports a missing package
        from asyncrl.config import ModelConfig, from_dict
        from asyncrl.models import load_tokenizer
        from asyncrl.run_dir import RunLayout

        model = json.loads(RunLayout(run_dir).config.read_text())["model"]
        tok = load_tokenizer(from_dict(ModelConfig, model))
    except Exception as e:  # a viewer without a tokenizer still shows everything but token text
        return None, f"{type(e).__name__}: {e}"
    return (lambda i: tok.decode([i])), ""


def main(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    try:
        reader = RunReader(run_dir)
        flt = parse_filter(args.filter)
    except (FileNotFoundError, FilterError) as e:
        print(f"asyncrl view: {e}", file=sys.stderr)
        return 2
    if args.print or not sys.stdout.isatty():
        # lazy: imports textual, which this module does not load otherwise
        from asyncrl.view.app import COLUMNS, table_cells

        reader.poll()
        print("\t".join(COLUMNS))
        for row in reader.rows:
            if flt.matches(row):
                print("\t".join(c.plain for c in table_cells(row)))
        return 0
    # lazy: imports textual, which this module does not load otherwise
    from asyncrl.view.app import ViewerApp

    decode, why = run_decoder(run_dir)
    if decode is None:
        print(f"asyncrl view: token text unavailable ({why}); the token view shows ids", file=sys.stderr)
    app = ViewerApp(str(run_dir), live=not args.no_live, decode=decode)
    app.filter = flt
    app.run()
    return 0
