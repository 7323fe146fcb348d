"""Small real models for tests and benchmarks: a tiny Llama built from a config, with the default
model's real tokenizer (and its ChatML chat template), saved as a plain HF directory."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from asyncrl.config import ModelConfig
from asyncrl.models import resolve_model_dir


def build_tiny_model(out_dir: str | Path, *, hidden: int = 64, layers: int = 2) -> Path:
    """Write a randomly initialised (seed 0) tiny LlamaForCausalLM plus the SmolLM2 tokenizer to `out_dir`;
    an `out_dir` that already holds one is returned as it is."""
    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    tok = AutoTokenizer.from_pretrained(resolve_model_dir(ModelConfig()))
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out
