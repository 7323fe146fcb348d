"""calculator: exact arithmetic through ast, and rejection of anything else."""

from __future__ import annotations

import pytest

from asyncrl.tools.base import ToolError, validate_arguments
from asyncrl.tools.calculator import Calculator, evaluate, format_number


@pytest.mark.parametrize("expr,expected", [
    ("1 + 2 * 3", "7"), ("(1 + 2) * 3", "9"), ("10 / 4", "2.5"), ("10 / 2", "5"), ("7 // 2", "3"),
    ("-7 // 2", "-4"), ("7 % 3", "1"), ("2 ** 10", "1024"), ("-(3 - 5)", "2"), ("+4", "4"),
    ("2 ** -2", "0.25"), ("1.5 * 4", "6"), ("1 / 3", "0.333333333333"), ("((2))", "2"), ("12 + 30", "42"),
])
def test_values(expr, expected):
    assert format_number(evaluate(expr)) == expected


@pytest.mark.parametrize("expr,message", [
    ("__import__('os').system('ls')", "unsupported syntax Call"),
    ("open('/etc/passwd')", "unsupported syntax Call"),
    ("x + 1", "unsupported syntax Name"),
    ("(1).__class__", "unsupported syntax Attribute"),
    ("'a' * 3", "unsupported syntax Constant"),
    ("True + 1", "unsupported syntax Constant"),
    ("[1, 2]", "unsupported syntax List"),
    ("lambda: 1", "unsupported syntax Lambda"),
    ("1 if 1 else 2", "unsupported syntax IfExp"),
    ("2 ^ 3", "use \\*\\* for powers"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("2 ** 65", "exponent 65 out of bounds"),
    ("3 ** 64 * 3 ** 64 * 3 ** 64", "result too large"), ("99 ** 64", "result too large"),
    ("(-1) ** 0.5", "not a real number"),
    ("1e308 * 10", "not finite"),
    ("1 +", "cannot parse"),
    ("", "empty expression"),
    ("1+" * 200 + "1", "expression too long"),
    ("1+" * 60 + "1", "expression too complex"),
])
def test_rejects(expr, message):
    with pytest.raises(ToolError, match=message):
        evaluate(expr)


async def test_tool_interface_and_schema():
    calc = Calculator({"max_exponent": 2})
    assert calc.name == "calculator" and calc.tool_schema["function"]["parameters"]["required"] == ["expression"]
    assert await calc.execute("i", {"expression": "3 ** 2"}) == ("9", 0.0, {})
    with pytest.raises(ToolError, match="exponent 3 out of bounds"):
        await calc.execute("i", {"expression": "3 ** 3"})


def test_validate_arguments():
    schema = {"type": "object", "required": ["a"], "additionalProperties": False,
              "properties": {"a": {"type": "integer"}, "b": {"type": ["string", "null"]}, "c": {"enum": ["x", "y"]},
                             "d": {"type": "number"}, "e": {"type": "array"}}}
    assert validate_arguments(schema, {"a": 1, "b": None, "c": "x", "d": 2, "e": []}) == []
    assert validate_arguments(schema, {"a": 2.0}) == []  # an integral float is an integer in JSON
    assert validate_arguments(schema, {}) == ["missing required argument 'a'"]
    assert validate_arguments(schema, {"a": True}) == ["argument 'a' must be of type integer, got bool True"]
    assert validate_arguments(schema, {"a": 1, "c": "z"}) == ["argument 'c' must be one of ['x', 'y'], got 'z'"]
    assert validate_arguments(schema, {"a": 1, "zz": 1}) == ["unknown argument 'zz' (expected: a, b, c, d, e)"]
    assert validate_arguments(schema, [1]) == ["arguments must be a JSON object, got list"]
