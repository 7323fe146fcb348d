"""Does an engine load what the learner sends? Checked through SGLang's own GET/POST /get_weights_by_name.

Why: SGLang 0.5.23's Llama loader (models/llama.py `_legacy_load_weights`, the default) skips a name
it does not hold with a log line ("Parameter ... not found in params_dict") and the update answers
success; the version moves while the weights never change. So, per sender (a relaunched engine gets
a new sender, asyncrl/run/learner_actor.py connect_engines):

    names    before an engine's first bucket, every tensor of the bucket is asked for by name
             (truncate_size=1): HTTP 400 "Get parameter by name failed" (SGLang's answer for a name
             its model does not map) means the engine would skip it; a first row whose width is not
             the sent tensor's means it would refuse it. Any such tensor stops the sync
             (WeightMismatchError naming the first ones) before a byte of that bucket moves.
    values   every `verify_every`-th sync, after it: one tensor (rotating over the model's) is read
             back from every engine that took the sync, and its first row (a 1-D tensor: its first
             VALUES elements) must equal what was sent, exactly, in one of the dtypes an engine may
             serve (the bytes cast as the engine's loader casts them); else WeightMismatchError.

SGLang's answer (http_server.py get_weights_by_name; models/llama.py get_weights_by_name): a bare JSON
list, `tensor.float().tolist()[:truncate_size]` of TP rank 0's shard, so truncation cuts the first
dimension and the width stays (o_proj and down_proj are gathered to full width; q/k/v and gate/up are
narrowed out of their stacked parameters). Row 0 of a row-sharded tensor is row 0 of the whole one,
and the width of every 2-D tensor is the whole one's, under any tensor-parallel size.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import torch

from asyncrl.weight_sync.engine_http import EngineHTTP
from asyncrl.weight_sync.errors import WeightMismatchError, WeightSyncError

ROUTE = "/get_weights_by_name"
VALUES = 64  # elements of a 1-D tensor compared after a sync
CONCURRENCY = 16  # name checks in flight per engine
SERVED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHOWN = 5  # names quoted in an error


def sample_of(t: torch.Tensor) -> torch.Tensor:
    """What an engine answers for `t` with truncate_size=1 (>= 2-D: its first row) or VALUES (1-D), on
    the CPU, in `t`'s dtype."""
    if t.dim() == 0:
        t = t.reshape(1)
    return (t[:1] if t.dim() >= 2 else t[:VALUES]).detach().to("cpu", copy=True)


def truncate_size(shape: Sequence[int]) -> int:
    return 1 if len(shape) >= 2 else VALUES


async def read(http: EngineHTTP, url: str, name: str, truncate: int) -> tuple[torch.Tensor | None, WeightSyncError | None]:
    """(the engine's values as float32, None); (None, None) when the engine holds no such name (HTTP
    400 without SGLang's success structure); (None, error) for anything else."""
    data, err = await http.call("POST", url, ROUTE, {"name": name, "truncate_size": truncate}, http.probe_timeout_s)
    if err is not None:
        if err.status == 400:
            return None, None
        return None, err
    try:
        return torch.tensor(data, dtype=torch.float32), None
    except (TypeError, ValueError, RuntimeError) as e:
        return None, WeightSyncError("config", f"{ROUTE} {name!r}: answer is not a list of numbers: {e}", url)


async def check_names(http: EngineHTTP, url: str, shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise WeightMismatchError if `url` would skip or refuse any of these tensors (see the module doc)."""
    limit = asyncio.Semaphore(CONCURRENCY)

    async def one(name: str, shape: tuple[int, ...]) -> str | None:
        async with limit:
            got, err = await read(http, url, name, 1)
        if err is not None and err.status == 404:
            raise WeightSyncError("config", f"the engine has no {ROUTE} route (SGLang 0.5 and the embedded engine "
                                  "have it), so asyncrl cannot check that it loads the names it is sent", url, 404)
        if err is not None:
            raise err
        if got is None:
            return f"{name} (not held by the served model)"
        want = tuple(shape[1:]) if len(shape) >= 2 else ()
        have = tuple(got.shape[1:]) if len(shape) >= 2 else ()
        if want != have:
            return f"{name} (sent {list(shape)}, the engine's row is {list(have)} wide)"
        return None

    problems = [p for p in await asyncio.gather(*(one(n, s) for n, s in shapes.items())) if p]
    if problems:
        raise WeightMismatchError(
            f"the engine would not load {len(problems)} of the {len(shapes)} tensors in this bucket: "
            f"{', '.join(problems[:SHOWN])}{' ...' if len(problems) > SHOWN else ''}. SGLang's loader skips "
            "a name it does not hold and still answers success, so these weights would never change; map the "
            "learner's names to the served model's (an FSDP or compile prefix, a renamed module, another "
            "model family) before training", url)


def matches(sent: torch.Tensor, got: torch.Tensor) -> bool:
    """`got` (float32) equals `sent` exactly as an engine serving float32, bfloat16 or float16 holds it."""
    if got.shape != sent.shape:
        return False
    if not sent.is_floating_point():
        return torch.equal(got, sent.float())
    return any(torch.equal(got, sent.to(dt).float()) for dt in SERVED_DTYPES)


async def check_values(http: EngineHTTP, urls: Sequence[str], name: str, sent: torch.Tensor) -> dict[str, Any]:
    """Raise WeightMismatchError naming the first engine whose `name` does not start with `sent`
    (sample_of the tensor sent); {url: error} for engines that could not be asked (left to the probe)."""
    answers = await asyncio.gather(*(read(http, u, name, truncate_size(sent.shape)) for u in urls))
    unasked = {}
    for url, (got, err) in zip(urls, answers):
        if err is not None:
            unasked[url] = err
            continue
        if got is None or not matches(sent, got):
            where = "holds no such tensor" if got is None else _first_difference(sent, got)
            raise WeightMismatchError(
                f"after the sync, {name} on the engine is not what was sent ({where}): the engine answered "
                "the update but did not load it; its sampler is not the learner's policy", url)
    return unasked


def _first_difference(sent: torch.Tensor, got: torch.Tensor) -> str:
    if got.shape != sent.shape:
        return f"shape {list(got.shape)} read back, {list(sent.shape)} sent"
    flat_s, flat_g = sent.float().reshape(-1), got.reshape(-1)
    i = int((flat_s != flat_g).nonzero()[0]) if (flat_s != flat_g).any() else 0
    return f"element {i}: sent {flat_s[i].item():.6g}, read back {flat_g[i].item():.6g}"
