"""CURVE with a ZAP allow-list, on a real service and real sockets: only the run's producer and
consumer keys get in, each only for its own role's requests; keys live in files, never on argv."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import msgspec
import pytest
import zmq

from asyncrl.buffer.client import AsyncBufferProducer, BufferConsumer, BufferError, BufferTimeout
from asyncrl.buffer.keys import BufferEndpoint, BufferKeyError, BufferKeys, KeyPair, curve_enabled, endpoint
from asyncrl.config import BufferConfig

from .conftest import traj, wait_until

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")]

REFUSED_TIMEOUT_S = 2.0  # a refused handshake is never answered: each refused request waits this long


def _store(c: BufferConsumer) -> dict:
    """What the service holds, as an allowed consumer reads it."""
    st = c.stats()
    return {k: st[k] for k in ("size", "bytes", "groups_pending", "groups_complete", "batches_outstanding",
                               "next_batch_id", "batches_committed", "version", "wal_bytes_written")}


@pytest.fixture
def curve_service(service):
    keys = BufferKeys.generate()
    svc = service(keys=keys, host="127.0.0.1", curve="on")
    return svc, keys


async def test_allowed_producer_and_consumer_work(curve_service):
    svc, keys = curve_service
    p = AsyncBufferProducer(keys.endpoint(svc.address, "producer"))
    assert await p.put_bytes(_encode(traj("a", "g"))) == "new"
    await p.close()
    c = BufferConsumer(keys.endpoint(svc.address, "consumer"))
    b = c.get_batch(1, 0, timeout_s=10)
    assert [g.group_id for g in b.groups] == ["g"]
    c.commit([b.batch_id], step=1)
    assert c.stats()["batches_outstanding"] == 0
    c.close()


async def test_without_curve_the_run_hands_out_plain_endpoints(service):
    """buffer.curve=auto (or off) on loopback: no keys, and the endpoints the fleet builds carry none."""
    cfg = BufferConfig(curve="auto")
    keys = BufferKeys.for_run(cfg)
    assert keys is None
    svc = service()
    p = AsyncBufferProducer(endpoint(keys, svc.address, "producer"))
    await p.put_bytes(_encode(traj("a", "g")))
    await p.close()
    c = BufferConsumer(endpoint(keys, svc.address, "consumer"))
    assert [g.group_id for g in c.get_batch(1, 0, timeout_s=10).groups] == ["g"]
    c.close()
    with pytest.raises(ValueError, match="go together"):
        BufferEndpoint(svc.address, server_public=KeyPair.generate().public)


@pytest.mark.parametrize("who", ["random key", "server's own key", "no CURVE"])
async def test_a_key_not_on_the_allow_list_cannot_put_get_or_commit(curve_service, who):
    svc, keys = curve_service
    # something to GET and a served batch to COMMIT, so a successful outsider would change the store
    p = AsyncBufferProducer(keys.endpoint(svc.address, "producer"))
    for i in range(2):
        await p.put_bytes(_encode(traj(f"u{i}", f"g{i}")))
    await p.close()
    c = BufferConsumer(keys.endpoint(svc.address, "consumer"))
    served = c.get_batch(1, 0, timeout_s=10)
    before = _store(c)

    if who == "no CURVE":
        outsider = BufferEndpoint(svc.address)
    else:  # knows the server's public key, brings a key pair of its own
        pair = KeyPair.generate() if who == "random key" else keys.server
        outsider = BufferEndpoint(svc.address, keys.server.public, pair)
    op = AsyncBufferProducer(outsider, timeout_s=REFUSED_TIMEOUT_S, retries=0)
    with pytest.raises(BufferTimeout):
        await op.put_bytes(_encode(traj("evil", "evil")))
    await op.close()
    oc = BufferConsumer(outsider, timeout_s=REFUSED_TIMEOUT_S)
    oc.REQUEST_TRIES = 1
    assert oc.get_batch(1, 0, timeout_s=REFUSED_TIMEOUT_S) is None
    with pytest.raises(BufferTimeout):
        oc.commit([served.batch_id], step=1)
    oc.close()

    assert _store(c) == before  # nothing stored, served or committed
    stats = c.stats()
    if who != "no CURVE":  # the ZAP handler itself refused the key (a NULL client fails before ZAP)
        assert stats["auth_denied"] >= 1
    assert stats["batches_outstanding"] == 1 and stats["batches_committed"] == 0
    c.close()


async def test_each_role_may_send_only_its_own_requests(curve_service):
    svc, keys = curve_service
    as_consumer = AsyncBufferProducer(keys.endpoint(svc.address, "consumer"))
    with pytest.raises(BufferError, match="consumer key may not send b'PUTS'"):
        await as_consumer.put_bytes(_encode(traj("x", "x")))
    await as_consumer.close()
    p = AsyncBufferProducer(keys.endpoint(svc.address, "producer"))
    await p.put_bytes(_encode(traj("a", "g")))
    await p.close()
    as_producer = BufferConsumer(keys.endpoint(svc.address, "producer"))
    with pytest.raises(BufferError, match="producer key may not send b'GET'"):
        as_producer.get_batch(1, 0, timeout_s=5)
    for call in (lambda: as_producer.commit([0], 1), lambda: as_producer.set_version(5), as_producer.stats):
        with pytest.raises(BufferError, match="producer key may not send"):
            call()
    as_producer.close()
    c = BufferConsumer(keys.endpoint(svc.address, "consumer"))
    st = c.stats()
    assert st["size"] == 1 and st["batches_outstanding"] == 0 and st["version"] == 0 and st["forbidden"] == 5
    c.close()


def test_keys_dir_is_created_private_and_read_back(tmp_path):
    d = tmp_path / "keys"
    keys = BufferKeys.load(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    files = sorted(p.name for p in d.iterdir())
    assert files == ["consumer.key_secret", "producer.key_secret", "server.key_secret"]
    assert all(stat.S_IMODE((d / f).stat().st_mode) == 0o600 for f in files)
    assert BufferKeys.load(d, create=False) == keys
    assert len({keys.server.public, keys.producer.public, keys.consumer.public}) == 3
    assert keys.server.secret not in repr(keys) and keys.producer.secret not in repr(keys.endpoint("tcp://x:1", "producer"))


def test_keys_dir_others_may_read_or_bad_key_is_refused(tmp_path):
    d = tmp_path / "keys"
    BufferKeys.load(d)
    os.chmod(d, 0o755)
    with pytest.raises(BufferKeyError, match="others may read it"):
        BufferKeys.load(d)
    os.chmod(d, 0o700)
    os.chmod(d / "producer.key_secret", 0o644)
    with pytest.raises(BufferKeyError, match="producer.key_secret.*others may read it"):
        BufferKeys.load(d)
    os.chmod(d / "producer.key_secret", 0o600)
    (d / "consumer.key_secret").write_text("not-a-key-sk-" + "x" * 20)
    with pytest.raises(BufferKeyError, match="consumer.key_secret: not a z85 CURVE secret key") as e:
        BufferKeys.load(d)
    assert "xxxxx" not in str(e.value)  # the file's content is not echoed
    (d / "consumer.key_secret").write_text((d / "producer.key_secret").read_text())
    with pytest.raises(BufferKeyError, match="same key"):
        BufferKeys.load(d).allowed()


@pytest.mark.parametrize("host,curve,on", [("127.0.0.1", "auto", False), ("0.0.0.0", "auto", True),
                                           ("127.0.0.1", "on", True), ("10.0.0.1", "off", False)])
def test_curve_auto_means_on_for_a_non_loopback_bind(host, curve, on):
    assert curve_enabled(BufferConfig(host=host, curve=curve)) is on
    assert (BufferKeys.for_run(BufferConfig(host=host, curve=curve)) is not None) is on


def test_a_keys_dir_with_curve_off_is_refused(tmp_path):
    with pytest.raises(BufferKeyError, match="keys_dir=.* is set but buffer.curve='auto'"):
        BufferKeys.for_run(BufferConfig(curve="auto", keys_dir=str(tmp_path / "k")))
    assert not (tmp_path / "k").exists()


def test_cli_takes_no_key_values_on_argv():
    r = subprocess.run([sys.executable, "-m", "asyncrl.cli", "buffer", "--help"], capture_output=True, text=True,
                       timeout=60, check=True)
    assert "--keys-dir" in r.stdout
    assert "secret" not in r.stdout.replace(".key_secret", "") and "--curve-" not in r.stdout


def test_cli_serves_with_keys_from_a_directory(tmp_path):
    """`asyncrl buffer --keys-dir` on all interfaces: the dir's producer key gets in, a stranger's does not."""
    d = tmp_path / "keys"
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "buffer", "--host", "0.0.0.0", "--wal-dir",
                             str(tmp_path / "wal"), "--keys-dir", str(d)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("BUFFER_ADDRESS "), line
        keys = BufferKeys.load(d, create=False)
        c = BufferConsumer(keys.endpoint(line.split()[1], "consumer"), timeout_s=30)
        assert c.stats()["size"] == 0
        c.close()
        stranger = BufferConsumer(BufferEndpoint(line.split()[1], keys.server.public, KeyPair.generate()),
                                  timeout_s=REFUSED_TIMEOUT_S)
        stranger.REQUEST_TRIES = 1
        with pytest.raises(BufferTimeout):
            stranger.stats()
        stranger.close()
    finally:
        proc.terminate()
        assert wait_until(lambda: proc.poll() is not None, 30)


def _encode(t) -> bytes:
    return msgspec.msgpack.encode(t)


async def test_a_runs_buffer_refuses_strangers_by_default(tmp_path):
    """Issue 36: with the default config a stranger process on the same host read STATS, PUT a forged group
    (trained at step 21 in place of the real one) and took real groups that then vanished. The default is now
    CURVE with fresh keys for each run: a client without keys (what the stranger was) gets no answer to STATS,
    PUT or GET, and nothing it sent is stored; the run's own consumer sees an empty, untouched buffer."""
    from asyncrl.buffer.server import BufferService
    from asyncrl.config import load_config

    cfg = load_config([]).buffer  # what `asyncrl train` uses unless told otherwise
    keys = BufferKeys.for_run(cfg)
    assert (cfg.curve, cfg.keys_dir) == ("on", None) and keys is not None
    assert BufferKeys.for_run(cfg).producer != keys.producer  # fresh keys for each run
    svc = BufferService(cfg, tmp_path / "wal", 0, keys)
    svc.start()
    try:
        stranger = BufferConsumer(svc.address, timeout_s=REFUSED_TIMEOUT_S)
        stranger.REQUEST_TRIES = 1
        with pytest.raises(BufferTimeout):
            stranger.stats()
        assert stranger.get_batch(1, 0, timeout_s=REFUSED_TIMEOUT_S) is None  # no reply: no batch
        stranger.close()
        forger = AsyncBufferProducer(svc.address, timeout_s=REFUSED_TIMEOUT_S, retries=0)
        with pytest.raises((BufferTimeout, BufferError)):
            await forger.put_bytes(_encode(traj("forged", "g-forged")))
        await forger.close()
        own = BufferConsumer(keys.endpoint(svc.address, "consumer"), timeout_s=30)
        assert _store(own)["size"] == 0 and own.stats()["received"] == 0
        own.close()
    finally:
        svc.stop()
