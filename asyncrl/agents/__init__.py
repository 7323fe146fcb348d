"""Agents: the agent-loop framework every loop is written against, and the built-in loops beside it.

Framework (imports no built-in):
- `base`: `AgentLoop` (the interface), `AgentContext`, `Episode` (token accounting and budgets),
  `InteractionSession`, `run_episode` (what the rollout worker calls);
- `chat`: ChatML rendering and delta tokenization;
- `trajectory_builder`: generated and inserted tokens -> `Trajectory`;
- `tool_runner`: one turn's tool calls (validation, parallelism, timeouts, truncation);
- `tool_calls`: what a tool-call parser returns.

Built-in plugins (registered by `builtin`, through the `asyncrl.plugins` entry point like a user's):
`single_turn`, `tool_agent`, `react`, `openai_agent`, and the tool-call `parsers`.
"""
