"""Search-R1 with a plain `openai` client: the model searches the env's retrieval server through a
`search` function and ends with `<answer> ... </answer>`, which the search_r1 env's reward scores.

An external command (it needs only `openai` and `httpx`): the retrieval server's URL comes from
ASYNCRL_TOOL_CONFIG, the sample as JSON on stdin, the endpoint from OPENAI_BASE_URL / OPENAI_API_KEY.

    asyncrl train env=search_r1 agent=openai_agent \
        'agent.openai.command=[python,examples/openai_agent/search_r1_agent.py]'
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import httpx
import openai

SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the knowledge base; returns the best matching passages.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}


def search(url: str, topk: int, arguments: str) -> str:
    try:
        query = str(json.loads(arguments)["query"])
        r = httpx.post(url, json={"queries": [query], "topk": topk, "return_scores": True}, timeout=30)
        r.raise_for_status()
        hits = r.json()["result"][0]
    except Exception as e:  # a malformed call or a failed search: tell the model, as a tool result
        return f"error: {e}"
    return "\n".join(f"Doc {k + 1}: {h['document']['contents']}" for k, h in enumerate(hits))


def main() -> None:
    sample = json.loads(sys.stdin.read())
    tool = json.loads(os.environ.get("ASYNCRL_TOOL_CONFIG") or "{}").get("search", {})
    url, topk = tool["retrieval_service_url"], int(tool.get("topk", 3))
    client = openai.OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    messages: list[dict[str, Any]] = list(sample["messages"])
    for _ in range(4):
        message = client.chat.completions.create(model="policy", messages=messages, tools=[SEARCH]).choices[0].message
        messages.append(message.model_dump(exclude_none=True))  # sent back as received: exact tokens
        if not message.tool_calls:
            return
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": search(url, topk, call.function.arguments)})


if __name__ == "__main__":
    main()
