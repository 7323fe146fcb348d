"""What is secret, and how a config is shown: the one owner of redaction.

asyncrl's config holds references to secrets, never their values: the buffer's CURVE keys live in
memory or in `buffer.keys_dir` (asyncrl/buffer/keys.py) and reach each process as actor arguments;
the wandb key stays in the environment (`WANDB_API_KEY`), read by wandb itself. So no secret can
reach argv (Hydra overrides), config.json, a checkpoint or the wandb config through the config.

The controller takes the secret environment variables (`SECRET_ENV`) out of its environment
before it starts anything (`withhold_env`), so Ray workers, engines and tools, which run
model-written code, never inherit them; only wandb, when online, is given its key.

`redacted` is the backstop every written copy of a config goes through (config.json, a
checkpoint's config, the wandb config): a field at a path in `SECRET_PATHS`, or whose name says it
is a secret (`*_secret`, `*password`, `*api_key`, `*_token`), is shown as `REDACTED`, whatever
later code puts there.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

from asyncrl.config import Config, to_dict

REDACTED = "<redacted>"
# dotted config paths whose values are secrets (none today: the config holds references only)
SECRET_PATHS: frozenset[str] = frozenset()
_SECRET_NAME = re.compile(r"(^|_)(secret|secret_key|password|passphrase|api_key|apikey|token|bearer)$", re.I)
# environment variables holding secrets a run may see; never copied into config, files or argv
SECRET_ENV = ("WANDB_API_KEY",)


def withhold_env() -> dict[str, str]:
    """Take the `SECRET_ENV` variables out of this process's environment, so that no process it
    starts afterwards (Ray's, the engines', the tools') inherits them; returns them for the one
    user that needs them (wandb online, `asyncrl.metrics.MetricsLogger`)."""
    return {k: os.environ.pop(k) for k in SECRET_ENV if k in os.environ}


@contextmanager
def secret_env_set(env: Optional[dict[str, str]]) -> Iterator[None]:
    """`env` in this process's environment for the duration of the block only (a process started
    inside it, such as wandb's service, inherits it; none started later does)."""
    env = dict(env or {})
    os.environ.update(env)
    try:
        yield
    finally:
        for k in env:
            os.environ.pop(k, None)


# environment variables whose values are a run's own secrets: the engine token, Ray's token for the run's
# own instance (asyncrl/run/ray_auth.py) and the wandb key. A config value may never hold one (see below).
RUN_SECRET_ENV = ("ASYNCRL_ENGINE_TOKEN", "RAY_AUTH_TOKEN", *SECRET_ENV)
MIN_SECRET_CHARS = 16  # shorter values are not looked for (they would match ordinary text)


def run_secrets_in(data: Any, path: str = "") -> list[str]:
    """Where `data` (nested dicts and lists, e.g. a resolved tool YAML) holds the value of a run secret
    (`RUN_SECRET_ENV`, as this process's environment has them), as "path (VARIABLE)"; never the value.
    A value that reaches a tool's config or schema reaches prompts, tool replies, trajectories, the buffer's
    WAL and logs (issue 36: `${oc.env:ASYNCRL_ENGINE_TOKEN}` in a tool YAML wrote the token into every
    trajectory), so such a config is refused where it is loaded."""
    values = {v: k for k in RUN_SECRET_ENV if len(v := os.environ.get(k, "")) >= MIN_SECRET_CHARS}
    if not values:
        return []
    found: list[str] = []

    def walk(x: Any, p: str) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                walk(k, p)
                walk(v, f"{p}.{k}" if p else str(k))
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{p}[{i}]")
        elif isinstance(x, str):
            found.extend(f"{p or '(top)'} ({name})" for value, name in values.items() if value in x)

    walk(data, path)
    return found


def is_secret(path: str) -> bool:
    """Is the config field at dotted `path` secret-bearing?"""
    return path in SECRET_PATHS or bool(_SECRET_NAME.search(path.rsplit(".", 1)[-1]))


def redacted(data: Any, path: str = "") -> Any:
    """A copy of a config dict (nested dicts and lists) with every secret-bearing value that is set
    replaced by `REDACTED`; unset (None, empty) values stay as they are, so the copy still says
    whether a secret was configured."""
    if isinstance(data, dict):
        out = {}
        for k, v in data.items():
            p = f"{path}.{k}" if path else str(k)
            out[k] = REDACTED if is_secret(p) and v not in (None, "") else redacted(v, p)
        return out
    if isinstance(data, list):
        return [redacted(v, path) for v in data]
    return data


def shown_config(cfg: Config) -> dict:
    """The config as every file and logger shows it: `to_dict(cfg)`, redacted."""
    return redacted(to_dict(cfg))
