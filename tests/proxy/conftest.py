"""Proxy test fixtures: one real embedded engine on the tiny model (untied head, so greedy paths vary),
its tokenizer, and a ProxyServer in front of it per test."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from asyncrl.config import AgentConfig, SamplingConfig
from asyncrl.engine.client import EngineClient
from asyncrl.engine.launcher import launch_embedded
from asyncrl.proxy.server import ProxyServer
from tests.engine.conftest import build_untied


@pytest.fixture(scope="session")
def proxy_model_dir(tiny_model_dir, tmp_path_factory):
    return build_untied(tiny_model_dir, tmp_path_factory.mktemp("proxy_untied"), seed=1)


@pytest.fixture(scope="session")
def proxy_tokenizer(proxy_model_dir):
    return AutoTokenizer.from_pretrained(proxy_model_dir)


@pytest.fixture(scope="session")
def proxy_engine(proxy_model_dir):
    proc = launch_embedded(proxy_model_dir, max_running_seqs=8, threads=1, startup_timeout_s=180)
    yield proc
    proc.stop()


def agent_cfg(**kw) -> AgentConfig:
    base = dict(max_assistant_turns=8, max_turn_tokens=12, max_response_tokens=256, max_prompt_tokens=512,
                sampling=SamplingConfig(temperature=0.0))
    base.update(kw)
    return AgentConfig(**base)


@pytest.fixture
async def client_engine(proxy_engine):
    c = EngineClient(proxy_engine.url, timeout_s=60)
    yield c
    await c.close()


@pytest.fixture
async def proxy(client_engine, proxy_tokenizer):
    async with ProxyServer(client_engine, proxy_tokenizer, agent_cfg()) as p:
        yield p


@pytest.fixture
async def oai(proxy):
    """`oai(session)`: a real openai.AsyncOpenAI for the episode's key (closed when the test ends)."""
    made: list[openai.AsyncOpenAI] = []

    def make(session) -> openai.AsyncOpenAI:
        made.append(openai.AsyncOpenAI(base_url=proxy.base_url, api_key=session.key, max_retries=0))
        return made[-1]

    yield make
    for c in made:
        await c.close()
