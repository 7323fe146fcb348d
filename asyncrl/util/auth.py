"""The run's engine token: who may change an engine (docs/design.md "Threat model").

One secret per run, `ASYNCRL_ENGINE_TOKEN`, held only in the environment of the run's own processes
(the controller makes it before Ray starts; engines, learner ranks and rollout workers inherit it),
never in argv, a log line or the config. Callers send it as SGLang does, `Authorization: Bearer
<token>`; the embedded engine checks it with `TokenGate`, which answers as SGLang 0.5.23's
`add_api_key_middleware` (srt/utils/auth.py) does for a server started with `--admin-api-key`:

    open routes                  any caller (generation, liveness, read-only info on loopback)
    every other route            401 {"error": "Unauthorized"} without the right bearer token
                                 (missing, malformed or wrong: SGLang does not tell them apart),
                                 403 {"error": "Forbidden..."} when the engine has no token at all
                                 (SGLang's answer for a route no key can unlock)

The gate denies by default: a route is open only if it is listed here, so a control route added
later is closed without anyone remembering to close it. On loopback, `LOOPBACK_OPEN` is open; bound
to any other address (which needs a token: `check_bind`), only `/health*` is (SGLang with
`--api-key` as well: every route but /health needs the key).
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import threading
from collections.abc import Mapping
from typing import Any

from asyncrl.util.net import is_loopback

ENV = "ASYNCRL_ENGINE_TOKEN"
MIN_TOKEN_CHARS = 16

# (method, path) any caller may use on an engine bound to loopback: generation and what only reads
LOOPBACK_OPEN = frozenset({
    ("POST", "/generate"),
    ("GET", "/health"), ("GET", "/health_generate"),
    ("GET", "/model_info"), ("GET", "/get_model_info"),
    ("GET", "/server_info"), ("GET", "/get_server_info"),
    ("GET", "/stats"), ("GET", "/weight_sync_info"),
})
# bound to a non-loopback address: liveness only (SGLang keeps /health* open whatever its keys)
EXPOSED_OPEN = frozenset({("GET", "/health"), ("GET", "/health_generate")})

UNAUTHORIZED = {"error": "Unauthorized"}  # SGLang's body, byte for byte
NO_TOKEN = {"error": f"Forbidden: this engine was started without {ENV}, so its control routes are closed"}


_ensure_lock = threading.Lock()  # engines launched from several threads must get one token


class TokenError(ValueError):
    """A token in the environment that cannot be one (the message never contains the value)."""


def make_token() -> str:
    """A fresh random token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def token_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The run's token from `ASYNCRL_ENGINE_TOKEN`, None when unset or empty; a value that cannot be
    sent in an HTTP header, or is too short to be a secret, is refused naming the variable only."""
    value = (os.environ if environ is None else environ).get(ENV, "")
    if not value:
        return None
    if len(value) < MIN_TOKEN_CHARS:
        raise TokenError(f"{ENV} is set but has {len(value)} characters; a token needs at least {MIN_TOKEN_CHARS} "
                         f"(make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    if not all(33 <= ord(c) < 127 for c in value):
        raise TokenError(f"{ENV} holds whitespace, control or non-ASCII characters; a bearer token cannot")
    return value


def ensure_token() -> str:
    """This process's token: the environment's, else a fresh one put into os.environ, so this process
    (its senders and clients) and every child it starts afterwards hold it."""
    with _ensure_lock:
        token = token_from_env()
        if token is None:
            token = os.environ[ENV] = make_token()
        return token


def auth_headers(token: str | None = None) -> dict[str, str]:
    """The header a caller sends: {"Authorization": "Bearer <token>"} with `token` or the
    environment's; {} when there is none."""
    token = token if token is not None else token_from_env()
    return {"Authorization": f"Bearer {token}"} if token else {}


def check_bind(host: str, token: str | None, where: str = "engine.host (--host)") -> None:
    """Refuse to serve an engine on a non-loopback address without a token."""
    if token is None and not is_loopback(host):
        raise TokenError(f"{where}={host!r} is not a loopback address, and {ENV} is not set: an engine reachable "
                         f"from other machines must require a token. Set {ENV} (asyncrl train makes one per run) "
                         f"or bind 127.0.0.1")


def bearer_matches(header: str | None, token: str) -> bool:
    """`Authorization: Bearer <token>`, compared in constant time (SGLang's parsing: scheme case-insensitive)."""
    if not header:
        return False
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), token.encode())


class TokenGate:
    """ASGI middleware: a request to a route not in `open_routes` needs the bearer token."""

    def __init__(self, app: Any, *, token: str | None, open_routes: frozenset[tuple[str, str]]):
        self.app, self.token, self.open_routes = app, token, open_routes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"]) in self.open_routes:
            await self.app(scope, receive, send)
            return
        if self.token is None:
            await _reply(send, 403, NO_TOKEN)
            return
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        if not bearer_matches(header, self.token):
            await _reply(send, 401, UNAUTHORIZED)
            return
        await self.app(scope, receive, send)


async def _reply(send: Any, status: int, body: dict) -> None:
    raw = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]})
    await send({"type": "http.response.body", "body": raw})
