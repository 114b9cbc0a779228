"""Row tables on one shard: the rows its keys hash to, created on first touch (docs/sparse.md).

``RowTables`` is the store's part for row tables: register, pull and push,
each checked whole before anything changes (a refused request changes
nothing: no row created, no step counted). A table keeps its rows in one
fp32 tensor ``[capacity, dim]`` that doubles when full, a dict from key to
row slot, and its optimizer's state beside the rows (server/optim/rowbase.py).

Sync per table push: asp (``num_workers`` <= 1) applies a push at once;
bsp holds step t's pushes until ``num_workers`` workers pushed it, then
applies the mean of their gradients as one optimizer step and answers them
all (a wait with a deadline that names the workers it waited for). A push
is applied once: one of a step at or below its worker's last applied (asp)
or the table's last bsp step is a retry, answered and counted, not applied.

Thread-safety: the store's lock (and condition), held over each whole
request but a bsp wait; changes are recorded for the shard's backup under
it (``--replicas 2``: the backup replays them, ``replay``), in order with
the dense ones.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from shardps.protos.rows import ROW_ITEMSIZE, RowTableSpec, init_rows
from shardps.server.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound
from shardps.server.optim import RowOptimizer, make_row_optimizer

INITIAL_CAPACITY = 1024


@dataclass
class RowTable:
    """One table's rows on this shard.

    Admission (``spec.admit`` > 1): a key not held is counted in ``seen`` at each push that carries it;
    its gradients are dropped (``dropped``) until the push that makes the count ``admit``, which creates
    the row and applies that push (``admitted``); a pull of it reads its init and stores nothing.
    Expiry (``spec.expire`` > 0): after each step, rows not pushed for more than ``expire`` of the table's
    steps are dropped (``expired``); touched again, they start from their init.
    """

    spec: RowTableSpec
    optimizer: RowOptimizer
    weights: torch.Tensor = field(init=False)
    state: dict[str, torch.Tensor] = field(init=False)
    slots: dict[int, int] = field(default_factory=dict)  # key (uint64 as int) -> row of ``weights``
    steps: int = 0  # pushes applied (the optimizer's step count: one per push, touched or not)
    held: dict[int, dict[int, tuple[np.ndarray, torch.Tensor]]] = field(default_factory=dict)  # bsp: step -> pushes
    bsp_done: int = -1  # the last bsp step applied
    seen: dict[int, int] = field(default_factory=dict)  # admission: pushes that carried each key not held
    counts: dict[str, int] = field(default_factory=lambda: {"admitted": 0, "dropped": 0, "expired": 0,
                                                            "duplicates": 0})
    pushed: dict[int, int] = field(default_factory=dict)  # asp: worker -> the last step of its applied

    def __post_init__(self) -> None:
        self.weights = torch.empty(0, self.spec.dim)
        self.state = {k: torch.zeros(0, *shape) for k, shape in self.optimizer.state_shapes(self.spec.dim).items()}
        self.last = torch.zeros(0, dtype=torch.int64)  # per slot: the table step that last pushed (or made) it
        self.updates = torch.zeros(0, dtype=torch.int64)  # per slot: the row's version (optimizer steps on it)
        self.staleness: Counter[int] = Counter()  # per pushed row: steps that updated it since the worker's pull
        self.keys = np.zeros(0, dtype=np.uint64)  # per slot: its key

    @property
    def size(self) -> int:
        return len(self.slots)

    def _grow(self, need: int) -> None:
        cap = len(self.weights)
        if need <= cap:
            return
        new_cap = max(INITIAL_CAPACITY, cap * 2, need)
        w = torch.zeros(new_cap, self.spec.dim)
        w[:cap] = self.weights
        self.weights = w
        for k, t in self.state.items():
            s = torch.zeros(new_cap, *t.shape[1:])
            s[:cap] = t
            self.state[k] = s
        self.last = torch.cat([self.last, torch.zeros(new_cap - cap, dtype=torch.int64)])
        self.updates = torch.cat([self.updates, torch.zeros(new_cap - cap, dtype=torch.int64)])
        self.keys = np.concatenate([self.keys, np.zeros(new_cap - cap, dtype=np.uint64)])

    def find(self, keys: np.ndarray) -> list[int]:
        """The slot of each uint64 key, -1 where not held."""
        found = self.slots
        return [found.get(k, -1) for k in keys.tolist()]

    def create(self, keys: np.ndarray, values: torch.Tensor | None = None) -> list[int]:
        """New rows for distinct uint64 ``keys`` not held (their init, or ``values``): their slots."""
        start, n = self.size, len(keys)
        self._grow(start + n)
        self.weights[start:start + n] = init_rows(self.spec, keys) if values is None else values
        self.last[start:start + n] = self.steps
        self.updates[start:start + n] = 0
        self.keys[start:start + n] = keys
        for j, k in enumerate(keys.tolist()):
            self.slots[k] = start + j
        return list(range(start, start + n))

    def slots_of(self, keys: np.ndarray) -> torch.Tensor:
        """The row slot of each (distinct) uint64 key, creating the rows not yet held with their init."""
        out = self.find(keys)
        new = [i for i, s in enumerate(out) if s < 0]
        if new:
            for i, slot in zip(new, self.create(keys[new]), strict=True):
                out[i] = slot
        return torch.tensor(out, dtype=torch.int64)

    def read(self, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of distinct uint64 ``keys`` and their versions: created where not held, or (admission)
        their init, unstored (version 0)."""
        if self.spec.admit <= 1:
            slots = self.slots_of(keys)  # first: it may grow ``weights``
            return self.weights[slots], self.updates[slots]
        out = self.find(keys)
        held = [i for i, s in enumerate(out) if s >= 0]
        rows, versions = init_rows(self.spec, keys), torch.zeros(len(keys), dtype=torch.int64)
        if held:
            at, slots = torch.tensor(held), torch.tensor([out[i] for i in held])
            rows[at], versions[at] = self.weights[slots], self.updates[slots]
        return rows, versions

    def observe_staleness(self, keys: np.ndarray, base: np.ndarray) -> None:
        """Count, for each key pushed with a known base version (>= 0) whose row is held, the steps that
        updated its row since."""
        known = np.flatnonzero(base >= 0)
        if not len(known):
            return
        out = self.find(keys[known])
        held = [i for i, s in enumerate(out) if s >= 0]
        if held:
            now = self.updates[torch.tensor([out[i] for i in held])].numpy()
            self.staleness.update((now - base[known[held]]).clip(min=0).tolist())

    def admit(self, keys: np.ndarray, grads: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
        """The keys (and their gradient rows) a push may step: held, or admitted by this push."""
        if self.spec.admit <= 1:
            return keys, grads
        out = self.find(keys)
        keep = []
        for i, k in enumerate(keys.tolist()):
            if out[i] >= 0:
                keep.append(i)
                continue
            n = self.seen.get(k, 0) + 1
            if n >= self.spec.admit:
                self.seen.pop(k, None)
                self.counts["admitted"] += 1
                keep.append(i)
            else:
                self.seen[k] = n
                self.counts["dropped"] += 1
        return keys[keep], grads[keep]

    def expire(self) -> None:
        """Drop the rows not pushed for more than ``spec.expire`` steps (swap-remove: rows from the end fill
        the holes)."""
        if self.spec.expire <= 0 or not self.size:
            return
        n = self.size
        gone = torch.nonzero(self.last[:n] < self.steps - self.spec.expire).flatten()
        if not len(gone):
            return
        keep_n = n - len(gone)
        holes = gone[gone < keep_n]
        removed = set(gone.tolist())
        movers = torch.tensor([s for s in range(keep_n, n) if s not in removed], dtype=torch.int64)
        for k in self.keys[gone.numpy()].tolist():
            del self.slots[k]
        if len(holes):
            self.weights[holes] = self.weights[movers]
            for st in self.state.values():
                st[holes] = st[movers]
            self.last[holes] = self.last[movers]
            self.updates[holes] = self.updates[movers]
            self.keys[holes.numpy()] = self.keys[movers.numpy()]
            for h, k in zip(holes.tolist(), self.keys[holes.numpy()].tolist(), strict=True):
                self.slots[k] = h
        for st in self.state.values():  # a slot used again starts with zero state
            st[keep_n:n] = 0
        self.counts["expired"] += len(gone)

    def state_bytes(self) -> int:
        return sum(t[: self.size].numel() * t.element_size() for t in self.state.values())


def _coalesce(keys: np.ndarray, grads: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """Distinct keys and the sum of each key's gradient rows (as a sparse tensor's ``coalesce``)."""
    uniq, inverse = np.unique(keys, return_inverse=True)
    if len(uniq) == len(keys):
        return keys, grads
    summed = torch.zeros(len(uniq), grads.shape[1])
    summed.index_add_(0, torch.from_numpy(inverse.reshape(-1).astype(np.int64)), grads)
    return uniq, summed


#: ``record(args, tensors)``: a change the shard's backup must replay (``RowTables.replay``), called under the
#: lock (the store's recorder: server/replica.py).
Record = Callable[[dict[str, Any], dict[str, torch.Tensor]], None]


def _no_record(args: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    pass


class RowTables:
    """The row tables of one shard. ``lock``: the condition it runs under (the store's; its own by default);
    ``record``: where its changes go for a backup."""

    def __init__(self, lock: threading.Condition | None = None, record: Record = _no_record,
                 recording: Callable[[], bool] = lambda: False) -> None:
        self.lock = lock if lock is not None else threading.Condition(threading.Lock())
        self.record = record
        self.recording = recording  # whether a backup takes the changes: only then are they copied for it
        self.tables: dict[str, RowTable] = {}

    def register(self, spec: RowTableSpec) -> int:
        """Declare a table (the same spec again: a no-op); its rows held here. FailedPrecondition for another
        spec under a name in use."""
        with self.lock:
            held = self.tables.get(spec.name)
            if held is not None:
                if held.spec != spec:
                    raise FailedPrecondition(f"row table {spec.name!r}: registered as {held.spec}, now asked as "
                                             f"{spec}")
                return held.size
            try:
                opt = make_row_optimizer(spec.optimizer)
            except ValueError as e:
                raise InvalidArgument(f"row table {spec.name!r}: {e}") from None
            self.tables[spec.name] = RowTable(spec, opt)
            self.record({"op": "register", "spec": spec.to_json()}, {})
            return 0

    def table(self, name: str, dim: int) -> RowTable:
        t = self.tables.get(name)
        if t is None:
            raise NotFound(f"row table {name!r} is not registered on this shard (registered: "
                           f"{sorted(self.tables)[:20]})")
        if dim != t.spec.dim:
            raise InvalidArgument(f"row table {name!r}: expected dim {t.spec.dim}, got {dim}")
        return t

    def pull(self, name: str, dim: int, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of distinct uint64 ``keys``, [len(keys), dim], created with their init where not held, and
        their versions."""
        with self.lock:
            return self.table(name, dim).read(keys)

    def push(self, name: str, dim: int, keys: np.ndarray, grads: torch.Tensor, *, worker: int = 0, step: int = 0,
             num_workers: int = 1, timeout: float = 60.0, base: np.ndarray | None = None) -> tuple[int, int]:
        """One optimizer step of the table on the rows of ``keys`` (repeated keys' gradients summed first):
        (distinct rows updated, the table's step count). Every push counts as a step, an empty one too;
        under bsp (``num_workers`` > 1) once per step, when every worker pushed it (see the module)."""
        if grads.shape != (len(keys), dim):
            raise InvalidArgument(f"row table {name!r}: expected gradients of shape [{len(keys)}, {dim}] for "
                                  f"{len(keys)} keys, got {list(grads.shape)}")
        if not bool(torch.isfinite(grads).all()):
            raise InvalidArgument(f"row table {name!r}: the gradients hold inf or nan")
        with self.lock:
            t = self.table(name, dim)
            if step <= (t.pushed.get(worker, -1) if num_workers <= 1 else t.bsp_done):
                t.counts["duplicates"] += 1  # a retry of a push applied already: applied once, answered again
                return 0, t.steps
            if base is not None:  # before any change: under bsp, no step applies while this one is held
                t.observe_staleness(keys, base)
            if num_workers <= 1:
                t.pushed[worker] = step
                self._record_step(name, keys, grads, worker=worker, step=step, bsp=False)
                return self._apply(t, keys, grads)
            pushes = t.held.setdefault(step, {})
            pushes[worker] = (keys, grads)
            if len(pushes) >= num_workers:
                del t.held[step]
                got = [pushes[w] for w in sorted(pushes)]
                keys, grads = np.concatenate([k for k, _ in got]), torch.cat([g for _, g in got]) / num_workers
                self._record_step(name, keys, grads, worker=worker, step=step, bsp=True)
                rows = self._apply(t, keys, grads)
                t.bsp_done = step
                self.lock.notify_all()
                return rows
            if not self.lock.wait_for(lambda: t.bsp_done >= step, timeout):
                missing = sorted(set(range(num_workers)) - set(t.held.get(step, {})))
                raise DeadlineExceeded(f"row table {name!r}: bsp step {step} waited {timeout:.1f}s for workers "
                                       f"{missing} of {num_workers}")
            return len(np.unique(keys)), t.steps

    def _record_step(self, name: str, keys: np.ndarray, grads: torch.Tensor, *, worker: int, step: int,
                     bsp: bool) -> None:
        if not self.recording():
            return
        self.record({"op": "step", "table": name, "worker": worker, "step": step, "bsp": bsp},
                    {"keys": torch.from_numpy(keys.view(np.int64).copy()), "grads": grads.clone()})

    def replay(self, args: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """A backup: apply a change its primary recorded (``record``), as the primary did."""
        with self.lock:
            if args["op"] == "register":
                spec = RowTableSpec.from_json(args["spec"])
                self.tables.setdefault(spec.name, RowTable(spec, make_row_optimizer(spec.optimizer)))
                return
            t = self.tables[args["table"]]
            keys = tensors["keys"].numpy().view(np.uint64)
            if args["op"] == "assign":
                new = [i for i, s in enumerate(t.find(keys)) if s < 0]
                t.create(keys[new], tensors["values"][new])
                return
            if args["bsp"]:
                t.bsp_done = args["step"]
            else:
                t.pushed[args["worker"]] = args["step"]
            self._apply(t, keys, tensors["grads"])

    @staticmethod
    def _apply(t: RowTable, keys: np.ndarray, grads: torch.Tensor) -> tuple[int, int]:
        uniq, summed = t.admit(*_coalesce(keys, grads))
        slots = t.slots_of(uniq)
        t.steps += 1
        t.optimizer.step(t.weights, t.state, slots, summed, t.steps)
        t.last[slots] = t.steps
        t.updates[slots] += 1
        t.expire()
        return len(uniq), t.steps

    def assign(self, name: str, dim: int, keys: np.ndarray, values: torch.Tensor) -> int:
        """Create the rows of distinct ``keys`` not held yet with ``values`` (their first values; rows held
        keep theirs): the rows created."""
        if values.shape != (len(keys), dim) or not bool(torch.isfinite(values).all()):
            raise InvalidArgument(f"row table {name!r}: expected {len(keys)} finite rows of dim {dim}, got "
                                  f"{list(values.shape)}")
        with self.lock:
            t = self.table(name, dim)
            new = [i for i, s in enumerate(t.find(keys)) if s < 0]
            if self.recording():
                self.record({"op": "assign", "table": name}, {"keys": torch.from_numpy(keys.view(np.int64).copy()),
                                                              "values": values.clone()})
            t.create(keys[new], values[new])
            return len(new)

    def snapshot(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Every table as (JSON-able meta, tensors: ``rows/{name}/keys`` (uint64 bits as int64),
        ``rows/{name}/weight``, ``rows/{name}/state/{key}``), copies: what a checkpoint holds of them."""
        with self.lock:
            return self.snapshot_locked()

    def snapshot_locked(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """``snapshot`` with the lock held (the store's snapshot, under its lock)."""
        meta: dict[str, Any] = {}
        tensors: dict[str, torch.Tensor] = {}
        for name, t in self.tables.items():
            n = t.size
            meta[name] = {"spec": t.spec.to_json(), "steps": t.steps, "bsp_done": t.bsp_done,
                          "counts": dict(t.counts), "seen": [[k, c] for k, c in t.seen.items()],
                          "pushed": [[w, st] for w, st in t.pushed.items()]}
            tensors[f"rows/{name}/keys"] = torch.from_numpy(t.keys[:n].view(np.int64).copy())
            tensors[f"rows/{name}/last"] = t.last[:n].clone()
            tensors[f"rows/{name}/updates"] = t.updates[:n].clone()
            tensors[f"rows/{name}/weight"] = t.weights[:n].clone()
            for k, st in t.state.items():
                tensors[f"rows/{name}/state/{k}"] = st[:n].clone()
        return meta, tensors

    def restore(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Replace every table with a snapshot's (``snapshot``); a snapshot of no tables empties them."""
        tables: dict[str, RowTable] = {}
        for name, m in meta.items():
            spec = RowTableSpec.from_json(m["spec"])
            t = RowTable(spec, make_row_optimizer(spec.optimizer), steps=m["steps"], bsp_done=m["bsp_done"],
                         seen={int(k): int(c) for k, c in m["seen"]}, counts=dict(m["counts"]),
                         pushed={int(w): int(st) for w, st in m["pushed"]})
            keys = tensors[f"rows/{name}/keys"].numpy().view(np.uint64)
            t.create(keys, tensors[f"rows/{name}/weight"])
            t.last[: len(keys)] = tensors[f"rows/{name}/last"]
            t.updates[: len(keys)] = tensors[f"rows/{name}/updates"]
            for k in t.state:
                t.state[k][: len(keys)] = tensors[f"rows/{name}/state/{k}"]
            tables[name] = t
        with self.lock:
            self.tables = tables
            self.lock.notify_all()

    def staleness(self) -> Counter[int]:
        """Row staleness over every table: {steps that updated a row between its pull and its push: rows}."""
        with self.lock:
            return sum((t.staleness for t in self.tables.values()), Counter())

    def stats(self) -> dict[str, dict[str, int]]:
        """Per table: rows held, weight and state bytes, steps."""
        with self.lock:
            return {n: {"rows": t.size, "weight_bytes": t.size * t.spec.dim * ROW_ITEMSIZE,
                        "state_bytes": t.state_bytes(), "steps": t.steps, "pending_admission": len(t.seen),
                        **t.counts} for n, t in self.tables.items()}
