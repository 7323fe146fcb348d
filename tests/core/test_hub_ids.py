"""model.path as a Hugging Face hub id resolved offline from the local HF cache (asyncrl/models.py
local_model_path), and the error that says what was looked for where."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from huggingface_hub import constants

from asyncrl.config import Config, ModelConfig
from asyncrl.models import ModelNotFoundError, resolve_model_dir
from asyncrl.run.preflight import check_model


def _cache_with(cache: Path, repo: str, model_dir: Path) -> Path:
    """The hub cache layout snapshot_download reads: models--org--name/{refs/main, snapshots/<rev>/...}."""
    root = cache / f"models--{repo.replace('/', '--')}"
    rev = "0123456789abcdef0123456789abcdef01234567"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(rev)
    shutil.copytree(model_dir, root / "snapshots" / rev)
    return root / "snapshots" / rev


def test_a_hub_id_in_the_local_cache_resolves_offline_and_an_absent_one_says_where_it_looked(
        tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)  # "org/tiny" is no directory relative to here
    snap = _cache_with(tmp_path / "hub", "org/tiny", tiny_model_dir)
    assert resolve_model_dir(ModelConfig(name="custom", path="org/tiny")) == snap
    cfg = Config(model=ModelConfig(name="custom", path="org/tiny"))
    assert check_model(cfg) == (str(snap), [])

    with pytest.raises(ModelNotFoundError) as e:
        resolve_model_dir(ModelConfig(name="custom", path="org/absent"))
    msg = str(e.value)
    assert "model.path='org/absent': no such directory" in msg
    assert f"looked in {tmp_path / 'hub'}/models--org--absent" in msg
    assert "downloads are off: set model.allow_download=true" in msg
    where, problems = check_model(Config(model=ModelConfig(name="custom", path="org/absent")))
    assert where is None and "not in the local cache" in problems[0] and "\n" not in problems[0]


def test_a_local_directory_wins_over_a_hub_id_and_non_ids_are_paths(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    _cache_with(tmp_path / "hub", "org/tiny", tiny_model_dir)
    shutil.copytree(tiny_model_dir, tmp_path / "org" / "tiny")
    assert resolve_model_dir(ModelConfig(name="custom", path="org/tiny")) == Path("org/tiny")
    for not_an_id in ("./nowhere/x", "/abs/nowhere", "a/b/c", "../up/x"):
        with pytest.raises(ModelNotFoundError, match="no Hugging Face checkpoint there"):
            resolve_model_dir(ModelConfig(name="custom", path=not_an_id))
