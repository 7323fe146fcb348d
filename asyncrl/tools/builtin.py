"""The built-in tools, registered on import. Loaded through asyncrl's own `asyncrl.plugins` entry point,
exactly like a third-party plugin; `base` and `loader` beside them never import this."""

from asyncrl.tools import calculator, gsm8k_reward, python, search  # noqa: F401  (registers them)
