"""ScriptedEngine: a TEST DOUBLE of asyncrl.engine.base.Generator (no model behind it).

It replies to the k-th generate call with the k-th scripted list of token ids, cut to
`max_new_tokens`, with fixed logprobs -(k + 1) - 0.001 * (i + 1) for token i and the double's
current `version` for every token. `calls` records (input_ids, sampling) of every request so
tests can check what the engine was asked (token in) against the trajectory (token out).
"""

from __future__ import annotations

from typing import Any, Optional

from asyncrl.engine.base import GenerateResult, SamplingParams


def scripted_logprob(turn: int, i: int) -> float:
    return -(turn + 1) - 0.001 * (i + 1)


class ScriptedEngine:
    def __init__(self, tokenizer: Any, script: list[Any], version: int = 0, versions_by_turn: Optional[list[int]] = None):
        """`script` items: a str (encoded, then <|im_end|> appended: a finished message), or a list of
        ids used as they are. `versions_by_turn[k]`: the version reported for call k."""
        self.tok = tokenizer
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.script = [self.ids_of(x) for x in script]
        self.version = version
        self.versions_by_turn = versions_by_turn
        self.calls: list[tuple[list[int], SamplingParams]] = []

    def ids_of(self, item: Any) -> list[int]:
        if isinstance(item, str):
            return self.tok.encode(item, add_special_tokens=False) + [self.im_end]
        return list(item)

    async def generate(self, input_ids: list[int], sampling: SamplingParams, *, rid: Optional[str] = None,
                       session_id: Optional[str] = None) -> GenerateResult:
        k = len(self.calls)
        self.calls.append((list(input_ids), sampling))
        if k >= len(self.script):
            raise AssertionError(f"ScriptedEngine: call {k} but only {len(self.script)} scripted replies")
        ids = self.script[k][: sampling.max_new_tokens]
        stopped = bool(ids) and ids[-1] in sampling.stop_token_ids
        version = self.versions_by_turn[k] if self.versions_by_turn else self.version
        return GenerateResult(output_ids=ids, logprobs=[scripted_logprob(k, i) for i in range(len(ids))],
                              versions=[version] * len(ids), finish_reason="stop" if stopped else "length",
                              weight_version=version, engine="scripted")
