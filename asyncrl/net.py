"""Network helpers shared by every part that opens a port."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` now (the OS picks it; "" means every interface)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
