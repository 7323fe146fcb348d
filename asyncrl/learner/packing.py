"""Micro-batches cut by a token budget, as packed rows or as padded rows.

A sequence s is its prompt (P_s >= 1 tokens) followed by its response (R_s tokens). Response token i
is predicted by the logits at position P_s + i - 1 of the concatenation; only positions whose
response token has loss_mask = 1 are projected onto the vocabulary (`keep`), so neither padding nor
tool output costs an lm_head row.

- packed: the sequences of a micro-batch are concatenated into rows no longer than its longest
  sequence (first-fit decreasing), with position_ids restarting at 0 for each sequence and no attention
  mask; transformers then builds a block-diagonal causal mask from the position_ids
  (masking_utils.find_packed_sequence_indices), so each sequence attends only to itself and the result
  equals separate forwards (verified in tests/learner/test_packing.py). A row shorter than the longest
  is filled up with a padding segment of its own (positions restarting at 0, no logits kept). Rows are
  capped at the longest sequence, not at the budget, because on CPU the masked attention of one long
  row still costs (row length)^2. Budget: the sum of lengths <= token_budget, micro-batches filled
  first-fit in decreasing length order; padding is only the tails of the rows.
- padded: one row per sequence, right-padded to the longest of the micro-batch, with an attention
  mask. Budget: n * max_len <= token_budget, sequences taken in their given order (the naive baseline).
- shared prompts (packed only, `algorithm.share_prompts`): the samples of one prompt (a GRPO group) are
  laid out as a tree in one row, the prompt once and every response after it:

      [p_0 .. p_{P-2}] [p_{P-1} r^1_0 .. r^1_{R1-1}] [p_{P-1} r^2_0 ..] ...
      positions 0..P-2, then each branch P-1 .. P-1+R_k

  with a 4-D boolean attention mask: a prefix token sees the prefix before it, a branch token sees the
  whole prefix and its own branch before it, nothing of the other branches or other units. The last prompt
  token is repeated in every branch so that each branch's first response token is predicted at a
  position of its own (`keep` selects each position at most once). Every response is then scored from
  exactly the context and positions of its own separate forward, and the prefix's gradient is the sum of
  the branches' (what separate forwards give), at the cost of P - 1 + sum(R_k + 1) tokens instead of
  sum(P + R_k): with GRPO's 4 samples of a 319-token prompt and ~150-token responses, about half.
  A unit is the samples of one prompt (a group larger than the budget is split into units); its stem,
  p_0 .. p_{P-2}, is what it can share with other units. The units of a row are laid out as the prefix
  tree (trie) of their stems, depth first: a node's tokens once, at their positions in the stems, and
  under the node where a unit's stem ends, its branches. The mask generalizes: a token sees the tokens
  before it in its own segment (a trie node or a branch) and in its segment's ancestors. Prompts that share
  a system prefix (a chat template's system prompt and tool schemas: 280 of the default task's ~315
  prompt tokens) then pay it once a row: the warm start's SFT batch of 8 demonstrations is 1120 tokens
  instead of 3080. Cost against the budget: the tokens a unit adds to its micro-batch's tree (its tree
  length less the longest stem prefix it shares with a unit already there; exact for a trie, whatever
  the order), units binned first-fit decreasing.
  Rows: a [rows, L] layout costs about rows * L * (span + L): the projections are linear in the tokens,
  attention under a dense mask is L per token, and `span` (`attention_span(model)`, 2048 for
  SmolLM2-135M) is the row length at which they are equal. One long row pays its padding nowhere and its
  shared prefixes once, but its attention grows with L; the layout tries the first-fits at each
  candidate row length (the tree lengths of the 1, 2, ... longest units together) and keeps the cheapest.
  Needs an attention that takes a custom mask (sdpa, eager): `shares_prompts_with(model)`.
A sequence longer than the budget gets a micro-batch of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class SeqSpec:
    """One sequence to score: token ids (prompt + response), prompt length and the response loss mask."""

    input_ids: torch.Tensor  # long [P + R]
    prompt_len: int
    loss_mask: torch.Tensor  # bool [R]

    def __post_init__(self) -> None:
        r = self.input_ids.numel() - self.prompt_len
        if self.prompt_len < 1:
            raise ValueError(f"a sequence needs at least one prompt token to predict its response, got prompt_len={self.prompt_len}")
        if r != self.loss_mask.numel():
            raise ValueError(f"loss_mask has {self.loss_mask.numel()} entries, the response has {r} tokens")

    @property
    def length(self) -> int:
        return self.input_ids.numel()


@dataclass
class MicroBatch:
    """Model inputs plus the map from kept logits rows back to (sequence, response position)."""

    seq_index: list[int]  # indices (into the list given to the planner) of the sequences in this micro-batch
    input_ids: torch.Tensor  # long [rows, L]
    position_ids: torch.Tensor  # long [rows, L]
    attention_mask: torch.Tensor | None  # long [rows, L] padded; None packed; bool [rows, 1, L, L] prompt trees
    keep: torch.Tensor  # bool [rows, L]: positions whose logits are needed
    targets: torch.Tensor  # long [K]: the token each kept position predicts (row-major order of keep)
    out_row: torch.Tensor  # long [K]: local sequence number (0..n-1) of each kept position
    out_col: torch.Tensor  # long [K]: response position of each kept position
    num_tokens: int  # real tokens in the micro-batch
    max_response: int  # longest response among its sequences

    @property
    def compute_tokens(self) -> int:
        """Tokens the transformer body processes (padding included)."""
        return self.input_ids.numel()


def plan_micro_batches(lengths: Sequence[int], token_budget: int, packing: bool) -> list[list[int]]:
    """Group sequence indices into micro-batches under `token_budget` (see the module docstring)."""
    _check_budget(token_budget)
    if packing:
        return first_fit_decreasing(lengths, token_budget)
    out: list[list[int]] = []
    cur: list[int] = []
    for i, n in enumerate(lengths):
        if cur and (len(cur) + 1) * max(n, max(lengths[j] for j in cur)) > token_budget:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def _check_budget(token_budget: int) -> None:
    if token_budget < 1:
        raise ValueError(f"algorithm.micro_batch_tokens must be >= 1, got {token_budget}")


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of indices whose lengths sum to <= capacity (an item longer than capacity gets its own bin),
    items taken longest first, each into the first bin it fits; bins listed in creation order, sorted inside."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= capacity:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


def prompt_key(s: SeqSpec) -> bytes:
    """Sequences with equal keys have identical prompts (ids compared exactly)."""
    return s.input_ids[: s.prompt_len].to(torch.int64).numpy().tobytes()


def unit_length(seqs: Sequence[SeqSpec], members: Sequence[int]) -> int:
    """Tokens of `members` (which share one prompt) laid out as a tree: P - 1 + sum(R_k + 1)."""
    p = seqs[members[0]].prompt_len
    return p - 1 + sum(seqs[n].length - p + 1 for n in members)


def prompt_units(seqs: Sequence[SeqSpec], token_budget: int | None = None) -> list[list[int]]:
    """Indices grouped by identical prompt (groups in order of first appearance, members longest first);
    with a budget, a group whose tree exceeds it is cut greedily into units that each fit (a member that
    alone exceeds it is a unit of its own)."""
    groups: dict[bytes, list[int]] = {}
    for n, s in enumerate(seqs):
        groups.setdefault(prompt_key(s), []).append(n)
    units: list[list[int]] = []
    for members in groups.values():
        members = sorted(members, key=lambda n: (-seqs[n].length, n))
        cur: list[int] = []
        for n in members:
            if cur and token_budget is not None and unit_length(seqs, cur + [n]) > token_budget:
                units.append(cur)
                cur = []
            cur.append(n)
        units.append(cur)
    return units


class _Units:
    """The prompt units of some sequences with what laying them out together costs: each unit's tree length
    and stem (its prompt less the last token: what it can share with other units), and the longest common
    prefix of two stems (cached). `across=False` shares nothing between units (each prompt's tree alone)."""

    def __init__(self, seqs: Sequence[SeqSpec], units: list[list[int]], across: bool = True):
        self.seqs, self.units, self.across = seqs, units, across
        self.length = [unit_length(seqs, u) for u in units]
        self.stem = [seqs[u[0]].input_ids[: seqs[u[0]].prompt_len - 1].to(torch.int64).numpy() for u in units]
        self._lcp: dict[tuple[int, int], int] = {}

    def lcp(self, a: int, b: int) -> int:
        if not self.across and a != b:
            return 0
        key = (a, b) if a < b else (b, a)
        if key not in self._lcp:
            x, y = self.stem[a], self.stem[b]
            n = min(len(x), len(y))
            diff = (x[:n] != y[:n]).nonzero()[0]
            self._lcp[key] = int(diff[0]) if len(diff) else n
        return self._lcp[key]

    def marginal(self, u: int, placed: Sequence[int]) -> int:
        """Tokens unit `u` adds to a prefix tree already holding `placed`: its tree length less the longest
        stem prefix it shares with one of them (exact for a trie, whatever the order of insertion)."""
        return self.length[u] - max((self.lcp(u, v) for v in placed), default=0)

    def fill(self, order: Sequence[int], capacity: int) -> tuple[list[list[int]], list[int]]:
        """First-fit of units (in `order`) into bins whose prefix trees hold <= capacity tokens (a unit longer
        than that gets a bin of its own); the bins and their tree lengths."""
        bins: list[list[int]] = []
        loads: list[int] = []
        for u in order:
            for b, load in enumerate(loads):
                add = self.marginal(u, bins[b])
                if load + add <= capacity:
                    bins[b].append(u)
                    loads[b] += add
                    break
            else:
                bins.append([u])
                loads.append(self.length[u])
        return bins, loads

    def longest_first(self) -> list[int]:
        return sorted(range(len(self.units)), key=lambda u: (-self.length[u], u))


def plan(seqs: Sequence[SeqSpec], token_budget: int, packing: bool, share_prompts: bool = False,
         across: bool = True) -> list[list[int]]:
    """Micro-batches (lists of indices into `seqs`) under `token_budget`; with shared prompts (packed only)
    units are binned first-fit decreasing, each costing the tokens it adds to its micro-batch's prefix tree
    (`across=False`: its own tree's)."""
    if not (packing and share_prompts):
        return plan_micro_batches([s.length for s in seqs], token_budget, packing)
    _check_budget(token_budget)
    units = _Units(seqs, prompt_units(seqs, token_budget), across)
    bins, _ = units.fill(units.longest_first(), token_budget)
    return [sorted(n for u in bin_ for n in units.units[u]) for bin_ in sorted(bins, key=min)]


def attn_implementation(model: torch.nn.Module) -> str | None:
    """The attention kernel of a transformers model, or of a critic's trunk."""
    cfg = getattr(model, "config", None) or getattr(getattr(model, "trunk", None), "config", None)
    return getattr(cfg, "_attn_implementation", None)


def shares_prompts_with(model: torch.nn.Module) -> bool:
    """Whether `model`'s attention takes the custom 4-D mask of shared-prompt rows (sdpa or eager; flash
    kernels read only position_ids and would let branches see each other)."""
    return attn_implementation(model) in ("sdpa", "eager")


DEFAULT_SPAN = 2048  # attention_span of SmolLM2-135M, and of a model whose config does not say


def attention_span(model: torch.nn.Module) -> int:
    """The row length at which a token's attention costs what the rest of its layer does: a [rows, L] layout
    costs about rows * L * (span + L) (module docstring). From the config: the layer's projection weights over
    3x its query width (FLOPs alone give 2x; sdpa with a tree mask measured 1.5x that on CPU: SmolLM2-135M,
    one thread, forward + backward of one row of L tokens took L * (8.75e-3 + 4.18e-6 L) s, span 2094)."""
    cfg = getattr(model, "config", None) or getattr(getattr(model, "trunk", None), "config", None)
    try:
        h, inter = int(cfg.hidden_size), int(cfg.intermediate_size)
        heads, kv = int(cfg.num_attention_heads), int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        hd = int(getattr(cfg, "head_dim", None) or h // heads)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return DEFAULT_SPAN
    weights = 2 * h * heads * hd + 2 * h * kv * hd + 3 * h * inter  # q, o; k, v; gate, up, down
    return max(1, weights // (3 * heads * hd))


@dataclass(frozen=True)
class Layout:
    """How one learner cuts and lays out its sequences: the token budget, packed or padded rows, and shared
    prompts (decided once the model is built: `shares_prompts_with`) with the model's `attention_span`.
    `across_prompts=False` keeps each prompt's tree to itself (the layout before prefix trees spanned prompts:
    the learner bench's baseline for them)."""

    token_budget: int
    packing: bool
    share_prompts: bool
    pad_id: int
    span: int = DEFAULT_SPAN
    across_prompts: bool = True

    @classmethod
    def for_model(cls, algo: Any, model: torch.nn.Module, pad_id: int) -> Layout:
        """The layout `algo` (an AlgorithmConfig) asks for, shared prompts only where `model` can take them."""
        share = algo.packing and algo.share_prompts and shares_prompts_with(model)
        return cls(algo.micro_batch_tokens, algo.packing, share, pad_id, attention_span(model))

    def plan(self, specs: Sequence[SeqSpec], local: Sequence[int]) -> list[list[int]]:
        """Micro-batches (positions into `local`) of the sequences `specs[i] for i in local`."""
        return plan([specs[i] for i in local], self.token_budget, self.packing, self.share_prompts,
                    self.across_prompts)

    def micro_batch(self, specs: Sequence[SeqSpec], idx: Sequence[int]) -> MicroBatch:
        return build_micro_batch([specs[i] for i in idx], idx, self.packing, self.pad_id, self.share_prompts,
                                 self.span, self.across_prompts)


def mask_argument(mb: MicroBatch, model: torch.nn.Module, device: Any = "cpu") -> torch.Tensor | None:
    """The attention_mask to give `model` for `mb`: a 4-D boolean tree mask becomes additive for eager."""
    m = mb.attention_mask
    if m is None:
        return None
    m = m.to(device)
    if m.dim() == 4:
        impl = attn_implementation(model)
        if impl == "eager":
            dtype = next(model.parameters()).dtype
            return torch.zeros(m.shape, dtype=dtype, device=device).masked_fill(~m, torch.finfo(dtype).min)
        if impl != "sdpa":
            raise ValueError(f"a shared-prompt micro-batch needs sdpa or eager attention, the model uses {impl!r} "
                             "(set algorithm.share_prompts=false)")
    return m


def tree_rows_of(units: _Units, span: int) -> tuple[list[list[int]], int]:
    """Units (indices into `units`) per row, and the row length: of the first-fits at each candidate row
    capacity (the tree lengths of the 1, 2, ... longest units laid out together), the one whose [rows, L]
    tensor costs least by rows * L * (span + L); on a tie the shorter rows."""
    order = units.longest_first()
    caps, placed, load = [], [], 0
    for u in order:
        load += units.marginal(u, placed)
        placed.append(u)
        caps.append(load)
    candidates = []  # (rows, L) per capacity, shortest rows first: min keeps the first of equal costs
    for cap in sorted(set(caps)):
        rows, loads = units.fill(order, cap)
        candidates.append((rows, max(loads)))
    return min(candidates, key=lambda c: len(c[0]) * c[1] * (span + c[1]))


class _Row:
    """One row of a shared-prefix layout being written: tokens, positions, the segment of each token, and each
    segment's parent (-1: none). A token sees the tokens before it in its own segment and in its ancestors'."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.pos: list[int] = []
        self.seg: list[int] = []
        self.parent: list[int] = []

    def segment(self, parent: int, ids: Sequence[int], first_position: int) -> int:
        me = len(self.parent)
        self.parent.append(parent)
        self.ids += list(ids)
        self.pos += range(first_position, first_position + len(ids))
        self.seg += [me] * len(ids)
        return me

    def mask(self, length: int) -> torch.Tensor:
        """bool [length, length]: query q sees key k iff k <= q and k's segment is q's or an ancestor of it;
        the tail after the tokens is one padding segment of its own (the last, with no parent)."""
        pad = len(self.parent)
        anc = torch.eye(pad + 1, dtype=torch.bool)
        for s, p in enumerate(self.parent):  # a parent is made before its children
            if p >= 0:
                anc[s] |= anc[p]
        seg = torch.full((length,), pad, dtype=torch.long)
        seg[: len(self.seg)] = torch.tensor(self.seg, dtype=torch.long)
        col = torch.arange(length)
        return anc[seg[:, None], seg[None, :]] & (col[None, :] <= col[:, None])


def _lay_row(units: _Units, row: Sequence[int], out: _Row, offsets: list[int]) -> None:
    """Write the units of `row` as their stems' prefix tree, depth first, with each sequence's branch (the last
    prompt token, then its response) under the node where its stem ends; records each sequence's offset."""
    # units sharing stem[:start], and their parent node; without sharing across prompts each unit from the root
    stack: list[tuple[list[int], int, int]] = [(list(row), 0, -1)] if units.across else \
        [([u], 0, -1) for u in reversed(row)]
    while stack:
        group, start, parent = stack.pop()
        first = units.stem[group[0]]
        stop = min((units.lcp(group[0], v) for v in group[1:]), default=len(first))
        node = out.segment(parent, first[start:stop].tolist(), start) if stop > start else parent
        children: dict[int, list[int]] = {}
        for u in group:
            stem = units.stem[u]
            if len(stem) > stop:
                children.setdefault(int(stem[stop]), []).append(u)
                continue
            for n in units.units[u]:
                s = units.seqs[n]
                p = s.prompt_len
                offsets[n] = len(out.ids) - (p - 1)
                out.segment(node, s.input_ids[p - 1:].tolist(), p - 1)
        stack.extend((g, stop, node) for g in reversed(list(children.values())))


def _tree_rows(seqs: Sequence[SeqSpec], pad_id: int, span: int, across: bool) -> tuple:
    """Shared-prefix layout (module docstring): ids, positions, 4-D mask, and each sequence's row and
    virtual offset (the offset at which its prompt would start, so response token c sits at
    offset + P + c and is predicted at offset + P - 1 + c)."""
    units = _Units(seqs, prompt_units(seqs), across)
    rows, L = tree_rows_of(units, span)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    pos = torch.zeros((len(rows), L), dtype=torch.long)
    mask = torch.zeros((len(rows), 1, L, L), dtype=torch.bool)
    row_of, offsets = [0] * len(seqs), [0] * len(seqs)
    for r, row in enumerate(rows):
        out = _Row()
        _lay_row(units, row, out, offsets)
        n = len(out.ids)
        ids[r, :n] = torch.tensor(out.ids, dtype=torch.long)
        pos[r, :n] = torch.tensor(out.pos, dtype=torch.long)
        pos[r, n:] = torch.arange(L - n)
        mask[r, 0] = out.mask(L)
        for u in row:
            for m in units.units[u]:
                row_of[m] = r
    return ids, pos, mask, row_of, offsets


def _targets(seqs: Sequence[SeqSpec], row_of: Sequence[int], offset_of: Sequence[int], shape) -> tuple:
    keep = torch.zeros(shape, dtype=torch.bool)
    rows, cols, tgts = [], [], []
    for n, s in enumerate(seqs):
        cols_n = torch.nonzero(s.loss_mask.bool(), as_tuple=False).flatten()
        pos = offset_of[n] + s.prompt_len - 1 + cols_n
        keep[row_of[n], pos] = True
        rows.append(torch.full_like(cols_n, n))
        cols.append(cols_n)
        tgts.append(s.input_ids[s.prompt_len + cols_n])
    # kept positions come back from the model in row-major order of `keep`; sort our lists the same way
    flat = torch.cat([torch.full_like(c, row_of[n]) * shape[1] + offset_of[n] + seqs[n].prompt_len - 1 + c
                      for n, c in enumerate(cols)]) if cols else torch.zeros(0, dtype=torch.long)
    order = torch.argsort(flat)
    cat = lambda xs: torch.cat(xs)[order] if xs else torch.zeros(0, dtype=torch.long)
    return keep, cat(tgts).long(), cat(rows).long(), cat(cols).long()


def build_micro_batch(seqs: Sequence[SeqSpec], seq_index: Sequence[int], packing: bool, pad_id: int = 0,
                      share_prompts: bool = False, span: int = DEFAULT_SPAN, across: bool = True) -> MicroBatch:
    """Lay out `seqs` as packed rows (with shared prompts: as prefix trees, rows chosen by the model's attention
    `span`), or as right-padded rows."""
    lengths = [s.length for s in seqs]
    max_resp = max((s.loss_mask.numel() for s in seqs), default=0)
    if packing and share_prompts:
        ids, pos, attn, row_of, offsets = _tree_rows(seqs, pad_id, span, across)
        keep, tgt, row, col = _targets(seqs, row_of, offsets, ids.shape)
    elif packing:
        rows = first_fit_decreasing(lengths, max(lengths))
        L = max(sum(lengths[n] for n in row) for row in rows)
        ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
        pos = torch.zeros((len(rows), L), dtype=torch.long)
        row_of, offsets = [0] * len(seqs), [0] * len(seqs)
        for r, row in enumerate(rows):
            off = 0
            for n in row:
                ids[r, off : off + lengths[n]] = seqs[n].input_ids.long()
                pos[r, off : off + lengths[n]] = torch.arange(lengths[n])
                row_of[n], offsets[n] = r, off
                off += lengths[n]
            pos[r, off:] = torch.arange(L - off)  # the tail is a padding "sequence" of its own; no logits kept
        keep, tgt, row, col = _targets(seqs, row_of, offsets, ids.shape)
        attn = None
    else:
        L = max(lengths)
        ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
        attn = torch.zeros((len(seqs), L), dtype=torch.long)
        for n, s in enumerate(seqs):
            ids[n, : s.length] = s.input_ids.long()
            attn[n, : s.length] = 1
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        keep, tgt, row, col = _targets(seqs, list(range(len(seqs))), [0] * len(seqs), ids.shape)
    return MicroBatch(list(seq_index), ids, pos, attn, keep, tgt, row, col, sum(lengths), max_resp)


def supports_2d_logits_to_keep() -> bool:
    """Newer transformers (slice_logits_to_keep) accept a boolean [rows, L] logits_to_keep; older ones only ints/1D."""
    # Local: transformers.modeling_utils takes seconds to import, and the planning half of this module
    # (and asyncrl.learner's math) stays torch-only; only a model forward asks this.
    # lazy: imports transformers, which this module does not load otherwise
    import transformers.modeling_utils as mu

    return hasattr(mu, "slice_logits_to_keep")


def kept_logits(model, mb: MicroBatch, device="cpu") -> torch.Tensor:
    """Forward `mb` through a causal LM and return the logits [K, V] of its kept positions (row-major order).

    With a transformers that takes a boolean logits_to_keep only those rows reach the lm_head; otherwise the
    union of kept positions over the rows is projected (1D logits_to_keep) and the kept ones selected.
    """
    kw = dict(input_ids=mb.input_ids.to(device), position_ids=mb.position_ids.to(device),
              attention_mask=mask_argument(mb, model, device), use_cache=False)
    keep = mb.keep.to(device)
    if supports_2d_logits_to_keep():
        logits = model(**kw, logits_to_keep=keep).logits
        return logits.reshape(-1, logits.shape[-1])
    pos = keep.any(0).nonzero().flatten()
    logits = model(**kw, logits_to_keep=pos).logits  # [rows, U, V]
    return logits[keep[:, pos]]


def scatter_rows(values: torch.Tensor, mb: MicroBatch, width: int | None = None) -> torch.Tensor:
    """Put per-kept-position values [K] into a [n_seqs, width] tensor (zeros elsewhere), differentiably."""
    width = mb.max_response if width is None else width
    out = values.new_zeros((len(mb.seq_index), width))
    return out.index_put((mb.out_row, mb.out_col), values)


def specs_of(trajs: list) -> tuple[list[SeqSpec], list[torch.Tensor]]:
    """Each trajectory (validated) as a SeqSpec of prompt + response ids, and its loss mask (bool [R])."""
    specs, masks = [], []
    for t in trajs:
        t.validate()
        ids = np.concatenate([t.prompt_ids.numpy(), t.response_ids.numpy()]).astype(np.int64)
        m = torch.from_numpy(t.loss_mask.numpy().astype(bool))
        specs.append(SeqSpec(torch.from_numpy(ids), len(t.prompt_ids), m))
        masks.append(m)
    return specs, masks
