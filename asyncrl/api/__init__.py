"""Every contract a plugin author implements, in one import (docs/plugins.md is its page).

    from asyncrl.api import register, Env, AgentLoop, Tool, Interaction

A plugin is a class or function registered under a kind and a name (`@register(kind, name)`), found
by asyncrl through the `asyncrl.plugins` entry-point group, a module path or a file named in the
config (`plugins: [...]`). The kinds and what each implements:

  env          `Env`: builds datasets (rows in verl's schema) and scores final answers; may say how to
               solve a row (`demo_turns` -> `DemoTurn`s) so it can be warm-started
  agent        `AgentLoop`: `async run(sample: Sample, ctx: AgentContext) -> Trajectory`
  tool         `Tool`: `name`, `description`, `parameters` (JSON schema), `async execute(...)`
  interaction  `Interaction`: the feedback turn after an answer (`respond(...) -> (done, text, reward, info)`)
  reward       a function of keywords (`final_text`, `ground_truth`, `extra_info`, `tool_rewards`,
               `turn_rewards`) -> a float or a dict with `score` (as `Env.reward`)
  tool_parser  reads a model's text into `ToolCall`s (`parse -> Parsed`) and writes an assistant turn back in
               its format (`render(content, calls) -> str`, for SFT and the warm start; what it cannot
               write is a `ToolFormatError`): asyncrl/agents/tool_calls.py
  openai_agent_fn  an OpenAI-client agent function run against the per-episode proxy
               (asyncrl/agents/openai_agent.py says its signature)
  loss         `(LossInputs, algorithm_cfg) -> PolicyTerms`  (torch)
  advantage    `(rewards, group_ids, algorithm_cfg) -> advantages`  (torch)

The names here are re-exports: each contract's home module holds its full docstring. The torch-based
contracts (`LossInputs`, `PolicyTerms`) are imported on first use, so `from asyncrl.api import Env`
does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from asyncrl.agents.base import AgentContext, AgentLoop, Episode
from asyncrl.agents.tool_calls import Parsed, ToolCall, ToolFormatError
from asyncrl.data.schema import Trajectory
from asyncrl.envs.base import DemoCall, DemoError, DemoTurn, Env, Sample
from asyncrl.envs.interactions import Interaction
from asyncrl.registry import alias, register
from asyncrl.tools.base import Tool, ToolError

_TORCH_CONTRACTS = {"LossInputs": "asyncrl.learner.losses", "PolicyTerms": "asyncrl.learner.losses"}

__all__ = [
    "AgentContext", "AgentLoop", "DemoCall", "DemoError", "DemoTurn", "Env", "Episode", "Interaction",
    "LossInputs", "Parsed", "PolicyTerms", "Sample", "Tool", "ToolCall", "ToolError", "ToolFormatError", "Trajectory",
    "alias", "register",
]


def __getattr__(name: str) -> Any:
    if name in _TORCH_CONTRACTS:  # lazy: the loss contracts import torch (seconds) that env and tool authors need not pay
        return getattr(importlib.import_module(_TORCH_CONTRACTS[name]), name)
    raise AttributeError(f"module 'asyncrl.api' has no attribute {name!r}")
