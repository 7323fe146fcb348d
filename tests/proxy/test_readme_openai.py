"""docs/plugins.md's "Train your OpenAI-client agent" example works as written: its file, its overrides, a run."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from asyncrl.agents.base import AgentContext, run_episode
from asyncrl.agents.openai_agent import check_config, stop_proxy
from asyncrl.config import load_config
from tests.agents.helpers import RecordingReward, make_sample

from .conftest import agent_cfg

PAGE = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"  # moved there from the README


async def test_readme_openai_agent_example(tmp_path, monkeypatch, plugin_registry, client_engine, proxy_tokenizer):
    text = PAGE.read_text()
    code = re.search(r"```python\n# my_agent.py\n(.*?)```", text, re.S).group(1)
    command = re.search(r"```bash\n(asyncrl train agent=openai_agent plugins=.*?)\n", text, re.S).group(1)
    (tmp_path / "my_agent.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(shlex.split(command)[2:])
    plugin_registry.load_all(cfg.plugins)
    check_config(cfg.agent.openai)
    reward = RecordingReward()
    ctx = AgentContext(engine=client_engine, tokenizer=proxy_tokenizer, tool_specs=[], reward_fn=reward,
                       cfg=agent_cfg(openai=cfg.agent.openai))
    try:
        traj = await run_episode(make_sample(), ctx, cfg.agent.name)
    finally:
        await stop_proxy(ctx)
    assert traj.metrics["proxy/calls"] == 1 and traj.metrics["proxy/reward_env"] == 1 and len(reward.calls) == 1
