"""Built-in agents. Importing this package imports every module in it, so their @register decorators
run; it is loaded through asyncrl's own `asyncrl.plugins` entry point, like any third-party plugin."""

import importlib
import pkgutil

for _m in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_m.name}")

from asyncrl.registry import alias  # noqa: E402

# verl's agent names, so a verl dataset's `agent_name` column works unchanged (`tool_agent` is the same)
alias("agent", "single_turn_agent", "single_turn")
