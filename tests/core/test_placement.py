"""asyncrl/run/placement.py's checks on a described cluster (the live ones run in tests/e2e/test_cluster.py),
the placement config's validation, and the addresses a wildcard-bound server advertises."""

from __future__ import annotations

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.run.placement import Node, actor_options, address_problems, fits, placement_problems, role_counts
from asyncrl.util.net import advertised


def _node(ip: str, **resources: float) -> Node:
    return Node(node_id=f"{ip}-id-0123456789", address=ip, resources={"CPU": 2.0, **resources})


def test_a_placement_is_refused_naming_the_role_its_request_and_what_the_nodes_offer():
    cfg = load_config(["+ray.placement.engine={gpu_node: 1}", "engine.num_engines=2"])
    nodes = [_node("10.0.0.1"), _node("10.0.0.2", rollout=4)]
    (problem,) = placement_problems(cfg, nodes)
    assert problem == ("ray.placement.engine={'gpu_node': 1} for each of 2 engine actor(s): no alive node offers "
                       "that (the 2 node(s) offer: CPU, rollout)")


def test_too_few_places_for_a_role_are_refused_with_what_each_node_holds():
    cfg = load_config(["+ray.placement.learner={learner: 1}", "trainer.learner_ranks=3"])
    nodes = [_node("10.0.0.1", learner=1), _node("10.0.0.2", learner=1.5), _node("10.0.0.3")]
    (problem,) = placement_problems(cfg, nodes)
    assert "for each of 3 learner actor(s): the nodes that offer it hold 2 in all" in problem
    assert "10.0.0.1 (10.0.0.1): 1, 10.0.0.2 (10.0.0.2): 1" in problem
    nodes.append(_node("10.0.0.4", learner=2))
    assert placement_problems(cfg, nodes) == []


def test_a_request_of_several_resources_needs_them_on_one_node():
    cfg = load_config(["+ray.placement.rollout={rollout: 1, sandbox: 2}", "trainer.rollout_workers=1"])
    split = [_node("10.0.0.1", rollout=4), _node("10.0.0.2", sandbox=8)]
    assert "no alive node offers that" in placement_problems(cfg, split)[0]
    assert fits(_node("10.0.0.3", rollout=4, sandbox=5), {"rollout": 1, "sandbox": 2}) == 2
    assert placement_problems(cfg, [_node("10.0.0.3", rollout=1, sandbox=2)]) == []


def test_attached_engines_and_an_unplaced_role_ask_nothing():
    cfg = load_config(["+ray.placement.engine={gpu_node: 1}", "engine.urls=[http://10.0.0.9:30000]"])
    assert role_counts(cfg)["engine"] == 0 and placement_problems(cfg, [_node("10.0.0.1")]) == []
    assert actor_options({}) == {}
    # an actor given any resource would hold a CPU for its life unless told otherwise (Ray's rule)
    assert actor_options({"engine": 1}) == {"resources": {"engine": 1}, "num_cpus": 0}


def test_a_cluster_of_several_nodes_needs_routable_buffer_and_engine_addresses():
    nodes = [_node("10.0.0.1"), _node("10.0.0.2")]
    problems = address_problems(load_config([]), nodes)
    assert len(problems) == 2
    assert problems[0].startswith("buffer.host=127.0.0.1: the Ray cluster has 2 alive nodes")
    assert problems[1].startswith("engine.host=127.0.0.1:")
    assert address_problems(load_config([]), nodes[:1]) == []  # one node: loopback is right
    assert address_problems(load_config(["buffer.host=0.0.0.0", "engine.host=0.0.0.0"]), nodes) == []
    assert len(address_problems(load_config(["buffer.host=0.0.0.0", "engine.urls=[http://10.0.0.9:1]"]), nodes)) == 0


@pytest.mark.parametrize("override, message", [
    ("+ray.placement.engine={engine_node: -1}", "ray.placement.engine.engine_node: must be a positive number, got -1"),
    ("+ray.placement.engine={engine_node: nan}", "ray.placement.engine.engine_node: must be a positive number, got nan"),
    ("+ray.placement.buffer={head: true}", "ray.placement.buffer.head: must be a positive number, got True"),
    ("ray.placement.engine.engine_node=1", "ray.placement.engine is a mapping that the config leaves empty; add to it "
                                           "with a leading '+': '+ray.placement.engine.engine_node=1'"),
    ("ray.place_timeout_s=0", "ray.place_timeout_s"),
])
def test_bad_placement_settings_are_refused_by_name(override, message):
    with pytest.raises(ConfigError) as e:
        load_config([override])
    assert message in str(e.value)


def test_num_cpus_with_a_cluster_address_is_refused():
    with pytest.raises(ConfigError, match=r"ray.num_cpus: sizes a local instance only; with ray.address='auto'"):
        load_config(["ray.address=auto", "ray.num_cpus=2"])


def test_a_wildcard_bound_server_is_advertised_at_its_node_ip():
    assert advertised("http://0.0.0.0:8000", "10.1.2.3") == "http://10.1.2.3:8000"
    assert advertised("http://[::]:8000/x", "10.1.2.3") == "http://10.1.2.3:8000/x"
    assert advertised("http://127.0.0.1:8000", "10.1.2.3") == "http://127.0.0.1:8000"
    assert advertised("http://10.9.9.9:8000", "10.1.2.3") == "http://10.9.9.9:8000"
