"""The Tool interface (verl-compatible) and JSON-schema argument validation.

A tool is a class registered with `@register("tool", name)` and constructed as
`ToolClass(config: dict, tool_schema: dict | None)` (verl's constructor shape). One object serves
many trajectories; per-trajectory state lives under `instance_id`:

    await tool.create(instance_id, **create_kwargs)          # before the first call of an episode
    text, reward, metrics = await tool.execute(instance_id, params)
    await tool.release(instance_id)                          # at the end of the episode

`execute` may raise `ToolError(message)`: the message goes back to the model as the tool's reply
and the call is counted as a tool error. Any other exception is reported the same way, with its type.
"""

from __future__ import annotations

import copy
from typing import Any, Optional


class ToolError(Exception):
    """A tool call failed in a way the model should read about (bad expression, server down ...)."""


class Tool:
    """Base class of tools. Subclasses set `name`, `description`, `parameters` (a JSON schema object),
    and implement `execute`; `create`/`release` hold per-trajectory state when the tool has any."""

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}, "required": []}

    def __init__(self, config: Optional[dict[str, Any]] = None, tool_schema: Optional[dict[str, Any]] = None):
        self.config = dict(config or {})
        self.tool_schema = copy.deepcopy(tool_schema) if tool_schema else self.default_schema()
        fn = self.tool_schema.get("function") or {}
        if not fn.get("name"):
            raise ValueError(f"tool {type(self).__name__}: tool_schema has no function.name: {self.tool_schema}")
        self.name = fn["name"]

    @classmethod
    def default_schema(cls) -> dict[str, Any]:
        """The OpenAI function schema used when the config gives no `tool_schema`."""
        return {"type": "function", "function": {"name": cls.name, "description": cls.description,
                                                  "parameters": copy.deepcopy(cls.parameters)}}

    async def create(self, instance_id: str, **create_kwargs: Any) -> str:
        return instance_id

    async def execute(self, instance_id: str, params: dict[str, Any]) -> tuple[str, float, dict[str, Any]]:
        raise NotImplementedError

    async def release(self, instance_id: str) -> None:
        return None


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def _type_ok(value: Any, typ: Any) -> bool:
    types = typ if isinstance(typ, list) else [typ]
    for t in types:
        py = _JSON_TYPES.get(t)
        if py is None:
            return True  # an unknown type name: do not reject what we cannot check
        if isinstance(value, bool) and t in ("integer", "number"):
            continue  # JSON true is not a number
        if t == "integer" and isinstance(value, float) and value.is_integer():
            return True
        if isinstance(value, py):
            return True
    return False


def validate_arguments(parameters: dict[str, Any], args: Any) -> list[str]:
    """Check `args` against a JSON-schema object: required keys, basic types, enums, and unknown keys
    when `additionalProperties` is false. Returns the problems found (empty: valid)."""
    if not isinstance(args, dict):
        return [f"arguments must be a JSON object, got {type(args).__name__}"]
    problems = []
    props = parameters.get("properties") or {}
    for key in parameters.get("required") or []:
        if key not in args:
            problems.append(f"missing required argument {key!r}")
    for key, value in args.items():
        spec = props.get(key)
        if spec is None:
            if parameters.get("additionalProperties") is False:
                problems.append(f"unknown argument {key!r} (expected: {', '.join(props) or 'none'})")
            continue
        if "type" in spec and not _type_ok(value, spec["type"]):
            problems.append(f"argument {key!r} must be of type {spec['type']}, got {type(value).__name__} {value!r}")
        elif "enum" in spec and value not in spec["enum"]:
            problems.append(f"argument {key!r} must be one of {spec['enum']}, got {value!r}")
    return problems


def tool_text(result: Any) -> str:
    """The text of a tool result: a str, or an object with `.text` (verl's ToolResponse)."""
    if isinstance(result, str):
        return result
    text = getattr(result, "text", None)
    if text is not None:
        return str(text)
    return str(result)
