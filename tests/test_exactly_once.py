"""A retried Push after a lost reply is acknowledged, not applied again."""

from __future__ import annotations

import copy
import threading

import grpc
import pytest
import torch
from torch import nn

import shardps
from tests.helpers import run_workers


class DropPushAnswers:
    """Fault injection on the data connection (server/datapath/dataconn.py): every ``every``-th Push that was
    taken in is answered UNAVAILABLE instead of with its answer."""

    def __init__(self, monkeypatch, every: int = 3) -> None:
        from shardps.protos import dataconn as wire
        from shardps.server.datapath.dataconn import Conn

        self.every, self.count, self.dropped = every, 0, 0
        self._lock = threading.Lock()
        answer = Conn.answer

        def lossy(conn, kind, call, status, ctl, payload=None):
            if kind == wire.PUSH and status == wire.OK:
                with self._lock:
                    self.count += 1
                    drop = self.count % self.every == 0
                    self.dropped += drop
                if drop:
                    status, ctl = grpc.StatusCode.UNAVAILABLE.value[0], [b"injected fault: reply lost"]
            return answer(conn, kind, call, status, ctl, payload)

        monkeypatch.setattr(Conn, "answer", lossy)


STEPS, WORKERS = 15, 2


def _train(addresses, base, sync):
    def worker(k):
        model = copy.deepcopy(base)
        with shardps.connect(addresses, worker_id=k, num_workers=WORKERS, part_bytes=256) as client:
            opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.Adam(lr=1e-2), sync=sync)
            for step in range(STEPS):
                g = torch.Generator().manual_seed(step * 10 + k)
                model(torch.randn(8, 12, generator=g)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            return {n: p.detach().clone() for n, p in model.named_parameters()}, client.retries_total
    return run_workers(worker, WORKERS)


@pytest.mark.fault
def test_lost_replies_are_retried_and_applied_once(make_cluster, monkeypatch):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))
    clean = make_cluster(2)
    expected = _train(clean.addresses, base, "bsp")
    faults = [DropPushAnswers(monkeypatch, 3)]  # the workers' calls are frames on their data connections
    faulty = make_cluster(2)
    got = _train(faulty.addresses, base, "bsp")
    assert faults[0].dropped >= STEPS  # a third of all pushes lost their reply
    assert sum(r for _, r in got) >= faults[0].dropped  # ... and were retried
    assert sum(s.job.duplicate_pushes_total for s in faulty.stores) == faults[0].dropped  # each once
    for (w_exp, _), (w_got, _) in zip(expected, got):
        for n in w_exp:
            assert torch.equal(w_got[n], w_exp[n]), n  # bitwise: every gradient applied exactly once
    for store in faulty.stores:
        assert store.job.duplicate_pushes_total > 0
        assert store.applier.gradients_applied_total == WORKERS * STEPS
        assert store.job.version == STEPS
