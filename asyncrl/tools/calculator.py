"""tool `calculator`: safe arithmetic through the `ast` module (never eval).

Accepted: integer and decimal literals, + - * / // % **, parentheses, unary minus/plus.
Bounds (fail with a ToolError naming the limit): expression length <= `max_chars` (256), at most
`max_nodes` (64) syntax nodes, |exponent| <= `max_exponent` (64) with a result of at most
`max_int_bits` (256) bits, |float results| finite. Results: integers exactly ("7"), floats with
12 significant digits and integral floats as integers ("10/4" -> "2.5", "10/2" -> "5").
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from asyncrl.registry import register
from asyncrl.tools.base import Tool, ToolError

_BINOPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate(expression: str, *, max_chars: int = 256, max_nodes: int = 64, max_exponent: int = 64,
             max_int_bits: int = 256) -> int | float:
    """Evaluate an arithmetic expression; raise ToolError for anything else or out of bounds."""
    if not isinstance(expression, str):
        raise ToolError(f"expression must be a string, got {type(expression).__name__}")
    expr = expression.strip()
    if not expr:
        raise ToolError("empty expression")
    if len(expr) > max_chars:
        raise ToolError(f"expression too long ({len(expr)} characters; limit {max_chars})")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {expr!r} as arithmetic") from None
    n = sum(1 for _ in ast.walk(tree))
    if n > max_nodes:
        raise ToolError(f"expression too complex ({n} nodes; limit {max_nodes})")

    def check(v: int | float) -> int | float:
        if isinstance(v, int) and v.bit_length() > max_int_bits:
            raise ToolError(f"result too large (over {max_int_bits} bits)")
        if isinstance(v, float) and not math.isfinite(v):
            raise ToolError("result is not finite")
        return v

    def ev(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return check(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow):
                if abs(b) > max_exponent:
                    raise ToolError(f"exponent {b} out of bounds (|exponent| <= {max_exponent})")
                if isinstance(a, int) and isinstance(b, int) and b > 0 and a not in (0, 1, -1):
                    if a.bit_length() * b > max_int_bits + 1:
                        raise ToolError(f"result too large (over {max_int_bits} bits)")
            try:
                r = _BINOPS[type(node.op)](a, b)
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
            except OverflowError:
                raise ToolError("result too large") from None
            if isinstance(r, complex):
                raise ToolError("result is not a real number")
            return check(r)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return check(_UNARY[type(node.op)](ev(node.operand)))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
            raise ToolError("'^' is not allowed; use ** for powers")
        raise ToolError(f"unsupported syntax {type(node).__name__} in {expr!r}: only numbers, + - * / // % ** and parentheses")

    return ev(tree)


def format_number(v: int | float) -> str:
    if isinstance(v, float):
        if v.is_integer() and abs(v) < 1e15:
            return str(int(v))
        return f"{v:.12g}"
    return str(v)


@register("tool", "calculator")
class Calculator(Tool):
    name = "calculator"
    description = "Evaluate an arithmetic expression with + - * / // % ** and parentheses, e.g. (3 + 4) * 2."
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "the arithmetic expression"}},
        "required": ["expression"],
    }

    async def execute(self, instance_id: str, params: dict[str, Any]) -> tuple[str, float, dict[str, Any]]:
        limits = {k: int(self.config[k]) for k in ("max_chars", "max_nodes", "max_exponent", "max_int_bits")
                  if k in self.config}
        return format_number(evaluate(params["expression"], **limits)), 0.0, {}
