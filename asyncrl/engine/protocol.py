"""The /generate request as the engine sees it: parsing with validation, and the SGLang reply shape.

Request body (SGLang 0.5.23 subset, token in / token out; unknown sampling params are refused, as
SGLang's contract gate refuses them):
    {"input_ids": [int, ...], "rid": str?, "return_logprob": bool?, "return_token_times": bool?,
     "sampling_params": {"temperature", "top_p", "top_k", "max_new_tokens", "min_new_tokens",
                         "stop_token_ids", "ignore_eos", "sampling_seed"}}
Reply (as SGLang's TokenizerManager builds it, srt/utils/weight_versions.py):
    {"text", "output_ids", "meta_info": {"id", "finish_reason": {"type": "stop"|"length"|"abort", ...},
     "prompt_tokens", "completion_tokens", "output_token_logprobs": [[logprob, token_id, null], ...],
     "weight_version": str (the version at the end), "weight_versions": [{"version": str, "start": int,
     "end": int}, ...] (the runs of output tokens each version produced, end exclusive; one span
     {version, 0, 0} for an empty output), ("output_token_times": [...], an asyncrl extension sent
     only when the request asks for it with return_token_times)}}
`parse_request` raises `BadRequest` naming the offending field and value; the server answers 400.
Every sampling value is checked here, before the request reaches the scheduler: non-finite numbers
(Python's json reads NaN and Infinity), out-of-range values, wrong types. A request that passes
cannot fail a step of the running batch.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

_SAMPLING_KEYS = {
    "temperature", "top_p", "top_k", "max_new_tokens", "min_new_tokens", "stop_token_ids", "ignore_eos", "sampling_seed",
    # accepted and ignored (SGLang clients send them):
    "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "n", "stop",
}


MIN_TEMPERATURE = 1e-6  # below it (and above 0) a temperature is refused: SGLang treats it as greedy


class BadRequest(ValueError):
    """A /generate (or other) request is malformed; the message names the field and value."""


@dataclass
class GenRequest:
    rid: str
    input_ids: list[int]
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop_token_ids: frozenset = frozenset()
    ignore_eos: bool = False
    sampling_seed: int | None = None
    return_logprob: bool = False
    return_token_times: bool = False
    # state, filled by the engine
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    finish: dict | None = None
    abort_requested: bool = False
    generator: torch.Generator | None = None
    future: asyncio.Future | None = None

    @property
    def finished(self) -> bool:
        return self.finish is not None


def _num(sp: dict, key: str, kind: type, default: Any) -> Any:
    v = sp.get(key, default)
    if v is None:
        return default
    if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise BadRequest(f"sampling_params.{key} must be an integer, got {v!r}")
    if kind is float and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise BadRequest(f"sampling_params.{key} must be a number, got {v!r}")
    if kind is int:
        return v
    try:
        x = float(v)
    except OverflowError:  # an integer too large for a float
        x = math.inf
    if not math.isfinite(x):  # Python's json reads NaN and Infinity
        raise BadRequest(f"sampling_params.{key} must be a finite number, got {v!r:.40}")
    return x


def parse_request(body: Any, vocab_size: int) -> GenRequest:
    """Validate a decoded JSON body against the model's vocabulary; raise BadRequest on any bad field."""
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    if "text" in body and "input_ids" not in body:
        raise BadRequest("this engine is token-in/token-out: send input_ids, not text")
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise BadRequest(f"input_ids must be a non-empty list of token ids, got {ids!r:.80}")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not (0 <= t < vocab_size):
            raise BadRequest(f"input_ids[{i}]={t!r} is not a token id of this model (vocabulary size {vocab_size})")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise BadRequest(f"sampling_params must be an object, got {sp!r:.80}")
    unknown = set(sp) - _SAMPLING_KEYS
    if unknown:
        raise BadRequest(f"unknown sampling_params {sorted(unknown)}; known: {sorted(_SAMPLING_KEYS)}")
    rid = body.get("rid")
    if rid is not None and (not isinstance(rid, str) or not rid):
        raise BadRequest(f"rid must be a non-empty string, got {rid!r:.80}")
    r = GenRequest(rid=rid or uuid.uuid4().hex, input_ids=list(ids))
    r.temperature = _num(sp, "temperature", float, 1.0)
    r.top_p = _num(sp, "top_p", float, 1.0)
    r.top_k = _num(sp, "top_k", int, -1)
    r.max_new_tokens = _num(sp, "max_new_tokens", int, 128)
    r.min_new_tokens = _num(sp, "min_new_tokens", int, 0)
    r.sampling_seed = _num(sp, "sampling_seed", int, None)
    if r.sampling_seed is not None and not -(2**63) <= r.sampling_seed <= 2**63 - 1:
        raise BadRequest(f"sampling_params.sampling_seed must be in [-2**63, 2**63 - 1], got {r.sampling_seed}")
    if r.temperature < 0:
        raise BadRequest(f"sampling_params.temperature must be >= 0, got {r.temperature}")
    if 0 < r.temperature < MIN_TEMPERATURE:  # logits / T would overflow to inf: no distribution to draw from
        raise BadRequest(f"sampling_params.temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {r.temperature}")
    if not 0 < r.top_p <= 1:
        raise BadRequest(f"sampling_params.top_p must be in (0, 1], got {r.top_p}")
    if r.top_k == 0 or r.top_k < -1:
        raise BadRequest(f"sampling_params.top_k must be -1 (off) or >= 1, got {r.top_k}")
    if r.max_new_tokens < 0:
        raise BadRequest(f"sampling_params.max_new_tokens must be >= 0, got {r.max_new_tokens}")
    if r.min_new_tokens < 0:
        raise BadRequest(f"sampling_params.min_new_tokens must be >= 0, got {r.min_new_tokens}")
    stops = sp.get("stop_token_ids") or []
    if not isinstance(stops, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in stops):
        raise BadRequest(f"sampling_params.stop_token_ids must be a list of integers, got {stops!r:.80}")
    r.stop_token_ids = frozenset(stops)
    r.ignore_eos = bool(sp.get("ignore_eos", False))
    r.return_logprob = bool(body.get("return_logprob", False))
    r.return_token_times = bool(body.get("return_token_times", False))
    return r


def weight_version_spans(versions: list[int], current: int) -> list[dict]:
    """Per-token versions -> SGLang's `weight_versions`: one {version, start, end} per run of equal
    versions (end exclusive, versions as strings); an empty output gives [{current, 0, 0}]."""
    if not versions:
        return [{"version": str(current), "start": 0, "end": 0}]
    spans: list[dict] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(v), "start": i, "end": i + 1})
    return spans


def build_reply(r: GenRequest, weight_version: int, text: str) -> dict:
    spans = weight_version_spans(r.versions, weight_version)
    meta: dict[str, Any] = {
        "id": r.rid,
        "finish_reason": r.finish,
        "prompt_tokens": len(r.input_ids),
        "completion_tokens": len(r.output_ids),
        "weight_version": spans[-1]["version"],
        "weight_versions": spans,
    }
    if r.return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.logprobs, r.output_ids)]
    if r.return_token_times:
        meta["output_token_times"] = list(r.times)
    return {"text": text, "output_ids": list(r.output_ids), "meta_info": meta}
