"""`BufferActor`: the buffer service inside a Ray actor (the controller's way to run it).

The service runs in a background thread of the actor process; the actor's methods talk to it over
its own socket (a `BufferConsumer`), so the serving thread stays the only owner of the state."""

from __future__ import annotations

from pathlib import Path

import ray

from asyncrl.buffer.client import BufferConsumer
from asyncrl.buffer.keys import BufferKeys, endpoint
from asyncrl.buffer.server import BufferService
from asyncrl.config import BufferConfig


@ray.remote(num_cpus=0)
class BufferActor:
    def __init__(self, cfg: BufferConfig, wal_dir: str | Path, max_staleness: int, keys: BufferKeys | None,
                 uniform_limit: int | None = None):
        """`keys`: the run's CURVE keys (`BufferKeys.for_run`), None without CURVE; handed over as an
        argument (never argv); the actor's own client uses the consumer's pair."""
        self._svc = BufferService(cfg, wal_dir, max_staleness, keys, uniform_limit)
        addr = self._svc.start()
        if cfg.host in ("0.0.0.0", "*"):  # advertise this node's address, not the wildcard
            addr = addr.replace("127.0.0.1", ray.util.get_node_ip_address())
        self._addr = addr
        self._client = BufferConsumer(endpoint(keys, self._svc.address, "consumer"), timeout_s=30.0)

    def address(self) -> str:
        return self._addr

    def health(self) -> str | None:
        """None while the service runs; the error that stopped it (e.g. a failed log write) otherwise."""
        return self._svc.health()

    def stats(self) -> dict:
        return self._client.stats()

    def take_dropped(self) -> list[tuple[str, str]]:
        """Groups closed unserved since the last call, as (group_id, reason): the controller routes them to
        their rollout workers, which give the groups' admission budget back."""
        return self._svc.take_dropped()

    def set_version(self, version: int) -> None:
        self._client.set_version(version)

    def stop(self) -> None:
        self._client.close()
        self._svc.stop()
