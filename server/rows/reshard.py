"""Row tables read from the checkpoints of a job with another number of shards (docs/sparse.md).

A row's shard is ``shard_of(key, num_shards)`` and its first value is a
function of (seed, name, key) alone, so a table checkpointed on n shards is
the same table on m: ``resharded(directory, shard_index, num_shards)`` reads
the newest checkpoint of each of the old job's shards
(``{directory}/shard-{i}``, their count from the checkpoints' meta) and
keeps, of every table, the rows (with their optimizer state, versions and
last steps) and the admission counts of the keys that shard ``shard_index``
of ``num_shards`` holds. The old shards must agree on each table's step
count and bsp step (a consistent cut: every push reaches every shard, so
they do unless a checkpoint fell between two shards' halves of a push);
otherwise FAILED_PRECONDITION names the table and the counts. A worker's
last asp step is the lowest any old shard had. The counts (admitted,
dropped, ...) are statistics: their sums go to the new shard 0.

Dense tensors are not resharded here (their checkpoint is restored only by
a job of the same shard count: ``ShardStore.restore``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from shardps.protos.rows import label, shard_of
from shardps.server.checkpoint import latest
from shardps.server.errors import FailedPrecondition

Snapshot = tuple[dict[str, Any], dict[str, torch.Tensor]]  # RowTables.snapshot(): (meta, tensors)


#: Where a snapshot keeps a table's round in progress (RowTables.snapshot: ``rowsheld/{table}/keys``, ``/grads``).
HELD = "rowsheld"


def _rounds(m: dict[str, Any]) -> int:
    """A table's rounds in a snapshot's meta (a checkpoint of before the tables' policies: its bsp steps + 1)."""
    return int(m["rounds"]) if "rounds" in m else int(m.get("bsp_done", -1)) + 1


def old_snapshots(directory: str) -> list[Snapshot]:
    """The row tables of the newest checkpoint of every shard of the job checkpointed in ``directory``."""
    first = latest(directory, 0)
    if first is None:
        raise FailedPrecondition(f"no checkpoint of shard 0 under {directory}")
    out = []
    for i in range(int(first.meta["num_shards"])):
        c = first if i == 0 else latest(directory, i)
        if c is None:
            raise FailedPrecondition(f"no checkpoint of shard {i} of {first.meta['num_shards']} under {directory}")
        tensors = c.tensors()
        out.append((c.meta.get("rows") or {}, {k: v for k, v in tensors.items()
                                              if k.startswith(("rows/", f"{HELD}/"))}))
    return out


def reshard(snapshots: list[Snapshot], shard_index: int, num_shards: int) -> Snapshot:
    """The (meta, tensors) of shard ``shard_index`` of ``num_shards`` from the snapshots of every old shard."""
    names = sorted({n for meta, _ in snapshots for n in meta})
    meta_out: dict[str, Any] = {}
    tensors_out: dict[str, torch.Tensor] = {}
    for name in names:
        got = [(m[name], t) for m, t in snapshots if name in m]
        specs = {repr(m["spec"]) for m, _ in got}
        cuts = sorted({(m["steps"], _rounds(m), repr(m.get("mode")), repr((m.get("held") or {}).get("contributions")))
                       for m, _ in got})
        if len(got) != len(snapshots) or len(specs) != 1 or len(cuts) != 1:
            raise FailedPrecondition(f"row table {label(name)}: expected the same spec, step count, rounds and round "
                                     f"in progress on each of the {len(snapshots)} old shards, got (steps, rounds, "
                                     f"mode, held pushes) {cuts} on {len(got)} shards with {len(specs)} specs")
        keys = np.concatenate([t[f"rows/{name}/keys"].numpy().view(np.uint64) for _, t in got])
        mine = torch.from_numpy(np.flatnonzero(shard_of(keys, num_shards) == shard_index))
        for part in sorted({k.removeprefix(f"rows/{name}/") for _, t in got for k in t
                            if k.startswith(f"rows/{name}/")}):
            tensors_out[f"rows/{name}/{part}"] = torch.cat([t[f"rows/{name}/{part}"] for _, t in got])[mine]
        seen = [(int(k), int(c)) for m, _ in got for k, c in m["seen"]]
        seen_keys = np.array([k for k, _ in seen], dtype=np.uint64)
        held_seen = shard_of(seen_keys, num_shards) == shard_index if seen else np.zeros(0, dtype=bool)
        pushed: dict[int, int] = {}
        for m, _ in got:
            for w, st in m["pushed"]:
                pushed[int(w)] = min(int(st), pushed.get(int(w), int(st)))
        first = got[0][0]
        counts = {k: sum(m["counts"].get(k, 0) for m, _ in got) if shard_index == 0 else 0 for k in first["counts"]}
        meta_out[name] = {"spec": first["spec"], "steps": first["steps"], "rounds": _rounds(first),
                          "mode": first.get("mode") or ["", 0], "counts": counts,
                          "seen": [[k, c] for (k, c), h in zip(seen, held_seen, strict=True) if h],
                          "pushed": [[w, st] for w, st in sorted(pushed.items())]}
        if first.get("held") is not None:  # a round in progress: each old shard held its keys' part of its pushes
            keys = np.concatenate([t[f"{HELD}/{name}/keys"].numpy().view(np.uint64) for _, t in got])
            mine_held = torch.from_numpy(np.flatnonzero(shard_of(keys, num_shards) == shard_index))
            tensors_out[f"{HELD}/{name}/keys"] = torch.cat([t[f"{HELD}/{name}/keys"] for _, t in got])[mine_held]
            tensors_out[f"{HELD}/{name}/grads"] = torch.cat([t[f"{HELD}/{name}/grads"] for _, t in got])[mine_held]
            meta_out[name]["held"] = first["held"]
    return meta_out, tensors_out
