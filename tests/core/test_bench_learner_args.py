"""`asyncrl bench learner` refuses a batch shape it cannot build by naming the flag, before it loads any model
(`--model-path /nonexistent`: loading would fail otherwise, with another message)."""

from __future__ import annotations

import argparse

import pytest

from asyncrl.bench import learner as bench_learner


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_learner.add_arguments(parser)
    return parser.parse_args(["--model-path", "/nonexistent", *argv])


@pytest.mark.parametrize("argv, says", [
    (["--num-seqs", "0"], "--num-seqs must be >= 1, got 0"),
    (["--min-len", "0"], "--min-len and --max-len must satisfy 1 <= min <= max, got 0 and 1024"),
    (["--min-len", "600", "--max-len", "500"], "--min-len and --max-len must satisfy 1 <= min <= max, got 600 and 500"),
    (["--group-size", "0", "--prompt-len", "8"], "--group-size must be >= 1, got 0"),
    (["--prompt-len", "-3"], "--prompt-len must be >= 0, got -3"),
    (["--prompt-len", "8", "--system-len", "-1"], r"--system-len must be in 0..--prompt-len \(8\), got -1"),
    (["--prompt-len", "8", "--system-len", "9"], r"--system-len must be in 0..--prompt-len \(8\), got 9"),
    (["--system-len", "280"], r"--system-len must be in 0..--prompt-len \(0\), got 280"),  # no prompt to prefix
])
def test_a_batch_shape_that_cannot_be_built_is_refused_by_name(argv, says):
    with pytest.raises(SystemExit, match=r"asyncrl bench learner: " + says):
        bench_learner.run(_args(*argv))


def test_a_valid_shape_passes_the_check():
    bench_learner.check_batch_shape(_args("--num-seqs", "8", "--group-size", "1", "--prompt-len", "315",
                                          "--system-len", "280", "--min-len", "60", "--max-len", "75"))
