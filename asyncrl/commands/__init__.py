"""The `asyncrl` subcommands: each module exposes `add_arguments(parser)` and `main(args) -> int`, and
`asyncrl/cli.py` maps names to them. A service's own entry point (`engine`, `buffer`, `retriever`)
sits with its service instead."""
