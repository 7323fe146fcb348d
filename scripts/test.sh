#!/usr/bin/env bash
# The test suite (CPU; tests marked gpu skip themselves without a GPU), in a random order
# (pytest-randomly). The seed is printed first; ASYNCRL_TEST_SEED=N replays that order.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
SEED=${ASYNCRL_TEST_SEED:-$((RANDOM * 32768 + RANDOM))}
echo "test order: --randomly-seed=$SEED (replay it: ASYNCRL_TEST_SEED=$SEED bash scripts/test.sh)"
exec python -m pytest -q -p no:cacheprovider -p randomly --randomly-seed="$SEED" --durations=15 "$@"
