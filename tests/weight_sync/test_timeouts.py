"""The weight sync's timeouts each have one owner: the sync's in the config (WeightSyncConfig.timeout_s),
the probe's in engine_http (PROBE_TIMEOUT_S). Every constructor's default is read from there; `is`, not
only `==`: a second literal of the same number, in another module, is another float object."""

from __future__ import annotations

import inspect

from asyncrl.config import EngineConfig, WeightSyncConfig
from asyncrl.engine.client import EngineClient
from asyncrl.run.supervisor import Supervisor
from asyncrl.weight_sync.broadcast import GroupTransport
from asyncrl.weight_sync.disk import DiskTransport
from asyncrl.weight_sync.engine_http import PROBE_TIMEOUT_S, EngineHTTP
from asyncrl.weight_sync.sender import PAUSE_MODE, WeightSender
from asyncrl.weight_sync.tensor import TensorTransport


def default(fn, name: str):
    return inspect.signature(fn).parameters[name].default


def test_sync_timeouts_default_to_the_configs(tmp_path):
    owner = WeightSyncConfig.timeout_s
    assert WeightSyncConfig().timeout_s == owner
    readers = {"GroupTransport": GroupTransport, "TensorTransport": TensorTransport, "DiskTransport": DiskTransport,
               "WeightSender": WeightSender}
    assert {k: default(c, "timeout_s") is owner for k, c in readers.items()} == {k: True for k in readers}
    disk = DiskTransport(str(tmp_path))
    built = {"GroupTransport": GroupTransport("gloo").timeout_s, "TensorTransport": TensorTransport().timeout_s,
             "DiskTransport": disk.timeout_s, "WeightSender": WeightSender(disk).timeout_s}
    assert built == {k: WeightSyncConfig().timeout_s for k in readers}
    assert default(WeightSender, "mode") is WeightSyncConfig.mode
    assert WeightSender(disk).pause_mode == PAUSE_MODE[WeightSyncConfig().mode]


def test_probe_timeout_is_spelled_once():
    assert default(EngineHTTP, "probe_timeout_s") is PROBE_TIMEOUT_S
    assert default(WeightSender, "probe_timeout_s") is PROBE_TIMEOUT_S
    assert EngineHTTP().probe_timeout_s == PROBE_TIMEOUT_S


def test_engine_side_defaults_are_the_engine_configs():
    """The client's patience and the supervisor's probe budget default to the config's engine section."""
    assert default(EngineClient, "timeout_s") is EngineConfig.request_timeout_s
    assert default(EngineClient, "max_retries") == EngineConfig().max_retries
    assert default(Supervisor, "probe_timeout_s") is EngineConfig.probe_timeout_s
