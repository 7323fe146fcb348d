"""`asyncrl engine serve --model-path DIR [--port N] ...`: run the embedded engine server alone.

Also runnable as `python -m asyncrl.engine.cli serve ...` (what the launcher spawns). `--port 0`
picks a free port; the chosen one is written to `--port-file` and printed as
`ASYNCRL_ENGINE_READY http://HOST:PORT` once the server accepts requests.

The control routes (abort, pause, weight updates) need the token in ASYNCRL_ENGINE_TOKEN, read from
the environment only (argv is readable by every local user); without it they answer 403, and a
non-loopback --host is refused. `--weights-dir` (repeatable) adds a directory that
/update_weights_from_disk may read from, besides --model-path.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    s = sub.add_parser("serve", help="serve a Hugging Face causal LM over the SGLang API subset")
    s.add_argument("--model-path", required=True, help="local Hugging Face checkpoint directory")
    s.add_argument("--host", default="127.0.0.1", help="a non-loopback address needs ASYNCRL_ENGINE_TOKEN")
    s.add_argument("--port", type=int, default=0, help="0: pick a free port")
    s.add_argument("--port-file", default=None, help="write the chosen port here once serving")
    s.add_argument("--device", default="cpu")
    s.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    s.add_argument("--max-running-seqs", type=int, default=16)
    s.add_argument("--max-running-tokens", type=int, default=16384)
    s.add_argument("--weight-version", type=int, default=0, help="initial weight_version")
    s.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    s.add_argument("--exit-with-parent", type=int, default=None, metavar="PID",
                   help="exit when process PID is no longer this server's parent (the launcher passes its pid)")
    s.add_argument("--weights-dir", action="append", default=[], metavar="DIR",
                   help="/update_weights_from_disk may load from below DIR (repeatable; --model-path always)")


def main(args: argparse.Namespace) -> int:
    from asyncrl.engine.server import serve
    from asyncrl.util.auth import TokenError

    try:
        serve(args.model_path, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
              max_running_seqs=args.max_running_seqs, max_running_tokens=args.max_running_tokens,
              weight_version=args.weight_version, port_file=args.port_file, threads=args.threads,
              exit_with_parent=args.exit_with_parent, weights_dirs=args.weights_dir)
    except TokenError as e:
        print(f"asyncrl engine: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m asyncrl.engine.cli")
    add_arguments(p)
    sys.exit(main(p.parse_args()))
