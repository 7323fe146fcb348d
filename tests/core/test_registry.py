import os
import subprocess
import sys
import textwrap

import pytest


def test_decorator_registers_and_duplicate_is_an_error(plugin_registry):
    @plugin_registry.register("tool", "dup_probe_tool")
    class A:
        pass

    assert plugin_registry.get("tool", "dup_probe_tool") is A
    with pytest.raises(plugin_registry.PluginError, match="duplicate tool plugin 'dup_probe_tool'"):
        plugin_registry.add("tool", "dup_probe_tool", object())


def test_unknown_name_lists_registered(plugin_registry):
    plugin_registry.add("reward", "probe_reward", lambda **kw: 0.0)
    with pytest.raises(plugin_registry.PluginError, match=r"unknown reward 'nope'; registered rewards: .*probe_reward"):
        plugin_registry.get("reward", "nope")


def test_verl_agent_names_are_aliases_and_an_alias_cannot_shadow_a_plugin(plugin_registry):
    assert plugin_registry.get("agent", "single_turn_agent") is plugin_registry.get("agent", "single_turn")
    assert plugin_registry.get("agent", "tool_agent").name == "tool_agent"
    plugin_registry.alias("reward", "probe_alias", "probe_target")
    plugin_registry.add("reward", "probe_target", lambda **kw: 0.5)
    assert plugin_registry.get("reward", "probe_alias")() == 0.5
    with pytest.raises(plugin_registry.PluginError, match="reward alias 'probe_target' -> 'x' clashes"):
        plugin_registry.alias("reward", "probe_target", "x")
    with pytest.raises(plugin_registry.PluginError, match="reward alias 'probe_alias' -> 'other' clashes"):
        plugin_registry.alias("reward", "probe_alias", "other")
    with pytest.raises(plugin_registry.PluginError,
                       match=r"unknown agent 'single_turn_agnt' \(did you mean 'single_turn_agent'\?\); registered "
                             r"agents: .*single_turn.* \(aliases: single_turn_agent -> single_turn\)"):
        plugin_registry.get("agent", "single_turn_agnt")


def test_a_plugin_file_that_fails_to_import_is_one_line_and_can_be_fixed(tmp_path, plugin_registry):
    f = tmp_path / "flaky.py"
    f.write_text("from asyncrl.registry import register\n\n@register('reward', 'flaky_probe')\ndef r(**kw):\n"
                 "    return 1.0\n\nraise KeyError('SECRET_TOKEN')\n")
    with pytest.raises(plugin_registry.PluginError) as e:
        plugin_registry.load_source(str(f))
    assert str(e.value) == f"plugin {f}: KeyError while importing at {f}:7: 'SECRET_TOKEN'"
    assert "flaky_probe" not in plugin_registry.names("reward")  # what it registered before failing is undone
    with pytest.raises(plugin_registry.PluginError) as e:
        plugin_registry.resolve_object(f"{f}:r")  # the same failure through a tool's class_name path
    assert str(e.value) == f"plugin {f}: KeyError while importing at {f}:7: 'SECRET_TOKEN'"
    f.write_text(f.read_text().replace("raise KeyError('SECRET_TOKEN')", ""))
    plugin_registry.load_source(str(f))  # not remembered as loaded: the fixed file loads
    assert plugin_registry.get("reward", "flaky_probe")() == 1.0


def test_unknown_kind_is_an_error(plugin_registry):
    with pytest.raises(plugin_registry.PluginError, match="unknown plugin kind 'widget'"):
        plugin_registry.register("widget", "x")


def test_plugin_file_from_config(tmp_path, plugin_registry):
    f = tmp_path / "my_reward.py"
    f.write_text(textwrap.dedent("""
        from asyncrl.registry import register

        @register("reward", "file_probe_reward")
        def file_probe_reward(**kw):
            return 1.0
    """))
    plugin_registry.load_source(str(f))
    p = [p for p in plugin_registry.all_plugins() if p.name == "file_probe_reward"][0]
    assert p.origin == f"config {f}"
    assert plugin_registry.get("reward", "file_probe_reward")() == 1.0


def test_missing_plugin_file_names_path(tmp_path, plugin_registry):
    with pytest.raises(plugin_registry.PluginError, match="plugin file .*nothere.py.* not found"):
        plugin_registry.load_source(str(tmp_path / "nothere.py"))


def test_tool_from_entry_points_of_an_installed_distribution(tmp_path):
    """A real distribution, built and pip-installed into a temporary path, registers a tool by entry point,
    and a loss through the learner's group: that module is imported only at the first lookup of a loss
    (a rollout worker's `load_all(learner=False)` leaves it alone)."""
    src = tmp_path / "src"
    (src / "probe_tools").mkdir(parents=True)
    (src / "probe_tools" / "__init__.py").write_text(textwrap.dedent("""
        from asyncrl.registry import register

        @register("tool", "entry_point_probe")
        class EntryPointProbe:
            pass
    """))
    (src / "probe_tools" / "loss.py").write_text(textwrap.dedent("""
        from asyncrl.registry import register

        @register("loss", "entry_point_probe_loss")
        def probe_loss(inputs):
            pass
    """))
    (src / "pyproject.toml").write_text(textwrap.dedent("""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "probe-tools"
        version = "0.1"
        [project.entry-points."asyncrl.plugins"]
        probe = "probe_tools"
        [project.entry-points."asyncrl.learner_plugins"]
        probe_loss = "probe_tools.loss"
        [tool.setuptools]
        packages = ["probe_tools"]
    """))
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), str(src)],
        check=True, timeout=300,
    )
    code = "from asyncrl import registry; print(registry.get('tool', 'entry_point_probe').__name__); " \
           "print([p.origin for p in registry.all_plugins() if p.name == 'entry_point_probe'][0])"
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    name, origin = out.stdout.split("\n")[:2]
    assert name == "EntryPointProbe"
    assert origin == "entry point probe-tools:probe"
    lazy = ("import sys; from asyncrl import registry; registry.load_all([], learner=False); "
            "print(registry.get('tool', 'entry_point_probe').__name__, 'probe_tools.loss' in sys.modules, "
            "'torch' in sys.modules); print(registry.get('loss', 'entry_point_probe_loss').__name__, "
            "'torch' in sys.modules); print([p.origin for p in registry.all_plugins() if p.name == "
            "'entry_point_probe_loss'][0])")
    out = subprocess.run([sys.executable, "-c", lazy], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["EntryPointProbe False False", "probe_loss True",
                                          "entry point probe-tools:probe_loss"], out.stdout
    # And it is absent without that path: the test cannot pass by accident.
    out2 = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out2.returncode != 0 and "unknown tool 'entry_point_probe'" in out2.stderr
