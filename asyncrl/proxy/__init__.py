"""An OpenAI-compatible endpoint in front of the engines, one session per episode (docs/design.md
"The OpenAI-compatible proxy").

- `errors`: `OpenAIError`, OpenAI's error shape;
- `requests`: validation of /v1/chat/completions and /v1/completions bodies into typed requests;
- `session`: one episode's calls, the exact-token prompt assembly and the chains -> trajectories rule;
- `replies`: OpenAI's reply and stream-chunk shapes;
- `server`: `ProxyServer`, the HTTP app on loopback and its per-episode API keys.

`asyncrl/agents/openai_agent.py` (agent `openai_agent`) runs the user's agent against it.
"""
