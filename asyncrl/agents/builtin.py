"""The built-in agent loops and tool-call parsers, registered on import. Loaded through asyncrl's own
`asyncrl.plugins` entry point, exactly like a third-party plugin; the framework modules beside them
(`base`, `chat`, `tool_calls`, `tool_runner`, `trajectory_builder`) never import this."""

from asyncrl.agents import openai_agent, parsers, react, single_turn, tool_agent  # noqa: F401  (registers them)
from asyncrl.registry import alias

# verl's agent names, so a verl dataset's `agent_name` column works unchanged (`tool_agent` is the same)
alias("agent", "single_turn_agent", "single_turn")
