"""`asyncrl bench learner` on the tiny model: every side runs and the GRPO-shaped batch shares its prompts."""

from __future__ import annotations

import argparse

import pytest

from asyncrl.bench import learner as bench


@pytest.mark.timeout(300)
def test_bench_learner_reports_the_shared_prompt_and_bf16_sides(tiny_model_dir):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--model-path", str(tiny_model_dir), "--num-seqs", "8", "--group-size", "4",
                              "--prompt-len", "24", "--system-len", "16", "--min-len", "4", "--max-len", "32", "--budget", "4096",
                              "--cpu-bf16", "--threads", "1"])
    out = bench.run(args)
    assert out["group_size"] == 4 and out["prompt_len"] == 24
    assert out["real_tokens"] == 8 * 24 + sum(out["lengths"])  # lengths are the responses'
    assert out["shared_compute_tokens"] < out["packed_compute_tokens"]  # each group's prompt laid out once
    # the tree lays the 16-token system prefix out once for all 4 groups (rows and padding differ)
    assert out["shared_compute_tokens"] < out["shared_groups_compute_tokens"]
    assert out["ratio_tree_over_groups"] > 0
    for side in ("padded", "packed", "shared", "shared_groups", "bf16", "shared_bf16"):
        assert out[f"{side}_seconds"] > 0 and len(out[f"{side}_seconds_all"]) == out["rounds"]
    assert out["ratio_shared_over_packed"] > 0 and out["ratio_shared_bf16_over_packed"] > 0
