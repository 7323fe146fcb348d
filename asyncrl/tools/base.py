"""The Tool interface (verl-compatible) and JSON-schema argument validation (the jsonschema library).

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
import functools
import json
import math
from typing import Any, Optional

from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import SchemaError, ValidationError


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


MAX_PROBLEMS = 5  # problems reported back to the model per call
MAX_SHOWN = 80  # characters of a bad value quoted back


class SchemaDefinitionError(ValueError):
    """A tool's `parameters` is not a valid JSON Schema."""


@functools.lru_cache(maxsize=256)
def _validator(schema_json: str) -> Any:
    schema = json.loads(schema_json)
    cls = validators.validator_for(schema, default=Draft202012Validator)
    return cls(schema)


def check_parameters_schema(parameters: dict[str, Any], where: str) -> None:
    """Raise SchemaDefinitionError naming `where` when `parameters` is not a valid JSON Schema (checked
    against the metaschema of the draft it declares with `$schema`, else Draft 2020-12)."""
    try:
        cls = validators.validator_for(parameters, default=Draft202012Validator)
        cls.check_schema(parameters)
    except SchemaError as e:
        raise SchemaDefinitionError(f"{where}: parameters is not a valid JSON Schema: {e.message} "
                                    f"(at {'/'.join(map(str, e.absolute_path)) or 'the top'})") from None
    except TypeError as e:  # e.g. a non-string key that json cannot hold
        raise SchemaDefinitionError(f"{where}: parameters is not a valid JSON Schema: {e}") from None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."


def _where(path: Any) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _nonfinite(args: Any) -> Optional[str]:
    """The path of the first NaN or infinite number in `args` (iteratively: any depth), else None."""
    stack: list[tuple[str, Any]] = [("", args)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return path or "(the arguments)"
        if isinstance(v, dict):
            stack.extend((f"{path}.{k}" if path else str(k), x) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", x) for i, x in enumerate(v))
    return None


def _problem(e: ValidationError) -> str:
    where = _where(e.absolute_path)
    at = f"argument {where!r}" if where else "the arguments"
    if e.validator == "required" and isinstance(e.instance, dict):
        missing = [k for k in e.validator_value if k not in e.instance]
        name = f"{where}.{missing[0]}" if where and missing else (missing[0] if missing else "?")
        return f"missing required argument {name!r}"
    if e.validator == "type":
        return f"{at} must be of type {e.validator_value}, got {type(e.instance).__name__} {_shown(e.instance)}"
    if e.validator == "enum":
        return f"{at} must be one of {_shown(e.validator_value)}, got {_shown(e.instance)}"
    if e.validator == "additionalProperties" and e.validator_value is False and isinstance(e.instance, dict):
        known = list((e.schema.get("properties") or {}).keys())
        extra = [k for k in e.instance if k not in known]
        inside = f" in {where!r}" if where else ""
        return (f"unknown argument {_shown(extra[0]) if extra else '?'}{inside} "
                f"(expected: {', '.join(known) or 'none'})")
    message = e.message if len(e.message) <= 200 else e.message[:197] + "..."
    return f"{at}: {message}"


def validate_arguments(parameters: dict[str, Any], args: Any) -> list[str]:
    """Check `args` against the tool's full JSON Schema (the jsonschema library; the draft the schema
    declares, else 2020-12): nested objects, array items, enums, bounds, patterns, required keys,
    additionalProperties. Returns up to MAX_PROBLEMS readable problems naming the path of each bad
    value (empty: valid). JSON has no NaN or infinity, so such a number is a problem too."""
    if not isinstance(args, dict):
        return [f"arguments must be a JSON object, got {type(args).__name__}"]
    bad = _nonfinite(args)
    if bad is not None:
        return [f"argument {bad!r} is not a finite number (JSON has no NaN or Infinity)"]
    try:
        validator = _validator(json.dumps(parameters))
        errors = sorted(validator.iter_errors(args), key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
        return [_problem(e) for e in errors[:MAX_PROBLEMS]]
    except RecursionError:
        return ["the arguments could not be checked: they, or the tool's schema ($ref), nest too deeply"]


def tool_text(result: Any) -> str:
    """The text of a tool result: a str, or an object with `.text` (verl's ToolResponse)."""
    if isinstance(result, str):
        return result
    text = getattr(result, "text", None)
    if text is not None:
        return str(text)
    return str(result)
