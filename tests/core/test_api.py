"""asyncrl.api: the one import of every plugin contract, and cheap for authors who need no torch."""

from __future__ import annotations

import subprocess
import sys

import asyncrl.api as api
from asyncrl import registry


def test_every_exported_name_resolves_to_its_home_modules_object():
    from asyncrl.agents.base import AgentLoop
    from asyncrl.envs.base import Env
    from asyncrl.learner.losses import LossInputs, PolicyTerms
    from asyncrl.tools.base import Tool

    assert api.AgentLoop is AgentLoop and api.Env is Env and api.Tool is Tool
    assert api.LossInputs is LossInputs and api.PolicyTerms is PolicyTerms
    for name in api.__all__:
        assert getattr(api, name) is not None, name


def test_an_unknown_name_is_an_attribute_error_naming_it():
    try:
        api.NoSuchContract  # noqa: B018
    except AttributeError as e:
        assert "NoSuchContract" in str(e)
    else:
        raise AssertionError("asyncrl.api.NoSuchContract resolved")


def test_importing_the_env_and_tool_contracts_does_not_import_torch():
    code = ("import sys; from asyncrl.api import Env, Tool, AgentLoop, register; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_every_registry_kind_is_described_on_the_api_page():
    for kind in registry.KINDS:
        assert f"\n  {kind} " in api.__doc__, f"plugin kind {kind!r} is not described in asyncrl/api/__init__.py"


def test_a_plugin_written_against_the_api_alone_registers_and_resolves():
    @api.register("tool", "api_test_echo")
    class Echo(api.Tool):
        name = "api_test_echo"
        description = "echo"

        async def execute(self, instance_id, params):
            return str(params), 0.0, {}

    try:
        assert registry.get("tool", "api_test_echo") is Echo
    finally:
        registry._registry["tool"].pop("api_test_echo")
