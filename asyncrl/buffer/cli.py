"""`asyncrl buffer`: run the replay buffer service alone, in the foreground (debugging, tests).

Keys are never command-line values (argv is readable by every local user): with CURVE the service
reads them from `--keys-dir` (created with fresh keys when absent); clients load the same directory
(`asyncrl.buffer.keys.BufferKeys.load`) and use their role's pair."""

from __future__ import annotations

import argparse
import logging

from asyncrl.buffer.keys import BufferKeyError, BufferKeys, curve_enabled
from asyncrl.buffer.server import BufferConfigError, serve_forever
from asyncrl.config import AlgorithmConfig, BufferConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BufferConfig()
    parser.add_argument("--host", default=d.host, help="interface to bind (non-loopback needs CURVE keys)")
    parser.add_argument("--port", type=int, default=d.port, help="0: a free port (printed on stdout)")
    parser.add_argument("--wal-dir", required=True, help="directory of the write-ahead log")
    parser.add_argument("--fsync", choices=("each", "batched", "off"), default=d.fsync)
    parser.add_argument("--capacity-trajectories", type=int, default=d.capacity_trajectories)
    parser.add_argument("--capacity-bytes", type=int, default=d.capacity_bytes)
    parser.add_argument("--max-staleness", type=int, default=AlgorithmConfig().max_staleness,
                        help="eta: trajectories older than version - eta are dropped (a GET may not change it)")
    parser.add_argument("--order", choices=("oldest", "newest"), default=d.order)
    parser.add_argument("--max-frame-bytes", type=int, default=d.max_frame_bytes)
    parser.add_argument("--compact-min-bytes", type=int, default=d.compact_min_bytes,
                        help="online log compaction once the log exceeds max(this, compact-ratio x the live state)")
    parser.add_argument("--compact-ratio", type=float, default=d.compact_ratio)
    parser.add_argument("--disk-reserve-bytes", type=int, default=d.disk_reserve_bytes,
                        help="preallocated beside the log, released when the disk is full (serving still logs)")
    parser.add_argument("--disk-probe-s", type=float, default=d.disk_probe_s,
                        help="while the disk is full: how often to check whether space returned")
    parser.add_argument("--dedupe-other-max", type=int, default=d.dedupe_other_max,
                        help="at most this many non-training uids and group ids are remembered (then refused)")
    parser.add_argument("--curve", choices=("off", "on", "auto"), default=d.curve,
                        help="CURVE encryption + allow-list of the client keys (auto: on for a non-loopback host)")
    parser.add_argument("--keys-dir", default=None,
                        help="with CURVE: 0700 directory of the key files (server/producer/consumer.key_secret), "
                             "created with fresh keys when absent")


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = BufferConfig(host=args.host, port=args.port, wal_dir=args.wal_dir, fsync=args.fsync,
                       capacity_trajectories=args.capacity_trajectories, capacity_bytes=args.capacity_bytes,
                       order=args.order, max_frame_bytes=args.max_frame_bytes,
                       curve=args.curve, keys_dir=args.keys_dir, compact_min_bytes=args.compact_min_bytes,
                       compact_ratio=args.compact_ratio, disk_reserve_bytes=args.disk_reserve_bytes,
                       disk_probe_s=args.disk_probe_s, dedupe_other_max=args.dedupe_other_max)
    try:
        if curve_enabled(cfg) and not cfg.keys_dir:
            raise BufferConfigError(f"--curve={cfg.curve} (host {cfg.host!r}) needs --keys-dir: the clients must "
                                    "load the same keys")
        serve_forever(cfg, args.wal_dir, args.max_staleness, BufferKeys.for_run(cfg))
    except (BufferConfigError, BufferKeyError) as e:
        print(f"asyncrl buffer: {e}")
        return 2
    return 0
