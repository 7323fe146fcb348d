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
    assert (cfg.trainer.run_name, cfg.trainer.output_dir) == (None, None)  # outputs/<start time>, at the start


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


def test_unknown_group_option_lists_the_groups_options():
    with pytest.raises(ConfigError) as e:
        load_config(["env=nonexistent"])
    assert str(e.value) == "env=nonexistent: no such option in config group 'env'; available: arithmetic, gsm8k, reasoning_gym, search_r1"
    with pytest.raises(ConfigError) as e:
        load_config(["agent=reactt", "trainer.total_steps=3"])
    assert str(e.value) == ("agent=reactt: no such option in config group 'agent' (did you mean 'react'?); "
                            "available: openai_agent, react, single_turn, tool_agent")
    with pytest.raises(ConfigError, match=r"^model=gpt: .*; env=nope: .*available: arithmetic"):
        load_config(["model=gpt", "env=nope"])  # every bad selection, not the first


def test_custom_model_without_a_path_says_what_it_needs():
    for overrides in (["model=custom"], ["model.name=custom"], ["model=custom", "model.path=null"]):
        with pytest.raises(ConfigError) as e:
            load_config(overrides)
        assert str(e.value) == "model=custom needs model.path (a local Hugging Face checkpoint directory)"
    assert load_config(["model=custom", "model.path=/some/dir"]).model.path == "/some/dir"


@pytest.mark.parametrize("override,message", [
    ("trainer.rollout_workers=0", "trainer.rollout_workers: must be >= 1, got 0"),
    ("trainer.learner_ranks=0", "trainer.learner_ranks: must be >= 1, got 0"),
    ("trainer.episodes_per_worker=0", "trainer.episodes_per_worker: must be >= 1, got 0"),
    ("trainer.max_inflight_generations=-1", "trainer.max_inflight_generations: must be >= 1, got -1"),
    ("trainer.eval_samples=0", "trainer.eval_samples: must be >= 1, got 0"),
    ("trainer.checkpoint_every=-1", "trainer.checkpoint_every: must be >= 0, got -1"),
    ("trainer.max_minutes=-1", "trainer.max_minutes: must be a finite number of minutes >= 0 (0: no budget), got -1.0"),
    ("trainer.max_minutes=nan", "trainer.max_minutes: must be a finite number of minutes >= 0 (0: no budget), got nan"),
    ("trainer.max_minutes=inf", "trainer.max_minutes: must be a finite number of minutes >= 0 (0: no budget), got inf"),
    ("trainer.weight_sync.bucket_mb=0", "trainer.weight_sync.bucket_mb: must be >= 1, got 0"),
    ("engine.max_running_tokens=0", "engine.max_running_tokens: must be >= 1, got 0"),
    ("engine.request_timeout_s=0", "engine.request_timeout_s: must be > 0, got 0.0"),
    ("buffer.capacity_trajectories=0", "buffer.capacity_trajectories: must be >= 1, got 0"),
    ("buffer.capacity_bytes=0", "buffer.capacity_bytes: must be >= 1, got 0"),
    ("agent.tool_concurrency=0", "agent.tool_concurrency: must be >= 1, got 0"),
    ("agent.max_user_turns=-1", "agent.max_user_turns: must be >= 0, got -1"),
    ("agent.sampling.top_k=0", "agent.sampling.top_k: must be -1 (off) or >= 1, got 0"),
    ("algorithm.micro_batch_tokens=0", "algorithm.micro_batch_tokens: must be >= 1, got 0"),
    ("env.num_train=0", "env.num_train: must be >= 1, got 0"),
    ("ray.num_cpus=0", "ray.num_cpus: must be >= 1, got 0"),
])
def test_numeric_ranges_are_checked_at_load(override, message):
    with pytest.raises(ConfigError) as e:
        load_config([override])
    assert str(e.value) == message


def test_the_embedded_engine_must_hold_the_longest_episode():
    with pytest.raises(ConfigError) as e:
        load_config(["engine.max_running_tokens=1000", "agent.max_prompt_tokens=600", "agent.max_response_tokens=500"])
    assert str(e.value) == ("engine.max_running_tokens: 1000 is less than agent.max_prompt_tokens + "
                            "agent.max_response_tokens = 1100: the embedded engine could not hold the longest episode allowed")
    assert load_config(["engine.max_running_tokens=1100", "agent.max_prompt_tokens=600",
                        "agent.max_response_tokens=500"]).engine.max_running_tokens == 1100


def test_group_estimators_need_two_samples_a_prompt():
    for est in ("grpo", "drgrpo", "rloo"):
        with pytest.raises(ConfigError, match=rf"algorithm.n_samples: must be >= 2 with adv_estimator={est} "):
            load_config([f"algorithm.adv_estimator={est}", "algorithm.n_samples=1"])
    cfg = load_config(["algorithm.adv_estimator=reinforce_pp", "algorithm.n_samples=1"])  # a batch baseline
    assert cfg.algorithm.n_samples == 1


def test_from_dict_rejects_bool_for_int_and_unknown_keys():
    with pytest.raises(ConfigError, match="algorithm.n_samples: expected an integer"):
        from_dict(AlgorithmConfig, {"n_samples": True}, "algorithm")
    with pytest.raises(ConfigError, match="unknown key 'algorithm.lrr'.*did you mean 'lr'"):
        from_dict(AlgorithmConfig, {"lrr": 1.0}, "algorithm")


def test_any_schema_key_overrides_without_plus_even_if_no_yaml_sets_it():
    cfg = load_config(["trainer.progress=false", "trainer.weight_sync.bucket_mb=8", "buffer.order=newest"])
    assert cfg.trainer.progress is False and cfg.trainer.weight_sync.bucket_mb == 8 and cfg.buffer.order == "newest"


@pytest.mark.parametrize("args,dp", [(["--dp-size", "2"], 2), (["--data-parallel-size=4"], 4), (["--dp", "2"], 2),
                                     (["--dp-size", "2", "--enable-dp-attention"], 1), (["--tp-size", "2"], 1)])
def test_sglang_data_parallel_replicas_are_refused_naming_extra_args(args, dp):
    """SGLang's weight-update routes assert dp_size == 1 (HTTP 500 at every sync); refused at load."""
    overrides = ["engine.type=sglang", "engine.extra_args=[" + ",".join(f"'{a}'" for a in args) + "]"]
    if dp == 1:
        assert load_config(overrides).engine.extra_args == args
        return
    with pytest.raises(ConfigError, match=f"engine.extra_args: data-parallel size {dp}: SGLang"):
        load_config(overrides)
    with pytest.raises(ConfigError, match="--dp-size needs an integer, got 'two'"):
        load_config(["engine.type=sglang", "engine.extra_args=['--dp-size','two']"])


def test_min_new_tokens_with_sglang_is_refused_by_name():
    assert load_config(["engine.type=embedded", "agent.sampling.min_new_tokens=4"]).agent.sampling.min_new_tokens == 4
    assert load_config(["engine.type=sglang", "agent.sampling.min_new_tokens=0"]).engine.type == "sglang"
    with pytest.raises(ConfigError, match="min_new_tokens: 4 with engine.type=sglang"):
        load_config(["engine.type=sglang", "agent.sampling.min_new_tokens=4"])
