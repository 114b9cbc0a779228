"""Row tables on one shard: the rows its keys hash to, created on first touch (docs/sparse.md).

``RowTables`` is the store's part for row tables: register, pull and push,
each checked whole before anything changes (a refused request changes
nothing: no row created, no step counted). Each table is a ``RowTable``
(server/rows/table.py: its rows, first touch, admission, expiry, versions).

Sync per table push: asp (``num_workers`` <= 1) applies a push at once;
bsp holds step t's pushes until every one of its ``num_workers`` workers
that is not gone (evicted or left: the store's membership, as the dense
barriers follow leases) pushed it, then applies the mean of the pushes held
as one optimizer step and answers them all (a wait with a deadline that
names the workers it waited for); an eviction or a Leave wakes the waiters
and the step completes without the gone. A push is applied once: one of a
step at or below its worker's last applied (asp) or the table's last bsp
step is a retry, answered and counted, not applied. A step with an inf/nan
in some gradient (or ``found_inf``) is skipped, as a dense one: no row
changes and no optimizer step, counted (``skipped``).

Thread-safety: the store's lock (and condition), held over each whole
request but a bsp wait; changes are recorded for the shard's backup under
it (``--replicas 2``: the backup replays them, ``replay``), in order with
the dense ones.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from shardps.protos.rows import ROW_ITEMSIZE, RowTableSpec, label
from shardps.protos.stats import RowTableStats
from shardps.server.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound
from shardps.server.experts.heldgrads import Held
from shardps.server.optim import make_row_optimizer
from shardps.server.rows import reshard as rowreshard
from shardps.server.rows.index import DictIndex, KeyIndex
from shardps.server.rows.table import RowTable


def _coalesce(keys: np.ndarray, grads: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """Distinct keys and the sum of each key's gradient rows (as a sparse tensor's ``coalesce``)."""
    uniq, inverse = np.unique(keys, return_inverse=True)
    if len(uniq) == len(keys):
        return keys, grads
    summed = torch.zeros(len(uniq), grads.shape[1])
    summed.index_add_(0, torch.from_numpy(inverse.reshape(-1).astype(np.int64)), grads)
    return uniq, summed


#: ``record(args, tensors)``: a change the shard's backup must replay (``RowTables.replay``), called under the
#: lock (the store's recorder: server/replication/state.py).
Record = Callable[[dict[str, Any], dict[str, torch.Tensor]], None]


def _no_record(args: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    pass


class Pushed(NamedTuple):
    """A push's answer: distinct rows updated, the table's step count, whether the step was skipped."""

    rows: int
    steps: int
    skipped: bool


class RowTables:
    """The row tables of one shard. ``lock``: the condition it runs under (the store's; its own by default);
    ``record``: where its changes go for a backup."""

    def __init__(self, lock: threading.Condition | None = None, record: Record = _no_record,
                 recording: Callable[[], bool] = lambda: False, gone: Callable[[], set[int]] = set,
                 index: Callable[[], KeyIndex | DictIndex] = KeyIndex) -> None:
        """``gone``: the workers evicted or gone from the job (the store's membership; called under the lock):
        bsp steps complete without them. ``index``: each table's key -> slot index (server/rows/index.py)."""
        self.index = index
        self.lock = lock if lock is not None else threading.Condition(threading.Lock())
        self.gone = gone
        self.record = record
        self.recording = recording  # whether a backup takes the changes: only then are they copied for it
        self.tables: dict[str, RowTable] = {}
        self.held = Held()  # expert gradients of a step's backwards, held for its last (server/experts/heldgrads.py)

    def register(self, spec: RowTableSpec) -> int:
        """Declare a table (the same spec again: a no-op); its rows held here. FailedPrecondition for another
        spec under a name in use."""
        with self.lock:
            held = self.tables.get(spec.name)
            if held is not None:
                if held.spec != spec:
                    raise FailedPrecondition(f"row table {label(spec.name)}: registered as {held.spec}, now asked as "
                                             f"{spec}")
                return held.size
            try:
                opt = make_row_optimizer(spec.optimizer)
            except ValueError as e:
                raise InvalidArgument(f"row table {label(spec.name)}: {e}") from None
            self.tables[spec.name] = RowTable(spec, opt, index=self.index())
            self.record({"op": "register", "spec": spec.to_json()}, {})
            return 0

    def table(self, name: str, dim: int) -> RowTable:
        t = self.tables.get(name)
        if t is None:
            raise NotFound(f"row table {label(name)} is not registered on this shard (registered: "
                           f"{sorted(self.tables)[:20]})")
        if dim != t.spec.dim:
            raise InvalidArgument(f"row table {label(name)}: expected dim {t.spec.dim}, got {dim}")
        return t

    def pull(self, name: str, dim: int, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of distinct uint64 ``keys``, [len(keys), dim], created with their init where not held, and
        their versions; InvalidArgument for a key repeated (before anything changes)."""
        ordered = np.sort(keys)
        repeated = int(np.count_nonzero(ordered[1:] == ordered[:-1]))
        if repeated:
            raise InvalidArgument(f"row table {label(name)}: expected distinct keys in a PullRows, got {repeated} "
                                  "repeated")
        with self.lock:
            return self.table(name, dim).read(keys)

    def push(self, name: str, dim: int, keys: np.ndarray, grads: torch.Tensor, *, worker: int = 0, step: int = 0,
             num_workers: int = 1, timeout: float = 60.0, base: np.ndarray | None = None,
             found_inf: bool = False) -> Pushed:
        """One optimizer step of the table on the rows of ``keys`` (repeated keys' gradients summed first).
        Every push counts as a step, an empty one too; under bsp (``num_workers`` > 1) once per step, when
        every worker that is not gone pushed it (see the module). A step whose gradients hold an inf/nan
        (``found_inf``: on any shard, as the worker says) is skipped: no row changes, no optimizer step,
        counted (``skipped``), as a dense step with found_inf is."""
        if grads.shape != (len(keys), dim):
            raise InvalidArgument(f"row table {label(name)}: expected gradients of shape [{len(keys)}, {dim}] for "
                                  f"{len(keys)} keys, got {list(grads.shape)}")
        if base is not None and len(base) != len(keys):
            raise InvalidArgument(f"row table {label(name)}: expected {len(keys)} base versions, got {len(base)}")
        skip = found_inf or not bool(torch.isfinite(grads).all())
        with self.lock:
            t = self.table(name, dim)
            if num_workers > 1 and worker >= num_workers:
                raise InvalidArgument(f"row table {label(name)}: expected a worker id in [0, {num_workers}) for a bsp "
                                      f"push of {num_workers} workers, got {worker}")
            if step <= (t.pushed.get(worker, -1) if num_workers <= 1 else t.bsp_done):
                t.counts["duplicates"] += 1  # a retry of a push applied already: applied once, answered again
                return Pushed(0, t.steps, step in t.skipped_steps)
            gone = self.gone() & set(range(num_workers)) if num_workers > 1 else set()
            if worker in gone:
                raise FailedPrecondition(f"row table {label(name)}: worker {worker} is gone from the job (evicted or "
                                         f"left; bsp steps go on without it): register again to rejoin")
            if base is not None and not skip:  # before any change: under bsp, no step applies while this one is held
                t.observe_staleness(keys, base)
            if num_workers <= 1:
                t.pushed[worker] = step
                self._record_step(name, keys, grads, worker=worker, step=step, bsp=False, skip=skip)
                return self._apply(t, keys, grads, step, skip)
            t.held.setdefault(step, {})[worker] = (keys, grads, skip)
            done = self._complete(t, step, num_workers)
            if done is not None:
                return done
            self.lock.notify_all()  # a push held: whoever watches the barrier looks again
            complete = self.lock.wait_for(lambda: t.bsp_done >= step or step in self._ready(t, num_workers),
                                          timeout)
            if complete and t.bsp_done < step:  # the workers still missing are gone: this waiter applies it
                done = self._complete(t, step, num_workers)
                assert done is not None
                return done
            if not complete:
                missing = sorted(set(range(num_workers)) - set(t.held.get(step, {})) - self.gone())
                raise DeadlineExceeded(f"row table {label(name)}: bsp step {step} waited {timeout:.1f}s for workers "
                                       f"{missing} of {num_workers}")
            return Pushed(len(np.unique(keys)), t.steps, step in t.skipped_steps)

    def _ready(self, t: RowTable, num_workers: int) -> set[int]:
        """The bsp steps every worker not gone has pushed."""
        want = set(range(num_workers)) - self.gone()
        return {s for s, got in t.held.items() if want <= set(got)}

    def _complete(self, t: RowTable, step: int, num_workers: int) -> Pushed | None:
        """Apply bsp ``step`` if every worker not gone pushed it (the mean of the pushes held): its answer."""
        if step not in self._ready(t, num_workers):
            return None
        pushes = t.held.pop(step)
        got = [pushes[w] for w in sorted(pushes)]
        skip = any(s for _, _, s in got)
        keys = np.concatenate([k for k, _, _ in got])
        grads = torch.cat([g for _, g, _ in got]) / len(got)
        self._record_step(t.spec.name, keys, grads, worker=-1, step=step, bsp=True, skip=skip)
        done = self._apply(t, keys, grads, step, skip)
        t.bsp_done = step
        self.lock.notify_all()
        return done

    def _record_step(self, name: str, keys: np.ndarray, grads: torch.Tensor, *, worker: int, step: int,
                     bsp: bool, skip: bool) -> None:
        if not self.recording():
            return
        if skip:  # nothing of the gradients is applied: the backup needs the step alone
            keys, grads = keys[:0], grads[:0]
        self.record({"op": "step", "table": name, "worker": worker, "step": step, "bsp": bsp, "skip": skip},
                    {"keys": torch.from_numpy(keys.view(np.int64).copy()), "grads": grads.clone()})

    def hold(self, name: str, dim: int, worker: int, step: int, index: int, keys: np.ndarray,
             grads: torch.Tensor, versions: np.ndarray | None = None) -> None:
        """Hold expert gradients (rows of uint64 ``keys``, pulled at ``versions``: -1 not known) as hold
        ``index`` of ``worker``'s ``step`` for the step's last Backward or push (server/experts/heldgrads.py), recorded
        for the backup; a hold held already is not."""
        versions = np.full(len(keys), -1, dtype=np.int64) if versions is None else versions
        with self.lock:
            self.table(name, dim)
            if grads.shape != (len(keys), dim):
                raise InvalidArgument(f"row table {label(name)}: expected gradients of shape [{len(keys)}, {dim}] for "
                                      f"{len(keys)} keys, got {list(grads.shape)}")
            new = self.held.add(name, worker, step, index, keys, grads, versions)
            if new and self.recording():
                self.record({"op": "hold", "table": name, "worker": worker, "step": step, "index": index},
                            {"keys": torch.from_numpy(keys.view(np.int64).copy()), "grads": grads.clone(),
                             "versions": torch.from_numpy(versions.astype(np.int64))})

    def replay(self, args: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """A backup: apply a change its primary recorded (``record``), as the primary did."""
        with self.lock:
            if args["op"] == "hold":
                keys = tensors["keys"].numpy().view(np.uint64)
                versions = tensors["versions"].numpy() if "versions" in tensors else np.full(len(keys), -1)
                self.held.add(args["table"], args["worker"], args["step"], args["index"], keys, tensors["grads"],
                              versions.astype(np.int64))
                return
            if args["op"] == "register":
                spec = RowTableSpec.from_json(args["spec"])
                self.tables.setdefault(spec.name, RowTable(spec, make_row_optimizer(spec.optimizer),
                                                                 index=self.index()))
                return
            t = self.tables[args["table"]]
            keys = tensors["keys"].numpy().view(np.uint64)
            if args["op"] == "assign":
                new = np.flatnonzero(t.find(keys) < 0)
                t.create(keys[new], tensors["values"][torch.from_numpy(new)])
                return
            if args["bsp"]:
                t.bsp_done = args["step"]
                t.held.pop(args["step"], None)
            else:
                t.pushed[args["worker"]] = args["step"]
            self._apply(t, keys, tensors["grads"], args["step"], bool(args.get("skip", False)))

    @staticmethod
    def _apply(t: RowTable, keys: np.ndarray, grads: torch.Tensor, step: int, skip: bool) -> Pushed:
        if skip:  # an inf/nan in some gradient of the step: no row changes, no optimizer step (as GradScaler)
            t.counts["skipped"] += 1
            t.skipped_steps.add(step)
            del_below = sorted(t.skipped_steps)[:-64]  # the newest are enough to answer retries
            t.skipped_steps.difference_update(del_below)
            return Pushed(0, t.steps, True)
        uniq, summed = t.admit(*_coalesce(keys, grads))
        slots = t.slots_of(uniq)
        t.steps += 1
        t.optimizer.step(t.weights, t.state, slots, summed, t.steps)
        t.last[slots] = t.steps
        t.updates[slots] += 1
        t.expire()
        return Pushed(len(uniq), t.steps, False)

    def assign(self, name: str, dim: int, keys: np.ndarray, values: torch.Tensor) -> int:
        """Create the rows of distinct ``keys`` not held yet with ``values`` (their first values; rows held
        keep theirs): the rows created."""
        if values.shape != (len(keys), dim) or not bool(torch.isfinite(values).all()):
            raise InvalidArgument(f"row table {label(name)}: expected {len(keys)} finite rows of dim {dim}, got "
                                  f"{list(values.shape)}")
        if len(np.unique(keys)) != len(keys):
            raise InvalidArgument(f"row table {label(name)}: expected distinct keys to assign, got "
                                  f"{len(keys) - len(np.unique(keys))} repeated")
        with self.lock:
            t = self.table(name, dim)
            new = np.flatnonzero(t.find(keys) < 0)
            if self.recording():
                self.record({"op": "assign", "table": name}, {"keys": torch.from_numpy(keys.view(np.int64).copy()),
                                                              "values": values.clone()})
            t.create(keys[new], values[torch.from_numpy(new)])
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
            t = RowTable(spec, make_row_optimizer(spec.optimizer), index=self.index(), steps=m["steps"],
                         bsp_done=m["bsp_done"],
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

    def restore_resharded(self, directory: str, shard_index: int, num_shards: int) -> None:
        """Replace every table with the rows shard ``shard_index`` of ``num_shards`` holds of the tables
        checkpointed in ``directory`` by a job of any number of shards (server/rows/reshard.py)."""
        self.restore(*rowreshard.reshard(rowreshard.old_snapshots(directory), shard_index, num_shards))

    def staleness(self) -> Counter[int]:
        """Row staleness over every table: {steps that updated a row between its pull and its push: rows}."""
        with self.lock:
            return sum((t.staleness for t in self.tables.values()), Counter())

    def stats(self) -> dict[str, dict[str, int]]:
        """Per table: rows held, weight, state and index bytes, steps, counts."""
        with self.lock:
            return self.stats_locked()

    def stats_locked(self) -> dict[str, dict[str, int]]:
        """``stats`` with the lock held."""
        return {n: {"rows": t.size, "weight_bytes": t.size * t.spec.dim * ROW_ITEMSIZE,
                    "state_bytes": t.state_bytes(), "index_bytes": t.index_bytes(), "steps": t.steps,
                    "pending_admission": len(t.seen), **t.counts} for n, t in self.tables.items()}

    def table_stats(self) -> list[RowTableStats]:
        """Every table's figures for Stats, by name; called with the lock held (the store's stats)."""
        st = self.stats_locked()
        return [RowTableStats(self.tables[n].spec.to_proto(), st[n], dict(self.tables[n].staleness))
                for n in sorted(self.tables)]
