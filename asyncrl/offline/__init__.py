"""Offline use of a model through the agent loops, outside a training run: `asyncrl eval` (eval_cli.py) and
`asyncrl generate` (generate_cli.py), over one engine (session.py) on a checkpoint (checkpoints.py), with the
scores as pure functions (scores.py)."""
