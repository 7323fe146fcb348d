"""Weight updates: /update_weights_from_disk on a real server, versions per token, apply_weights errors."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.engine.conftest import greedy_path, greedy_reference, post, stats, wait_tokens


@pytest.fixture(scope="module")
def other_model_dir(tiny_model_dir, tmp_path_factory):
    from tests.engine.conftest import build_untied

    return build_untied(tiny_model_dir, tmp_path_factory.mktemp("tiny_seed1"), seed=1)


@pytest.fixture()
def fresh_engine(engine_model_dir):
    """A server of its own (its weights change), starting at weight_version 3."""
    from asyncrl.engine.launcher import launch_embedded

    proc = launch_embedded(engine_model_dir, threads=1, weight_version=3, startup_timeout_s=120)
    yield proc
    proc.stop()


@pytest.mark.timeout(180)
async def test_update_weights_from_disk_changes_outputs_and_versions(fresh_engine, tiny_model, engine_model_dir,
                                                                     other_model_dir):
    from transformers import AutoModelForCausalLM

    url = fresh_engine.url
    other = AutoModelForCausalLM.from_pretrained(other_model_dir, dtype=torch.float32).eval()
    p = list(range(400, 420))
    body = {"input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": 12, "min_new_tokens": 12}}
    before = (await post(url, "/generate", body)).json()
    assert before["output_ids"] == greedy_reference(tiny_model, p, 12)
    assert before["meta_info"]["weight_version"] == "3"

    r = await post(url, "/update_weights_from_disk", {"model_path": str(other_model_dir)})
    assert r.status_code == 200 and r.json()["success"] and r.json()["weight_version"] == 4  # no version: +1
    after = (await post(url, "/generate", body)).json()
    assert after["output_ids"] == greedy_reference(other, p, 12) != before["output_ids"]
    assert after["meta_info"]["weight_versions"] == [{"version": "4", "start": 0, "end": 12}]
    assert after["meta_info"]["weight_version"] == "4"

    # a request that spans an update: tokens before it carry 4, after it 9
    long_body = {"input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": 400, "min_new_tokens": 400}}
    start = (await stats(url))["tokens_out"]
    task = asyncio.create_task(post(url, "/generate", long_body))
    await wait_tokens(url, start + 3)
    await post(url, "/pause_generation", {"mode": "in_place"})
    k = (await stats(url))["tokens_out"] - start
    r = await post(url, "/update_weights_from_disk", {"model_path": str(engine_model_dir), "weight_version": 9})
    assert r.json()["weight_version"] == 9
    await post(url, "/continue_generation", {})
    o = (await task).json()
    spans = o["meta_info"]["weight_versions"]  # SGLang's shape: runs of output tokens per version
    assert spans == [{"version": "4", "start": 0, "end": k}, {"version": "9", "start": k, "end": 400}]
    assert o["meta_info"]["weight_version"] == "9"
    async with __import__("httpx").AsyncClient() as h:
        assert (await h.get(url + "/model_info")).json()["weight_version"] == "9"
    # bad updates are 400s naming the problem, and the server keeps serving
    r = await post(url, "/update_weights_from_disk", {"model_path": "/nonexistent/dir"})
    assert r.status_code == 400 and "/nonexistent/dir" in r.json()["error"]
    assert (await post(url, "/update_weights_from_disk", {})).status_code == 400
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
