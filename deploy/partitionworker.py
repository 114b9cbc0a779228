"""A worker of the partition harness (deploy/partitions.py), in one host of its simulated cluster.

Run as ``python -m shardps.deploy.partitionworker``. Each stdin line is a JSON
command, each answer one JSON line on stdout (``{"ok": false, "error": ...}``
when the command raised). The harness says when each push runs, so a fault
starts between two given pushes, never at a moment.

Exact accounting: the job's tensors (one a shard) start at zero, the
optimizer is SGD with lr 1 under asp, and push ``i`` of worker ``w`` is a
gradient of -1.0 at coordinate ``w * per_worker + i`` of every tensor, 0
elsewhere. A push applied once leaves exactly 1.0 there (fp32 sums of small
integers are exact), a push applied twice 2.0, one never applied 0.0.

A push that raised is sent again (the same gradient, the same clock: the
shards that took it in answer it as a duplicate), until it is acknowledged;
one that the optimizer dropped at a rejoin (its worker was evicted) is not,
and its outcome stays unknown (0 or 1 on each shard).

Commands:
- ``join``: ``addresses``, ``backups``, ``worker``, ``workers``, ``per_worker``
  (the pushes a worker may make), ``timeout`` (every RPC's deadline),
  ``recovery`` (how long an unreachable shard is retried); a second ``join``
  leaves nothing of the first (a new job).
- ``push``: until ``acked`` pushes are acknowledged or ``attempts`` more were
  made; answers the counts (``pushed``: acknowledged by this command).
- ``log``: every push's outcome (``acked``, ``dropped``, ``pending``) and its
  acknowledgements: ``[shard, version, server, epoch, duplicate]`` each.
- ``stats``, ``record``, ``weights``: what the servers say (observer's
  commands; each call bounded).
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

import torch

from shardps.protos.optim import SGD
from shardps.worker.client import connect
from shardps.worker.optimizer import DistributedOptimizer

STATS = ("role", "version", "replica_state", "gradients_applied_total", "duplicate_pushes_total", "evictions_total")


def tensor_names(shards: int) -> list[str]:
    return [f"t{s}" for s in range(shards)]


def endpoint_stats(addresses: list[str], keys: tuple[str, ...], timeout: float) -> dict[str, Any]:
    """Each endpoint's Stats (those ``keys``), one connection each, or ``{"error": ...}`` where it does not
    answer within ``timeout`` seconds."""
    out: dict[str, Any] = {}
    for a in addresses:
        try:
            with connect([a], timeout=timeout, recovery_timeout=0.0, ready_timeout=timeout) as cl:
                s = cl.stats()[0]
            out[a] = {k: s[k] for k in keys if k in s}
        except Exception as e:  # noqa: BLE001 - an endpoint that does not answer is an answer here
            out[a] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return out


def shard_records(endpoints: list[str], job: str, shards: int, timeout: float = 5.0,
                  wait: float | None = None) -> list[dict[str, Any] | None]:
    """Shards ``0 .. shards-1``'s records in etcd (server/coordinator.py), as this host reads them (None: no
    record); ``wait``: seconds to wait for a member that just started."""
    from shardps.server.coordinator import Etcd, ShardLease

    etcd = Etcd(endpoints, timeout=timeout)
    try:
        if wait:
            etcd.check(wait)
        recs = [ShardLease(etcd, job, s, "observer:0").read() for s in range(shards)]
    finally:
        etcd.close()
    return [None if r is None else {"primary": r.primary, "epoch": r.epoch, "alone": r.alone, "held": r.holder > 0}
            for r in recs]


class Worker:
    def __init__(self) -> None:
        self.client: Any = None
        self.opt: Any = None
        self.params: dict[str, torch.Tensor] = {}
        self.worker = 0
        self.per_worker = 0
        self.pushes: list[dict[str, Any]] = []  # one per push index: outcome, acks, tries, last error

    def join(self, c: dict[str, Any]) -> dict[str, Any]:
        self._close()
        self.worker, self.per_worker = c["worker"], c["per_worker"]
        size = c["workers"] * self.per_worker
        shards = len(c["addresses"])
        self.params = {n: torch.zeros(size, requires_grad=True) for n in tensor_names(shards)}
        self.client = connect(c["addresses"], worker_id=self.worker, num_workers=c["workers"],
                                      backups=c["backups"], timeout=c["timeout"], recovery_timeout=c["recovery"],
                                      ready_timeout=c["timeout"])
        self.opt = DistributedOptimizer(list(self.params.items()), self.client,
                                                optimizer=SGD(lr=1.0), sync="asp")
        self.pushes = []
        parts = [[p.name, p.start, p.stop, p.server] for p in self.client.shard_map.parts]
        return {"parts": parts, **self.state()}

    def state(self) -> dict[str, Any]:
        acked = sum(p["outcome"] == "acked" for p in self.pushes)
        return {"acked": acked, "made": len(self.pushes), "rejoins": self.opt.rejoins,
                "failovers": self.client.failovers_total, "addresses": list(self.client.addresses)}

    def _attempt(self) -> None:
        """One try of the current push (a new one once the last is settled)."""
        if not self.pushes or self.pushes[-1]["outcome"] != "pending":
            if len(self.pushes) >= self.per_worker:
                raise RuntimeError(f"worker {self.worker} made its {self.per_worker} pushes")
            self.pushes.append({"outcome": "pending", "acks": [], "tries": 0, "error": ""})
        p = self.pushes[-1]
        i = len(self.pushes) - 1
        for t in self.params.values():
            g = torch.zeros_like(t)
            g[self.worker * self.per_worker + i] = -1.0
            t.grad = g
        pushed, rejoins = self.opt.pushes, self.opt.rejoins
        p["tries"] += 1
        try:
            self.opt.step()
        except Exception as e:  # noqa: BLE001 - the push's outcome is unknown: sent again next attempt
            p["error"] = f"{type(e).__name__}: {e}"[:400]
            return
        if self.opt.pushes == pushed + 1:
            p["outcome"] = "acked"
            cl = self.client
            p["acks"] = [[s, r.version, cl.addresses[s], cl.transport.fence_epochs[s], r.duplicate]
                         for s, r in enumerate(self.opt.last_push)]
        elif self.opt.rejoins > rejoins:
            p["outcome"] = "dropped"  # evicted: the optimizer rejoined and dropped this gradient
        else:
            raise RuntimeError(f"push {i}: step() neither pushed nor rejoined")

    def push(self, c: dict[str, Any]) -> dict[str, Any]:
        """Attempts until ``acked`` pushes in all are acknowledged, at most ``attempts``; ``pushed``: how many of
        them were."""
        before = self.state()["acked"]
        for _ in range(c["attempts"]):
            if self.state()["acked"] >= c["acked"]:
                break
            self._attempt()
        now = self.state()
        return {**now, "pushed": now["acked"] - before}

    def log(self, c: dict[str, Any]) -> dict[str, Any]:
        return {"pushes": self.pushes}

    def stats(self, c: dict[str, Any]) -> dict[str, Any]:
        return {"stats": endpoint_stats(c["addresses"], STATS, c.get("timeout", 2.0))}

    def record(self, c: dict[str, Any]) -> dict[str, Any]:
        return {"records": shard_records(c["endpoints"], c["job"], c["shards"], c.get("timeout", 5.0), c.get("wait"))}

    def weights(self, c: dict[str, Any]) -> dict[str, Any]:
        """The tensors as the servers at ``addresses`` (one a shard, in order) hold them."""
        t = c.get("timeout", 10.0)
        with connect(c["addresses"], timeout=t, recovery_timeout=0.0, ready_timeout=t) as cl:
            cl.attach()
            state = cl.export_state()
        return {"weights": {n: s["weight"].tolist() for n, s in state.items()}}

    def _close(self) -> None:
        if self.client is not None:
            try:
                self.client.close(leave=False)
            finally:
                self.client = None


def main() -> None:
    w = Worker()
    print(json.dumps({"ok": True, "ready": True}), flush=True)
    for line in sys.stdin:
        c = json.loads(line)
        if c["op"] == "close":
            w._close()
            print(json.dumps({"ok": True}), flush=True)
            return
        try:
            answer = {"ok": True, **getattr(w, c["op"])(c)}
        except Exception as e:  # noqa: BLE001 - reported to the harness, which decides
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000], "trace": traceback.format_exc()[-3000:]}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
