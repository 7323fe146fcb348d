"""Micro-batch planning and layout; packed rows score exactly like separate forwards (real tiny model)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.engine.sampling import token_logprobs
from asyncrl.learner import packing as packing_mod
from asyncrl.learner.packing import (
    SeqSpec,
    build_micro_batch,
    kept_logits,
    plan,
    plan_micro_batches,
    scatter_rows,
    unit_length,
)


def test_plan_packed_first_fit_decreasing():
    # lengths 5,3,8,2 budget 8: [8] | [5,3] | [2]
    assert plan_micro_batches([5, 3, 8, 2], 8, packing=True) == [[2], [0, 1], [3]]
    assert plan_micro_batches([5, 3, 8, 2], 100, packing=True) == [[0, 1, 2, 3]]
    assert plan_micro_batches([20, 3], 8, packing=True) == [[0], [1]]  # too long: alone


def test_plan_padded_counts_padding_against_the_budget():
    assert plan_micro_batches([5, 3, 8, 2], 8, packing=False) == [[0], [1], [2], [3]]
    assert plan_micro_batches([5, 3, 8, 2], 12, packing=False) == [[0, 1], [2], [3]]  # 2 x 5 fits, 3 x 8 does not
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        plan_micro_batches([1], 0, packing=True)


def _seqs():
    mk = lambda ids, p, m: SeqSpec(torch.tensor(ids), p, torch.tensor(m, dtype=torch.bool))
    return [mk([11, 12, 13, 14, 15], 2, [1, 0, 1]), mk([21, 22, 23], 1, [1, 1]), mk([31, 32], 1, [1])]


def test_packed_layout_positions_and_targets():
    # rows capped at the longest sequence (5): [A] and [B + C]
    mb = build_micro_batch(_seqs(), [4, 7, 9], packing=True)
    assert mb.input_ids.tolist() == [[11, 12, 13, 14, 15], [21, 22, 23, 31, 32]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    assert mb.attention_mask is None and mb.compute_tokens == 10 == mb.num_tokens
    # A (P=2): 13 from pos 1, 14 masked, 15 from pos 3; B (P=1): 22 from pos 0, 23 from pos 1; C: 32 from pos 3
    assert mb.keep.nonzero().tolist() == [[0, 1], [0, 3], [1, 0], [1, 1], [1, 3]]
    assert mb.targets.tolist() == [13, 15, 22, 23, 32]
    assert mb.out_row.tolist() == [0, 0, 1, 1, 2] and mb.out_col.tolist() == [0, 2, 0, 1, 0]
    rows = scatter_rows(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), mb)
    assert rows.tolist() == [[1.0, 0.0, 2.0], [3.0, 4.0, 0.0], [5.0, 0.0, 0.0]]


def test_packed_row_tail_is_a_padding_segment():
    s = _seqs()
    mb = build_micro_batch([s[0], s[1]], [0, 1], packing=True, pad_id=0)
    assert mb.input_ids.tolist() == [[11, 12, 13, 14, 15], [21, 22, 23, 0, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    assert mb.keep[1, 3:].tolist() == [False, False]


def test_padded_layout():
    mb = build_micro_batch(_seqs(), [0, 1, 2], packing=False, pad_id=0)
    assert mb.input_ids.tolist() == [[11, 12, 13, 14, 15], [21, 22, 23, 0, 0], [31, 32, 0, 0, 0]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
    assert mb.targets.tolist() == [13, 15, 22, 23, 32]
    assert mb.compute_tokens == 15 and mb.num_tokens == 10


def test_seq_spec_rejects_bad_shapes():
    with pytest.raises(ValueError, match="prompt_len=0"):
        SeqSpec(torch.tensor([1, 2]), 0, torch.tensor([True, True]))
    with pytest.raises(ValueError, match="loss_mask has 1 entries, the response has 2"):
        SeqSpec(torch.tensor([1, 2, 3]), 1, torch.tensor([True]))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("keep_2d", [True, False])
def test_packed_and_padded_rows_score_like_separate_forwards(tiny_model_dir, keep_2d, monkeypatch):
    """Token by token: logprob of response token i comes from position P + i - 1 of its own sequence."""

    if not keep_2d:  # the path for transformers versions without a boolean logits_to_keep
        monkeypatch.setattr(packing_mod, "supports_2d_logits_to_keep", lambda: False)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    seqs = []
    for n, p in [(9, 3), (5, 1), (12, 6), (2, 1), (3, 2)]:
        m = torch.rand(n - p, generator=g) > 0.25
        seqs.append(SeqSpec(torch.randint(5, 3000, (n,), generator=g), p, m))
    with torch.no_grad():
        ref = [model(input_ids=s.input_ids[None]).logits[0] for s in seqs]
        for packing in (True, False):
            mb = build_micro_batch(seqs, list(range(len(seqs))), packing)
            if packing:
                assert mb.input_ids.shape[0] < len(seqs)  # several sequences share a row
            out = kept_logits(model, mb)
            got = scatter_rows(token_logprobs(out, mb.targets, 0.7), mb)
            for n, s in enumerate(seqs):
                for i in range(s.loss_mask.numel()):
                    tok = s.input_ids[s.prompt_len + i]
                    want = token_logprobs(ref[n][s.prompt_len + i - 1], tok, 0.7) if s.loss_mask[i] else torch.tensor(0.0)
                    assert abs(got[n, i].item() - want.item()) < 1e-5, (packing, n, i, got[n, i], want)


def _tree_seqs():
    mk = lambda ids, p, m: SeqSpec(torch.tensor(ids), p, torch.tensor(m, dtype=torch.bool))
    # A and B share the prompt [1, 2, 3]; C has its own one-token prompt
    return [mk([1, 2, 3, 4, 5], 3, [1, 1]), mk([1, 2, 3, 6], 3, [1]), mk([7, 8, 9], 1, [1, 0])]


def test_shared_prompt_tree_layout_positions_mask_and_targets():
    # span 0: attention is all a row costs, so two short rows (2 x 7 x 7) beat one of 10 (10 x 10)
    mb = build_micro_batch(_tree_seqs(), [10, 11, 12], packing=True, pad_id=0, share_prompts=True, span=0)
    # unit {A, B}: prefix [1, 2], branches [3 4 5] and [3 6] (the last prompt token repeated); unit {C}: [7 8 9]
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5, 3, 6], [7, 8, 9, 0, 0, 0, 0]]
    assert mb.position_ids.tolist()[0] == [0, 1, 2, 3, 4, 2, 3]
    assert mb.position_ids.tolist()[1][:3] == [0, 1, 2]
    want0 = [[1, 0, 0, 0, 0, 0, 0],
             [1, 1, 0, 0, 0, 0, 0],
             [1, 1, 1, 0, 0, 0, 0],
             [1, 1, 1, 1, 0, 0, 0],
             [1, 1, 1, 1, 1, 0, 0],
             [1, 1, 0, 0, 0, 1, 0],   # B's branch sees the prefix and itself, never A's branch
             [1, 1, 0, 0, 0, 1, 1]]
    want1 = [[1, 0, 0, 0, 0, 0, 0],
             [1, 1, 0, 0, 0, 0, 0],
             [1, 1, 1, 0, 0, 0, 0]] + [[int(3 <= k <= q) for k in range(7)] for q in range(3, 7)]  # padding: itself
    assert mb.attention_mask.shape == (2, 1, 7, 7) and mb.attention_mask.dtype == torch.bool
    assert mb.attention_mask[0, 0].int().tolist() == want0
    assert mb.attention_mask[1, 0].int().tolist() == want1
    # A: 4 from pos 2, 5 from pos 3; B: 6 from its own copy of the last prompt token (pos 5); C: 8 from pos 0
    assert mb.keep.nonzero().tolist() == [[0, 2], [0, 3], [0, 5], [1, 0]]
    assert mb.targets.tolist() == [4, 5, 6, 8]
    assert mb.out_row.tolist() == [0, 0, 1, 2] and mb.out_col.tolist() == [0, 1, 0, 0]
    assert mb.num_tokens == 12 and mb.compute_tokens == 14


def test_shared_prompt_units_with_nothing_in_common_share_a_row_when_padding_costs_more():
    # SmolLM2's span (2048): one row of 10 costs less than two of 7 (the second padded from 3)
    mb = build_micro_batch(_tree_seqs(), [10, 11, 12], packing=True, pad_id=0, share_prompts=True)
    assert mb.input_ids.tolist() == [[7, 8, 9, 1, 2, 3, 4, 5, 3, 6]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 2, 3]]
    m = mb.attention_mask[0, 0].int()
    assert m[3:, :3].sum() == 0 and m[:3, 3:].sum() == 0  # C and {A, B} never see each other
    assert m[8].tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 1, 0]  # B's branch: the prefix [1, 2] and itself
    assert mb.targets.tolist() == [8, 4, 5, 6] and mb.out_row.tolist() == [2, 0, 0, 1]  # row-major order
    assert mb.compute_tokens == 10


def test_shared_prompt_plan_costs_a_unit_by_its_tree_and_splits_groups_over_the_budget():
    s = _tree_seqs()
    assert unit_length(s, [0, 1]) == 2 + 3 + 2 and unit_length(s, [2]) == 3
    assert plan(s, 10, packing=True, share_prompts=True) == [[0, 1, 2]]  # 7 + 3 fit in 10
    assert plan(s, 7, packing=True, share_prompts=True) == [[0, 1], [2]]
    assert plan(s, 5, packing=True, share_prompts=True) == [[0], [1], [2]]  # the group cut: A (5) | B (4) | C (3)
    assert plan(s, 5, packing=False, share_prompts=True) == plan_micro_batches([5, 4, 3], 5, packing=False)
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        plan(s, 0, packing=True, share_prompts=True)


def _grouped_seqs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for p, responses in [(5, [4, 7, 1]), (1, [3, 6]), (8, [5]), (2, [2, 9])]:
        prompt = torch.randint(5, 3000, (p,), generator=g)
        for r in responses:
            m = torch.rand(r, generator=g) > 0.25
            seqs.append(SeqSpec(torch.cat([prompt, torch.randint(5, 3000, (r,), generator=g)]), p, m))
    return seqs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_prompt_trees_score_like_separate_forwards(tiny_model_dir, attn):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=attn).eval()
    seqs = _grouped_seqs()
    with torch.no_grad():
        ref = [model(input_ids=s.input_ids[None]).logits[0] for s in seqs]
        mb = build_micro_batch(seqs, list(range(len(seqs))), True, share_prompts=True)
        assert mb.input_ids.shape[0] < len(seqs)  # the samples of a prompt share a row
        got = scatter_rows(token_logprobs(kept_logits(model, mb), mb.targets, 0.7), mb)
    for n, s in enumerate(seqs):
        for i in range(s.loss_mask.numel()):
            tok = s.input_ids[s.prompt_len + i]
            want = token_logprobs(ref[n][s.prompt_len + i - 1], tok, 0.7) if s.loss_mask[i] else torch.tensor(0.0)
            assert abs(got[n, i].item() - want.item()) < 1e-5, (attn, n, i, got[n, i], want)


@pytest.mark.timeout(120)
def test_shared_prompt_trees_give_the_gradients_of_separate_forwards(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    seqs = _grouped_seqs(1)
    weights = torch.linspace(-1.0, 1.0, sum(int(s.loss_mask.sum()) for s in seqs))

    def grads(share: bool) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        mb = build_micro_batch(seqs, list(range(len(seqs))), True, share_prompts=share)
        logp = scatter_rows(token_logprobs(kept_logits(model, mb), mb.targets, 1.0), mb)
        flat = torch.cat([logp[n, : s.loss_mask.numel()][s.loss_mask] for n, s in enumerate(seqs)])
        (flat * weights).sum().backward()  # a fixed weight per token, in sequence order
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    shared, separate = grads(True), grads(False)
    assert shared.keys() == separate.keys() and shared
    for k in separate:
        assert torch.allclose(shared[k], separate[k], rtol=1e-4, atol=1e-6), k


def _system_prompt_seqs(seed: int = 0):
    """Prompts that share a system prefix the way a chat template's do, with the cases a prefix tree must get
    right: one stem a prefix of another's, a prompt that is the bare system prefix plus one token, a prompt
    of one token (empty stem), two samples of one prompt, and prompts that branch inside the prefix."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(5, 3000, (n,), generator=g)
    system = rand(6)
    q1, q2 = rand(3), rand(2)
    prompts = [
        torch.cat([system, q1]),             # stem: system + q1[:2]
        torch.cat([system, q1, rand(2)]),    # its stem extends the first prompt's (nested)
        torch.cat([system, rand(1)]),        # stem: the system prefix exactly
        torch.cat([system[:4], q2]),         # branches inside the system prefix
        rand(1),                             # empty stem
        torch.cat([system, q1]),             # the first prompt again: one unit with it
    ]
    seqs = []
    for prompt, r in zip(prompts, [4, 3, 5, 2, 3, 6]):
        m = torch.rand(r, generator=g) > 0.2
        m[0] = True
        seqs.append(SeqSpec(torch.cat([prompt, rand(r)]), len(prompt), m))
    return seqs


