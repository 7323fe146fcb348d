"""The plugin examples of docs/plugins.md (once the README's) work as written: their files, overrides, tool."""

from __future__ import annotations

import asyncio
import re
import shlex
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.tools.base import ToolError
from asyncrl.tools.loader import load_tool_specs, make_tools

PAGE = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"  # moved there from the README


def test_readme_plugin_example(tmp_path, monkeypatch, plugin_registry):
    text = PAGE.read_text()
    code = re.search(r"```python\n# my_tools.py\n(.*?)```", text, re.S).group(1)
    command = re.search(r"```bash\n(asyncrl train plugins=.*?)\n```", text, re.S).group(1)
    (tmp_path / "my_tools.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    overrides = shlex.split(command)[2:]
    cfg = load_config(overrides)
    plugin_registry.load_all(cfg.plugins)
    tools = make_tools(load_tool_specs(cfg.env.tools, cfg.env.tools_config), {})
    assert list(tools) == ["word_count"]
    tool = tools["word_count"]
    assert asyncio.run(tool.execute("i0", {"text": "one two  three"})) == ("3", 0.0, {})
    with pytest.raises(ToolError, match="empty"):
        asyncio.run(tool.execute("i0", {"text": "  "}))


def test_readme_loss_example(tmp_path, monkeypatch, plugin_registry):
    import torch

    from asyncrl.learner.losses import check_off_policy_correction, policy_loss, resolve_loss

    text = PAGE.read_text()
    block = re.search(r"```python\n(# my_loss.py: (asyncrl train .*?)\n.*?)```", text, re.S)
    (tmp_path / "my_loss.py").write_text(block.group(1))
    monkeypatch.chdir(tmp_path)
    cfg = load_config(shlex.split(block.group(2))[2:])
    plugin_registry.load_all(cfg.plugins)
    loss = resolve_loss(cfg.algorithm.loss)
    assert cfg.algorithm.loss == "half_ppo" and check_off_policy_correction(cfg.algorithm, loss) is None
    logp = torch.tensor([[0.2, -0.3]], requires_grad=True)
    value, _ = policy_loss(logp, torch.zeros(1, 2), torch.tensor([2.0]), torch.ones(1, 2, dtype=torch.bool),
                           loss_fn=lambda inp: loss(inp, cfg.algorithm))
    # -0.5 * A * r per token, token mean: -0.5 * 2 * (e^0.2 + e^-0.3) / 2
    assert float(value.detach()) == pytest.approx(-0.5 * (2.718281828 ** 0.2 + 2.718281828 ** -0.3))
