"""A user's tool from a .py file, verl-shaped tool YAML, and the answer_feedback interaction."""

from __future__ import annotations

import textwrap

import pytest

from asyncrl.agents.base import run_episode
from asyncrl.config import InteractionSpec, ToolSpec, load_config
from asyncrl.envs.interactions import AnswerFeedback, answers_match, extract_answer
from asyncrl.tools.loader import ToolConfigError, load_tool_specs, make_tools

from .helpers import call, enc, make_ctx, make_sample
from .scripted_engine import ScriptedEngine

pytestmark = pytest.mark.timeout(60)

USER_TOOL = textwrap.dedent('''
    from asyncrl.registry import register
    from asyncrl.tools.base import Tool

    @register("tool", "reverse_words_user")
    class ReverseWords(Tool):
        name = "reverse_words"
        description = "Reverse the order of words."
        parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
        created = []
        released = []

        async def create(self, instance_id, **kw):
            self.created.append((instance_id, kw))
            return instance_id

        async def execute(self, instance_id, params):
            return " ".join(reversed(params["text"].split())), 0.25, {}

        async def release(self, instance_id):
            self.released.append(instance_id)
''')


async def test_user_tool_file_loaded_as_plugin_and_called(tokenizer, tmp_path, plugin_registry):
    path = tmp_path / "my_tool.py"
    path.write_text(USER_TOOL)
    plugin_registry.load_source(str(path))
    cls = plugin_registry.get("tool", "reverse_words_user")
    engine = ScriptedEngine(tokenizer, [call("reverse_words", {"text": "a b c"}), "Answer: 17"])
    ctx, reward = make_ctx(tokenizer, engine, tools=[{"class_name": "reverse_words_user"}])
    sample = make_sample(extra_info={"tools_kwargs": {"reverse_words": {"create_kwargs": {"seed": 3}}}})
    traj = await run_episode(sample, ctx, "tool_agent")
    d = enc(tokenizer, "\n<|im_start|>tool\nc b a<|im_end|>\n<|im_start|>assistant\n")
    assert traj.response_ids.numpy().tolist() == engine.script[0] + d + engine.script[1]
    assert cls.created == [("g0-0", {"seed": 3})] and cls.released == ["g0-0"]
    assert reward.calls[0]["tool_rewards"] == [0.25]
    assert '"name": "reverse_words"' in tokenizer.decode(traj.prompt_ids.numpy().tolist())


VERL_YAML = textwrap.dedent('''
    tools:
      - class_name: "asyncrl.tools.calculator.Calculator"
        config:
          type: native
          max_exponent: 3
        tool_schema:
          type: "function"
          function:
            name: "calc"
            description: "A calculator."
            parameters:
              type: "object"
              properties:
                expression:
                  type: "string"
                  description: "arithmetic"
              required: ["expression"]
''')


