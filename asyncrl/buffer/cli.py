"""`asyncrl buffer`: run the replay buffer service alone, in the foreground (debugging, tests)."""

from __future__ import annotations

import argparse
import logging

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
    parser.add_argument("--curve-secret", default=None, help="z85 server secret key")
    parser.add_argument("--curve-public", default=None, help="z85 server public key")


def main(args: argparse.Namespace) -> int:
    from asyncrl.buffer.server import BufferConfigError, serve_forever

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = BufferConfig(host=args.host, port=args.port, wal_dir=args.wal_dir, fsync=args.fsync,
                       capacity_trajectories=args.capacity_trajectories, capacity_bytes=args.capacity_bytes,
                       order=args.order, max_frame_bytes=args.max_frame_bytes,
                       curve_server_secret=args.curve_secret, curve_server_public=args.curve_public)
    try:
        serve_forever(cfg, args.wal_dir, args.max_staleness)
    except BufferConfigError as e:
        print(f"asyncrl buffer: {e}")
        return 2
    return 0
