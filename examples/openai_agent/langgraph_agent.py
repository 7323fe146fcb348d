"""The default arithmetic task solved by a LangGraph ReAct agent (langgraph + langchain-openai).

The agent is ordinary LangGraph code: a `ChatOpenAI` model bound to a calculator tool, run by
`create_react_agent`. The only asyncrl-specific lines are the registration and pointing `ChatOpenAI`
at the episode's endpoint (`base_url`, `api_key` of the client asyncrl hands in). LangGraph sends the
conversation back as it received it, so each episode is one multi-turn trajectory of the engine's
exact tokens.

    asyncrl train agent=openai_agent plugins=[examples/openai_agent/langgraph_agent.py] \
        agent.openai.function=arithmetic_langgraph

The reward is the arithmetic env's, on the last reply. langgraph and langchain-openai are in the
project's `dev` extra (they are what this example needs; asyncrl itself does not import them).
"""

from __future__ import annotations

import ast
import operator
from typing import Any

import openai
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

from asyncrl.registry import register

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and abs(node.value) < 1e12:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.operand))
    raise ValueError("only numbers and + - * / ( )")


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression, e.g. '3*4+5'."""
    try:
        value = _evaluate(ast.parse(expression[:256], mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:  # told to the model as the result
        return f"error: {e}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


@register("openai_agent_fn", "arithmetic_langgraph")
async def solve(client: openai.AsyncOpenAI, sample: Any) -> None:
    model = ChatOpenAI(model="policy", base_url=str(client.base_url), api_key=client.api_key, max_retries=0)
    agent = create_react_agent(model, [calculator])
    await agent.ainvoke({"messages": list(sample.messages)}, config={"recursion_limit": 9})
    return None
