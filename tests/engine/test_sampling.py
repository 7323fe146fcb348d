"""The logprob definition and the token drawing rules, on hand-computed values."""

from __future__ import annotations

import json
import math

import pytest
import torch

from asyncrl.engine.protocol import BadRequest, parse_request
from asyncrl.engine.sampling import (
    effective_temperature,
    sample_row,
    sample_tokens,
    token_logprobs,
    truncate_logits,
)


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


def test_sample_tokens_draws_each_row_by_its_own_settings_as_sample_row_does():
    """A step of mixed rows (greedy, plain, top-k, top-p, banned, unseeded) drawn at once gives each seeded
    row the token sample_row gives it alone with the same seed."""
    torch.manual_seed(0)
    logits = torch.randn(6, 300) * 3
    settings = [  # temperature, top_k, top_p, banned, seed
        (0.0, -1, 1.0, (), None), (1.0, -1, 1.0, (), 1), (0.7, 5, 1.0, (), 2), (1.3, -1, 0.8, (), 3),
        (1.0, -1, 1.0, tuple(int(t) for t in logits[4].topk(3).indices), 4), (0.0, -1, 1.0, (int(logits[5].argmax()),), None),
    ]
    for trial in range(20):
        gens = [torch.Generator().manual_seed(100 * trial + s) if s is not None else None for *_, s in settings]
        got = sample_tokens(logits, [s[0] for s in settings], [s[1] for s in settings], [s[2] for s in settings],
                            [s[3] for s in settings], gens)
        for i, (t, k, p, banned, seed) in enumerate(settings):
            g = torch.Generator().manual_seed(100 * trial + seed) if seed is not None else None
            assert got[i] == sample_row(logits[i], temperature=t, top_k=k, top_p=p, banned=banned, generator=g), (trial, i)
            assert got[i] not in banned
        assert got[0] == int(logits[0].argmax())
        assert got[2] in logits[2].topk(5).indices.tolist()


def test_sample_tokens_follows_the_distribution_and_never_draws_a_token_without_mass():
    """8000 seeded draws of softmax([log .5, log .3, log .2, -inf, -inf]): each token's frequency within 0.02 of
    its probability, and the two masked tokens (the last ones, where a draw rounding past the top would land)
    never drawn."""
    row = torch.tensor([math.log(0.5), math.log(0.3), math.log(0.2), float("-inf"), float("-inf")])
    g = torch.Generator().manual_seed(0)
    draws = []
    for _ in range(100):
        draws += sample_tokens(row.expand(80, -1), [1.0] * 80, [-1] * 80, [1.0] * 80, [()] * 80, [g] * 80)
    freq = [draws.count(t) / len(draws) for t in range(5)]
    assert all(abs(f - p) < 0.02 for f, p in zip(freq, [0.5, 0.3, 0.2, 0.0, 0.0])), freq
    assert freq[3] == freq[4] == 0.0

