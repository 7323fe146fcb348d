"""The `asyncrl` command line.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `main(args) -> int`;
this file only maps names to modules, so `asyncrl --help` stays fast (nothing heavy is imported
until a subcommand runs). `train` is different: everything after it is a Hydra override.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import PackageNotFoundError, version

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("asyncrl.commands.train", "run RL training (Hydra overrides: asyncrl train agent=react trainer.total_steps=5)"),
    "plugins": ("asyncrl.commands.plugins", "list every registered agent loop, tool, parser, interaction, env and reward"),
    "data": ("asyncrl.commands.data", "build or check datasets (asyncrl data check FILE | asyncrl data arithmetic --out DIR)"),
    "buffer": ("asyncrl.buffer.cli", "run the ZMQ replay buffer service alone (debugging)"),
    "engine": ("asyncrl.engine.cli", "run the embedded inference engine server alone"),
    "retriever": ("asyncrl.envs.search_r1.cli", "run the retrieval server for Search-R1 (asyncrl retriever serve)"),
    "export": ("asyncrl.learner.export", "export a training checkpoint as a plain Hugging Face directory"),
    "bench": ("asyncrl.bench", "run a benchmark (asyncrl bench --help lists them); prints a JSON line"),
    "diagnose": ("asyncrl.commands.diagnose", "report versions, devices and whether the default model loads"),
    "sft": ("asyncrl.sft.trainer", "supervised warm start on chat data with tool calls "
            "(asyncrl sft demos.jsonl --out outputs/sft; then asyncrl train model.path=outputs/sft/final)"),
    "eval": ("asyncrl.commands.eval", "measure a model on a dataset split: mean@k, pass@k per data source "
             "(asyncrl eval [RUN_DIR|CHECKPOINT|HF_DIR] -k 4)"),
    "generate": ("asyncrl.commands.generate", "run a dataset through the agent loop into a parquet of responses, "
                 "resumable (asyncrl generate [MODEL] --out FILE.parquet)"),
    "view": ("asyncrl.commands.view", "browse a run's trajectories in a terminal UI, live (asyncrl view RUN_DIR)"),
    "report": ("asyncrl.commands.report", "plot a run's curves (PNG) and summarize it (markdown): asyncrl report RUN_DIR"),
}


def version_line() -> str:
    """asyncrl's version, with torch's and python's (read from package metadata: importing torch is slow)."""
    def v(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return f"asyncrl {v('asyncrl')} (torch {v('torch')}, transformers {v('transformers')}, python {sys.version.split()[0]})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncrl",
        description="Asynchronous, off-policy RL for multi-turn, tool-using LLM agents.",
    )
    parser.add_argument("-V", "--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] in (["--version"], ["-V"]):
        print(version_line())
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        parser.error(f"unknown command {name!r}; commands: {', '.join(SUBCOMMANDS)}")
    module_name, help_text = SUBCOMMANDS[name]
    module = importlib.import_module(module_name)
    sub = argparse.ArgumentParser(prog=f"asyncrl {name}", description=help_text)
    module.add_arguments(sub)
    args = sub.parse_args(rest) if not getattr(module, "RAW_ARGS", False) else argparse.Namespace(argv=rest)
    return int(module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
