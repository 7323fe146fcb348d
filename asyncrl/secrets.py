"""What is secret, and how a config is shown: the one owner of redaction.

asyncrl's config holds references to secrets, never their values: the buffer's CURVE keys live in
memory or in `buffer.keys_dir` (asyncrl/buffer/keys.py) and reach each process as actor arguments;
the wandb key stays in the environment (`WANDB_API_KEY`), read by wandb itself. So no secret can
reach argv (Hydra overrides), config.json, a checkpoint or the wandb config through the config.

`redacted` is the backstop every written copy of a config goes through (config.json, a
checkpoint's config, the wandb config): a field at a path in `SECRET_PATHS`, or whose name says it
is a secret (`*_secret`, `*password`, `*api_key`, `*_token`), is shown as `REDACTED`, whatever
later code puts there.
"""

from __future__ import annotations

import re
from typing import Any

from asyncrl.config import Config, to_dict

REDACTED = "<redacted>"
# dotted config paths whose values are secrets (none today: the config holds references only)
SECRET_PATHS: frozenset[str] = frozenset()
_SECRET_NAME = re.compile(r"(^|_)(secret|secret_key|password|passphrase|api_key|apikey|token|bearer)$", re.I)
# environment variables holding secrets a run may see; never copied into config, files or argv
SECRET_ENV = ("WANDB_API_KEY",)


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
