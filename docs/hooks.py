"""MkDocs hook (mkdocs.yml `hooks:`): the site's home page is the README.

The README links to docs pages as `docs/<page>` (right on GitHub, relative to the repository root); the
site serves the docs folder at its root, so those links lose their `docs/` prefix here. One file, the
README, stays the only copy of the home page.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

README = Path(__file__).resolve().parents[1] / "README.md"


def home_page() -> str:
    return re.sub(r"\]\(docs/", "](", README.read_text())


def on_files(files, config):
    files.append(File.generated(config, "index.md", content=home_page()))
    return files
