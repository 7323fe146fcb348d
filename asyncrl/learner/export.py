"""`asyncrl export --checkpoint DIR --out DIR`: a training checkpoint as a plain Hugging Face directory.

The checkpoint's config.json names the model it was trained from (model.path or the default model);
that model's architecture and tokenizer are rebuilt (with its LoRA adapters when model.lora.rank > 0,
merged into the weights after loading), the DCP model state loaded (resharded to one process), and the
result saved with `save_pretrained` (safetensors) into a temp dir renamed into place.
The output loads with AutoModelForCausalLM.from_pretrained(out) alone.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from asyncrl.config import Config, ModelConfig, from_dict
from asyncrl.learner import checkpoint as ckpt
from asyncrl.learner.lora import apply_lora, lora_scaling, merge_state_dict
from asyncrl.models import load_model, resolve_model_dir


def save_hf(state_dict: dict[str, torch.Tensor], model_cfg: ModelConfig, out_dir: Path) -> Path:
    """Write `state_dict` (full, unsharded) as an HF directory of the configured model's architecture."""
    src = resolve_model_dir(model_cfg)
    config = AutoConfig.from_pretrained(src)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    tied = getattr(config, "tie_word_embeddings", False)
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"exported state dict does not fit {type(model).__name__}: missing={missing} unexpected={unexpected}")
    if tied:
        model.tie_weights()
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(src).save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def export_checkpoint(checkpoint: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Load the model state of a `LearnerWorker.save_checkpoint` directory and write it as an HF directory."""
    cfg: Config = from_dict(Config, ckpt.read_config(checkpoint))
    model = load_model(cfg.model, device="cpu", dtype="float32")
    lora = cfg.model.lora
    if lora.rank:  # the checkpoint holds the adapters unmerged: rebuild them, load, merge
        apply_lora(model, lora.rank, lora.alpha, list(lora.target_modules), lora.seed)
    ckpt.load(checkpoint, model, None)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    if lora.rank:
        sd = merge_state_dict(sd, lora_scaling(lora))
    return save_hf(sd, cfg.model, Path(out_dir))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="a checkpoint directory (outputs/.../checkpoints/step_N)")
    parser.add_argument("--out", required=True, help="where to write the Hugging Face directory")


def main(args: argparse.Namespace) -> int:
    try:
        out = export_checkpoint(args.checkpoint, args.out)
    except ckpt.CheckpointError as e:
        print(f"asyncrl export: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0
