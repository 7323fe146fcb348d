"""The weight-sync errors, as codes (never recognised by message wording).

    refused      the engine answered and said no: HTTP 4xx with SGLang's {"success": false, "message"}
                 (a refused bucket is a WeightMismatchError: names, shapes or dtypes disagree)
    unreachable  no HTTP answer (connection refused or reset), or a 5xx: the engine is dead or broken
    timeout      no answer within the time allowed
    config       our own request or setup is wrong: a 4xx without SGLang's reply structure (a
                 validation error, an unknown route), a bad transport name, no tensors to send
"""

from __future__ import annotations

CODES = ("refused", "unreachable", "timeout", "config")


class WeightSyncError(RuntimeError):
    """A weight-sync step failed; `code` is one of CODES, `url` the engine (None: not one engine)."""

    def __init__(self, code: str, message: str, url: str | None = None, status: int | None = None):
        if code not in CODES:
            raise ValueError(f"WeightSyncError code {code!r} is not one of {CODES}")
        super().__init__(f"[{code}] {url + ': ' if url else ''}{message}")
        self.code, self.message, self.url, self.status = code, message, url, status

    @property
    def engine_is_down(self) -> bool:
        """Dead or hung engines are left out of the sync and reported; every other code raises."""
        return self.code in ("unreachable", "timeout")


class WeightMismatchError(WeightSyncError):
    """An engine received a bucket and refused to load it (its names, shapes or dtypes are not the
    served model's): a configuration bug, raised, never skipped."""

    def __init__(self, message: str, url: str | None = None, status: int | None = None):
        super().__init__("refused", message, url, status)
