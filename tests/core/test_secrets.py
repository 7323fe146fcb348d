"""Redaction (asyncrl.secrets) and the config copies that go through it: config.json's and the
checkpoint's (`shown_config`) and the wandb config (MetricsLogger, with a real offline wandb run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import Config, to_dict
from asyncrl.metrics import MetricsLogger
from asyncrl.secrets import REDACTED, is_secret, redacted, secret_env_set, shown_config, withhold_env

SECRET = "s3cr3t-Zk9!value-that-must-not-leak-0123456789"
WANDB_KEY = "local-" + "ab12" * 10  # shaped like a wandb key


def _files_containing(root: Path, needle: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]


def test_secret_bearing_fields_are_redacted_wherever_they_sit():
    cfg = {"engine": {"api_key": SECRET, "max_new_tokens": 5, "stop_token_ids": [1]},
           "buffer": {"curve_server_secret": SECRET, "keys_dir": "/k", "unset_secret": None},
           "env": {"tools": [{"name": "search", "auth_token": SECRET, "password": SECRET}]},
           "trainer": {"wandb_project": "p"}}
    out = redacted(cfg)
    assert out["engine"] == {"api_key": REDACTED, "max_new_tokens": 5, "stop_token_ids": [1]}
    assert out["buffer"] == {"curve_server_secret": REDACTED, "keys_dir": "/k", "unset_secret": None}
    assert out["env"]["tools"] == [{"name": "search", "auth_token": REDACTED, "password": REDACTED}]
    assert out["trainer"] == {"wandb_project": "p"}
    assert SECRET not in json.dumps(out)
    assert cfg["engine"]["api_key"] == SECRET  # the input is not changed


@pytest.mark.parametrize("path", ["max_new_tokens", "agent.max_turn_tokens", "stop_token_ids", "buffer.keys_dir",
                                  "trainer.dump_trajectories", "tokenizer"])
def test_ordinary_fields_are_not_secret(path):
    assert not is_secret(path)


def test_the_schema_holds_no_secret_values():
    """Every field of the config schema is a reference or a setting: the default config shows in full.
    A new field whose name says it holds a secret shows as redacted once set (see above)."""
    assert shown_config(Config()) == to_dict(Config())


def _child_sees(name: str) -> str:
    """What a freshly started process finds in its environment under `name`."""
    r = subprocess.run([sys.executable, "-c", f"import os; print(os.environ.get({name!r}, '<unset>'))"],
                       capture_output=True, text=True, check=True, timeout=60)
    return r.stdout.strip()


def test_withheld_env_reaches_only_processes_started_inside_secret_env_set(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", WANDB_KEY)
    held = withhold_env()
    assert held == {"WANDB_API_KEY": WANDB_KEY} and "WANDB_API_KEY" not in os.environ
    assert _child_sees("WANDB_API_KEY") == "<unset>"
    with secret_env_set(held):
        assert _child_sees("WANDB_API_KEY") == WANDB_KEY
    assert _child_sees("WANDB_API_KEY") == "<unset>" and "WANDB_API_KEY" not in os.environ


def test_wandb_gets_the_redacted_config_and_never_the_key(tmp_path, monkeypatch):
    """A real offline wandb run: its whole directory holds neither the configured secret nor the
    WANDB_API_KEY of the environment, and its config shows the secret field redacted."""
    monkeypatch.setenv("WANDB_API_KEY", WANDB_KEY)
    m = MetricsLogger(tmp_path, wandb_mode="offline", config={"engine": {"api_key": SECRET}, "seed": 3},
                      progress=False)
    assert m._wandb is not None, "wandb offline did not start: this test would prove nothing"
    assert dict(m._wandb.config)["engine"] == {"api_key": REDACTED}
    m.log(1, {"train/reward_mean": 0.5})
    m.close()
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb")), "wandb wrote no run file"
    assert _files_containing(tmp_path, REDACTED), "the redacted config was not written anywhere"
    assert _files_containing(tmp_path, SECRET) == []
    assert _files_containing(tmp_path, WANDB_KEY) == []
