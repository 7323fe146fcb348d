"""OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

from __future__ import annotations

from typing import Any, Optional


class OpenAIError(Exception):
    """A request the proxy refuses; `body()` is what OpenAI would answer."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str, code: str = "invalid_value") -> OpenAIError:
    """A 400 naming the field."""
    return OpenAIError(400, f"{param}: {message}", param=param, code=code)
