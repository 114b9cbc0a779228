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
    pg = placement_group(bundles, strategy=strategy, name=name)
    if not pg.wait(timeout):
        remove_placement_group(pg)
        raise PlacementError(f"{what}: the placement group of {len(bundles)} bundles {bundles} with strategy "
                             f"{strategy} could not be placed within {timeout:.0f}s; alive nodes: "
                             f"{describe_nodes()}")
    return pg


def in_bundle(pg: PlacementGroup, index: int) -> dict[str, Any]:
    """Actor options that put it into bundle ``index`` of ``pg``."""
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=index, placement_group_capture_child_tasks=False)}
