"""Placement: which Ray nodes host each role, and whether the cluster can hold the run.

Roles and where they go: `ray.placement.{engine,learner,rollout,buffer}` (config.py PlacementConfig) are
the Ray resources one actor of the role asks for, beside its CPU request; Ray puts it on a node that
offers them (a node offers a custom resource when started with it: `ray start --resources='{"engines": 4}'`,
or `Cluster.add_node(resources=...)`). An empty mapping: any node. Learner and critic ranks share the
`learner` entry and may span nodes: on a cluster of several nodes their process group meets at rank 0's
node IP and a port free there (`node_rendezvous`), on one node at 127.0.0.1.

What the run checks before its parts start (`cluster_problems`, after `ray.init`, every problem at once):
- each role's request fits at least one alive node, and the nodes that fit it hold all of its actors
  (engines: engine.num_engines, none when attached; learner: trainer.learner_ranks plus critic ranks on
  their own; rollout: trainer.rollout_workers; buffer: 1). Roles are checked one at a time: two roles
  asking for one resource are not summed (Ray then queues the second, and the run's start waits);
- a cluster of more than one alive node gets routable addresses only: buffer.host and engine.host may
  not be loopback (the buffer then runs CURVE, the engines demand the run's token: config.py refuses the
  open forms), since a worker on another node cannot reach 127.0.0.1 of the buffer's node;
- the run directory is one storage every node sees: the driver writes a marker with a fresh nonce, a task
  pinned to each alive node reads it back and writes its own (`shared_dir_problems`); a node that cannot is
  named. Checkpoints, the buffer's log, engine logs and restart weights, and trajectory logs are written
  under it by whichever node holds the role (docs/cluster.md "What must be shared").

Where an actor goes after its node is lost: the same request again (`actor_options`), so Ray picks a node
that still offers it; a replacement that no node can take within `ray.place_timeout_s` stops the run
naming the role and its request (asyncrl/run/supervisor.py).
"""

from __future__ import annotations

import math
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.config import PLACED_ROLES, Config
from asyncrl.util.net import free_port, is_loopback

MARKER_PREFIX = ".asyncrl-shared-"


@dataclass(frozen=True)
class Node:
    node_id: str
    address: str  # the node's IP, as Ray knows it
    resources: dict[str, float]  # its total resources (CPU, GPU, memory, custom ones)


def alive_nodes() -> list[Node]:
    """The cluster's alive nodes (ray.init has run)."""
    import ray  # lazy: the checks on a described cluster (and their tests) need no Ray

    return [Node(n["NodeID"], n["NodeManagerAddress"], dict(n.get("Resources", {})))
            for n in ray.nodes() if n.get("Alive")]


def actor_options(resources: dict[str, float]) -> dict[str, Any]:
    """`.options(...)` for an actor of a role whose placement asks for `resources`. With no CPU named, Ray has
    an actor given any resource hold one CPU for its life (a plain one holds none once placed): a node of 2
    CPUs would then take only two of the run's actors; their threads are sized by the run itself."""
    return {"resources": dict(resources), "num_cpus": 0} if resources else {}


def role_counts(cfg: Config) -> dict[str, int]:
    """How many actors of each role the run starts."""
    critic = cfg.algorithm.critic
    separate_critic = cfg.algorithm.adv_estimator == "gae" and critic.placement == "separate"
    counts = (0 if cfg.engine.urls else cfg.engine.num_engines,
              cfg.trainer.learner_ranks + (critic.ranks if separate_critic else 0), cfg.trainer.rollout_workers, 1)
    return dict(zip(PLACED_ROLES, counts, strict=True))


def fits(node: Node, request: dict[str, float]) -> int:
    """How many actors asking for `request` the node's resources hold."""
    if not request:
        return 1 << 30
    return min(math.floor(node.resources.get(k, 0.0) / v + 1e-9) for k, v in request.items())


