#!/usr/bin/env bash
# Build the documentation site (mkdocs.yml) with every warning an error: a broken link, a missing page or an
# API docstring mkdocstrings cannot render fails the build. The site goes to SITE_DIR (default: a temporary
# directory, removed on exit); `SITE_DIR=site bash scripts/docs.sh` keeps it (site/ is ignored by git).
# The reference pages it shows are generated: python scripts/gen_reference.py.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${SITE_DIR:-}" ]; then
    out=$SITE_DIR
else
    out=$(mktemp -d)
    trap 'rm -rf "$out"' EXIT
fi
NO_MKDOCS_2_WARNING=1 python -m mkdocs build --strict --site-dir "$out"
echo "docs: mkdocs build --strict passed ($out)"
