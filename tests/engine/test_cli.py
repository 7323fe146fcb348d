"""The engine's settings have one owner, the config's EngineConfig: the `asyncrl engine serve` flags take their
defaults from it, the launcher's argv carries every one of them, and a new EngineConfig field must be placed."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Literal

import pytest

from asyncrl.config import EngineConfig, load_config
from asyncrl.engine import cli
from asyncrl.engine.cli import SETTINGS, add_arguments, settings_argv, settings_from_args
from asyncrl.engine.launcher import launch_embedded

# EngineConfig's fields that are not the engine process's settings, and who reads each instead
NOT_THE_PROCESS = {
    "type": "launch_configured (which launcher)", "num_engines": "the fleet", "urls": "attach",
    "launch_timeout_s": "the launchers' wait", "request_timeout_s": "EngineClient", "max_retries": "EngineClient",
    "probe_timeout_s": "EngineWatch, Supervisor", "probe_failures": "EngineWatch",
    "mem_fraction_static": "launch_sglang", "extra_args": "launch_sglang",
}


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["serve", "--model-path", "/m", *argv])


def test_every_engine_config_field_is_a_flag_or_read_elsewhere():
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert not set(SETTINGS) & set(NOT_THE_PROCESS)
    assert fields == set(SETTINGS) | set(NOT_THE_PROCESS), (
        f"EngineConfig fields placed nowhere: {sorted(fields - set(SETTINGS) - set(NOT_THE_PROCESS))}; "
        f"named but gone: {sorted((set(SETTINGS) | set(NOT_THE_PROCESS)) - fields)}")


def test_cli_defaults_are_the_configs():
    args, schema, composed = parse(), EngineConfig(), load_config([]).engine
    want = {f: getattr(schema, f) for f in SETTINGS}
    assert {f: getattr(args, f) for f in SETTINGS} == want
    assert {f: getattr(composed, f) for f in SETTINGS} == want  # the Hydra tree re-lists none of them differently
    assert settings_from_args(args) == schema


def test_cli_defaults_follow_the_owner(monkeypatch):
    """Move every default in the owner: the flags' defaults move with it (a literal in the CLI would not)."""

    @dataclasses.dataclass
    class Moved(EngineConfig):
        host: str = "127.0.0.9"
        device: str | None = "cpu"
        dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float16"
        max_running_seqs: int = 5
        max_running_tokens: int = 77
        cuda_graphs: bool = False

    monkeypatch.setattr(cli, "EngineConfig", Moved)
    moved, args = Moved(), parse()
    assert all(getattr(moved, f) != getattr(EngineConfig(), f) for f in SETTINGS)
    assert {f: getattr(args, f) for f in SETTINGS} == {f: getattr(moved, f) for f in SETTINGS}


def test_the_launchers_argv_carries_every_setting():
    engine = EngineConfig(host="127.0.0.2", device="cuda:1", dtype="bfloat16", max_running_seqs=3,
                          max_running_tokens=77, cuda_graphs=False)
    assert all(getattr(engine, f) != getattr(EngineConfig(), f) for f in SETTINGS)
    assert settings_from_args(parse(*settings_argv(engine))) == engine
    assert "--device" not in settings_argv(EngineConfig())  # None: resolved by the server


def test_a_setting_that_is_no_boolean_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        parse("--cuda-graphs", "yes")
    assert "--cuda-graphs: expected true or false, got 'yes'" in capsys.readouterr().err


def test_a_bad_setting_is_refused_naming_flag_and_key(capsys):
    assert cli.main(parse("--max-running-tokens", "0")) == 2
    assert capsys.readouterr().err.strip() == (
        "asyncrl engine: --max-running-tokens: engine.max_running_tokens: must be >= 1, got 0")


def test_launch_embedded_refuses_a_name_that_is_no_setting(tmp_path):
    with pytest.raises(TypeError, match=r"\['max_running_token'\] are not engine settings.*max_running_tokens"):
        launch_embedded(tmp_path, max_running_token=5)
