"""Ray's own surface for a run: who may join the Ray instance `asyncrl train` starts.

Anyone who joins a run's Ray cluster runs code as the run's user: they can read the engine token and the
buffer's keys from its actors, and submit any task. Ray 2.60 turns its token authentication on for a local
`ray.init()` and keeps the token in `~/.ray/auth_token`, written with the process's umask (0644 here: any
local user who can reach the home directory could read it and join; issue 36).

For a Ray instance the run starts itself, `private_local_ray` gives Ray a fresh token of its own: in this
process's environment (`RAY_AUTH_MODE=token`, `RAY_AUTH_TOKEN`), which Ray's processes inherit, never in a
file or on a command line, so the token lives as long as the run and no other run or user holds it. A user
who set `RAY_AUTH_MODE` or `RAY_AUTH_TOKEN` themselves keeps their setting. A run that joins a cluster
(`ray.address`, `RAY_ADDRESS`) uses that cluster's own authentication, as the user set it. `ray start --head`
turns token mode on when a token file exists (Ray 2.60's `maybe_enable_token_auth_if_token_available`); a
joining node or driver does not, so without `RAY_AUTH_MODE=token` a run spent a minute retrying
"Authentication token is missing or incorrect": it then stops with exit 2 and `JOIN_HINT` (turning token mode
on by itself is no answer: a token-mode driver joins a cluster without authentication, but its actors died
there). Either way, a `~/.ray/auth_token`
that others may read is reported, with the command that fixes it.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"


_set_here: dict[str, str] = {}  # what an earlier run of this process (a sweep's) put in the environment


def private_local_ray() -> Optional[str]:
    """Token authentication with a fresh per-run token for the local Ray instance this process is about to
    start; returns the token (for redaction), or None where the user's own Ray settings decide."""
    if _set_here and all(os.environ.get(k) == v for k, v in _set_here.items()):
        for k in _set_here:  # an earlier run's, not the user's: this run gets its own
            del os.environ[k]
    if os.environ.get(MODE_ENV) is not None or os.environ.get(TOKEN_ENV):
        log.info("Ray authentication as set in the environment (%s=%s%s)", MODE_ENV, os.environ.get(MODE_ENV, "<unset>"),
                 f", {TOKEN_ENV} set" if os.environ.get(TOKEN_ENV) else "")
        return None
    token = secrets.token_hex(32)
    _set_here.clear()
    _set_here.update({MODE_ENV: "token", TOKEN_ENV: token})
    os.environ.update(_set_here)
    _reload_ray_auth()
    return token


JOIN_HINT = ("is it running, and does it use token authentication? Ray 2.60 turns it on for `ray start --head` "
             "when ~/.ray/auth_token exists: every node and the run's driver then need RAY_AUTH_MODE=token and the "
             "same token (that file, or RAY_AUTH_TOKEN)")


def _reload_ray_auth() -> None:
    """Make this process's Ray see the environment just set: Ray reads its mode and token once, at import
    (its own `_enable_token_auth` reloads them the same way). Without it the driver would talk to its own
    token-guarded GCS without the token."""
    # lazy: ray's C++ side, imported only where a run starts its Ray instance
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def readable_token_file(home: Optional[Path] = None) -> Optional[str]:
    """A warning when Ray's default token file (~/.ray/auth_token) may be read by other users, else None."""
    path = (home or Path.home()) / ".ray" / "auth_token"
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return None
    if not mode & 0o077:
        return None
    return (f"{path} has mode {oct(mode)}: other local users may read it and join any Ray cluster that uses it "
            f"(this run's own Ray instance does not); chmod 600 {path}")
