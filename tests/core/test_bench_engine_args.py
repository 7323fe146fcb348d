"""`asyncrl bench engine` refuses a bad --temperature or an absent GPU by name, before it loads any model."""

from __future__ import annotations

import argparse

import pytest
import torch

from asyncrl.bench import engine as bench_engine


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_engine.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("value", ["nan", "inf", "-0.5"])
def test_a_non_finite_or_negative_temperature_is_refused(value):
    with pytest.raises(SystemExit, match=r"--temperature must be a finite number >= 0, got"):
        bench_engine.run(_args("--temperature", value, "--model-path", "/nonexistent"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU: --device cuda is valid here")
def test_device_cuda_without_a_gpu_is_refused():
    with pytest.raises(SystemExit, match=r"--device cuda, but torch .* sees no CUDA GPU"):
        bench_engine.run(_args("--device", "cuda"))


def test_bench_lists_exactly_the_modules_that_are_benchmarks():
    """`asyncrl bench --help` names every module with the benchmark entry points, and nothing else."""
    import importlib

    from asyncrl import bench

    names = bench.available()
    for name in names:
        module = importlib.import_module(f"asyncrl.bench.{name}")
        assert callable(getattr(module, "run", None)) and callable(getattr(module, "add_arguments", None)), name
    for helper in bench.HELPERS:
        assert not hasattr(importlib.import_module(f"asyncrl.bench.{helper}"), "run"), helper
    assert {"buffer", "engine", "learner", "weights", "e2e", "agents", "data", "retriever", "startup", "retract"} <= set(names)


def test_bench_retract_measures_both_sides_on_a_real_engine(tiny_model_dir):
    """`asyncrl bench retract` (what an in_place sync costs SGLang): both sides run on a real embedded
    engine; a count below 1 is refused by name before any engine starts."""
    from asyncrl.bench import retract

    parser = argparse.ArgumentParser()
    retract.add_arguments(parser)
    with pytest.raises(SystemExit, match="--requests must be >= 1, got 0"):
        retract.run(parser.parse_args(["--requests", "0", "--model-path", "/nonexistent"]))
    out = retract.run(parser.parse_args(["--requests", "2", "--context", "12", "--decode", "2", "--rounds", "1",
                                         "--model-path", str(tiny_model_dir)]))
    assert out["reprefill_s_all"] and out["decode_s_all"] and out["reprefill_in_decode_steps"] > 0
    # the decode step is a difference of medians: on the tiny model it is noise and may round to 0
    assert out["reprefill_tok_s"] > 0 and out["decode_step_s"] >= 0 and min(out["decode_s_all"]) > 0
