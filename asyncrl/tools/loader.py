"""Tool configs in verl's YAML shape, loaded unchanged:

    tools:
      - class_name: "pkg.module.ClassName" | "file.py:ClassName" | "calculator"   # or a registered name
        config: {type: native, ...}                                               # passed to the tool
        tool_schema: {type: function, function: {name, description, parameters}} # optional for built-ins

verl's own classes (`verl.tools.gsm8k_tool.Gsm8kTool`, `verl.tools.search_tool.SearchTool`) name the asyncrl
tools that do the same (`VERL_TOOL_CLASSES`), so verl's example YAMLs load as they are.
`load_tool_specs(cfg.env.tools, cfg.env.tools_config)` merges the inline list with the YAML file's
`tools:` list, resolves every class (so a typo fails before any episode starts), fills a missing
`tool_schema` from the class's default, and rejects duplicate tool names. `make_tools(specs,
overrides)` builds one instance per tool, `overrides[tool_name]` updating its config (e.g. the
retrieval server's url known only at run time).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from asyncrl import registry
from asyncrl.config import ToolSpec
from asyncrl.secrets import run_secrets_in
from asyncrl.tools.base import SchemaDefinitionError, check_parameters_schema


class ToolConfigError(ValueError):
    """A tool entry that cannot be loaded (unknown class, bad schema, duplicate name)."""


# verl's own tool classes, as verl's YAMLs name them -> the asyncrl tool that does what they do. verl's
# classes are written against verl's tool interface (a JSON string of parameters, verl's ToolResponse), so
# the name maps whether or not verl is installed.
VERL_TOOL_CLASSES = {
    "verl.tools.gsm8k_tool.Gsm8kTool": "gsm8k_reward",
    "verl.workers.tool.gsm8k_tool.Gsm8kTool": "gsm8k_reward",  # its path in older verl releases' YAMLs
    "verl.tools.search_tool.SearchTool": "search",
}


def resolve_tool_class(class_name: str) -> Any:
    """A registered tool name, one of verl's classes (`VERL_TOOL_CLASSES`), or a `module.Class` /
    `module:Class` / `file.py:Class` path."""
    if not class_name:
        raise ToolConfigError("tool entry has an empty class_name")
    class_name = VERL_TOOL_CLASSES.get(class_name, class_name)
    if "." not in class_name and ":" not in class_name and "/" not in class_name:
        return registry.get("tool", class_name)
    return registry.resolve_object(class_name)


def _as_spec(entry: Any, where: str) -> ToolSpec:
    if isinstance(entry, ToolSpec):
        return ToolSpec(entry.class_name, dict(entry.config or {}), copy.deepcopy(entry.tool_schema))
    if isinstance(entry, str):
        return ToolSpec(class_name=entry)
    if not isinstance(entry, dict):
        raise ToolConfigError(f"{where}: expected a mapping with class_name, got {type(entry).__name__} {entry!r}")
    unknown = set(entry) - {"class_name", "config", "tool_schema"}
    if unknown:
        raise ToolConfigError(f"{where}: unknown keys {sorted(unknown)}; valid: class_name, config, tool_schema")
    return ToolSpec(str(entry.get("class_name") or ""), dict(entry.get("config") or {}),
                    copy.deepcopy(entry.get("tool_schema")))


def _check_schema(schema: Any, where: str) -> None:
    if not isinstance(schema, dict) or schema.get("type", "function") != "function":
        raise ToolConfigError(f"{where}: tool_schema must be {{type: function, function: {{...}}}}, got {schema!r}")
    fn = schema.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ToolConfigError(f"{where}: tool_schema.function.name is missing in {schema!r}")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise ToolConfigError(f"{where}: tool_schema.function.parameters must be a JSON-schema object, got {params!r}")
    try:
        check_parameters_schema(params, f"{where}: tool {fn['name']!r}")
    except SchemaDefinitionError as e:
        raise ToolConfigError(str(e)) from None


def read_tools_yaml(path: str | Path) -> list[Any]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ToolConfigError(f"env.tools_config: file {str(path)!r} not found (looked at {p.resolve()})")
    data = OmegaConf.to_container(OmegaConf.load(p), resolve=True)
    if not isinstance(data, dict) or not isinstance(data.get("tools"), list):
        raise ToolConfigError(f"{p}: expected a mapping with a 'tools:' list, got {type(data).__name__}")
    return data["tools"]


def load_tool_specs(tools: Optional[list[Any]] = None, tools_config: Optional[str] = None) -> list[ToolSpec]:
    """The validated tool list: inline entries first, then those of the verl YAML file `tools_config`."""
    entries = [(f"env.tools[{i}]", e) for i, e in enumerate(tools or [])]
    if tools_config:
        entries += [(f"{tools_config}: tools[{i}]", e) for i, e in enumerate(read_tools_yaml(tools_config))]
    specs, seen = [], {}
    for where, entry in entries:
        spec = _as_spec(entry, where)
        if leaks := run_secrets_in({"config": spec.config, "tool_schema": spec.tool_schema}):
            raise ToolConfigError(
                f"{where}: {', '.join(leaks)} holds the value of a run secret (from an interpolation such as "
                "${oc.env:...}?): a tool's config and schema reach prompts, tool replies, trajectories, the buffer's "
                "log and console lines; give the tool what it needs another way")
        try:
            cls = resolve_tool_class(spec.class_name)
        except registry.PluginError as e:
            raise registry.PluginError(f"{where}: {e}") from e  # still a LookupError, now saying where
        if spec.config.get("type", "native") != "native":
            raise ToolConfigError(f"{where}: tool type {spec.config['type']!r} is not supported (only 'native')")
        if spec.tool_schema is None:
            default = getattr(cls, "default_schema", None)
            if default is None:
                raise ToolConfigError(f"{where}: {spec.class_name} has no default schema; give tool_schema")
            spec.tool_schema = default()
        _check_schema(spec.tool_schema, where)
        name = spec.tool_schema["function"]["name"]
        if name in seen:
            raise ToolConfigError(f"{where}: duplicate tool name {name!r} (also {seen[name]})")
        seen[name] = where
        specs.append(spec)
    return specs


def tool_name(spec: ToolSpec) -> str:
    return spec.tool_schema["function"]["name"]


def make_tools(specs: list[ToolSpec], overrides: Optional[dict[str, dict[str, Any]]] = None) -> dict[str, Any]:
    """One tool object per spec, by tool name; `overrides[name]` updates that tool's config."""
    out = {}
    for spec in specs:
        name = tool_name(spec)
        config = {k: v for k, v in spec.config.items() if k != "type"}
        config.update((overrides or {}).get(name) or {})
        cls = resolve_tool_class(spec.class_name)
        try:
            out[name] = cls(config, copy.deepcopy(spec.tool_schema))
        except Exception as e:
            raise ToolConfigError(f"tool {name!r} ({spec.class_name}) could not be built with config {config}: {e}") from e
    return out


def tool_schemas(specs: list[ToolSpec]) -> list[dict[str, Any]]:
    return [copy.deepcopy(s.tool_schema) for s in specs]
