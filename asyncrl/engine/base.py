"""What the rollout side needs from an engine: token in, token out.

`Generator` is the interface agent loops call; `EngineClient` (asyncrl/engine/client.py) implements
it over HTTP against the embedded engine or SGLang, and tests may implement it with a scripted
double. Logprobs are those of the distribution the token was sampled from: see
`asyncrl/engine/sampling.py` for the exact definition the learner must share.
"""

from __future__ import annotations

from typing import Optional, Protocol

import msgspec


class SamplingParams(msgspec.Struct, kw_only=True):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop_token_ids: list[int] = []
    sampling_seed: Optional[int] = None  # SGLang's name (it refuses `seed`)

    def to_sglang(self) -> dict:
        d = {f: getattr(self, f) for f in self.__struct_fields__ if getattr(self, f) is not None}
        return d


class GenerateResult(msgspec.Struct, kw_only=True):
    output_ids: list[int]
    logprobs: list[float]  # one per output token
    versions: list[int]  # policy version that produced each output token
    finish_reason: str  # stop | length | abort
    weight_version: int  # engine version when the reply was sent
    engine: str = ""  # which engine served it (router bookkeeping)


class Generator(Protocol):
    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        rid: Optional[str] = None,
        session_id: Optional[str] = None,
    ) -> GenerateResult:
        """Generate a continuation of `input_ids`. `session_id` keeps a trajectory's turns on one engine."""
        ...
