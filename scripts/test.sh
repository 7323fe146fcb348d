#!/usr/bin/env bash
# The test suite (CPU; tests marked gpu skip themselves without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
exec python -m pytest -q -p no:cacheprovider --durations=15 "$@"
