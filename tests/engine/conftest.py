"""Engine test fixtures: real embedded engine servers (subprocesses) on the tiny model."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from asyncrl.util.auth import auth_headers


def build_untied(tiny_model_dir, out, seed: int):
    """The tiny model's architecture with an untied, seeded lm_head. (With tied random embeddings the
    greedy path just repeats the last prompt token, which would make token-by-token checks weak.)"""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    cfg.tie_word_embeddings = False
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def engine_model_dir(tiny_model_dir, tmp_path_factory):
    return build_untied(tiny_model_dir, tmp_path_factory.mktemp("tiny_untied"), seed=0)


@pytest.fixture(scope="session")
def tiny_model(engine_model_dir):
    """The engines' model loaded in the test process (the reference for token-by-token checks)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(engine_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def engine(engine_model_dir):
    """One shared embedded engine server (port 0, one torch thread). Tests must not change its weights;
    a test that changes its version or pauses it puts them back, and a leak fails here at the end."""
    from asyncrl.engine.launcher import launch_embedded

    proc = launch_embedded(engine_model_dir, max_running_seqs=16, threads=1, startup_timeout_s=120)
    try:
        yield proc
        left = {"version": httpx.get(proc.url + "/model_info", timeout=30).json()["weight_version"],
                "paused": httpx.get(proc.url + "/stats", timeout=30).json()["paused"],
                "session_open": httpx.get(proc.url + "/weight_sync_info", timeout=30,
                                          headers=auth_headers()).json()["session_open"]}
        assert left == {"version": "0", "paused": False, "session_open": False}, f"the shared engine was left changed: {left}"
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def engine2(engine_model_dir):
    """A second server (router tests)."""
    from asyncrl.engine.launcher import launch_embedded

    proc = launch_embedded(engine_model_dir, max_running_seqs=16, threads=1, startup_timeout_s=120)
    yield proc
    proc.stop()


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy generate, exactly n new tokens."""
    import torch

    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def greedy_path(model, prompt: list[int], output: list[int]) -> list[int]:
    """argmax of one teacher-forced forward over prompt + output: equals `output` iff it is the greedy path."""
    import torch

    with torch.inference_mode():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    return logits.argmax(-1).tolist()


def teacher_forced_logprobs(model, prompt: list[int], output: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T)[token] from one forward over prompt + output (T == 0 -> 1)."""
    import torch

    t = 1.0 if temperature == 0 else temperature
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / t, -1).gather(-1, torch.tensor(output)[:, None])[:, 0].tolist()


async def post(url: str, path: str, body, timeout: float = 60.0, headers: dict | None = None) -> httpx.Response:
    """POST with the run's token (what launch_embedded gave the engines) unless `headers` is given."""
    async with httpx.AsyncClient(timeout=timeout, headers=auth_headers() if headers is None else headers) as h:
        if isinstance(body, (bytes, str)):
            return await h.post(url + path, content=body)
        return await h.post(url + path, json=body)


async def stats(url: str) -> dict:
    async with httpx.AsyncClient(timeout=10) as h:
        return (await h.get(url + "/stats")).json()


async def wait_tokens(url: str, at_least: int, timeout_s: float = 60.0) -> dict:
    """Poll /stats until the engine has produced `at_least` tokens more than ... (absolute count)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = await stats(url)
        if s["tokens_out"] >= at_least:
            return s
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine at {url} did not reach {at_least} output tokens in {timeout_s}s: {s}")
