"""docs/reference/cli.md and docs/reference/config.md are what scripts/gen_reference.py writes from the code
(the argparse parsers and the config schema): a changed option, key, default or description changes them.
The pages are built in this process (the worker has the modules imported already; a fresh interpreter cost
the suite about 7 s of CPU), with the script's own fixed terminal width."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_reference_pages_are_current(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")  # what the script sets at import; restored after the test
    spec = importlib.util.spec_from_file_location("gen_reference", REPO / "scripts" / "gen_reference.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    pages = {"cli.md": gen.cli_page(), "config.md": gen.config_page()}
    stale = [name for name, text in pages.items()
             if not (REPO / "docs" / "reference" / name).is_file()
             or (REPO / "docs" / "reference" / name).read_text() != text]
    assert not stale, (f"docs/reference/{', '.join(stale)} out of date with the code: run "
                       "`python scripts/gen_reference.py` and commit the result")
