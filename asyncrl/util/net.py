"""Network helpers shared by every part that opens a port."""

from __future__ import annotations

import ipaddress
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` now (the OS picks it; "" means every interface)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket; port 0 picks a free one (read it back with getsockname)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def is_loopback(host: str) -> bool:
    """True for localhost and loopback IP literals (127.0.0.0/8, ::1, [::1]); every other host (names,
    wildcards such as 0.0.0.0 or *, interface names) counts as exposed."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def advertised(url: str, node_ip: str) -> str:
    """`url` as other machines reach it: a wildcard host (a server bound to every interface) becomes `node_ip`."""
    from urllib.parse import urlsplit, urlunsplit  # lazy: the one function here that parses URLs

    parts = urlsplit(url)
    if parts.hostname not in ("0.0.0.0", "::", "*"):  # urlsplit gives [::] as "::"
        return url
    netloc = f"{node_ip}:{parts.port}" if parts.port else node_ip
    return urlunsplit(parts._replace(netloc=netloc))
