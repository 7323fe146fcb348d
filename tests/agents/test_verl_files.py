"""A verl user's own files, unchanged: the GSM8K tool-use parquet verl's preprocessing writes with verl's tool
YAML, and verl's Search-R1 tool YAML (issue 40).

The rows are built field for field as verl's `examples/data_preprocess/gsm8k_multiturn_w_tool.py` builds
them; the YAMLs are verl's `examples/sglang_multiturn/config/tool_config/*.yaml` as written (verl's own class
paths, its `item:` typo included). The engine is the ScriptedEngine test double (the model's turns are
scripted); the config, the preflight's checks, the file reader, the tool, the agent loop and the env's
reward are asyncrl's real ones.
"""

from __future__ import annotations

import pytest

from asyncrl.agents.base import AgentContext, run_episode
from asyncrl.config import load_config
from asyncrl.data.rows import write_rows
from asyncrl.envs.base import Sample, load_rows, resolve_env
from asyncrl.run.preflight import check_env, check_tools
from asyncrl.tools.gsm8k_reward import Gsm8kRewardTool
from asyncrl.tools.loader import make_tools
from asyncrl.tools.search import SearchTool

from .helpers import call
from .scripted_engine import ScriptedEngine

VERL_GSM8K_YAML = """\
tools:
  - class_name: "{cls}"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, 0.0 if parsed answer is incorrect or not correctly parsed)"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""

VERL_SEARCH_YAML = """\
tools:
  - class_name: "verl.tools.search_tool.SearchTool"
    config:
      retrieval_service_url: http://127.0.0.1:8000/retrieve
      num_workers: 120
      rate_limit: 120
      default_timeout: 7
      type: native
    tool_schema:
      type: "function"
      function:
        name: "search"
        description: "Searches the web for relevant information based on the given query."
        parameters:
          type: "object"
          properties:
            query_list:
              type: "array"
              item:
                type: "string"
              description: "A list of fully-formed semantic queries. The tool will return search results for each query."
          required: ["query_list"]
"""


def verl_gsm8k_row(idx: int, question: str, answer_raw: str, solution: str) -> dict:
    """One row as verl's gsm8k_multiturn_w_tool.py writes it."""
    question_full = question + " " + "Let's think step by step and output the final answer after `####`."
    return {
        "data_source": "openai/gsm8k",
        "prompt": [
            {"role": "system", "content": (
                "You are a math expert. You are given a question and you need to solve it step by step. "
                "Reasoning step by step before any tool call. "
                "You should use the `calc_gsm8k_reward` tool after step by step solving the question, "
                "before generate final answer at least once and refine your answer if necessary. "
                "Put your final answer in the format of `#### <answer>`.")},
            {"role": "user", "content": question_full},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": solution},
        "extra_info": {
            "split": "train", "index": idx, "answer": answer_raw, "question": question,
            "need_tools_kwargs": True,
            "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": solution}}},
            "interaction_kwargs": {"query": question_full, "ground_truth": solution},
        },
    }


@pytest.mark.parametrize("cls", ["verl.tools.gsm8k_tool.Gsm8kTool", "verl.workers.tool.gsm8k_tool.Gsm8kTool"])
async def test_verls_gsm8k_tool_use_parquet_and_tool_yaml_run_as_they_are(tokenizer, tmp_path, cls):
    rows = [verl_gsm8k_row(0, "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
                              "clips in May. How many clips did Natalia sell altogether in April and May?",
                           "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "72"),
            verl_gsm8k_row(1, "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of "
                              "babysitting. How much did she earn?", "#### 10", "10")]
    parquet = write_rows(rows, tmp_path / "train.parquet")
    yaml = tmp_path / "gsm8k_tool_config.yaml"
    yaml.write_text(VERL_GSM8K_YAML.format(cls=cls))
    cfg = load_config(["env=gsm8k", f"env.train_file={parquet}", f"env.tools_config={yaml}",
                       "agent.max_assistant_turns=4"])
    specs, problems = check_tools(cfg)
    assert problems == [] and [s.tool_schema["function"]["name"] for s in specs] == ["calc_gsm8k_reward"]
    assert check_env(cfg)[1] == []
    assert isinstance(make_tools(specs)["calc_gsm8k_reward"], Gsm8kRewardTool)

    env = resolve_env(cfg.env.name)
    row = load_rows(cfg, env, "train")[0]
    sample = Sample.from_row(row, data_index=0, group_id="g0", sample_index=0, group_size=1)
    engine = ScriptedEngine(tokenizer, [
        "48/2 = 24, so 48 + 24 = 72. " + call("calc_gsm8k_reward", {"answer": "72"}),
        "Let me check once more. " + call("calc_gsm8k_reward", {"answer": "71"}),
        "#### 72"])
    ctx = AgentContext.for_config(cfg, engine, tokenizer)
    traj = await run_episode(sample, ctx, "tool_agent")
    replies = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert replies == ["Current parsed answer='72' reward=1.0", "Current parsed answer='71' reward=0.0"]
    assert traj.tool_rewards == [0.0, -0.05]  # verl's: an answer that does not improve is penalized
    assert traj.reward == 1.0  # the gsm8k env's strict rule on the final "#### 72"


async def test_the_gsm8k_reward_tool_says_when_a_row_has_no_ground_truth(tokenizer):
    tool = Gsm8kRewardTool()
    await tool.create("e1")
    with pytest.raises(Exception, match=r"no ground truth for this row \(extra_info.tools_kwargs.calc_gsm8k_reward"):
        await tool.execute("e1", {"answer": "3"})
    await tool.create("e2", ground_truth="1,000")
    assert await tool.execute("e2", {"answer": "#### 1000"}) == (
        "Current parsed answer='#### 1000' reward=1.0", 0.0, {"answer_reward": 1.0})
    await tool.release("e2")
    assert "e2" not in tool._episodes


def test_verls_search_tool_yaml_is_the_search_r1_tool_set(tmp_path):
    yaml = tmp_path / "search_tool_config.yaml"
    yaml.write_text(VERL_SEARCH_YAML)
    cfg = load_config(["env=search_r1", f"env.tools_config={yaml}"])
    specs, problems = check_tools(cfg)
    assert problems == [] and [s.tool_schema["function"]["name"] for s in specs] == ["search"]
    tool = make_tools(specs)["search"]
    assert isinstance(tool, SearchTool) and tool._url() == "http://127.0.0.1:8000/retrieve"
    assert tool.config["default_timeout"] == 7
    # the run's own retrieval server, when it starts one, is what the tool asks (asyncrl/envs/search_r1)
    served = make_tools(specs, {"search": {"url": "http://127.0.0.1:5999"}})["search"]
    assert served._url() == "http://127.0.0.1:5999/retrieve"
