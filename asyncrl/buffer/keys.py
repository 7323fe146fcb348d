"""The buffer's CURVE keys: one pair for the server, one for the producers, one for the consumer.

Whether CURVE is on is `curve_enabled(cfg)` (`buffer.curve`: on, off, or auto = on for a
non-loopback bind). The keys are never config values: `BufferKeys.for_run(cfg)` makes them in
memory (``buffer.keys_dir`` unset: they live only as long as the run and are never written), or
reads them from ``buffer.keys_dir`` (a 0700 directory of 0600 files, one z85 secret key per file:
``server.key_secret``, ``producer.key_secret``, ``consumer.key_secret``; created with fresh keys
when absent). Public keys are derived from the secrets.

The buffer service allow-lists exactly the producer and consumer public keys (ZAP, see
`asyncrl.buffer.server`) and knows each client's role by its key. Each client process gets a
`BufferEndpoint`: the address, the server's public key and its own role's key pair only. Secret
keys never appear in a repr, so no log line or error message can carry one.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import zmq

from asyncrl.config import BufferConfig
from asyncrl.util.net import is_loopback

Role = Literal["producer", "consumer"]
ROLES: tuple[Role, ...] = ("producer", "consumer")
KEY_FILES = ("server", *ROLES)  # <name>.key_secret in keys_dir


class BufferKeyError(ValueError):
    """A key file or keys directory that must not be used (wrong permissions, not a z85 key)."""


def curve_enabled(cfg: BufferConfig) -> bool:
    """`buffer.curve` resolved: auto means on exactly when the bind is not loopback."""
    return cfg.curve == "on" or (cfg.curve == "auto" and not is_loopback(cfg.host))


@dataclass(frozen=True)
class KeyPair:
    public: str  # z85, 40 characters
    secret: str = field(repr=False)

    @classmethod
    def generate(cls) -> KeyPair:
        pub, sec = zmq.curve_keypair()
        return cls(pub.decode(), sec.decode())

    @classmethod
    def from_secret(cls, secret: str, where: str) -> KeyPair:
        secret = secret.strip()
        try:
            if len(secret) != 40:
                raise ValueError("not 40 characters")
            public = zmq.curve_public(secret.encode()).decode()
        except (ValueError, zmq.ZMQError) as e:  # the secret itself is never put in the message
            raise BufferKeyError(f"{where}: not a z85 CURVE secret key ({e})") from None
        return cls(public, secret)


@dataclass(frozen=True)
class BufferEndpoint:
    """What one client needs to reach the buffer: address, and with CURVE the server's public key
    and this client's own key pair (its role's)."""

    address: str
    server_public: Optional[str] = None
    client: Optional[KeyPair] = None

    def __post_init__(self) -> None:
        if (self.server_public is None) != (self.client is None):
            raise ValueError("BufferEndpoint: server_public and client keys go together")


@dataclass(frozen=True)
class BufferKeys:
    server: KeyPair
    producer: KeyPair
    consumer: KeyPair

    @classmethod
    def generate(cls) -> BufferKeys:
        return cls(KeyPair.generate(), KeyPair.generate(), KeyPair.generate())

    @classmethod
    def load(cls, keys_dir: str | Path, create: bool = True) -> BufferKeys:
        """Read the three secrets from `keys_dir`; with `create`, make the directory (0700) and any
        missing key file (0600) first. Refuses a directory or file others may read."""
        d = Path(keys_dir).expanduser()
        if not d.exists() and create:
            d.mkdir(mode=0o700, parents=True)
        if not d.is_dir():
            raise BufferKeyError(f"buffer.keys_dir={str(d)!r} is not a directory")
        _check_private(d, 0o077)
        pairs = {}
        for name in KEY_FILES:
            path = d / f"{name}.key_secret"
            if not path.exists() and create:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(KeyPair.generate().secret + "\n")
            if not path.is_file():
                raise BufferKeyError(f"buffer.keys_dir: {str(path)!r} is missing")
            _check_private(path, 0o077)
            pairs[name] = KeyPair.from_secret(path.read_text(), str(path))
        return cls(**pairs)

    @classmethod
    def for_run(cls, cfg: BufferConfig) -> Optional[BufferKeys]:
        """The keys a run's buffer uses: None without CURVE, else from buffer.keys_dir or fresh."""
        if not curve_enabled(cfg):
            if cfg.keys_dir:
                raise BufferKeyError(f"buffer.keys_dir={cfg.keys_dir!r} is set but buffer.curve={cfg.curve!r} "
                                     f"(host {cfg.host!r}) turns CURVE off: set buffer.curve=on or unset keys_dir")
            return None
        return cls.load(cfg.keys_dir) if cfg.keys_dir else cls.generate()

    def allowed(self) -> dict[str, Role]:
        """The allow-list: client public key -> role."""
        if self.producer.public == self.consumer.public:
            raise BufferKeyError("the producer and consumer keys are the same key: roles could not be told apart")
        return {self.producer.public: "producer", self.consumer.public: "consumer"}

    def endpoint(self, address: str, role: Role) -> BufferEndpoint:
        if role not in ROLES:
            raise ValueError(f"buffer client role {role!r} is not one of {ROLES}")
        return BufferEndpoint(address, self.server.public, getattr(self, role))


def endpoint(keys: Optional[BufferKeys], address: str, role: Role) -> BufferEndpoint:
    """The endpoint a client of `role` gets: with CURVE keys, the server's public key and its role's pair."""
    return keys.endpoint(address, role) if keys is not None else BufferEndpoint(address)


def _check_private(path: Path, forbidden: int) -> None:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & forbidden:
        raise BufferKeyError(f"{str(path)!r} has mode {oct(mode)}: others may read it; chmod "
                        f"{'700' if path.is_dir() else '600'} it")
