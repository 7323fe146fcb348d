"""`asyncrl engine serve --model-path DIR [--port N] ...`: run the embedded engine server alone.

Also runnable as `python -m asyncrl.engine.cli serve ...` (what the launcher spawns). `--port 0`
picks a free port; the chosen one is written to `--port-file` and printed as
`ASYNCRL_ENGINE_READY http://HOST:PORT` once the server accepts requests.

The control routes (abort, pause, weight updates) need the token in ASYNCRL_ENGINE_TOKEN, read from
the environment only (argv is readable by every local user); without it they answer 403, and a
non-loopback --host is refused. `--weights-dir` (repeatable) adds a directory that
/update_weights_from_disk may read from, besides --model-path.

The engine's settings (--host, --device, --dtype, --max-running-seqs, --max-running-tokens, --cuda-graphs) are the
fields of `engine` in the run's config (asyncrl.config.EngineConfig), named in SETTINGS: their defaults
are EngineConfig's, the launcher writes them with `settings_argv`, and `settings_from_args` reads them
back into one EngineConfig (validated as the config is) that the server and its scheduler take whole.
"""

from __future__ import annotations

import argparse
import sys
import typing

from asyncrl.config import ConfigError, EngineConfig
from asyncrl.util.auth import TokenError

# EngineConfig field -> the flag that carries it to the engine process (every setting the process takes)
SETTINGS = {"host": "--host", "device": "--device", "dtype": "--dtype", "max_running_seqs": "--max-running-seqs",
            "max_running_tokens": "--max-running-tokens", "cuda_graphs": "--cuda-graphs"}


def settings_argv(engine: EngineConfig) -> list[str]:
    """The flags that give the engine process `engine`'s settings (a None device is left out: resolved there)."""
    out = []
    for field, flag in SETTINGS.items():
        value = getattr(engine, field)
        if value is not None:
            out += [flag, str(value).lower() if isinstance(value, bool) else str(value)]
    return out


def settings_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the parsed flags describe (EngineConfig's checks: a bad value raises ConfigError)."""
    return EngineConfig(**{field: getattr(args, field) for field in SETTINGS})


def _boolean(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() == "true"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    s = sub.add_parser("serve", help="serve a Hugging Face causal LM over the SGLang API subset")
    s.add_argument("--model-path", required=True, help="local Hugging Face checkpoint directory")
    d = EngineConfig()  # the settings' defaults: the config's
    s.add_argument("--host", default=d.host, help="a non-loopback address needs ASYNCRL_ENGINE_TOKEN")
    s.add_argument("--port", type=int, default=0, help="0: pick a free port")
    s.add_argument("--port-file", default=None, help="write the chosen port here once serving")
    s.add_argument("--device", default=d.device, help="default: cuda if available, else cpu")
    s.add_argument("--dtype", default=d.dtype, choices=typing.get_args(typing.get_type_hints(EngineConfig)["dtype"]),
                   help='weights and compute (auto: by the precision rule, docs/design.md "Precision")')
    s.add_argument("--max-running-seqs", type=int, default=d.max_running_seqs, help="requests decoded at once")
    s.add_argument("--max-running-tokens", type=int, default=d.max_running_tokens,
                   help="prompt + generated tokens of the running requests; a longer prompt is refused (400)")
    s.add_argument("--cuda-graphs", type=_boolean, default=d.cuda_graphs, metavar="true|false",
                   help="on a GPU, replay decode steps as CUDA graphs (asyncrl/engine/graphs.py)")
    s.add_argument("--weight-version", type=int, default=0, help="initial weight_version")
    s.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    s.add_argument("--exit-with-parent", type=int, default=None, metavar="PID",
                   help="exit when process PID is no longer this server's parent (the launcher passes its pid)")
    s.add_argument("--scratch-dir", default=None, metavar="DIR",
                   help="the launcher's temporary dir, removed when the server exits because its parent is gone")
    s.add_argument("--weights-dir", action="append", default=[], metavar="DIR",
                   help="/update_weights_from_disk may load from below DIR (repeatable; --model-path always)")


def main(args: argparse.Namespace) -> int:
    # lazy: imports fastapi, huggingface_hub, torch, transformers, which this module does not load otherwise
    from asyncrl.engine.server import serve

    try:
        settings = settings_from_args(args)
    except ConfigError as e:  # it names the config key (engine.max_running_tokens: ...); say the flag too
        flag = next((f for k, f in SETTINGS.items() if str(e).startswith(f"engine.{k}:")), None)
        print(f"asyncrl engine: {flag}: {e}" if flag else f"asyncrl engine: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        serve(args.model_path, settings, port=args.port, weight_version=args.weight_version,
              port_file=args.port_file, threads=args.threads, exit_with_parent=args.exit_with_parent,
              weights_dirs=args.weights_dir, scratch_dir=args.scratch_dir)
    except TokenError as e:
        print(f"asyncrl engine: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


def standalone_parser() -> argparse.ArgumentParser:
    """The parser of `python -m asyncrl.engine.cli` (also what a forked engine parses: engine/forkserver.py)."""
    p = argparse.ArgumentParser(prog="python -m asyncrl.engine.cli")
    add_arguments(p)
    return p


if __name__ == "__main__":
    sys.exit(main(standalone_parser().parse_args()))
