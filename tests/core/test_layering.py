"""The package layering of docs/design.md "The folder map", checked on the source: no import cycle among
asyncrl's modules, and no module imports one from a layer above its own (function-local imports
included: hiding an import inside a function does not change what a module depends on).

The layers, lowest first. A module belongs to the layer of the longest prefix listed for it. The built-in
plugins sit above the frameworks they are written against (a plugin may use the proxy, the SFT tools or
the rollout side; the frameworks never import a plugin by name: they find plugins in the registry).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import asyncrl

ROOT = Path(asyncrl.__file__).resolve().parent

LAYERS: list[tuple[str, ...]] = [
    ("asyncrl.util", "asyncrl.configs"),
    ("asyncrl.run_dir",),
    ("asyncrl.config",),
    ("asyncrl.registry", "asyncrl.secrets", "asyncrl.data", "asyncrl.metrics", "asyncrl.console_log"),
    ("asyncrl.models", "asyncrl.sandbox", "asyncrl.weight_sync"),
    ("asyncrl.testing", "asyncrl.engine", "asyncrl.buffer", "asyncrl.tools", "asyncrl.envs"),
    ("asyncrl.learner", "asyncrl.agents"),
    ("asyncrl.proxy", "asyncrl.offline", "asyncrl.sft"),
    (  # the built-in plugins, and the rollout side that runs them
        "asyncrl.agents.builtin", "asyncrl.agents.single_turn", "asyncrl.agents.tool_agent", "asyncrl.agents.react",
        "asyncrl.agents.openai_agent", "asyncrl.agents.parsers",
        "asyncrl.tools.builtin", "asyncrl.tools.calculator", "asyncrl.tools.gsm8k_reward", "asyncrl.tools.python",
        "asyncrl.tools.search",
        "asyncrl.envs.builtin", "asyncrl.envs.arithmetic", "asyncrl.envs.gsm8k", "asyncrl.envs.interactions",
        "asyncrl.envs.reasoning_gym",
        "asyncrl.envs.rewards", "asyncrl.envs.search_r1",
        "asyncrl.rollout",
    ),
    ("asyncrl.run", "asyncrl.view"),
    ("asyncrl.bench", "asyncrl.commands", "asyncrl.api"),
    ("asyncrl.cli",),
]

# Upward imports allowed, each with its reason (docs/design.md "The folder map" names them too).
UPWARD: dict[tuple[str, str], str] = {}


def module_files() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = module_files()


def owner(name: str) -> str:
    """The asyncrl module that `name` (a module or a name inside one) resolves to."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def imports_of(module: str) -> set[str]:
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for n in names:
            if n.startswith("asyncrl.") and owner(n) not in (module, "asyncrl"):
                found.add(owner(n))
    return found


GRAPH = {m: imports_of(m) for m in MODULES}


def layer(module: str) -> int:
    best, index = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, index = len(p), i
    if index is None:
        raise AssertionError(f"{module} is in no layer of tests/core/test_layering.py: add it to LAYERS")
    return index


def test_every_module_has_a_layer():
    for m in MODULES:
        if m != "asyncrl":
            layer(m)


def test_no_module_imports_one_from_a_layer_above_its_own():
    upward = []
    for m, deps in GRAPH.items():
        if m == "asyncrl":
            continue
        for d in deps:
            if layer(d) > layer(m) and (m, d) not in UPWARD:
                upward.append(f"{m} (layer {layer(m)}) imports {d} (layer {layer(d)})")
    assert not upward, "upward imports:\n" + "\n".join(sorted(upward))
    assert len(UPWARD) <= 2


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    assert strongly_connected(GRAPH) == []


def test_the_cycle_finder_finds_a_cycle():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_at_most_twelve_modules_directly_under_asyncrl():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= 12, top


@pytest.mark.parametrize("folder", sorted(p.name for p in ROOT.iterdir() if p.is_dir() and p.name != "__pycache__"))
def test_every_folder_is_a_package_with_a_docstring(folder):
    init = ROOT / folder / "__init__.py"
    if folder == "configs":
        return  # YAML presets shipped as package data
    assert init.is_file(), f"asyncrl/{folder} has no __init__.py"
    assert ast.get_docstring(ast.parse(init.read_text())), f"asyncrl/{folder}/__init__.py says nothing of what it owns"


def local_imports_without_reason(source: str) -> list[int]:
    """Lines of function-local imports that no `# lazy: <reason>` comment covers: on the import's own line,
    or in the comment lines right above the contiguous run of imports it belongs to."""
    lines = source.splitlines()
    missing = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if "# lazy:" in lines[node.lineno - 1]:
                continue
            above = node.lineno - 1
            while above >= 1 and lines[above - 1].strip().startswith(("import ", "from ")):
                above -= 1
            comments = []
            while above >= 1 and lines[above - 1].strip().startswith("#"):
                comments.append(lines[above - 1].strip())
                above -= 1
            if not any(c.startswith("# lazy:") for c in comments):
                missing.append(node.lineno)
    return missing


def test_function_local_imports_say_why():
    """An import inside a function hides a dependency: it is allowed only where the import is heavy (torch,
    transformers, ray ... that the module does not load otherwise) or optional, and says so."""
    missing = []
    for path in MODULES.values():
        for line in local_imports_without_reason(path.read_text()):
            missing.append(f"{path.relative_to(ROOT.parent)}:{line}")
    assert not missing, "function-local imports with no '# lazy: <reason>' comment:\n" + "\n".join(missing)


def test_the_reason_check_finds_an_unexplained_local_import():
    src = ("def f():\n    import json\n    return json\n\n"
           "def g():\n    # lazy: imports torch, which this module does not load otherwise\n"
           "    import torch\n    from torch import nn\n    return nn\n")
    assert local_imports_without_reason(src) == [2]
