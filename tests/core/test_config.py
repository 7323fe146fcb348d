import subprocess
import sys

import pytest

from asyncrl.config import AlgorithmConfig, Config, ConfigError, TrainerConfig, from_dict, load_config


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "asyncrl.cli", *args], capture_output=True, text=True, timeout=120)


def test_default_config_composes_and_validates():
    cfg = load_config([])
    assert isinstance(cfg, Config)
    assert cfg.model.name == "smollm2-135m"
    assert cfg.agent.name == "tool_agent"
    assert cfg.env.name == "arithmetic"
    assert cfg.env.tools[0].class_name == "calculator"
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.trainer.output_dir.startswith("outputs/2")  # ${now:} resolved


def test_override_selects_group_and_sets_value():
    cfg = load_config(["agent=react", "algorithm.max_staleness=3"])
    assert cfg.agent.name == "react"
    assert cfg.algorithm.max_staleness == 3
    assert cfg.trainer.mode == "async"


def test_sync_mode_resolves_the_staleness_bound_to_zero_at_load():
    cfg = load_config(["algorithm.max_staleness=3", "trainer=sync"])
    assert (cfg.trainer.mode, cfg.algorithm.max_staleness) == ("sync", 0)
    assert Config(trainer=TrainerConfig(mode="sync")).algorithm.max_staleness == 0  # built directly, too
    assert Config().algorithm.max_staleness == AlgorithmConfig().max_staleness == 2


def test_cfg_job_prints_react_agent():
    out = run_cli("train", "--cfg", "job", "agent=react")
    assert out.returncode == 0, out.stderr
    assert "name: react" in out.stdout.split("agent:")[1].split("\nenv:")[0]


def test_misspelled_top_level_key_names_it_and_valid_keys():
    out = run_cli("train", "algoritm.lr=1")
    assert out.returncode != 0
    assert "'algoritm'" in out.stderr
    for key in ("model", "engine", "agent", "env", "algorithm", "trainer"):
        assert key in out.stderr
    assert "did you mean 'algorithm'" in out.stderr


def test_misspelled_nested_key_lists_section_keys():
    with pytest.raises(ConfigError, match=r"agent.max_trn.*max_assistant_turns"):
        load_config(["agent.max_trn=3"])


def test_wrong_type_names_key():
    with pytest.raises(ConfigError, match=r"algorithm.lr: expected a number, got 'abc'"):
        load_config(["algorithm.lr=abc"])


def test_literal_choices_listed():
    with pytest.raises(ConfigError, match=r"trainer.mode: 'fast' is not one of \['async', 'sync'\]"):
        load_config(["trainer.mode=fast"])


def test_range_checks_at_load_time():
    with pytest.raises(ConfigError, match="algorithm.max_staleness: must be >= 0, got -1"):
        load_config(["algorithm.max_staleness=-1"])


def test_unknown_group_option_lists_choices():
    with pytest.raises(ConfigError, match="react"):
        load_config(["agent=reactt"])


def test_from_dict_rejects_bool_for_int_and_unknown_keys():
    with pytest.raises(ConfigError, match="algorithm.n_samples: expected an integer"):
        from_dict(AlgorithmConfig, {"n_samples": True}, "algorithm")
    with pytest.raises(ConfigError, match="unknown key 'algorithm.lrr'.*did you mean 'lr'"):
        from_dict(AlgorithmConfig, {"lrr": 1.0}, "algorithm")


def test_any_schema_key_overrides_without_plus_even_if_no_yaml_sets_it():
    cfg = load_config(["trainer.progress=false", "trainer.weight_sync.bucket_mb=8", "buffer.order=newest"])
    assert cfg.trainer.progress is False and cfg.trainer.weight_sync.bucket_mb == 8 and cfg.buffer.order == "newest"


def test_min_new_tokens_with_sglang_is_refused_by_name():
    assert load_config(["engine.type=embedded", "agent.sampling.min_new_tokens=4"]).agent.sampling.min_new_tokens == 4
    assert load_config(["engine.type=sglang", "agent.sampling.min_new_tokens=0"]).engine.type == "sglang"
    with pytest.raises(ConfigError, match="min_new_tokens: 4 with engine.type=sglang"):
        load_config(["engine.type=sglang", "agent.sampling.min_new_tokens=4"])