async def test_verl_tool_yaml_loads_and_runs(tokenizer, tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(VERL_YAML)
    specs = load_tool_specs([], str(path))
    assert [s.tool_schema["function"]["name"] for s in specs] == ["calc"] and specs[0].config["type"] == "native"
    engine = ScriptedEngine(tokenizer, [call("calc", {"expression": "2**3"}) + call("calc", {"expression": "2**4"}), "Answer: 8"])
    ctx, _ = make_ctx(tokenizer, engine, tools=[], tools_config=str(path))
    traj = await run_episode(make_sample(ground_truth="8"), ctx, "tool_agent")
    assert [m["content"] for m in traj.messages if m["role"] == "tool"] == [
        "8", "Error: exponent 4 out of bounds (|exponent| <= 3)"]
    assert traj.metrics["tool_error"] == 1 and traj.reward == 1.0


@pytest.mark.parametrize("where", ["config", "description"])
def test_a_tool_yaml_that_interpolates_a_run_secret_is_refused_naming_where(tmp_path, monkeypatch, where):
    """Issue 36: `${oc.env:ASYNCRL_ENGINE_TOKEN}` in a tool YAML wrote the run's engine token into every
    trajectory and the buffer's WAL (a tool's config and schema reach prompts, tool replies and logs). Such a
    tool is refused where it is loaded (the preflight, and every rollout worker), naming the key and the
    variable, never the value."""
    token = "f" * 64
    monkeypatch.setenv("ASYNCRL_ENGINE_TOKEN", token)
    text = VERL_YAML.replace("max_exponent: 3", "max_exponent: 3\n      api_key: ${oc.env:ASYNCRL_ENGINE_TOKEN}") \
        if where == "config" else VERL_YAML.replace('"A calculator."', '"A calculator; key ${oc.env:ASYNCRL_ENGINE_TOKEN}"')
    path = tmp_path / "tools.yaml"
    path.write_text(text)
    with pytest.raises(ToolConfigError) as e:
        load_tool_specs([], str(path))
    named = "config.api_key" if where == "config" else "tool_schema.function.description"
    assert f"{path}: tools[0]: {named} (ASYNCRL_ENGINE_TOKEN) holds the value of a run secret" in str(e.value)
    assert token not in str(e.value)
    monkeypatch.delenv("ASYNCRL_ENGINE_TOKEN")
    monkeypatch.setenv("SOME_TOOL_API_KEY", token)  # a tool's own key is the user's to pass: not a run secret
    path.write_text(text.replace("ASYNCRL_ENGINE_TOKEN", "SOME_TOOL_API_KEY"))
    assert [s.tool_schema["function"]["name"] for s in load_tool_specs([], str(path))] == ["calc"]


@pytest.mark.parametrize("env,names", [("arithmetic", ["calculator"]), ("search_r1", ["search"])])
def test_tool_specs_from_the_real_config_tree(env, names):
    cfg = load_config([f"env={env}"])
    assert all(isinstance(t, ToolSpec) for t in cfg.env.tools)
    specs = load_tool_specs(cfg.env.tools, cfg.env.tools_config)
    assert [s.tool_schema["function"]["name"] for s in specs] == names
    assert cfg.env.tools[0].tool_schema is None  # the caller's config is not modified


def test_tool_config_errors_name_the_problem(tmp_path):
    with pytest.raises(LookupError, match="unknown tool 'calculater'"):
        load_tool_specs(["calculater"])
    with pytest.raises(ToolConfigError, match="duplicate tool name 'calculator'"):
        load_tool_specs(["calculator", {"class_name": "calculator"}])
    with pytest.raises(ToolConfigError, match=r"env.tools\[0\]: unknown keys \['schema'\]"):
        load_tool_specs([{"class_name": "calculator", "schema": {}}])
    with pytest.raises(ToolConfigError, match="not found"):
        load_tool_specs([], str(tmp_path / "missing.yaml"))
    with pytest.raises(ToolConfigError, match="unknown keys"):
        make_tools(load_tool_specs([{"class_name": "python", "config": {"timeout": 3}}]))
    tools = make_tools(load_tool_specs(["search"]), {"search": {"url": "http://127.0.0.1:1"}})
    assert tools["search"].config["url"] == "http://127.0.0.1:1"


async def test_interaction_configured_by_spec(tokenizer):
    engine = ScriptedEngine(tokenizer, ["Answer: 16", "Answer: 17"])
    ctx, _ = make_ctx(tokenizer, engine)
    ctx.interactions = [InteractionSpec(name="one_try", class_name="answer_feedback", config={"max_attempts": 1})]
    traj = await run_episode(make_sample(extra_info={"interaction_kwargs": {"name": "one_try"}}), ctx, "tool_agent")
    assert traj.turn_rewards == [0.0] and traj.finish_reason == "stop" and len(engine.calls) == 1
    with pytest.raises(LookupError, match="unknown interaction 'nope'"):
        await run_episode(make_sample(extra_info={"interaction_kwargs": {"name": "nope"}}), ctx, "tool_agent")


def test_answer_extraction_and_comparison():
    assert extract_answer("so 3 + 4 = 7.\nAnswer: 1,234 apples") == "1,234 apples"
    assert extract_answer("the total is 12 then 15.") == "15"
    assert extract_answer("no number") is None
    assert answers_match("1,234 apples", 1234) and answers_match("$17.0", "17") and not answers_match("16", "17")
    assert answers_match("Paris.", "paris") and not answers_match("Paris", "London")
    assert not answers_match("17", "17.5", compare="numeric") and answers_match("seventeen", "Seventeen", "string")


async def test_answer_feedback_counts_attempts():
    it = AnswerFeedback({"max_attempts": 2})
    await it.start("i", ground_truth="17")
    done, text, score, extra = await it.respond("i", [{"role": "assistant", "content": "Answer: 16"}])
    assert (done, score, extra) == (False, 0.0, {"attempts": 1}) and "16 is incorrect" in text
    done, text, score, _ = await it.respond("i", [{"role": "assistant", "content": "Answer: 15"}])
    assert (done, text, score) == (True, "Incorrect.", 0.0)
    await it.finish("i")
    await it.start("j", ground_truth="17")
    assert (await it.respond("j", [{"role": "assistant", "content": "It is 17"}]))[:3] == (True, "Correct.", 1.0)


VERL_STYLE_YAML = """\
tools:
  - class_name: "{cls}"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "{name}"
        description: "{name}, as the user's own YAML names it"
        parameters:
          type: "object"
          properties:
            expression:
              type: "string"
              description: "what to evaluate"
          required: ["expression"]
"""


@pytest.mark.parametrize("env,preset", [("gsm8k", "calculator"), ("search_r1", "search"), ("arithmetic", "calculator")])
def test_a_tool_yaml_is_the_whole_tool_set_as_in_verl(tmp_path, env, preset):
    """verl's tool YAML is the whole tool set: with it the env preset's tools are dropped. (Before, a YAML
    naming its tool as the preset does failed with 'duplicate tool name', and one naming it otherwise gave
    the model the preset's tool too.)"""
    same = tmp_path / "same.yaml"
    same.write_text(VERL_STYLE_YAML.format(cls="calculator", name=preset))
    other = tmp_path / "other.yaml"
    other.write_text(VERL_STYLE_YAML.format(cls="calculator", name="calc_gsm8k_reward"))
    base = [f"env={env}", "env.train_file=x.parquet"]
    assert [s.tool_schema["function"]["name"] for s in load_tool_specs(load_config(base).env.tools)] == [preset]
    for yaml, names in ((same, [preset]), (other, ["calc_gsm8k_reward"])):
        cfg = load_config([*base, f"env.tools_config={yaml}"])
        assert cfg.env.tools == []
        assert [s.tool_schema["function"]["name"] for s in load_tool_specs(cfg.env.tools, cfg.env.tools_config)] == names
    # inline tools the user gives beside the YAML are theirs: both load, inline first (a clash is still named)
    for inline in ("env.tools=[{class_name: python}]", "++env.tools=[{class_name: python}]"):
        cfg = load_config([*base, f"env.tools_config={other}", inline])
        names = [s.tool_schema["function"]["name"] for s in load_tool_specs(cfg.env.tools, cfg.env.tools_config)]
        assert names == ["python", "calc_gsm8k_reward"], (inline, names)
    cfg = load_config([*base, f"env.tools_config={same}", f"env.tools=[{{class_name: {preset}}}]"])
    with pytest.raises(ToolConfigError, match=f"duplicate tool name '{preset}'"):
        load_tool_specs(cfg.env.tools, cfg.env.tools_config)


VERL_REWARD = '''\
calls = []


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature (verl/utils/reward_score), as a verl user's reward file writes it."""
    calls.append(dict(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                      extra_info=extra_info))
    return 1.0 if solution_str.strip().endswith(str(ground_truth)) else 0.0


def takes_everything(**kw):
    calls.append(sorted(kw))
    return 0.5


def verl_with_kwargs(data_source, solution_str, ground_truth, extra_info=None, sandbox_fusion_url=None, **kwargs):
    """verl's default_compute_score's shape: verl's names, its own options, and **kwargs."""
    calls.append(sorted([data_source and "data_source", "solution_str", "ground_truth", *kwargs]))
    return 0.25


def needs_a_model(solution_str, model):
    return 0.0


def positional_only(final_text, /):
    return 0.0
'''


async def test_a_verl_reward_file_loads_unchanged_and_gets_verls_arguments(tokenizer, tmp_path, plugin_registry):
    """A reward function is called with the arguments it names, asyncrl's or verl's: verl's
    `compute_score(data_source, solution_str, ground_truth, extra_info)` gets the whole response decoded as
    verl's reward manager decodes it (tool replies included); `**kw` gets asyncrl's five, as before; one
    that needs an argument no caller gives is refused where the reward is resolved (the preflight), naming it."""
    from asyncrl.envs.base import resolve_reward_fn
    from asyncrl.run.preflight import check_env

    path = tmp_path / "verl_reward.py"
    path.write_text(VERL_REWARD)
    cfg = load_config([f"env.reward.path={path}", "env.reward.name=compute_score"])
    fn = resolve_reward_fn(cfg.env)
    module = __import__("sys").modules[fn.__module__]
    engine = ScriptedEngine(tokenizer, [call("calculator", {"expression": "3*4+5"}), "It is 17"])
    ctx, _ = make_ctx(tokenizer, engine)
    ctx.reward_fn = fn
    sample = make_sample(ground_truth="17", extra_info={"split": "train"})
    sample.data_source = "openai/gsm8k"
    traj = await run_episode(sample, ctx, "tool_agent")
    assert traj.reward == 1.0
    (got,) = module.calls
    assert got["data_source"] == "openai/gsm8k" and got["ground_truth"] == "17" and got["extra_info"] == {"split": "train"}
    assert got["solution_str"] == tokenizer.decode(traj.response_ids.numpy().tolist(), skip_special_tokens=True)
    assert "17" in got["solution_str"].split("It is")[0]  # the tool's reply is in it, as in verl

    ctx.reward_fn = module.takes_everything
    module.calls.clear()
    engine.script.append(enc(tokenizer, "Answer: 17"))
    assert (await run_episode(sample, ctx, "tool_agent")).reward == 0.5
    assert module.calls == [["extra_info", "final_text", "ground_truth", "tool_rewards", "turn_rewards"]]

    ctx.reward_fn = module.verl_with_kwargs
    module.calls.clear()
    engine.script.append(enc(tokenizer, "Answer: 17"))
    assert (await run_episode(sample, ctx, "tool_agent")).reward == 0.25
    assert module.calls == [["data_source", "ground_truth", "solution_str"]]  # nothing of asyncrl's in **kwargs

    for name, needed in (("needs_a_model", "'model'"), ("positional_only", "'final_text'")):
        bad = load_config([f"env.reward.path={path}", f"env.reward.name={name}"])
        with pytest.raises(TypeError, match=f"reward function {name} requires {needed}, which no caller gives"):
            resolve_reward_fn(bad.env)
        _, problems = check_env(bad)
        assert len(problems) == 1 and problems[0].startswith("env.reward: ") and f"requires {needed}" in problems[0]
