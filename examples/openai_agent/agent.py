"""The default arithmetic task solved by a plain `openai` client agent with function calling.

Nothing here knows about training: the agent talks to whatever OpenAI-compatible server its client
points at. asyncrl gives it, per episode, a client bound to the rollout worker's proxy, and trains on
the exact tokens the engine produced for its calls.

As a registered function (in the rollout worker's process):

    asyncrl train agent=openai_agent plugins=[examples/openai_agent/agent.py] \
        agent.openai.function=arithmetic_calculator

As an external command (any program that reads OPENAI_BASE_URL / OPENAI_API_KEY; the sample comes
as JSON on stdin):

    asyncrl train agent=openai_agent 'agent.openai.command=[python,examples/openai_agent/agent.py]'

The reward is the arithmetic env's, on the last reply (this agent returns None and sets none).
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import sys
from types import SimpleNamespace
from typing import Any

import openai

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression, e.g. '3*4+5'.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(arguments: str) -> str:
    """The tool, on the agent's side: + - * / and parentheses on numbers, anything else an error text."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only numbers and + - * / ( )")

    try:
        value = ev(ast.parse(str(json.loads(arguments)["expression"]), mode="eval").body)
    except Exception as e:  # the model's call was malformed: tell it, as a tool result
        return f"error: {e}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


async def solve(client: openai.AsyncOpenAI, sample: Any) -> None:
    messages: list[dict[str, Any]] = list(sample.messages)
    for _ in range(4):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))  # sent back as received: exact tokens
        if not message.tool_calls:
            return None
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(call.function.arguments)})
    return None


try:  # registered when loaded as an asyncrl plugin; the command form needs only `openai`
    from asyncrl.registry import register
except ImportError:
    pass
else:
    register("openai_agent_fn", "arithmetic_calculator")(solve)


async def main() -> None:
    sample = SimpleNamespace(**json.loads(sys.stdin.read()))
    async with openai.AsyncOpenAI() as client:  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
        await solve(client, sample)


if __name__ == "__main__":
    asyncio.run(main())
