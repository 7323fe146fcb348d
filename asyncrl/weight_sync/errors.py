"""The weight-sync errors, as codes (recognised by HTTP status and reply structure; one by wording, below).

    refused      the engine answered and said no: HTTP 4xx with SGLang's {"success": false, "message"}
                 (a refused bucket is a WeightMismatchError: names, shapes or dtypes disagree)
    flush_refused  the engine loaded the tensors and then refused to flush its cache (SGLang, requests
                 still running or queued: scheduler_components/weight_updater.py
                 flush_cache_after_weight_update). Its reply differs from a refused load only in its
                 message, whose start (FLUSH_REFUSED) is the one wording read. The engine holds the new
                 weights without the new version (SGLang's /model_info does not move): it is left out
                 of this sync and reported; the next sync sends every tensor again
    delta_mismatch  a delta bucket (delta.py) did not rebuild the tensors the sender hashed, or the engine
                 does not hold the base it was meant for: marked by `asyncrl_delta_mismatch` in the refusal.
                 Nothing of the bucket was applied; the sync is abandoned and the next one sends every tensor
    unreachable  no HTTP answer (connection refused or reset), or a 5xx: the engine is dead or broken
    timeout      no answer within the time allowed
    config       our own request or setup is wrong: a 4xx without SGLang's reply structure (a
                 validation error, an unknown route), a bad transport name, no tensors to send
"""

from __future__ import annotations

CODES = ("refused", "flush_refused", "delta_mismatch", "unreachable", "timeout", "config")
FLUSH_REFUSED = "Weights were updated, but the cache was not flushed"  # SGLang 0.5.23's message starts so


class WeightSyncError(RuntimeError):
    """A weight-sync step failed; `code` is one of CODES, `url` the engine (None: not one engine)."""

    def __init__(self, code: str, message: str, url: str | None = None, status: int | None = None):
        if code not in CODES:
            raise ValueError(f"WeightSyncError code {code!r} is not one of {CODES}")
        super().__init__(f"[{code}] {url + ': ' if url else ''}{message}")
        self.code, self.message, self.url, self.status = code, message, url, status

    @property
    def engine_is_down(self) -> bool:
        """Dead or hung."""
        return self.code in ("unreachable", "timeout")

    @property
    def left_out(self) -> bool:
        """Dead, hung, its cache flush refused or a delta that did not match: left out of the sync and
        reported; every other code raises."""
        return self.engine_is_down or self.code in ("flush_refused", "delta_mismatch")


class WeightMismatchError(WeightSyncError):
    """An engine received a bucket and refused to load it (its names, shapes or dtypes are not the
    served model's): a configuration bug, raised, never skipped."""

    def __init__(self, message: str, url: str | None = None, status: int | None = None):
        super().__init__("refused", message, url, status)
