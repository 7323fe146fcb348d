"""The agent-loop framework: what every loop (built-in or a user's plugin) is written against.

- `base`: `AgentLoop` (the interface), `AgentContext`, `Episode` (token accounting and budgets),
  `InteractionSession`, `run_episode` (what the rollout worker calls);
- `chat`: ChatML rendering and delta tokenization;
- `trajectory_builder`: generated and inserted tokens -> `Trajectory`;
- `tool_runner`: one turn's tool calls (validation, parallelism, timeouts, truncation);
- `tool_calls`: what a tool-call parser returns.

The concrete loops (`single_turn`, `tool_agent`, `react`) and the parsers are plugins in
`asyncrl.agents`; nothing here imports them.
"""
