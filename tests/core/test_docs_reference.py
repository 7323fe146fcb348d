"""docs/reference/cli.md and docs/reference/config.md are what scripts/gen_reference.py writes from the code
(the argparse parsers and the config schema): a changed option, key, default or description changes them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGES = ("cli.md", "config.md")


def test_reference_pages_are_current(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_reference.py"), "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    stale = [name for name in PAGES
             if not (REPO / "docs" / "reference" / name).is_file()
             or (REPO / "docs" / "reference" / name).read_text() != (tmp_path / name).read_text()]
    assert not stale, (f"docs/reference/{', '.join(stale)} out of date with the code: run "
                       "`python scripts/gen_reference.py` and commit the result")
