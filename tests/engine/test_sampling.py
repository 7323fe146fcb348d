"""The logprob definition and the token drawing rules, on hand-computed values."""

from __future__ import annotations

import json
import math

import pytest
import torch

from asyncrl.engine.protocol import BadRequest, parse_request
from asyncrl.engine.sampling import effective_temperature, sample_row, token_logprobs, truncate_logits


def test_token_logprobs_hand_values():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    got = token_logprobs(logits, torch.tensor([2, 1]), 1.0)
    assert got[0].item() == pytest.approx(3 - math.log(math.e + math.e**2 + math.e**3), abs=1e-6)  # -0.4076
    assert got[1].item() == pytest.approx(-math.log(3), abs=1e-6)
    # T = 0.5 doubles the logits: log(e^6 / (e^2 + e^4 + e^6))
    half = token_logprobs(logits[:1], torch.tensor([2]), 0.5)
    assert half.item() == pytest.approx(6 - math.log(math.e**2 + math.e**4 + math.e**6), abs=1e-6)
    # greedy (T == 0) uses T = 1
    assert token_logprobs(logits, torch.tensor([2, 1]), 0.0).tolist() == got.tolist()
    # per-row temperatures, 0 meaning 1
    rows = token_logprobs(torch.stack([logits[0], logits[0]]), torch.tensor([2, 2]), torch.tensor([0.0, 0.5]))
    assert rows.tolist() == pytest.approx([got[0].item(), half.item()], abs=1e-6)


def test_token_logprobs_is_float32_and_ignores_truncation():
    logits = torch.tensor([[4.0, 3.0, 0.0]], dtype=torch.bfloat16)
    lp = token_logprobs(logits, torch.tensor([1]), 1.0)
    assert lp.dtype == torch.float32
    # a top_k=1 draw could never pick token 1, but its logprob is still taken from the full distribution
    assert lp.item() == pytest.approx(3 - math.log(math.e**4 + math.e**3 + 1), abs=1e-5)


@pytest.mark.parametrize("bad", [-0.1, math.nan, math.inf, -math.inf])
def test_negative_or_non_finite_temperature_is_refused(bad):
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        effective_temperature(bad)
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        token_logprobs(torch.zeros(2, 3), torch.tensor([0, 0]), torch.tensor([1.0, bad]))


@pytest.mark.parametrize("raw,needle", [
    ('{"temperature": NaN}', "sampling_params.temperature must be a finite number, got nan"),
    ('{"temperature": Infinity}', "sampling_params.temperature must be a finite number, got inf"),
    ('{"top_p": NaN}', "sampling_params.top_p must be a finite number"),
    ('{"top_p": -Infinity}', "sampling_params.top_p must be a finite number"),
    ('{"temperature": 1e999}', "sampling_params.temperature must be a finite number"),
    ('{"temperature": ' + str(10**400) + '}', "sampling_params.temperature must be a finite number"),
    ('{"temperature": 1e-300}', "sampling_params.temperature must be 0 (greedy) or >= 1e-06"),
    ('{"top_p": 1.5}', "sampling_params.top_p must be in (0, 1]"),
    ('{"top_k": 2.5}', "sampling_params.top_k must be an integer"),
    ('{"max_new_tokens": NaN}', "sampling_params.max_new_tokens must be an integer"),
])
def test_parse_request_refuses_hostile_sampling_values(raw, needle):
    """JSON as Python's json reads it (NaN, Infinity and 1e999 are accepted by the decoder): every bad
    value is refused at parse time, naming the field, before anything reaches the scheduler."""
    body = json.loads('{"input_ids": [1, 2], "sampling_params": ' + raw + '}')
    with pytest.raises(BadRequest) as e:
        parse_request(body, vocab_size=100)
    assert needle in str(e.value)


def test_parse_request_accepts_the_edges():
    body = {"input_ids": [1], "sampling_params": {"temperature": 0, "top_p": 1, "top_k": -1}}
    r = parse_request(body, vocab_size=100)
    assert (r.temperature, r.top_p, r.top_k) == (0.0, 1.0, -1)
    assert parse_request({"input_ids": [1], "sampling_params": {"temperature": 1e-6}}, 100).temperature == 1e-6


def test_truncate_top_k_and_top_p():
    z = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    assert torch.isinf(truncate_logits(z, 2, 1.0)).tolist() == [False, False, True]
    # top_p 0.6: mass before token 2 is 0.8 >= 0.6 -> dropped; before token 1 is 0.5 < 0.6 -> kept
    assert torch.isinf(truncate_logits(z, -1, 0.6)).tolist() == [False, False, True]
    # top_p 0.5: mass before token 1 is already 0.5 -> only the top token stays
    assert torch.isinf(truncate_logits(z, -1, 0.5)).tolist() == [False, True, True]
    # order of the vocabulary does not matter
    zz = torch.log(torch.tensor([0.2, 0.5, 0.3]))
    assert torch.isinf(truncate_logits(zz, -1, 0.6)).tolist() == [True, False, False]


def test_sample_row_greedy_banned_and_seeded():
    row = torch.tensor([0.0, 5.0, 4.0, 1.0])
    assert sample_row(row, temperature=0) == 1
    assert sample_row(row, temperature=0, banned=(1,)) == 2
    assert sample_row(row, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(0)) == 1
    flat = torch.zeros(1000)
    a = [sample_row(flat, temperature=1.0, generator=g) for g in [torch.Generator().manual_seed(7)] * 20]
    b = [sample_row(flat, temperature=1.0, generator=g) for g in [torch.Generator().manual_seed(7)] * 20]
    assert a == b and len(set(a)) > 10
