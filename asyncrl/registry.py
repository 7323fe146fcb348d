"""The plugin registry: agent loops, tools, tool parsers, interactions, envs, rewards, losses and advantage
estimators.

Three ways in, all ending in `register`:
  1. the `@register(kind, name)` decorator, run when the defining module is imported;
  2. the `asyncrl.plugins` entry-point group of any installed distribution: each entry point
     names a module (or `module:attr`) that is imported, so its decorators run. asyncrl's own
     built-ins (`asyncrl.agents`, `asyncrl.tools`, `asyncrl.envs`) come in this way too. The group
     `asyncrl.learner_plugins` holds modules of the learner's kinds (`LEARNER_KINDS`: losses and
     advantage estimators, asyncrl's own `asyncrl.learner.losses` and `asyncrl.learner.advantages`
     among them): it is imported on the first lookup of one of those kinds, so a process that never
     asks for one (a rollout worker, an eval worker) never imports torch. A module of the first group
     may register any kind;
  3. `plugins: [a.module.path, ./file.py]` in the config.
The core never imports a plugin by name. A duplicate or unknown name is an error listing what is
registered. `alias(kind, other, name)` makes `other` resolve to `name` (verl's agent names). A plugin
that fails to import (syntax error, missing module, exception) is a one-line `PluginError` naming the
plugin, the file and the line.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.metadata
import importlib.util
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KINDS = ("agent", "tool", "tool_parser", "interaction", "env", "reward", "openai_agent_fn", "loss", "advantage")
LEARNER_KINDS = ("loss", "advantage")
ENTRY_POINT_GROUP = "asyncrl.plugins"
LEARNER_ENTRY_POINT_GROUP = "asyncrl.learner_plugins"


class PluginError(LookupError):
    """An unknown or duplicate plugin name, or a plugin source that cannot be loaded."""


@dataclass(frozen=True)
class Plugin:
    kind: str
    name: str
    obj: Any
    origin: str  # "entry point <dist>:<name>", "config <path>", or "module <name>"


_registry: dict[str, dict[str, Plugin]] = {k: {} for k in KINDS}
_aliases: dict[str, dict[str, str]] = {k: {} for k in KINDS}  # kind -> {alias: registered name}
_origin_stack: list[str] = []
_groups_loaded: set[str] = set()
_loaded_sources: set[str] = set()


@contextlib.contextmanager
def _origin(label: str) -> Iterator[None]:
    _origin_stack.append(label)
    try:
        yield
    finally:
        _origin_stack.pop()


def register(kind: str, name: str | None = None) -> Callable[[Any], Any]:
    """Decorator: `@register("tool", "calculator")` registers the class or function under that name."""
    if kind not in KINDS:
        raise PluginError(f"unknown plugin kind {kind!r}; kinds: {', '.join(KINDS)}")

    def deco(obj: Any) -> Any:
        add(kind, name or getattr(obj, "name", None) or obj.__name__, obj)
        return obj

    return deco


def add(kind: str, name: str, obj: Any) -> None:
    """Register `obj` as plugin `name` of `kind` (the decorator's non-decorator form)."""
    if kind not in KINDS:
        raise PluginError(f"unknown plugin kind {kind!r}; kinds: {', '.join(KINDS)}")
    origin = _origin_stack[-1] if _origin_stack else f"module {getattr(obj, '__module__', '?')}"
    existing = _registry[kind].get(name)
    if existing is not None:
        if existing.obj is obj:
            return  # the same object imported twice (e.g. module re-import): harmless
        raise PluginError(
            f"duplicate {kind} plugin {name!r}: already registered from {existing.origin}, "
            f"again from {origin}"
        )
    _registry[kind][name] = Plugin(kind, name, obj, origin)


def alias(kind: str, other: str, name: str) -> None:
    """Make `other` another name of plugin `name` of `kind` (e.g. verl's `single_turn_agent`)."""
    if kind not in KINDS:
        raise PluginError(f"unknown plugin kind {kind!r}; kinds: {', '.join(KINDS)}")
    if other in _registry[kind] or _aliases[kind].get(other, name) != name:
        raise PluginError(f"{kind} alias {other!r} -> {name!r} clashes with an existing {kind} of that name")
    _aliases[kind][other] = name


def import_failure(label: str, e: BaseException) -> PluginError:
    """One line for a plugin that failed to import: where (file, line) and why."""
    if isinstance(e, SyntaxError):
        where = "" if e.filename == label else f" in {e.filename}"
        return PluginError(f"plugin {label}: syntax error{where} at line {e.lineno}: {e.msg}")
    if isinstance(e, ImportError):
        return PluginError(f"plugin {label}: cannot import {e.name or 'a module'!r} ({e})")
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename != __file__]  # the plugin's line
    at = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return PluginError(f"plugin {label}: {type(e).__name__} while importing{at}: {e}")


