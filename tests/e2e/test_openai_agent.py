"""End to end: `asyncrl train agent=openai_agent` with the example OpenAI-client agent (a registered
function, loaded from examples/openai_agent/agent.py through `plugins`) trains on the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.metrics import read_metrics

from .test_train import _overrides, _train, _trained

pytestmark = [pytest.mark.timeout(420)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openai_agent" / "agent.py"


@pytest.mark.heavy(35)
def test_openai_client_agent_trains_end_to_end(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    res = _train(["agent=openai_agent", f"plugins=[{EXAMPLE}]", *_overrides(tiny_model_dir, out, **{
        "agent.openai.function": "arithmetic_calculator", "agent.openai.timeout_s": 120})])
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    uids = [u for rec in _trained(out) for u in rec["uids"]]
    assert len(uids) == len(set(uids)) == 3 * 2 * 2  # steps x groups x samples, nothing twice
    for r in rows:  # every trained episode went through the proxy: one chain of >= 1 call
        assert r["train/proxy/calls"] >= 1 and r["train/proxy/chains"] == 1, r
