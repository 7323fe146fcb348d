from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    """The real SmolLM2 tokenizer (ChatML template) shipped with the tiny model."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
