"""`asyncrl bench memory` on the tiny model (SmolLM2's 49,152-token vocabulary) in Search-R1's shape: the
sides measured in a fresh process, and the chunked head's step grows by a fraction of the whole logits'."""

from __future__ import annotations

import argparse

import pytest

from asyncrl.bench import memory as bench


@pytest.mark.heavy(20)
def test_bench_memory_measures_every_side_in_a_fresh_process_and_chunking_saves_memory(tiny_model_dir):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = bench.run(parser.parse_args(["--model-path", str(tiny_model_dir), "--shape", "search_r1", "--samples", "4"]))
    sides = out["search_r1"]
    assert set(sides) == {"tokens", "trained_tokens", "whole", "chunked", "chunked_gc"}
    assert sides["whole"]["logits_chunk_tokens"] == 0 and sides["chunked"]["logits_chunk_tokens"] == 256
    assert sides["trained_tokens"] > 4 * 200 and out["model_gb"] > 0
    # ~1,400 trained tokens: whole logits hold 5x the chunk's 256 rows, several copies each
    assert out["search_r1_ratio_growth_whole_over_chunked"] > 1.5, out
    assert all(sides[s]["seconds"] > 0 and sides[s]["peak_gb"] >= sides[s]["growth_gb"] > 0 for s in bench.SIDES)


def test_bench_memory_refuses_an_empty_group_before_any_model_loads():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(SystemExit, match="--samples must be >= 1, got 0"):
        bench.run(parser.parse_args(["--samples", "0"]))
