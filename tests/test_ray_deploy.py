"""The Ray deployment files: a `ray up` cluster config and a KubeRay RayJob (no cluster is started)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import yaml

from shardps.cli import build_parser

RAY = Path(__file__).resolve().parents[1] / "deploy" / "ray"


def _parse_entrypoint(entrypoint: str):
    argv = shlex.split(entrypoint)
    assert argv[:2] == ["shardps", "ray"], argv
    return build_parser().parse_args(argv[1:])


def test_the_cluster_config_is_valid_for_ray_up_and_has_ps_and_gpu_nodes():
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = yaml.safe_load((RAY / "cluster.yaml").read_text())
    validate_config(prepare_config(yaml.safe_load((RAY / "cluster.yaml").read_text())))  # Ray's own schema
    types = cfg["available_node_types"]
    assert types[cfg["head_node_type"]]["resources"] == {"CPU": 0}  # the head runs drivers only
    ps = [t for t in types.values() if "ps" in t["resources"]]
    gpu = [t for t in types.values() if re.match(r"(g|p)\d", t["node_config"]["InstanceType"])]
    assert ps and ps[0]["min_workers"] >= 2 and gpu
    assert any("shardps" in c and ".whl" in c for c in cfg["setup_commands"])
    # The job the comments tell users to submit is a valid `shardps ray` command on this cluster.
    submit = re.search(r"-- (shardps ray .*?)$", (RAY / "cluster.yaml").read_text().replace("\\\n#", ""), re.M)
    args = _parse_entrypoint(" ".join(submit.group(1).split()))
    assert json.loads(args.server_resources) == {"ps": 0.001} and args.use_gpu


def test_the_rayjob_runs_the_same_entrypoint_on_ps_and_gpu_groups():
    job = yaml.safe_load((RAY / "rayjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    spec = job["spec"]
    args = _parse_entrypoint(spec["entrypoint"])
    assert args.example == "digits" and args.use_gpu and json.loads(args.server_resources) == {"ps": 0.001}
    assert spec["shutdownAfterJobFinishes"] is True and spec["rayClusterSpec"]["rayVersion"] == "2.60.0"
    groups = {g["groupName"]: g for g in spec["rayClusterSpec"]["workerGroupSpecs"]}
    assert json.loads(json.loads(groups["ps"]["rayStartParams"]["resources"])) == {"ps": 1}
    assert groups["ps"]["replicas"] >= args.servers or args.strategy != "STRICT_SPREAD"
    [gpu] = groups["gpu"]["template"]["spec"]["containers"]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert spec["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    images = {c["image"] for g in [spec["rayClusterSpec"]["headGroupSpec"], *groups.values()]
              for c in g["template"]["spec"]["containers"]}
    assert images == {"shardps-ray:latest"}
    dockerfile = (RAY / "Dockerfile").read_text()
    assert "rayproject/ray:2.60.0" in dockerfile and "shardps[ray]" in dockerfile
