#!/usr/bin/env bash
# Make .venv-sglang: SGLang 0.5.23's HTTP app importable on a CPU machine, for the contract tests
# in tests/sglang (pytest -m sglang, run with .venv-sglang/bin/python; they skip where sglang is
# not importable). Not a working SGLang: no CUDA, no scheduler; only the HTTP layer is exercised.
#
# - torch 2.13.0 CPU, installed first so nothing pulls a CUDA build; everything else --no-deps.
# - SGLang's wheel --no-deps: SGLANG_WHEEL if set, else `pip download --no-deps sglang==0.5.23`
#   (wheel only) into a temporary directory removed on exit.
# - The pure-Python modules the import chain of sglang.srt.entrypoints.http_server needs (found by
#   importing it and adding what was missing, one at a time), pinned as they worked.
# - torchvision: no CPU build matching torch 2.13.0 is installable here, and the chain touches it
#   only for vision preprocessing (transformers' image utils, sglang's internvl_utils), so a stub
#   package stands in; calling anything in it raises.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-sglang}
if [ -n "${SGLANG_WHEEL:-}" ] && [ ! -f "$SGLANG_WHEEL" ]; then
  echo "setup_sglang_env: SGLANG_WHEEL=$SGLANG_WHEEL is not a file" >&2; exit 1
fi
python3 -m venv "$VENV"
echo '*' > "$VENV/.gitignore"
P="$VENV/bin/pip"
WHEEL=${SGLANG_WHEEL:-}
if [ -z "$WHEEL" ]; then
  DL=$(mktemp -d)
  trap 'rm -rf "$DL"' EXIT
  "$P" download -q --no-deps --only-binary=:all: --dest "$DL" sglang==0.5.23
  WHEEL=$(ls "$DL"/sglang-0.5.23-*.whl 2>/dev/null | head -1)
  [ -n "$WHEEL" ] || { echo "setup_sglang_env: pip download sglang==0.5.23 gave no wheel in $DL" >&2; exit 1; }
fi
"$P" install -q torch==2.13.0
"$P" install -q --no-deps "$WHEEL"
"$P" install -q --no-deps \
  aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 \
  annotated-types==0.8.0 anyio==4.16.0 apache-tvm-ffi==0.1.15.post2 asttokens==3.0.2 attrs==26.1.0 \
  certifi==2026.10.18 cffi==2.1.1 charset-normalizer==3.5.2 click==8.5.1 compressed-tensors==0.20.0 \
  dill==0.4.1 einops==0.8.2 executing==2.3.0 fastapi==0.165.0 filelock==4.2.12 frozenlist==1.8.0 \
  fsspec==2026.9.0 gguf==0.19.0 h11==0.16.0 hf-xet==1.8.0 httpcore2==2.16.2 httpx2==2.16.2 \
  huggingface_hub==2.4.0 idna==3.20 ipython==9.18.1 ipython_pygments_lexers==1.1.1 jedi==0.20.1 \
  Jinja2==3.1.6 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 loguru==0.7.3 \
  markdown-it-py==4.3.0 MarkupSafe==3.0.4 matplotlib-inline==0.2.2 mdurl==0.1.2 mpmath==1.3.0 \
  msgspec==0.22.0 multidict==7.2.1 networkx==3.6.1 numpy==2.4.6 openai==3.54.0 \
  opentelemetry-api==1.45.2 orjson==3.13.0 packaging==26.3 parso==0.8.7 \
  partial-json-parser==0.2.1.1.post7 pexpect==4.9.0 pillow==13.0.0 prompt_toolkit==3.0.53 \
  propcache==0.5.4 psutil==7.2.2 ptyprocess==0.7.0 pure_eval==0.2.4 pybase64==1.5.1 pycparser==3.12 \
  pydantic==2.14.3 pydantic_core==2.50.4 Pygments==2.21.0 python-multipart==0.0.34 PyYAML==6.0.3 \
  pyzmq==27.3.0 referencing==0.37.0 regex==2026.11.15 requests==2.34.2 rich==15.0.0 rpds-py==2026.9.1 \
  safetensors==0.8.0 sentencepiece==0.2.3 setproctitle==1.3.8 shellingham==1.5.4 sniffio==1.3.1 \
  soundfile==0.14.0 stack-data==0.6.3 starlette==1.10.0 sympy==1.14.0 tokenizers==0.23.3 tqdm==4.70.1 \
  traitlets==5.16.1 transformers==5.23.0 triton==3.9.0 truststore==0.10.5 typer==0.29.2 \
  typing-inspection==0.4.5 typing_extensions==4.16.0 urllib3==2.8.0 uvicorn==0.54.0 uvloop==0.23.0 \
  wcwidth==0.9.4 xgrammar==0.2.8 yarl==1.25.1 \
  pytest==9.2.0 pytest-asyncio==1.5.0 pytest-timeout==2.4.0 pluggy==1.7.0 iniconfig==2.3.1 httpx==0.28.1 \
  httpcore==1.0.9
"$P" install -q --no-deps -e .
SP=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$SP/torchvision" "$SP/torchvision-0.28.0.dist-info"
cat > "$SP/torchvision/__init__.py" <<'PY'
"""asyncrl CPU test stub (scripts/setup_sglang_env.sh): no CPU build of torchvision for torch 2.13.0
is installable here, and SGLang's http_server import chain touches torchvision only for vision-model
preprocessing. Every submodule and attribute is a placeholder; calling one fails loudly."""

import importlib.abc
import importlib.machinery
import sys
import types


class _Placeholder:
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()

    def __call__(self, *a, **k):
        raise RuntimeError("torchvision is a stub in this environment (asyncrl's SGLang contract tests)")


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
__path__ = []


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder()
PY
printf 'Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\nSummary: asyncrl CPU test stub\n' \
  > "$SP/torchvision-0.28.0.dist-info/METADATA"
printf 'torchvision/__init__.py,,\n' > "$SP/torchvision-0.28.0.dist-info/RECORD"
"$VENV/bin/python" -c 'import torch, sglang.srt.entrypoints.http_server; assert torch.__version__.endswith("+cpu"), torch.__version__' \
  && echo "setup_sglang_env: sglang.srt.entrypoints.http_server imports in $VENV"
