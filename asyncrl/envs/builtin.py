"""The built-in envs, interactions and rewards, registered on import. Loaded through asyncrl's own
`asyncrl.plugins` entry point, exactly like a third-party plugin; `base` beside them never imports this."""

from asyncrl.envs import arithmetic, gsm8k, interactions, reasoning_gym, rewards, search_r1  # noqa: F401  (registers them)
