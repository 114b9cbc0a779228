"""Expert gradients a step's backwards leave on a shard until the step's last ``Backward`` pushes them.

``ExpertCall.hold`` (a pipeline stage's micro-batches under MoE placement
"send", experts.proto): each ``Backward`` of a step but its last keeps its
experts' gradients here, per (table, worker), and the step's last one (with
or without tokens) pushes them summed with its own. One step at a time: a
hold of a newer step drops an older step's (that step was abandoned: its
worker went on), and a ``Backward`` of another step than the one held
pushes its own gradients alone. Each hold names its index in the step
(``ExpertCall.hold_index``): one held already (a retry whose answer was
lost, or one sent again to the backup that took over) is not held twice.

Once a ``Backward`` with hold is answered its worker goes on, so what is
held must outlive its shard's primary: ``RowTables`` (server/rows/tables.py) owns
a ``Held``, records every hold for the backup (--replicas 2) and replays it
there. The push that consumes them is recorded as any row push; the backup
keeps its copy until a newer hold replaces it, and a retry of that push on
a promoted backup is a duplicate (applied once). A backup that joins later
gets them in the snapshot that syncs it (``state`` / ``load``; not in
checkpoints: a step redone after a rollback holds its gradients anew). The
Ray expert actors (deploy/ray/experts.py) hold nothing themselves: they send
each hold to their shard (``PushRows`` with ``hold``), which keeps it here.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

# (step, the hold indexes taken, keys, gradients, versions)
Entry = tuple[int, set[int], list[np.ndarray], list[torch.Tensor], list[np.ndarray]]


class Held:
    """What a (table, worker)'s step has held so far. Thread-safe (its own lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.data: dict[tuple[str, int], Entry] = {}

    def add(self, table: str, worker: int, step: int, index: int, keys: np.ndarray, grads: torch.Tensor,
            versions: np.ndarray) -> bool:
        """Hold ``grads`` (rows of uint64 ``keys``, read at ``versions``) as hold ``index`` of (``table``,
        ``worker``, ``step``); an older step's are dropped. False: that hold is held already (a retry)."""
        with self.lock:
            cur = self.data.get((table, worker))
            if cur is None or cur[0] != step:
                cur = self.data[(table, worker)] = (step, set(), [], [], [])
            if index in cur[1]:
                return False
            cur[1].add(index)
            cur[2].append(keys.copy())
            cur[3].append(grads)
            cur[4].append(versions)
            return True

    def holds(self, table: str, worker: int, step: int) -> bool:
        """Whether anything is held for (``table``, ``worker``, ``step``)."""
        with self.lock:
            cur = self.data.get((table, worker))
            return cur is not None and cur[0] == step

    def with_held(self, table: str, worker: int, step: int, keys: np.ndarray, grads: torch.Tensor,
                  versions: np.ndarray) -> tuple[np.ndarray, torch.Tensor, np.ndarray]:
        """``keys``, ``grads`` and ``versions`` with those held for (table, worker, step) before them (repeated
        keys: the push sums them). Nothing is forgotten: ``drop`` once the push went through."""
        with self.lock:
            cur = self.data.get((table, worker))
        if cur is None or cur[0] != step:
            return keys.copy(), grads, versions
        return (np.concatenate([*cur[2], keys]), torch.cat([*cur[3], grads]), np.concatenate([*cur[4], versions]))

    def drop(self, table: str, worker: int, step: int) -> None:
        """Forget what (table, worker) held for ``step`` (its push went through)."""
        with self.lock:
            cur = self.data.get((table, worker))
            if cur is not None and cur[0] == step:
                del self.data[(table, worker)]

    def state(self) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
        """What is held, for the snapshot that syncs a backup: (JSON-able meta, tensors ``rowholds/{j}/{i}/...``:
        keys (uint64 bits as int64), gradients and versions of hold ``i`` of entry ``j``)."""
        meta: list[dict[str, Any]] = []
        tensors: dict[str, torch.Tensor] = {}
        with self.lock:
            for j, ((table, worker), (step, indexes, keys, grads, versions)) in enumerate(self.data.items()):
                meta.append({"table": table, "worker": worker, "step": step, "indexes": sorted(indexes),
                             "holds": len(keys)})
                for i, (k, g, v) in enumerate(zip(keys, grads, versions)):
                    tensors[f"rowholds/{j}/{i}/keys"] = torch.from_numpy(k.view(np.int64).copy())
                    tensors[f"rowholds/{j}/{i}/grads"] = g.clone()
                    tensors[f"rowholds/{j}/{i}/versions"] = torch.from_numpy(np.asarray(v, dtype=np.int64).copy())
        return meta, tensors

    def load(self, meta: list[dict[str, Any]], tensors: dict[str, torch.Tensor]) -> None:
        """Replace what is held with a snapshot's (``state``)."""
        data: dict[tuple[str, int], Entry] = {}
        for j, m in enumerate(meta):
            n = range(m["holds"])
            data[(m["table"], int(m["worker"]))] = (
                int(m["step"]), {int(i) for i in m["indexes"]},
                [tensors[f"rowholds/{j}/{i}/keys"].numpy().view(np.uint64).copy() for i in n],
                [tensors[f"rowholds/{j}/{i}/grads"].clone() for i in n],
                [tensors[f"rowholds/{j}/{i}/versions"].numpy().copy() for i in n])
        with self.lock:
            self.data = data