def test_prompts_that_share_a_prefix_lay_it_out_once():
    seqs = _system_prompt_seqs()
    mb = build_micro_batch(seqs, list(range(len(seqs))), True, share_prompts=True)
    assert mb.input_ids.shape[0] == 1
    # each prompt alone would pay its whole stem; the tree pays the system prefix once
    separate = sum(unit_length(seqs, u) for u in packing_mod.prompt_units(seqs))
    # stems: the first prompt's (8 tokens) and the bare system prefix (6) lie inside the nested one's (10); the
    # prompt branching inside the prefix shares 4 of its 5; the one-token prompt has none; the repeat is one unit
    assert mb.compute_tokens == separate - 8 - 6 - 4
    # every token's position is its position in its own sequence
    for n, s in enumerate(seqs):
        keep_cols = mb.keep[0].nonzero().flatten()[mb.out_row == n]
        assert (mb.position_ids[0, keep_cols] == s.prompt_len - 1 + mb.out_col[mb.out_row == n]).all()


def test_prefix_tree_plan_bins_by_the_tokens_a_unit_adds():
    seqs = _system_prompt_seqs()
    units = packing_mod.prompt_units(seqs)
    tree = build_micro_batch(seqs, list(range(len(seqs))), True, share_prompts=True).compute_tokens
    assert plan(seqs, tree, packing=True, share_prompts=True) == [list(range(len(seqs)))]
    # the same budget costed unit by unit (no sharing across prompts) would need more micro-batches
    assert len(packing_mod.first_fit_decreasing([unit_length(seqs, u) for u in units], tree)) > 1
    assert len(plan(seqs, tree - 1, packing=True, share_prompts=True)) == 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_prefix_trees_score_and_differentiate_like_separate_forwards(tiny_model_dir, attn):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=attn)
    seqs = _system_prompt_seqs(3)
    weights = torch.linspace(-1.0, 1.0, sum(int(s.loss_mask.sum()) for s in seqs))

    def run(share: bool, span: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        mb = build_micro_batch(seqs, list(range(len(seqs))), True, share_prompts=share, span=span)
        if share:
            assert mb.input_ids.shape[0] == (1 if span else 3)
        logp = scatter_rows(token_logprobs(kept_logits(model, mb), mb.targets, 0.7), mb)
        flat = torch.cat([logp[n, : s.loss_mask.numel()][s.loss_mask] for n, s in enumerate(seqs)])
        (flat * weights).sum().backward()
        return flat.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    want_logp, want_grads = run(False, 0)
    for span in (2048, 0):
        logp, grads = run(True, span)
        assert torch.allclose(logp, want_logp, atol=1e-5), (attn, span, (logp - want_logp).abs().max())
        assert grads.keys() == want_grads.keys() and grads
        for k in want_grads:
            assert torch.allclose(grads[k], want_grads[k], rtol=1e-4, atol=1e-6), (attn, span, k)


def test_attention_span_from_the_model_config():
    from types import SimpleNamespace as NS

    smol = NS(config=NS(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                        head_dim=64))
    assert packing_mod.attention_span(smol) == 2048
    assert packing_mod.attention_span(NS(config=NS())) == packing_mod.DEFAULT_SPAN  # a config that does not say
    critic = NS(config=None, trunk=NS(config=smol.config))
    assert packing_mod.attention_span(critic) == 2048
