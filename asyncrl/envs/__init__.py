"""Environments: the contract between a dataset row, an env and the rollout side (`base`: `Env`,
`Sample`, rewards), and the built-in envs beside it (`arithmetic`, `gsm8k`, `search_r1`, `reasoning_gym`, the
`interactions` and `rewards`; registered by `builtin`, through the `asyncrl.plugins` entry point like
a user's)."""
