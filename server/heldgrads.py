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
held must outlive its shard's primary: ``RowTables`` (server/rows.py) owns
a ``Held``, records every hold for the backup (--replicas 2) and replays it
there. The push that consumes them is recorded as any row push; the backup
keeps its copy until a newer hold replaces it, and a retry of that push on
a promoted backup is a duplicate (applied once). The Ray expert actors
(deploy/ray/experts.py) keep their own, not replicated.
"""

from __future__ import annotations

import threading

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

    def take(self, table: str, worker: int, step: int, keys: np.ndarray, grads: torch.Tensor,
             versions: np.ndarray) -> tuple[np.ndarray, torch.Tensor, np.ndarray]:
        """``with_held`` and ``drop`` at once (an expert actor: its push is not retried from here)."""
        out = self.with_held(table, worker, step, keys, grads, versions)
        self.drop(table, worker, step)
        return out