def placement_problems(cfg: Config, nodes: list[Node]) -> list[str]:
    problems = []
    offered = sorted({k for n in nodes for k in n.resources if not k.startswith("node:") and k != "object_store_memory"})
    for role, count in role_counts(cfg).items():
        request = getattr(cfg.ray.placement, role)
        if not request or not count:
            continue
        hosts = [(n, k) for n in nodes if (k := fits(n, request)) > 0]
        what = f"ray.placement.{role}={request} for each of {count} {role} actor(s)"
        if not hosts:
            problems.append(f"{what}: no alive node offers that (the {len(nodes)} node(s) offer: "
                            f"{', '.join(offered) or 'nothing'})")
        elif sum(k for _, k in hosts) < count:
            held = ", ".join(f"{n.address} ({n.node_id[:8]}): {k}" for n, k in hosts)
            problems.append(f"{what}: the nodes that offer it hold {sum(k for _, k in hosts)} in all ({held})")
    return problems


def address_problems(cfg: Config, nodes: list[Node]) -> list[str]:
    if len(nodes) < 2:
        return []
    problems = []
    why = f"the Ray cluster has {len(nodes)} alive nodes and a {{}} on one is not reachable from another"
    if is_loopback(cfg.buffer.host):
        problems.append(f"buffer.host={cfg.buffer.host}: {why.format('loopback address')}: set buffer.host=0.0.0.0 "
                        "(the buffer then runs CURVE, buffer.curve)")
    if not cfg.engine.urls and is_loopback(cfg.engine.host):
        problems.append(f"engine.host={cfg.engine.host}: {why.format('loopback address')}: set engine.host=0.0.0.0 "
                        "(the engines then demand the run's token)")
    return problems


def shared_dir_problems(out: Path, nodes: list[Node], timeout_s: float = 60.0) -> list[str]:
    """Every node reads the driver's marker in `out` and writes its own; the nodes that cannot are named."""
    if len(nodes) < 2:
        return []
    import ray  # lazy: as in alive_nodes
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # lazy: as in alive_nodes

    nonce = secrets.token_hex(8)
    marker = out / f"{MARKER_PREFIX}{nonce}"
    marker.write_text(nonce)
    try:
        probe = ray.remote(num_cpus=0, max_retries=0)(_see_marker)
        refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False))
                .remote(str(marker), nonce, n.node_id) for n in nodes]
        problems = []
        for n, ref in zip(nodes, refs):
            try:
                seen = ray.get(ref, timeout=timeout_s)
            except Exception as e:  # noqa: BLE001 - a node that does not answer cannot be shown to see it
                seen = f"the check did not run there: {e!r}"[:300]
            theirs = Path(f"{marker}-{n.node_id}")
            if seen is None and not (theirs.is_file() and theirs.read_text() == n.node_id):
                seen = f"its marker {theirs} is not visible from the driver"
            if seen is not None:
                problems.append(f"trainer.output_dir={out} must be one storage every node sees; node {n.address} "
                                f"({n.node_id[:8]}): {seen}")
        return problems
    finally:
        for p in out.glob(f"{MARKER_PREFIX}{nonce}*"):
            p.unlink(missing_ok=True)


def _see_marker(path: str, nonce: str, node_id: str) -> str | None:
    """On one node: None when `path` holds `nonce` and its own marker could be written, else why not."""
    p = Path(path)
    try:
        if p.read_text() != nonce:
            return f"{path} holds something else there"
        Path(f"{path}-{node_id}").write_text(node_id)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def cluster_problems(cfg: Config, out: Path) -> list[str]:
    """Everything `cluster_problems`'s module docstring lists, checked against the live cluster."""
    nodes = alive_nodes()
    return placement_problems(cfg, nodes) + address_problems(cfg, nodes) + shared_dir_problems(out, nodes)


def node_rendezvous() -> tuple[str, int]:
    """In rank 0's actor: its node's IP and a free port there (where its group meets when ranks span nodes)."""
    import ray  # lazy: as in alive_nodes

    ip = ray.util.get_node_ip_address()
    return ip, free_port(ip)


def group_env(master_addr: str, master_port: int, rank: int, world_size: int) -> None:
    """The environment torch.distributed's env:// rendezvous reads, in a rank's own process."""
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK="0")
