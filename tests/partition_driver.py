"""A worker (or an observer) in a NetCluster host, driven one command at a time: tests/test_partitions.py.

Run as ``python -m tests.partition_driver`` in a host. Each stdin line is a
JSON command; each answer one JSON line on stdout (``{"ok": false, "error":
...}`` when the command raised). The test decides when each step runs, so a
fault lands between two given steps, never at a moment.

Commands:
- ``join``: ``shardps.connect`` + ``DistributedOptimizer`` (SGD, bsp) on a
  small MLP; ``addresses``, ``worker``, ``workers``, ``backups``, ``timeout``
  (every RPC's deadline), ``recovery`` (``recovery_timeout``).
- ``steps`` ``n``: n optimizer steps; the data of a step depends on the
  worker and its step number only, so two runs are equal bit for bit.
- ``until`` ``version``: steps until every shard's version is at least that.
- ``state``: versions, clock, steps, rejoins, fail-overs, retries, addresses.
- ``weights``: a digest of the worker's parameters (sha256 of their bytes).
- ``stats`` ``addresses``: each endpoint's Stats (or the error), one call each.
- ``server_weights`` ``addresses``: the digest of the weights the shards hold.
- ``push_once`` ``address`` ``worker`` ``workers``: a client that knows only
  ``address`` (one shard) registers as ``worker`` and pushes one step there.

``join`` takes ``sync`` too (default bsp).
"""

from __future__ import annotations

import hashlib
import json
import sys
import traceback
from typing import Any

import torch
from torch import nn

import shardps
from shardps.deploy.partitionworker import endpoint_stats

LR = 0.1
STATS = ("role", "version", "worker_clocks", "evicted_workers", "evictions_total", "gradients_applied_total",
         "duplicate_pushes_total", "replica_state")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))


def batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


class Driver:
    def __init__(self) -> None:
        self.client: Any = None
        self.opt: Any = None
        self.model = make_model()
        self.worker = 0

    def join(self, c: dict[str, Any]) -> dict[str, Any]:
        """Join the job; a second join is the worker process restarted (no Leave, a fresh model)."""
        if self.client is not None:
            self.client.close(leave=False)
            self.model = make_model()
        self.worker = c["worker"]
        self.client = shardps.connect(c["addresses"], worker_id=self.worker, num_workers=c["workers"],
                                      backups=c.get("backups"), timeout=c.get("timeout", 30.0),
                                      recovery_timeout=c.get("recovery", 30.0), ready_timeout=30.0)
        self.opt = shardps.DistributedOptimizer(self.model, self.client, optimizer=shardps.optim.SGD(lr=LR),
                                                sync=c.get("sync", "bsp"))
        return self.state(c)

    def _step(self) -> None:
        x, y = batch(self.worker, self.opt.local_steps)
        nn.functional.mse_loss(self.model(x), y).backward()
        self.opt.step()
        self.opt.zero_grad()

    def steps(self, c: dict[str, Any]) -> dict[str, Any]:
        for _ in range(c["n"]):
            self._step()
        return self.state(c)

    def until(self, c: dict[str, Any]) -> dict[str, Any]:
        for _ in range(c.get("max_steps", 1000)):
            if min(self.client.versions) >= c["version"]:
                break
            self._step()
        return self.state(c)

    def state(self, c: dict[str, Any]) -> dict[str, Any]:
        cl = self.client
        return {"versions": list(cl.versions), "clock": self.opt.round, "steps": self.opt.local_steps,
                "pushes": self.opt.pushes, "rejoins": self.opt.rejoins, "failovers": cl.failovers_total,
                "retries": cl.retries_total, "addresses": list(cl.addresses)}

    def timeout(self, c: dict[str, Any]) -> dict[str, Any]:
        """Every RPC's deadline from now on."""
        self.client.timeout = c["seconds"]
        return self.state(c)

    def weights(self, c: dict[str, Any]) -> dict[str, Any]:
        return {"digest": digest(dict(self.model.named_parameters()))}

    def stats(self, c: dict[str, Any]) -> dict[str, Any]:
        return {"stats": endpoint_stats(c["addresses"], STATS, c.get("timeout", 2.0))}

    def server_weights(self, c: dict[str, Any]) -> dict[str, Any]:
        with shardps.connect(c["addresses"], timeout=10.0, recovery_timeout=5.0, ready_timeout=10.0) as cl:
            cl.attach()
            state = cl.export_state()
        return {"digest": digest({n: s["weight"] for n, s in state.items()}),
                "versions": {n: s["version"] for n, s in state.items()}}

    def push_once(self, c: dict[str, Any]) -> dict[str, Any]:
        """A client that knows only one endpoint (a stale address list) registers there and pushes a step."""
        model = make_model()
        with shardps.connect([c["address"]], worker_id=c["worker"], num_workers=c["workers"],
                             timeout=c.get("timeout", 5.0), recovery_timeout=0.0, ready_timeout=5.0) as cl:
            opt = shardps.DistributedOptimizer(model, cl, optimizer=shardps.optim.SGD(lr=LR), sync="bsp")
            x, y = batch(c["worker"], opt.local_steps)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            return {"versions": list(cl.versions), "pushes": opt.pushes}


def main() -> None:
    d = Driver()
    print(json.dumps({"ok": True, "ready": True}), flush=True)
    for line in sys.stdin:
        c = json.loads(line)
        if c["op"] == "close":
            if d.client is not None:
                d.client.close()
            print(json.dumps({"ok": True}), flush=True)
            return
        try:
            answer = {"ok": True, **getattr(d, c["op"])(c)}
        except Exception as e:  # noqa: BLE001 - reported to the test, which decides
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000],
                      "trace": traceback.format_exc()[-3000:]}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
