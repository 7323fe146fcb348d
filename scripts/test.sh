#!/usr/bin/env bash
# The test suite (CPU; tests marked gpu skip themselves without a GPU), in a random order
# (pytest-randomly), on ASYNCRL_TEST_WORKERS pytest-xdist workers (default 3, measured on 2 cores: 3
# workers took 11 min 24 s, 2 and 4 took 12 min 15 s, one about 20 min; with 3, both cores stay 95-99%
# busy, so more workers cannot help; 0 runs it in this process). The seed is printed first;
# ASYNCRL_TEST_SEED=N replays that order. The heavy tests start first, spread over the workers
# (tests/conftest.py spread_heavy_tests). The slowest 15 are listed.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
# Bytecode caches (gitignored): without them every worker and every process a test starts compiles
# asyncrl and re-does pytest's assertion rewriting (about 9 s of CPU for each worker's collection).
unset PYTHONDONTWRITEBYTECODE
SEED=${ASYNCRL_TEST_SEED:-$((RANDOM * 32768 + RANDOM))}
WORKERS=${ASYNCRL_TEST_WORKERS:-3}
echo "test order: --randomly-seed=$SEED on $WORKERS workers (replay it: ASYNCRL_TEST_SEED=$SEED bash scripts/test.sh)"
exec python -m pytest -q -p no:cacheprovider -p randomly --randomly-seed="$SEED" -n "$WORKERS" --dist worksteal \
    --durations=15 "$@"
