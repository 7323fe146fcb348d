"""The sender interface, its report, its errors, and the HTTP steps every transport shares.

A sync, whatever the transport: POST /pause_generation {mode} to every engine -> move the buckets
-> set the new version -> POST /continue_generation (always, even after a failure). A sender
raises WeightMismatchError when an engine refuses a bucket (names/shapes/dtypes disagree: a
configuration bug); an engine that is dead, hangs or times out is skipped and reported in the
SyncReport instead (and left out of the next sync's group), so training goes on with the others.
"""

from __future__ import annotations

import abc
import asyncio
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch

Bucket = list[tuple[str, torch.Tensor]]


class WeightSyncError(RuntimeError):
    """A sync could not be carried out (no engine reachable, bad configuration)."""


class WeightMismatchError(WeightSyncError):
    """An engine refused a bucket: the message names the tensor and the engine."""


@dataclass
class SyncReport:
    version: int
    transport: str
    engines_ok: list[str] = field(default_factory=list)
    engines_failed: dict[str, str] = field(default_factory=dict)  # url -> why
    seconds: float = 0.0
    bytes: int = 0
    buckets: int = 0
    collectives: int = 0

    @property
    def ok(self) -> bool:
        return bool(self.engines_ok) and not self.engines_failed

    def metrics(self) -> dict[str, float]:
        return {"sync/ok": float(self.ok), "sync/engines_ok": float(len(self.engines_ok)),
                "sync/engines_failed": float(len(self.engines_failed)), "sync/bytes": float(self.bytes),
                "sync/buckets": float(self.buckets), "sync/collectives": float(self.collectives),
                "sync/transfer_seconds": self.seconds}


class WeightSender(abc.ABC):
    """Pushes the learner's full weights to inference engines. One instance per learner rank 0."""

    transport: str = ""

    @abc.abstractmethod
    async def connect(self, engine_urls: list[str]) -> None:
        """Remember the engines (and, for collectives, build the update group with them)."""

    @abc.abstractmethod
    async def sync(self, params_iter: Iterable[Bucket], version: int) -> SyncReport:
        """Send every bucket of `params_iter`, then make `version` the engines' weight version.
        `params_iter` is always consumed to the end (the FSDP gather behind it is collective)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release groups and connections (idempotent)."""


# ----------------------------------------------------------------------------- shared HTTP steps


class EngineHTTP:
    """Posting to a set of engines; a failure is returned as a message, never raised."""

    def __init__(self, probe_timeout_s: float = 5.0):
        self.client = httpx.AsyncClient(timeout=None, trust_env=False)
        self.probe_timeout_s = probe_timeout_s

    async def post(self, url: str, path: str, body: dict, timeout: float | None) -> tuple[bool, Any]:
        """(True, json reply) or (False, why). A success=false reply counts as a failure."""
        try:
            r = await self.client.post(url.rstrip("/") + path, json=body, timeout=timeout)
        except (httpx.HTTPError, OSError) as e:
            return False, f"{url}{path}: {type(e).__name__}: {e}"
        try:
            data = r.json()
        except ValueError:
            data = {"message": r.text[:500]}
        if r.status_code != 200 or (isinstance(data, dict) and data.get("success") is False):
            msg = data.get("message") or data.get("error") if isinstance(data, dict) else data
            return False, f"{url}{path}: HTTP {r.status_code}: {msg}"
        return True, data

    async def post_all(self, urls: list[str], path: str, body: dict, timeout: float | None) -> dict[str, tuple[bool, Any]]:
        res = await asyncio.gather(*(self.post(u, path, body, timeout) for u in urls))
        return dict(zip(urls, res))

    async def alive(self, urls: list[str]) -> tuple[list[str], dict[str, str]]:
        """(answering /health within the probe timeout, {dead url: why})."""
        async def one(u: str) -> str | None:
            try:
                r = await self.client.get(u.rstrip("/") + "/health", timeout=self.probe_timeout_s)
                return None if r.status_code == 200 else f"/health answered HTTP {r.status_code}"
            except (httpx.HTTPError, OSError) as e:
                return f"/health failed: {type(e).__name__}: {e}"
        why = await asyncio.gather(*(one(u) for u in urls))
        return [u for u, w in zip(urls, why) if w is None], {u: w for u, w in zip(urls, why) if w is not None}

    async def info(self, url: str) -> dict:
        """asyncrl capabilities ({} for a server without them, e.g. a real SGLang)."""
        try:
            r = await self.client.get(url.rstrip("/") + "/weight_sync_info", timeout=self.probe_timeout_s)
            return r.json() if r.status_code == 200 else {}
        except (httpx.HTTPError, OSError, ValueError):
            return {}

    async def pause(self, urls: list[str], mode: str, timeout: float) -> dict[str, str]:
        """POST /pause_generation {mode}; returns {url: why} for engines that did not pause."""
        res = await self.post_all(urls, "/pause_generation", {"mode": mode}, timeout)
        return {u: why for u, (ok, why) in res.items() if not ok}

    async def resume(self, urls: list[str], timeout: float) -> dict[str, str]:
        res = await self.post_all(urls, "/continue_generation", {}, timeout)
        return {u: why for u, (ok, why) in res.items() if not ok}

    async def aclose(self) -> None:
        await self.client.aclose()


def names_a_tensor(why: str) -> bool:
    """Whether an engine's failure message is a refusal about a named tensor (a configuration
    error: raise) rather than a transport failure (skip the engine)."""
    return re.search(r"HTTP (200|400): .*weight '", why) is not None


def drain(it: Any) -> None:
    """Consume the rest of an iterator (the other FSDP ranks wait on its gathers)."""
    for _ in it:
        pass


class Stopwatch:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.t0
