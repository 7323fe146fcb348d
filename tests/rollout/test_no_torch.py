"""A rollout or eval worker never trains: setting one up imports neither torch nor transformers' model
registry (about 4 s of CPU at each start and restart of a worker, measured in docs/benchmarks.md "start-up").
Each check runs in a fresh interpreter, since this one has imported both."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

from transformers import AutoTokenizer

from asyncrl.config import ModelConfig
from asyncrl.models import _generic_tokenizer, load_tokenizer

SETUP = """
import asyncio, sys
from asyncrl import registry
from asyncrl.agents.base import AgentContext
from asyncrl.config import load_config
from asyncrl.engine.client import EngineClient
from asyncrl.envs.base import load_rows, resolve_env
from asyncrl.models import load_tokenizer
import asyncrl.rollout.evaluate
from asyncrl.rollout.worker import RolloutWorker
import asyncrl.run.rollout_actor

cfg = load_config(["model=custom", "model.path=MODEL", "agent=AGENT"])
registry.load_all(cfg.plugins, learner=False)  # as RolloutActor.start and the eval worker do
tokenizer = load_tokenizer(cfg.model)
ctx = AgentContext.for_config(cfg, EngineClient(["http://127.0.0.1:9"]), tokenizer, {})
rows = load_rows(cfg, resolve_env(cfg.env.name), "train")
agent = registry.get("agent", cfg.agent.name)
print(ctx.tool_schemas()[0]["function"]["name"], len(rows) > 0, "torch" in sys.modules,
      "transformers.models" in sys.modules)
registry.get("loss", cfg.algorithm.loss)  # the first lookup of a learner kind loads that group: torch
print("torch" in sys.modules)
"""


def _setup(model_dir, agent: str) -> list[str]:
    code = SETUP.replace("MODEL", str(model_dir)).replace("AGENT", agent)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split("\n")[:2]


def test_a_rollout_workers_set_up_imports_no_torch_until_a_loss_is_looked_up(tiny_model_dir):
    for agent in ("tool_agent", "react"):
        assert _setup(tiny_model_dir, agent) == ["calculator True False False", "True"], agent


def test_the_tokenizer_loads_as_autotokenizer_loads_it(tiny_model_dir):
    """The direct load of a generic fast tokenizer (asyncrl/models.py) gives what AutoTokenizer gives: the same
    class, vocabulary, special tokens and chat template, token for token."""
    ours = load_tokenizer(ModelConfig(path=str(tiny_model_dir)))
    auto = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab() and ours.special_tokens_map == auto.special_tokens_map
    assert (ours.pad_token_id, ours.eos_token_id, ours.model_max_length) == \
        (auto.pad_token_id, auto.eos_token_id, auto.model_max_length)
    tools = [{"type": "function", "function": {"name": "calculator", "description": "d",
                                               "parameters": {"type": "object", "properties": {}}}}]
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "What is 2+2? <|im_end|> ünï"},
            {"role": "assistant", "content": "<tool_call>{}</tool_call>"}]
    for kw in ({}, {"tools": tools}, {"add_generation_prompt": True}):
        assert ours.apply_chat_template(chat, tokenize=False, **kw) == auto.apply_chat_template(chat, tokenize=False,
                                                                                                  **kw)
    text = "Answer: 42\n<|im_start|>user\n\u00e9\u4e2d 🙂" * 3
    assert ours(text)["input_ids"] == auto(text)["input_ids"] and ours.decode(auto(text)["input_ids"]) == text


def test_other_tokenizers_and_unreadable_configs_go_through_autotokenizer(tiny_model_dir, tmp_path):
    """The direct load is only for the case compared above; anything else (another model type, a named
    tokenizer class, custom code, a missing or malformed file) is AutoTokenizer's to load."""
    assert _generic_tokenizer(tiny_model_dir)
    cases = {
        "qwen2": ("config.json", lambda c: {**c, "model_type": "qwen2"}),
        "named class": ("tokenizer_config.json", lambda c: {**c, "tokenizer_class": "LlamaTokenizer"}),
        "custom code": ("tokenizer_config.json", lambda c: {**c, "auto_map": {"AutoTokenizer": ["x.T", None]}}),
        "model custom code": ("config.json", lambda c: {**c, "auto_map": {"AutoConfig": "x.C"}}),
        "malformed": ("config.json", lambda c: "{not json"),
        "not an object": ("tokenizer_config.json", lambda c: [1, 2]),
        "missing": ("tokenizer.json", None),
    }
    for name, (file, change) in cases.items():
        d = tmp_path / name.replace(" ", "_")
        shutil.copytree(tiny_model_dir, d)
        if change is None:
            (d / file).unlink()
        else:
            new = change(json.loads((d / file).read_text()))
            (d / file).write_text(new if isinstance(new, str) else json.dumps(new))
        assert not _generic_tokenizer(d), name
    assert type(load_tokenizer(ModelConfig(path=str(tmp_path / "qwen2")))).__name__ == "Qwen2Tokenizer"
