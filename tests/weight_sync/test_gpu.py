"""GPU transports (skipped without CUDA): CUDA-IPC tensors to a colocated engine, NCCL to engines on
other GPUs, and both against a real SGLang server when the `sglang` package is installed."""

from __future__ import annotations

import importlib.util

import httpx
import pytest
import torch

from asyncrl.engine.launcher import launch_embedded
from asyncrl.weight_sync.bucketing import iter_buckets

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
PROMPT = [1, 2, 3, 4]
GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}


def greedy(url: str) -> list[int]:
    r = httpx.post(url + "/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY}, timeout=120)
    r.raise_for_status()
    return r.json()["output_ids"]


def version_of(url: str) -> int:
    return int(httpx.get(url + "/model_info", timeout=30).json()["weight_version"])


@pytest.fixture(scope="module")
def moved(tiny_model_dir, tmp_path_factory):
    """The tiny model with seeded noise added, on cuda:0 (the learner's weights), and its HF export."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).to("cuda:0")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.randn(p.shape, generator=g) * 0.05).to(p.device))
    out = tmp_path_factory.mktemp("moved")
    model.save_pretrained(out)
    for f in tiny_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            (out / f.name).write_bytes(f.read_bytes())
    return model, out


async def test_tensor_transport_to_a_colocated_embedded_engine(tiny_model_dir, moved):
    from asyncrl.weight_sync import WeightSender
    from asyncrl.weight_sync.tensor import TensorTransport

    model, export = moved
    with launch_embedded(export, device="cuda", dtype="float32") as ref:
        want = greedy(ref.url)
    with launch_embedded(tiny_model_dir, device="cuda", dtype="float32") as eng:
        before = greedy(eng.url)
        assert before != want
        sender = WeightSender(TensorTransport(timeout_s=120), timeout_s=120)
        await sender.connect([eng.url])
        report = await sender.sync(iter_buckets(model.named_parameters(), 1 << 16), version=1)
        await sender.close()
        assert report.ok and report.buckets >= 3
        assert greedy(eng.url) == want
        assert version_of(eng.url) == 1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs the engine on another GPU than the sender")
async def test_nccl_transport_to_an_embedded_engine_on_another_gpu(tiny_model_dir, moved):
    from asyncrl.weight_sync import WeightSender
    from asyncrl.weight_sync.broadcast import GroupTransport

    model, export = moved
    with launch_embedded(export, device="cuda", dtype="float32", extra_env={"CUDA_VISIBLE_DEVICES": "1"}) as ref:
        want = greedy(ref.url)
    with launch_embedded(tiny_model_dir, device="cuda", dtype="float32", extra_env={"CUDA_VISIBLE_DEVICES": "1"}) as eng:
        sender = WeightSender(GroupTransport("nccl", timeout_s=120), timeout_s=120)
        await sender.connect([eng.url])
        report = await sender.sync(iter_buckets(model.named_parameters(), 1 << 16), version=1)
        await sender.close()
        assert report.ok
        assert greedy(eng.url) == want


needs_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed")


@needs_sglang
@pytest.mark.parametrize("transport", ["tensor", "nccl"])
async def test_same_sender_against_a_real_sglang_server(tiny_model_dir, moved, transport):
    """SGLang 0.5's contract: a session around the buckets, one broadcast per tensor (SGLang offers no
    coalescing), version as a string, pause mode retract with flush_cache on the last bucket."""
    if transport == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs SGLang on another GPU than the sender")
    from asyncrl.config import EngineConfig
    from asyncrl.engine.launcher import launch_sglang
    from asyncrl.weight_sync import WeightSender
    from asyncrl.weight_sync.broadcast import GroupTransport
    from asyncrl.weight_sync.tensor import TensorTransport

    model, export = moved
    env = {"CUDA_VISIBLE_DEVICES": "1"} if transport == "nccl" else None
    with launch_sglang(export, EngineConfig(type="sglang"), port=0, host="127.0.0.1", dtype="float32", extra_env=env) as ref:
        want = greedy(ref.url)
    with launch_sglang(tiny_model_dir, EngineConfig(type="sglang"), port=0, host="127.0.0.1", dtype="float32",
                       extra_env=env) as eng:
        t = TensorTransport(timeout_s=300) if transport == "tensor" else GroupTransport("nccl", timeout_s=300)
        sender = WeightSender(t, timeout_s=300)
        await sender.connect([eng.url])
        report = await sender.sync(iter_buckets(model.named_parameters(), 1 << 20), version=1)
        await sender.close()
        assert report.ok, report.engines_failed
        assert greedy(eng.url) == want
