"""Replay-buffer throughput: 4 producer processes -> 1 consumer, realistic 2,048-token trajectories.

Three transports carry the same payload bytes (a msgpack Trajectory with all its arrays and a
readable conversation, ~30 KB):
  (a) asyncrl: the buffer service in its own process (`asyncrl buffer`, WAL with ``fsync=batched``),
      producers `AsyncBufferProducer.put_bytes` (a window of concurrent puts, each acked after the WAL
      append), the consumer `BufferConsumer.get_batch` (decoded `Batch`) and one `commit` at the end
      (a learner commits at its checkpoint); as a run has it by default, with CURVE (encryption and the
      allow-list of the run's keys), and the same without (``buffer.curve=off``): their ratio
      ``curve_over_plain`` is what CURVE costs;
  (b) a Ray actor queue, the shape of verl's async message queue: an actor with put/get methods,
      producers (Ray actors) calling ``ray.get(queue.put.remote(payload))``, the consumer polling
      ``ray.get(queue.get.remote(n))``;
  (c) raw pyzmq PUSH -> PULL of the same bytes, no log, no ack: the ceiling.
  (d) (c) whose receiver appends every message to a file and fdatasyncs once per drained round: the
      ceiling of any buffer that logs a trajectory before counting it.
Time runs from the moment all producers are released until the consumer holds every trajectory.
The sides run interleaved for ``--rounds`` rounds (asyncrl/bench/rounds.py); reports the median
trajectories/s of each with its spread, MB/s, and the ratios of medians a/b, a/c, d/c, a/d (a with CURVE) and
curve_over_plain.

``--scale N``: instead, N small training trajectories (groups of 4, ids ``bench-g<p>-<i>``) go through
put / get / commit in rounds against the buffer process, and the line reports the buffer process's RSS
(psutil) after the first round and at the end, their ratio, and the log's size on disk.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque

import msgspec
import numpy as np
import psutil
import ray
import zmq

from asyncrl.bench.rounds import MIN_ROUNDS, interleave, ratio, summary
from asyncrl.buffer.client import AsyncBufferProducer, BufferConsumer
from asyncrl.buffer.keys import BufferKeys, endpoint
from asyncrl.data.schema import Array, Trajectory, encode, make_trajectory
from asyncrl.util.net import free_port

UID_WIDTH = 12  # uids are "p<k>-<index>" padded to a fixed width so the template can be patched


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trajectories", type=int, default=8000, help="total, split over the producers")
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2048, help="prompt + response tokens per trajectory")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--batch-groups", type=int, default=16, help="groups per get_batch (one learner step)")
    parser.add_argument("--window", type=int, default=64,
                        help="concurrent puts per asyncrl producer (a worker's concurrent agent loops)")
    parser.add_argument("--fsync", choices=("each", "batched", "off"), default="batched")
    parser.add_argument("--skip-ray", action="store_true")
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS, help="interleaved rounds; medians are reported")
    parser.add_argument("--scale", type=int, default=0,
                        help="N > 0: carry N small trajectories through put/get/commit and report the buffer's RSS")


# ---------------------------------------------------------------------------- payloads


def template(tokens: int, group_size: int = 8) -> bytes:
    """A realistic trajectory: 1/4 prompt, 3/4 response with two tool turns, readable messages."""
    rng = np.random.default_rng(0)
    p = tokens // 4
    r = tokens - p
    mask = np.ones(r, dtype=np.uint8)
    mask[r // 3: r // 3 + 64] = 0  # tool output
    mask[2 * r // 3: 2 * r // 3 + 64] = 0
    versions = np.where(mask == 1, 3, -1).astype(np.int32)
    versions[r // 2:] = np.where(mask[r // 2:] == 1, 4, -1)  # spans a weight update
    logp = np.where(mask == 1, -rng.exponential(1.0, r), 0).astype(np.float32)
    t = Trajectory(
        uid="x" * UID_WIDTH, group_id="g" * UID_WIDTH, group_size=group_size, env="arithmetic", agent="tool_agent",
        prompt_ids=Array.from_numpy(rng.integers(0, 49152, p, dtype=np.int32)),
        response_ids=Array.from_numpy(rng.integers(0, 49152, r, dtype=np.int32)),
        loss_mask=Array.from_numpy(mask), behavior_logprobs=Array.from_numpy(logp),
        versions=Array.from_numpy(versions), reward=1.0, turn_rewards=[0.0, 0.0, 1.0], num_turns=3,
        metrics={"tool_calls": 2.0, "response_tokens": float(r)},
        messages=[{"role": "user", "content": "w " * p}, {"role": "assistant", "content": "w " * (r // 3)},
                  {"role": "tool", "content": "w " * 64}, {"role": "assistant", "content": "w " * (r // 3)}])
    return encode(t)


def payload(tmpl: bytes, producer: int, index: int, group_size: int) -> bytes:
    uid = f"p{producer}-{index}".ljust(UID_WIDTH, "_").encode()
    gid = f"p{producer}-{index // group_size}".ljust(UID_WIDTH, "_").encode()
    return tmpl.replace(b"x" * UID_WIDTH, uid, 1).replace(b"g" * UID_WIDTH, gid, 1)


# ---------------------------------------------------------------------------- producer processes


def _asyncrl_producer(addr, k, n, tokens, group_size, window, barrier):
    tmpl = template(tokens, group_size)

    async def main():
        prod = AsyncBufferProducer(addr, timeout_s=30.0)  # an address, or a BufferEndpoint with CURVE keys
        await prod.put_bytes(payload(template(tokens, 1), k, 10**6, 1))  # warm the connection (a group of 1)
        barrier.wait()
        sem = asyncio.Semaphore(window)

        async def one(i):
            async with sem:
                await prod.put_bytes(payload(tmpl, k, i, group_size))

        await asyncio.gather(*(one(i) for i in range(n)))
        await prod.close()

    asyncio.run(main())


def _zmq_producer(addr, k, n, tokens, group_size, barrier):
    tmpl = template(tokens, group_size)
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.connect(addr)
    barrier.wait()
    for i in range(n):
        s.send(payload(tmpl, k, i, group_size))
    s.close(linger=-1)
    ctx.term()


def _start(target, args, nprod, barrier_parties):
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(barrier_parties)
    procs = [ctx.Process(target=target, args=(*args(k), barrier), daemon=True) for k in range(nprod)]
    for p in procs:
        p.start()
    return procs, barrier


def _per_producer(a) -> int:
    """Whole groups per producer, so every group completes."""
    per = a.trajectories // a.producers // a.group_size * a.group_size
    if per < a.group_size:
        raise ValueError(f"--trajectories={a.trajectories} gives less than one group of {a.group_size} per producer")
    return per


# ---------------------------------------------------------------------------- the three runs


def run_asyncrl(a, curve: bool = True) -> tuple[float, int]:
    per = _per_producer(a)
    wal = tempfile.mkdtemp(prefix="asyncrl-bench-wal-")
    keys_dir = os.path.join(tempfile.mkdtemp(prefix="asyncrl-bench-keys-"), "keys")
    security = ["--curve", "on", "--keys-dir", keys_dir] if curve else ["--curve", "off"]
    srv = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "buffer", "--wal-dir", wal, "--fsync", a.fsync,
                            "--port", str(free_port()), "--max-staleness", "4", *security],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        addr = srv.stdout.readline().split()[1]
        keys = BufferKeys.load(keys_dir, create=False) if curve else None
        producer_ep = endpoint(keys, addr, "producer")
        procs, barrier = _start(_asyncrl_producer,
                                lambda k: (producer_ep, k, per, a.tokens, a.group_size, a.window), a.producers,
                                a.producers + 1)
        c = BufferConsumer(endpoint(keys, addr, "consumer"), timeout_s=30)
        warm = c.get_batch(a.producers, 0, timeout_s=60)  # the warm-up groups of 1
        c.commit([warm.batch_id], 0)
        barrier.wait()
        t0 = time.perf_counter()
        got = nbytes = 0
        need = per * a.producers
        ids = []
        while got < need:
            left_groups = (need - got) // a.group_size
            b = c.get_batch(min(a.batch_groups, left_groups), current_version=4, timeout_s=30)
            if b is None:
                raise RuntimeError(f"asyncrl run stalled at {got}/{need} trajectories: {c.stats()}")
            ids.append(b.batch_id)
            for t in b.trajectories():
                got += 1
                nbytes += t.num_tokens  # touch the decoded struct
        c.commit(ids, step=1)  # a learner commits at its checkpoint, not per batch
        dt = time.perf_counter() - t0
        c.close()
        for p in procs:
            p.join(30)
        return dt, got
    finally:
        srv.terminate()
        srv.wait(10)
        shutil.rmtree(wal, ignore_errors=True)
        shutil.rmtree(os.path.dirname(keys_dir), ignore_errors=True)


def run_asyncrl_plain(a) -> tuple[float, int]:
    return run_asyncrl(a, curve=False)


def run_zmq(a) -> tuple[float, int]:
    per = _per_producer(a)
    ctx = zmq.Context()
    s = ctx.socket(zmq.PULL)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    procs, barrier = _start(_zmq_producer, lambda k: (f"tcp://127.0.0.1:{port}", k, per, a.tokens, a.group_size),
                            a.producers, a.producers + 1)
    barrier.wait()
    t0 = time.perf_counter()
    got = 0
    while got < per * a.producers:
        s.recv(copy=False)
        got += 1
    dt = time.perf_counter() - t0
    for p in procs:
        p.join(30)
    s.close(linger=0)
    ctx.term()
    return dt, got


def run_zmq_log(a) -> tuple[float, int]:
    """(d) the raw transport of (c) plus only what any durable log must do: the receiver appends every
    message (a 4-byte length, then the bytes) to a file and fdatasyncs once per drained round (the WAL's
    ``fsync=batched`` policy). No checksum, no decode, no validation, no ack: the ceiling of a buffer that
    writes each trajectory to disk before it is counted, on this machine's disk."""
    per = _per_producer(a)
    ctx = zmq.Context()
    s = ctx.socket(zmq.PULL)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    logdir = tempfile.mkdtemp(prefix="asyncrl-bench-log-")
    fd = os.open(os.path.join(logdir, "raw.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    procs, barrier = _start(_zmq_producer, lambda k: (f"tcp://127.0.0.1:{port}", k, per, a.tokens, a.group_size),
                            a.producers, a.producers + 1)
    try:
        barrier.wait()
        t0 = time.perf_counter()
        got = 0
        while got < per * a.producers:
            parts = [s.recv(copy=False)]
            while len(parts) < 256:  # drain what is there: one write and one fdatasync per round
                try:
                    parts.append(s.recv(zmq.NOBLOCK, copy=False))
                except zmq.Again:
                    break
            os.writev(fd, [b for m in parts for b in (len(m.buffer).to_bytes(4, "little"), m.buffer)])
            os.fdatasync(fd)
            got += len(parts)
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
        shutil.rmtree(logdir, ignore_errors=True)
    for p in procs:
        p.join(30)
    s.close(linger=0)
    ctx.term()
    return dt, got


def run_ray(a) -> tuple[float, int]:
    @ray.remote
    class RayQueue:  # the shape of verl's async message queue: put one, get many
        def __init__(self):
            self.q = deque()

        def put(self, obj) -> bool:
            self.q.append(obj)
            return True

        def get(self, n: int) -> list:
            return [self.q.popleft() for _ in range(min(n, len(self.q)))]

    @ray.remote
    class RayProducer:
        def __init__(self, k, tokens, group_size):
            self.k, self.tmpl = k, template(tokens, group_size)

        def ready(self) -> bool:
            return True

        def run(self, queue, n, group_size) -> int:
            for i in range(n):
                ray.get(queue.put.remote(payload(self.tmpl, self.k, i, group_size)))
            return n

    per = _per_producer(a)
    ray.init(address="local", num_cpus=a.producers + 2, include_dashboard=False, log_to_driver=False)
    try:
        q = RayQueue.remote()
        prods = [RayProducer.remote(k, a.tokens, a.group_size) for k in range(a.producers)]
        ray.get([p.ready.remote() for p in prods] + [q.get.remote(0)])
        n_batch = a.batch_groups * a.group_size
        t0 = time.perf_counter()
        done = [p.run.remote(q, per, a.group_size) for p in prods]
        got = 0
        while got < per * a.producers:
            items = ray.get(q.get.remote(n_batch))
            got += len(items)
            if not items:
                time.sleep(0.001)
        dt = time.perf_counter() - t0
        ray.get(done)
        return dt, got
    finally:
        ray.shutdown()


SCALE_ROUND, SCALE_GROUP = 4096, 4


def run_scale(a) -> dict:
    """`--scale N`: N small trajectories through one producer and one consumer, RSS of the buffer process."""
    rounds = max(1, a.scale // SCALE_ROUND)
    wal = tempfile.mkdtemp(prefix="asyncrl-bench-wal-")
    srv = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "buffer", "--wal-dir", wal, "--fsync", a.fsync,
                            "--port", str(free_port()), "--max-staleness", "4", "--curve", "off"], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
    base = make_trajectory(uid="x", group_id="x", group_size=SCALE_GROUP, prompt_ids=[1, 2, 3],
                           response_ids=[4, 5, 6, 7], loss_mask=[1] * 4, behavior_logprobs=[-0.5] * 4,
                           versions=[0] * 4, reward=1.0)
    rss: list[int] = []

    async def main(addr: str) -> float:
        ps = psutil.Process(srv.pid)
        prod, cons = AsyncBufferProducer(addr, timeout_s=60.0), BufferConsumer(addr, timeout_s=60)
        t0 = time.perf_counter()
        for r in range(rounds):
            first = r * SCALE_ROUND // SCALE_GROUP
            await asyncio.gather(*(prod.put_bytes(encode(msgspec.structs.replace(
                base, uid=f"bench-g{p}-{i}", group_id=f"bench-g{p}")))
                for p in range(first, first + SCALE_ROUND // SCALE_GROUP) for i in range(SCALE_GROUP)))
            ids, got = [], 0
            while got < SCALE_ROUND:
                b = await asyncio.to_thread(cons.get_batch, 256, 0, None, 60.0)
                if b is None:
                    raise RuntimeError(f"--scale stalled in round {r}: {cons.stats()}")
                ids.append(b.batch_id)
                got += sum(len(g.trajectories) for g in b.groups)
            await asyncio.to_thread(cons.commit, ids, r)
            if r == 0 or r == rounds - 1:
                rss.append(ps.memory_info().rss)
        dt = time.perf_counter() - t0
        await prod.close()
        cons.close()
        return dt

    try:
        addr = srv.stdout.readline().split()[1]
        dt = asyncio.run(main(addr))
        wal_bytes = sum(f.stat().st_size for f in os.scandir(wal) if f.name.endswith(".wal"))
    finally:
        srv.terminate()
        srv.wait(10)
        shutil.rmtree(wal, ignore_errors=True)
    n = rounds * SCALE_ROUND
    return {"scale_trajectories": n, "fsync": a.fsync, "seconds": round(dt, 1), "traj_per_s": round(n / dt, 1),
            "rss_first_round_mib": round(rss[0] / 2**20, 1), "rss_end_mib": round(rss[-1] / 2**20, 1),
            "rss_end_over_first": round(rss[-1] / rss[0], 3), "wal_mib_end": round(wal_bytes / 2**20, 1)}


def run(args: argparse.Namespace) -> dict:
    if args.scale:
        return run_scale(args)
    size = len(template(args.tokens))
    n = _per_producer(args) * args.producers
    out: dict = {"trajectory_bytes": size, "trajectories": n, "producers": args.producers, "fsync": args.fsync,
                 "rounds": args.rounds}
    sides = {"zmq": run_zmq, "zmq_log": run_zmq_log, "asyncrl": run_asyncrl, "asyncrl_plain": run_asyncrl_plain}
    if not args.skip_ray:
        sides["ray"] = run_ray

    def rate(fn):
        def one() -> float:
            dt, got = fn(args)
            return got / dt
        return one

    per_s = interleave({name: rate(fn) for name, fn in sides.items()}, args.rounds)
    for name, values in per_s.items():
        out.update(summary(f"{name}_traj_per_s", values, 1))
        out[f"{name}_mb_per_s"] = round(statistics.median(values) * size / 1e6, 1)
    if "ray" in per_s:
        out["a_over_b"] = ratio(per_s["asyncrl"], per_s["ray"], 2)
    out["a_over_c"] = ratio(per_s["asyncrl"], per_s["zmq"])
    out["d_over_c"] = ratio(per_s["zmq_log"], per_s["zmq"])
    out["a_over_d"] = ratio(per_s["asyncrl"], per_s["zmq_log"])
    out["curve_over_plain"] = ratio(per_s["asyncrl"], per_s["asyncrl_plain"])
    return out
