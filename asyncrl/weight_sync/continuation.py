"""Continuing a generation that a weight sync in `abort` mode cut short (AReaL-style interruptible
rollout): re-post prompt + partial output with the remaining budget until it ends for a reason other
than abort. The pieces are concatenated, so a result's per-token versions may span the update.
"""

from __future__ import annotations

from typing import Any

import httpx


async def generate_continuing(client: httpx.AsyncClient, url: str, input_ids: list[int], sampling_params: dict,
                              max_rounds: int = 8) -> dict[str, Any]:
    """POST /generate, re-posting after each `abort` finish. Returns {"output_ids", "versions",
    "logprobs", "finish_reason", "rounds": [finish reason of each round]}."""
    budget = int(sampling_params.get("max_new_tokens", 128))
    out: dict[str, Any] = {"output_ids": [], "versions": [], "logprobs": [], "finish_reason": "", "rounds": []}
    for _ in range(max_rounds):
        body = {"input_ids": list(input_ids) + out["output_ids"], "return_logprob": True,
                "sampling_params": {**sampling_params, "max_new_tokens": budget - len(out["output_ids"])}}
        r = await client.post(url.rstrip("/") + "/generate", json=body, timeout=None)
        r.raise_for_status()
        data = r.json()
        meta = data["meta_info"]
        out["output_ids"] += data["output_ids"]
        out["versions"] += meta.get("output_token_versions") or [meta["weight_version"]] * len(data["output_ids"])
        out["logprobs"] += [lp for lp, _, _ in meta.get("output_token_logprobs") or []]
        reason = meta["finish_reason"]["type"] if isinstance(meta["finish_reason"], dict) else str(meta["finish_reason"])
        out["rounds"].append(reason)
        out["finish_reason"] = reason
        if reason != "abort" or len(out["output_ids"]) >= budget:
            return out
    raise RuntimeError(f"generation still aborted after {max_rounds} rounds: {out['rounds']}")