def _exec_file(mod_name: str, path: Path, origin: str) -> Any:
    """Import the file `path` as module `mod_name`; a failure leaves no half-imported module behind, and
    nothing it registered before failing."""
    spec = importlib.util.spec_from_file_location(mod_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    before = {kind: set(table) for kind, table in _registry.items()}
    with _origin(origin):
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[mod_name]
            for kind, table in _registry.items():
                for name in set(table) - before[kind]:
                    del table[name]
            raise import_failure(str(path), e) from e
    return module


def load_entry_points(kind: str | None = None) -> None:
    """Import every module named in the `asyncrl.plugins` entry-point group, and for a kind of
    `LEARNER_KINDS` (or None: every kind) those of `asyncrl.learner_plugins` too (each group once per process)."""
    _load_group(ENTRY_POINT_GROUP)
    if kind is None or kind in LEARNER_KINDS:
        _load_group(LEARNER_ENTRY_POINT_GROUP)


def _load_group(group: str) -> None:
    if group in _groups_loaded:
        return
    _groups_loaded.add(group)
    for ep in importlib.metadata.entry_points(group=group):
        dist = ep.dist.name if ep.dist is not None else "?"
        with _origin(f"entry point {dist}:{ep.name}"):
            try:
                ep.load()
            except Exception as e:  # a broken third-party plugin names itself, never hides
                raise import_failure(f"entry point {ep.name} = {ep.value!r} of {dist}", e) from e


def load_source(source: str, base_dir: str | Path | None = None) -> None:
    """Import a plugin module by dotted path, or a `.py` file by path (relative to `base_dir`)."""
    if source in _loaded_sources:
        return
    if source.endswith(".py") or "/" in source:
        path = Path(source).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        if not path.is_file():
            raise PluginError(f"plugin file {source!r} not found (looked at {path.resolve()})")
        _exec_file(f"asyncrl_user_plugin_{abs(hash(str(path.resolve())))}", path.resolve(), f"config {path}")
    else:
        with _origin(f"config {source}"):
            try:
                importlib.import_module(source)
            except ModuleNotFoundError as e:
                if e.name == source or source.startswith(f"{e.name}."):
                    raise PluginError(f"plugin module {source!r} not found (no module named {e.name!r})") from e
                raise import_failure(source, e) from e
            except Exception as e:
                raise import_failure(source, e) from e
    _loaded_sources.add(source)


def load_all(sources: list[str] | tuple[str, ...] = (), base_dir: str | Path | None = None, *,
             learner: bool = True) -> None:
    """Entry points, then the config's `plugins:` list. `learner=False` (a process that never trains: rollout
    and eval workers) leaves the `asyncrl.learner_plugins` group to the first lookup of a learner kind."""
    load_entry_points(None if learner else "")
    for s in sources:
        load_source(s, base_dir)


def resolve_object(spec: str) -> Any:
    """`module.path:Attr` or `path/file.py:Attr` to the object (used by verl-style `class_name`)."""
    target, _, attr = spec.rpartition(":") if ":" in spec else spec.rpartition(".")
    if not target or not attr:
        raise PluginError(f"cannot resolve {spec!r}: expected 'module.path:Name' or 'file.py:Name'")
    if target.endswith(".py"):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise PluginError(f"file {target!r} in {spec!r} not found")
        mod_name = f"asyncrl_user_plugin_{abs(hash(str(path)))}"
        module = sys.modules.get(mod_name) or _exec_file(mod_name, path, f"file {path}")
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            raise PluginError(f"cannot import {target!r} for {spec!r}: {e}") from e
        except Exception as e:
            raise import_failure(f"{target} (for {spec!r})", e) from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise PluginError(f"{target!r} has no attribute {attr!r} (from {spec!r})") from None


def get(kind: str, name: str) -> Any:
    """The registered object; an unknown name lists what is registered for that kind."""
    if kind not in KINDS:
        raise PluginError(f"unknown plugin kind {kind!r}; kinds: {', '.join(KINDS)}")
    load_entry_points(kind)
    plugin = _registry[kind].get(_aliases[kind].get(name, name))
    if plugin is None:
        known = ", ".join(sorted(_registry[kind])) or "(none)"
        aliases = f" (aliases: {', '.join(f'{a} -> {n}' for a, n in sorted(_aliases[kind].items()))})" \
            if _aliases[kind] else ""
        close = difflib.get_close_matches(name, [*_registry[kind], *_aliases[kind]], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise PluginError(f"unknown {kind} {name!r}{hint}; registered {kind}s: {known}{aliases}")
    return plugin.obj


def names(kind: str) -> list[str]:
    load_entry_points(kind)
    return sorted(_registry[kind])


def all_plugins() -> list[Plugin]:
    load_entry_points()
    return [p for kind in KINDS for _, p in sorted(_registry[kind].items())]
