"""The job the fuzzer runs against: its tensors, its set-up, and reading its state."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from shardps.testing.fuzz.cases import VOLATILE_STATS

# -- the job the fuzzer runs against ---------------------------------------------------

#: The job's row table (docs/sparse.md): dim 4, SparseAdam (state to hash), its rows of ROW_KEYS pushed (so held
#: on their shards); 0, -1 (2**64-1 on the wire) and the int64 extremes among them.
ROW_TABLE = "emb"
ROW_DIM = 4
ROW_KEYS = torch.tensor([0, -1, 1, 2, 3, 5, 8, 2**63 - 1, -(2**63), 77, 1000, 31337], dtype=torch.int64)


def job_tensors() -> dict[str, torch.Tensor]:
    """Small tensors of every wire dtype; with part_bytes=32 "w" is split across two shards."""
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(4, 5, generator=g),
        "b": torch.randn(5, generator=g),
        "h": torch.randn(2, 3, generator=g).to(torch.float16),
        "e": torch.randn(7, generator=g).to(torch.bfloat16),
    }


def prepare_job(addresses: Sequence[str], sync: str, *, num_workers: int = 2, steps: int = 2,
                timeout: float = 30.0, frames: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Register ``num_workers`` workers and push ``steps`` valid steps from each; return the weights then.

    Optimizers with state (SGD momentum, Adam) so that the state hash covers
    more than weights. Worker 0 goes on the servers' data connections
    (``shm=False``); ``frames``, when given, is filled with what a frame
    fuzzer needs to speak as it on them (gen_frames.py): ``host``, ``port``,
    ``token``, ``worker_id``, ``shards`` (a ``gen_frames.Shard`` each), or
    left empty when the servers offer no data port.
    """
    import shardps  # here, not at the top: the generators and the judge need none of the package's API

    tensors = job_tensors()

    def optimizer(name: str, t: torch.Tensor) -> Any:
        if name == "b":
            return shardps.optim.SGD(lr=0.5, momentum=0.5)
        if name == "e":
            return shardps.optim.Adam(lr=0.01)
        return shardps.optim.SGD(lr=0.5)

    clients = [shardps.connect(addresses, worker_id=k, num_workers=num_workers, timeout=timeout, part_bytes=32,
                               shm=k != 0) for k in range(num_workers)]
    try:
        clients[0].register(tensors, optimizer, sync=sync)
        for c in clients[1:]:
            c.register(tensors, optimizer, sync=sync)
        if frames is not None:
            _frames_of(clients[0], frames)
        for c in clients:
            c.rows.register(ROW_TABLE, ROW_DIM, optimizer=shardps.optim.SparseAdam(lr=0.1), seed=1)
        for step in range(steps):
            for k, c in enumerate(clients):
                c.push({n: torch.full_like(t, 0.25 * (k + 1)) for n, t in tensors.items()}, step=step)
                c.rows.push(ROW_TABLE, ROW_KEYS, torch.full((len(ROW_KEYS), ROW_DIM), 0.25 * (k + 1)), step)
        return clients[0].pull()
    finally:
        for c in clients:
            c.close(leave=False)  # the job's workers stay registered while it is fuzzed


def _frames_of(client: Any, out: dict[str, Any]) -> None:
    from shardps.testing.fuzz.gen_frames import Shard
    from shardps.worker.datapath.dataconn import ConnPath

    paths = [p for p in client.paths if isinstance(p, ConnPath)]
    if not paths:
        return
    host, port = paths[0].conn.where.rsplit(":", 1)
    out.update(host=host, port=int(port), token=paths[0].conn.token, worker_id=client.worker_id,
               shards=[Shard(p.route, part.name, tuple(client.layouts[part.name].shape))
                       for p in paths if p.conn is paths[0].conn
                       for part in client.shard_map.parts_for(p.shard)[:1]])


def pull_all(addresses: Sequence[str], timeout: float = 30.0) -> dict[str, torch.Tensor]:
    """Every tensor's weights, by a fresh pull-only client (a valid pull)."""
    import shardps

    with shardps.connect(addresses, worker_id=0, num_workers=1, timeout=timeout) as c:
        c.attach()
        return c.pull()


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]) for n in a)


def local_state(stores: Sequence[Any]) -> list[tuple[str, str, str]]:
    """In-process shards: ``state_hash()`` and the counters and membership of ``stats()`` (less pulls)."""
    out = []
    for s in stores:
        st = dataclasses.asdict(s.stats())
        for k in VOLATILE_STATS:
            st.pop(k, None)
        st["tensors"] = [(t["spec"], t["weight_bytes"], t["optimizer_state_bytes"]) for t in st["tensors"]]
        out.append((s.state_hash(), repr(sorted(st.items())), rows_hash(s)))
    return out


def rows_hash(store: Any) -> str:
    """A digest of a shard's row tables: their snapshot (rows, state, keys, versions, counts), as a checkpoint
    holds them."""
    import hashlib
    import json

    meta, tensors = store.rows.snapshot()
    h = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for k in sorted(tensors):
        h.update(k.encode())
        h.update(tensors[k].numpy().tobytes())
    return h.hexdigest()
