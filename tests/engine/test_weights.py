"""Weight updates: /update_weights_from_disk on a real server (SGLang 0.5's answers: string versions,
400 with success=false), versions per token, apply_weights errors."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from tests.engine.conftest import greedy_path, greedy_reference, post, stats, wait_tokens


async def model_info(url: str) -> dict:
    async with httpx.AsyncClient(timeout=10) as h:
        return (await h.get(url + "/model_info")).json()


@pytest.fixture(scope="module")
def other_model_dir(tiny_model_dir, tmp_path_factory):
    from tests.engine.conftest import build_untied

    return build_untied(tiny_model_dir, tmp_path_factory.mktemp("tiny_seed1"), seed=1)


@pytest.fixture()
def fresh_engine(engine_model_dir, other_model_dir, tmp_path):
    """A server of its own (its weights change), starting at weight_version 3; it may load weights
    from the other model's directory and the test's tmp_path."""
    from asyncrl.engine.launcher import launch_embedded

    proc = launch_embedded(engine_model_dir, threads=1, weight_version=3, startup_timeout_s=120,
                           weights_dirs=[other_model_dir, tmp_path])
    yield proc
    proc.stop()


@pytest.mark.timeout(180)
async def test_update_weights_from_disk_changes_outputs_and_versions(fresh_engine, tiny_model, engine_model_dir,
                                                                     other_model_dir, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    save_file({"model.norm.weight": torch.zeros(3)}, str(bad_dir / "model.safetensors"))

    url = fresh_engine.url
    other = AutoModelForCausalLM.from_pretrained(other_model_dir, dtype=torch.float32).eval()
    p = list(range(400, 420))
    body = {"input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": 12, "min_new_tokens": 12}}
    before = (await post(url, "/generate", body)).json()
    assert before["output_ids"] == greedy_reference(tiny_model, p, 12)
    assert before["meta_info"]["weight_version"] == "3"

    r = await post(url, "/update_weights_from_disk", {"model_path": str(other_model_dir), "weight_version": "4"})
    assert r.status_code == 200 and r.json()["success"] is True and r.json()["num_paused_requests"] == 0
    after = (await post(url, "/generate", body)).json()
    assert after["output_ids"] == greedy_reference(other, p, 12) != before["output_ids"]
    assert after["meta_info"]["weight_versions"] == [{"version": "4", "start": 0, "end": 12}]
    assert after["meta_info"]["weight_version"] == "4"
    # no weight_version: the weights change, the version stays (SGLang)
    r = await post(url, "/update_weights_from_disk", {"model_path": str(other_model_dir)})
    assert r.status_code == 200 and (await model_info(url))["weight_version"] == "4"

    # a request that spans an update: tokens before it carry 4, after it 9
    long_body = {"input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": 400, "min_new_tokens": 400}}
    start = (await stats(url))["tokens_out"]
    task = asyncio.create_task(post(url, "/generate", long_body))
    await wait_tokens(url, start + 3)
    await post(url, "/pause_generation", {"mode": "in_place"})
    k = (await stats(url))["tokens_out"] - start
    r = await post(url, "/update_weights_from_disk", {"model_path": str(engine_model_dir), "weight_version": "9"})
    assert r.status_code == 200 and r.json()["success"] is True
    await post(url, "/continue_generation", {})
    o = (await task).json()
    spans = o["meta_info"]["weight_versions"]  # SGLang's shape: runs of output tokens per version
    assert spans == [{"version": "4", "start": 0, "end": k}, {"version": "9", "start": k, "end": 400}]
    assert o["meta_info"]["weight_version"] == "9"
    assert (await model_info(url))["weight_version"] == "9"
    # a refused load is HTTP 400 with success=false naming the problem; a malformed request is HTTP 400
    # without "success"; the server keeps serving, on the weights and version it had
    missing = str(tmp_path / "nonexistent")
    r = await post(url, "/update_weights_from_disk", {"model_path": missing, "weight_version": "10"})
    assert r.status_code == 400 and r.json()["success"] is False and missing in r.json()["message"]
    r = await post(url, "/update_weights_from_disk", {"model_path": str(bad_dir), "weight_version": "10"})
    assert r.status_code == 400 and r.json()["success"] is False and "model.norm.weight" in r.json()["message"]
    for bad in [{}, {"model_path": 3}, {"model_path": str(engine_model_dir), "weight_version": 10}, "[1]"]:
        r = await post(url, "/update_weights_from_disk", bad)
        assert r.status_code == 400 and "success" not in r.json(), bad
    assert (await model_info(url))["weight_version"] == "9"
    ok = (await post(url, "/generate", body)).json()
    assert greedy_path(tiny_model, p, ok["output_ids"]) == ok["output_ids"]  # back on the original weights


@pytest.mark.timeout(60)
async def test_apply_weights_rejects_unknown_names_and_shapes(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from asyncrl.engine.scheduler import EngineCore

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    core = EngineCore(model, weight_version=0)
    with pytest.raises(ValueError, match="'model.not_a_layer.weight' is not a parameter"):
        await core.apply_weights([("model.not_a_layer.weight", torch.zeros(1))], None)
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\), the model's is \(64,\)"):
        await core.apply_weights([("model.norm.weight", torch.zeros(3))], None)
    assert core.weight_version == 0
    await core.apply_weights([("model.norm.weight", torch.full((64,), 2.0))], 5)
    assert core.weight_version == 5 and torch.equal(model.model.norm.weight, torch.full((64,), 2.0))
    await core.apply_weights([], None)
    assert core.weight_version == 6
