"""The command line of `asyncrl train` (asyncrl/commands/train_args.py, train_help.py, console_log.py, sweep.py
planning) and `asyncrl --version`: what a Hydra or verl user types either works or is refused by name."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import yaml

from asyncrl.commands.sweep import hydra_quoted, plan, run_name
from asyncrl.commands.train_args import TrainArgsError, expand_sweep, parse_train_args
from asyncrl.commands.train_help import COMMON_KEYS, describe
from asyncrl.config import group_options, load_config
from asyncrl.console_log import ConsoleLog, write_overrides
from asyncrl.secrets import REDACTED


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncrl.cli", *args], capture_output=True, text=True, timeout=120)


def test_a_comma_list_without_m_names_the_override_and_the_command_that_sweeps():
    with pytest.raises(TrainArgsError) as e:
        parse_train_args(["algorithm.lr=1e-6,2e-6", "trainer.total_steps=3"])
    msg = str(e.value)
    assert "'algorithm.lr=1e-6,2e-6' is a sweep" in msg
    assert "asyncrl train -m algorithm.lr=1e-6,2e-6 trainer.total_steps=3" in msg
    assert "--multirun" not in msg  # not Hydra's hint, which asyncrl's Compose-based loader would then refuse
    assert parse_train_args(["-m", "algorithm.lr=1e-6,2e-6"]).multirun
    assert parse_train_args(["agent.stop=[a,b]"]).overrides == ["agent.stop=[a,b]"]  # a list is not a sweep


def test_hydra_overrides_are_translated_or_refused_by_name():
    a = parse_train_args(["hydra.run.dir=/tmp/r", "hydra.job.name=exp1", "trainer.total_steps=2"])
    assert a.overrides == ["trainer.output_dir=/tmp/r", "trainer.run_name=exp1", "trainer.total_steps=2"]
    assert a.typed == ["hydra.run.dir=/tmp/r", "hydra.job.name=exp1", "trainer.total_steps=2"]
    assert parse_train_args(["-m", "hydra.sweep.dir=/tmp/s", "seed=1,2"]).sweep_dir == "/tmp/s"
    for bad, says in (("hydra.sweep.dir=/tmp/s", "applies to sweeps only"),
                      ("hydra.verbose=true", "'hydra.verbose' is a Hydra runtime setting"),
                      ("hydra.job.chdir=true", "'hydra.job.chdir'"),
                      ("hydra/launcher=joblib", "'hydra/launcher'"),
                      ("+hydra.foo=1", "'hydra.foo'"),
                      ("~hydra", "'hydra'")):
        with pytest.raises(TrainArgsError, match=".*") as e:
            parse_train_args([bad])
        assert says in str(e.value), (bad, str(e.value))
    with pytest.raises(TrainArgsError, match="unknown option '--bogus'"):
        parse_train_args(["--bogus"])
    with pytest.raises(TrainArgsError, match="--cfg 'hydra' is not supported"):
        parse_train_args(["--cfg", "hydra"])


def test_sweeps_expand_like_hydras_basic_sweeper():
    combos = expand_sweep(["algorithm.lr=1e-6,2e-6", "trainer.total_steps=3", "seed=range(0,3)"], group_options)
    assert combos[0] == ["algorithm.lr=1e-06", "trainer.total_steps=3", "seed=0"]
    assert len(combos) == 6 and combos[-1] == ["algorithm.lr=2e-06", "trainer.total_steps=3", "seed=2"]
    assert expand_sweep(["env=glob(*,exclude=gsm8k)"], group_options) == [["env=arithmetic"], ["env=reasoning_gym"],
                                                                          ["env=search_r1"]]
    assert expand_sweep(["agent=choice(react,single_turn)"], group_options) == [["agent=react"], ["agent=single_turn"]]
    with pytest.raises(TrainArgsError, match="interval\\(\\) is a search space"):
        expand_sweep(["algorithm.lr=interval(0,1)"], group_options)
    with pytest.raises(TrainArgsError, match="'seed' is not one"):
        expand_sweep(["seed=glob(*)"], group_options)
    with pytest.raises(TrainArgsError, match="selects no value"):
        expand_sweep(["env=glob(nothing*)"], group_options)
    with pytest.raises(TrainArgsError):  # Hydra's own parse error, one line
        expand_sweep(["algorithm.lr=[1,"], group_options)


def test_a_sweep_plan_is_checked_whole_before_any_run(tmp_path):
    args = parse_train_args(["-m", f"hydra.sweep.dir={tmp_path}", "trainer.total_steps=1,2", "seed=7"])
    root, combos, varying = plan(args)
    assert root == tmp_path and varying == [["trainer.total_steps=1"], ["trainer.total_steps=2"]]
    assert [run_name(k, v) for k, v in enumerate(varying)] == ["0_trainer.total_steps=1", "1_trainer.total_steps=2"]
    assert run_name(3, ["env.options.path=/a b/../c"]) == "3_env.options.path=_a_b_.._c"
    with pytest.raises(TrainArgsError, match="sweep run trainer.total_steps=0: config error: trainer.total_steps: must be >= 1, got 0"):
        plan(parse_train_args(["-m", "trainer.total_steps=0,2"]))
    with pytest.raises(TrainArgsError, match="set the sweep's directory with hydra.sweep.dir"):
        plan(parse_train_args(["-m", "seed=1,2", "trainer.run_name=x"]))
    assert not list(tmp_path.iterdir())  # planning wrote nothing
    for odd in ("/tmp/a=b,c d/0_seed=1", "/tmp/it's"):  # what a run dir may hold reaches the child intact
        assert load_config([f"trainer.output_dir={hydra_quoted(odd)}"]).trainer.output_dir == odd


def test_every_listed_key_has_a_default_and_a_description_from_config_py():
    rows = describe()
    assert [k for k, _, _ in rows] == list(COMMON_KEYS)
    assert not [k for k, _, text in rows if not text], "keys without a description in asyncrl/config.py"
    with pytest.raises(KeyError, match="'trainer.nope' is not a key"):
        describe(("trainer.nope",))


def test_train_help_and_version_print_what_they_promise():
    h = _cli("train", "--help")
    assert h.returncode == 0, h.stderr
    assert "env        arithmetic, gsm8k, reasoning_gym, search_r1" in h.stdout
    assert "algorithm.lr" in h.stdout and "AdamW learning rate of the policy" in h.stdout
    assert "asyncrl train -m" in h.stdout
    v = _cli("--version")
    assert v.returncode == 0 and v.stdout.startswith("asyncrl 0.") and "torch 2." in v.stdout
    bad = _cli("train", "hydra.verbose=true")
    assert bad.returncode == 2 and "'hydra.verbose' is a Hydra runtime setting" in bad.stderr


def test_console_log_tees_prints_and_log_lines_with_secrets_redacted(tmp_path, capsys):
    secret = "sk-" + "x1y2" * 8
    logger = logging.getLogger("asyncrl.test_console")
    handler = logging.StreamHandler(sys.stderr)
    logging.getLogger().addHandler(handler)
    try:
        with ConsoleLog(tmp_path, [secret, ""]):
            print(f"step 1 with key {secret}")
            logger.warning("a warning line")
        print("after the block")
    finally:
        logging.getLogger().removeHandler(handler)
    record = (tmp_path / "train.log").read_text()
    assert f"step 1 with key {REDACTED}" in record and "a warning line" in record
    assert secret not in record and "after the block" not in record
    assert secret in capsys.readouterr().out  # the console itself is unchanged
    write_overrides(tmp_path, ["a.b=1", "+x.api_key=hunter2", "s=it's"])
    assert yaml.safe_load((tmp_path / "overrides.yaml").read_text()) == ["a.b=1", f"+x.api_key={REDACTED}", "s=it's"]
    write_overrides(tmp_path, [])
    assert yaml.safe_load((tmp_path / "overrides.yaml").read_text()) == []
