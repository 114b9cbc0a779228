"""Placement groups with a deadline: Ray itself waits forever for an infeasible one, silently.

``place(bundles, strategy, timeout=...)`` returns a ready placement group or
raises ``PlacementError`` naming the bundles, the strategy and the alive
nodes with their resources, so the user sees at once why it does not fit.
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from shardps.protos import env

log = logging.getLogger("shardps.ray")

STRATEGIES = ("SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK")
DEFAULT_PLACEMENT_TIMEOUT_S = 120.0


class PlacementError(RuntimeError):
    """A placement group could not be placed on the cluster within its deadline."""


def actor_logging() -> None:
    """shardps log lines of an actor at SHARDPS_LOG_LEVEL (default WARNING), once, in Ray's log stream."""
    level = (env.get(env.LOG_LEVEL) or "WARNING").upper()
    if logging.getLogger().handlers:
        logging.getLogger("shardps").setLevel(level)
    else:
        logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def check_strategy(strategy: str) -> str:
    s = strategy.upper()
    if s not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    return s


def describe_nodes() -> str:
    """The alive nodes and what each offers, for error messages."""
    out = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = {k: v for k, v in n.get("Resources", {}).items()
               if not k.startswith("node:") and k not in ("memory", "object_store_memory")}
        out.append(f"{n['NodeID'][:12]} ({n.get('NodeManagerAddress', '?')}): {res}")
    return "; ".join(out) or "none"


def place(bundles: list[dict[str, float]], strategy: str, *, timeout: float = DEFAULT_PLACEMENT_TIMEOUT_S,
          what: str = "shardps", name: str = "") -> PlacementGroup:
    """A ready placement group of ``bundles`` under ``strategy``, or ``PlacementError`` after ``timeout``."""
    strategy = check_strategy(strategy)
    alive = [n for n in ray.nodes() if n.get("Alive")]
    if strategy == "STRICT_SPREAD" and len(bundles) > len(alive):
        raise PlacementError(f"{what}: STRICT_SPREAD needs one node per bundle: {len(bundles)} bundles "
                             f"{bundles}, {len(alive)} alive nodes: {describe_nodes()}")
    short = shortfall(bundles)
    if short:
        # An autoscaler may still add nodes, so this waits; but the user learns now why it may not end.
        log.warning("%s: %s; waiting up to %.0fs for the cluster to grow", what, short, timeout)
    pg = placement_group(bundles, strategy=strategy, name=name)
    if not pg.wait(timeout):
        remove_placement_group(pg)
        raise PlacementError(f"{what}: the placement group of {len(bundles)} bundles {bundles} with strategy "
                             f"{strategy} could not be placed within {timeout:.0f}s; alive nodes: "
                             f"{describe_nodes()}" + (f"; {short}" if short else ""))
    return pg


def shortfall(bundles: list[dict[str, float]]) -> str:
    """Why ``bundles`` cannot fit the cluster as it is, counting all of its resources (also those in use),
    or "" when they could."""
    total: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            total[k] = total.get(k, 0.0) + v
    have = ray.cluster_resources()
    missing = {k: (v, have.get(k, 0.0)) for k, v in total.items() if v > have.get(k, 0.0) + 1e-9}
    if not missing:
        return ""
    parts = ", ".join(f"{k} {need:g} (the cluster has {got:g} in all)" for k, (need, got) in missing.items())
    return (f"these bundles need {parts}: add nodes, ask for less (--server-cpus, --worker-cpus, "
            f"--stage-cpus) or start Ray with more (ray start --num-cpus N)")


def in_bundle(pg: PlacementGroup, index: int) -> dict[str, Any]:
    """Actor options that put it into bundle ``index`` of ``pg``."""
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=index, placement_group_capture_child_tasks=False)}
