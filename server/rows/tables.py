"""Row tables on one shard: the rows its keys hash to, created on first touch (docs/sparse.md).

``RowTables`` is the store's part for row tables: register, pull and push,
each checked whole before anything changes (a refused request changes
nothing: no row created, no step counted). Each table is a ``RowTable``
(server/rows/table.py: its rows, first touch, admission, expiry, versions).

Sync: one model for rows and dense tensors (docs/sync.md). Each table has
the ``SyncPolicy`` of the mode its pushes name (``sync``: the job's mode as
the worker knows it, over the table's ``num_workers`` workers):
``BarrierPolicy`` for bsp and every:X (a round applies the mean of every
worker's push once every worker not gone, as the store's membership says,
pushed one; its gradients are ``RowGrad`` s, summed by concatenation),
``AsyncPolicy`` for asp and ssp:S (applied on arrival). Another mode or
worker count in a push (a live switch) applies what the old policy held
first. A push is taken in and answered at once with ``ready``, the table's
rounds once it is applied; the wait is at the worker's next call on the
table: a pull carries ``min_round`` (and, under ssp, ``min_clock``: every
worker has pushed that many steps), a push on a shard the worker did not
pull from since carries ``min_round`` too, and under ssp:S a push of step t
waits until every worker pushed t - S. A retry (a step at or below its
worker's last taken in) is answered again and counted, not taken in twice.
A step with an inf/nan in some gradient (or ``found_inf``) is skipped, as a
dense one: no row changes and no optimizer step, counted (``skipped``).
Waits end early when the shard awaits a rollback or closes (``halted``).

Thread-safety: the store's lock (and condition), held over each whole
request but its waits; the pushes taken in are recorded for the shard's
backup under it (``--replicas 2``: the backup takes them in through the
same policy, ``replay``), in order with the dense changes; a round in
progress is in the snapshot (``rowsheld/{table}/``).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import numpy as np
import torch

from shardps.protos.rows import ROW_ITEMSIZE, RowTableSpec, label
from shardps.protos.stats import RowTableStats
from shardps.protos.syncspec import SyncSpec
from shardps.server.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound, StoreError
from shardps.server.experts.heldgrads import Held
from shardps.server.optim import make_row_optimizer
from shardps.server.rows import reshard as rowreshard
from shardps.server.rows.index import DictIndex, KeyIndex
from shardps.server.rows.reshard import HELD
from shardps.server.rows.table import RowTable
from shardps.server.sync import Contribution, Grads, HeldState, Received, RowGrad, Update, make_policy

#: The one "part" of a table's gradient a sync policy holds (a barrier sums per part).
ROWS = ("rows", 0)


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
    """A push's answer: its distinct rows, the table's step count, whether its step was skipped (when applied
    at once), and the rounds the table will have applied once it is (``ready``: a pull's ``min_round``)."""

    rows: int
    steps: int
    skipped: bool
    ready: int = 0


class RowTables:
    """The row tables of one shard. ``lock``: the condition it runs under (the store's; its own by default);
    ``record``: where its changes go for a backup."""

    def __init__(self, lock: threading.Condition | None = None, record: Record = _no_record,
                 recording: Callable[[], bool] = lambda: False, gone: Callable[[], set[int]] = set,
                 index: Callable[[], KeyIndex | DictIndex] = KeyIndex,
                 halted: Callable[[], bool] = lambda: False,
                 check_epoch: Callable[[int], None] = lambda epoch: None) -> None:
        """``gone``: the workers evicted or gone from the job (the store's membership; called under the lock):
        bsp steps complete without them. ``index``: each table's key -> slot index (server/rows/index.py).
        ``check_epoch(epoch)``: ABORTED unless the job is in the rollback epoch a change was computed in; a
        change that names its epoch is checked under the lock, where a rollback's restore and its new epoch
        happen together (the store's ``restore``), so none of an epoch before reaches a table after it."""
        self.index = index
        self.lock = lock if lock is not None else threading.Condition(threading.Lock())
        self.gone = gone
        self.record = record
        self.recording = recording  # whether a backup takes the changes: only then are they copied for it
        # Whether the shard awaits a rollback (restarted from its checkpoint) or is closing: a wait for a round or
        # the ssp clock ends at once (the worker's next dense call is refused and it rolls back).
        self.halted = halted
        self.check_epoch = check_epoch
        self.tables: dict[str, RowTable] = {}
        self.waiting = 0  # pulls and pushes waiting now for a round or the ssp clock
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

    def pull(self, name: str, dim: int, keys: np.ndarray, *, min_round: int = 0, min_clock: int = 0,
             timeout: float = 60.0, epoch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of distinct uint64 ``keys``, [len(keys), dim], created with their init where not held, and
        their versions; InvalidArgument for a key repeated (before anything changes). First waits (at most
        ``timeout``) until the table applied ``min_round`` rounds (the worker's own push is in) and every worker
        of the table pushed ``min_clock`` steps (ssp); DeadlineExceeded names what it still waits for.
        ``epoch``: the worker's rollback epoch (``check_epoch``, before and after the wait): a rollback while
        it waits ends the wait, ABORTED (the rounds it waits for will not come; the tables were restored)."""
        ordered = np.sort(keys)
        repeated = int(np.count_nonzero(ordered[1:] == ordered[:-1]))
        if repeated:
            raise InvalidArgument(f"row table {label(name)}: expected distinct keys in a PullRows, got {repeated} "
                                  "repeated")
        with self.lock:
            if epoch is not None:
                self.check_epoch(epoch)
            t = self.table(name, dim)
            self._wait(t, min_round, min_clock, timeout, epoch=epoch)
            if epoch is not None:  # the lock was let go while it waited: a rollback may have come
                self.check_epoch(epoch)
            return t.read(keys)

    def push(self, name: str, dim: int, keys: np.ndarray, grads: torch.Tensor, *, worker: int = 0, step: int = 0,
             num_workers: int = 1, sync: str = "", min_round: int = 0, timeout: float = 60.0,
             base: np.ndarray | None = None, found_inf: bool = False, epoch: int | None = None) -> Pushed:
        """Take in worker ``worker``'s push of ``step`` (repeated keys' gradients summed when applied) under the
        sync mode ``sync`` over ``num_workers`` workers (see the module); its answer says the rounds that apply
        it (``ready``). Waits first (at most ``timeout``) for the worker's previous round (``min_round``) and,
        under ssp:S, until every worker pushed ``step - S``. Every push counts, an empty one too. A step whose
        gradients hold an inf/nan (``found_inf``: on any shard, as the worker says) is skipped: no row changes,
        no optimizer step, counted (``skipped``), as a dense step with found_inf is. ``epoch``: the rollback
        epoch it was computed in (``check_epoch``, before and after any wait)."""
        if grads.shape != (len(keys), dim):
            raise InvalidArgument(f"row table {label(name)}: expected gradients of shape [{len(keys)}, {dim}] for "
                                  f"{len(keys)} keys, got {list(grads.shape)}")
        if base is not None and len(base) != len(keys):
            raise InvalidArgument(f"row table {label(name)}: expected {len(keys)} base versions, got {len(base)}")
        spec = self._spec(name, sync, num_workers)
        n = max(1, num_workers)
        if n > 1 and worker >= n:
            raise InvalidArgument(f"row table {label(name)}: expected a worker id in [0, {n}) for a push of {n} "
                                  f"workers, got {worker}")
        skip = found_inf or not bool(torch.isfinite(grads).all())
        with self.lock:
            if epoch is not None:
                self.check_epoch(epoch)
            t = self.table(name, dim)
            if step > t.pushed.get(worker, -1):
                if spec.barrier and n > 1 and worker in self.gone():
                    raise FailedPrecondition(f"row table {label(name)}: worker {worker} is gone from the job "
                                             f"(evicted or left; barrier rounds go on without it): register again "
                                             f"to rejoin")
                self._wait(t, min_round, spec.min_clock(step) if spec.bounded else 0, timeout, n, str(spec),
                           epoch=epoch)
                if epoch is not None:  # the lock was let go while it waited: a rollback may have come
                    self.check_epoch(epoch)
            if step <= t.pushed.get(worker, -1):  # a retry of a push taken in already: taken in once, answered again
                t.counts["duplicates"] += 1
                return Pushed(0, t.steps, step in t.skipped_steps, self._ready(t, worker))
            if base is not None and not skip:
                t.observe_staleness(keys, base)
            if self.recording():  # the backup takes the push in through the same policy (``replay``)
                self.record({"op": "push", "table": name, "worker": worker, "step": step, "n": n,
                             "sync": str(spec), "skip": skip},
                            {"keys": torch.from_numpy(keys.view(np.int64).copy()), "grads": grads.clone()})
            skipped = self._take(t, spec, n, worker, step, keys, grads, skip)
            return Pushed(0 if skipped else len(np.unique(keys)), t.steps, skipped, self._ready(t, worker))

    @staticmethod
    def _spec(name: str, sync: str, num_workers: int) -> SyncSpec:
        """The mode a push names; "": bsp over more than one worker, else asp (a client that names none)."""
        if not sync:
            return SyncSpec("bsp") if num_workers > 1 else SyncSpec("asp")
        try:
            return SyncSpec.parse(sync)
        except ValueError as e:
            raise InvalidArgument(f"row table {label(name)}: {e}") from None

    def _expected(self, n: int) -> set[int]:
        """The workers of a table pushed by ``n`` that are not gone: a round needs each of them."""
        return set(range(n)) - self.gone()

    def _slowest(self, t: RowTable, n: int) -> int:
        """Under the lock: the least clock (steps taken in) of the table's workers not gone."""
        clocks = [t.pushed.get(w, -1) + 1 for w in self._expected(n)]
        return min(clocks) if clocks else 0

    def _wait(self, t: RowTable, min_round: int, min_clock: int, timeout: float, n: int | None = None,
              mode: str = "", epoch: int | None = None) -> None:
        """Under the lock: until ``t`` applied ``min_round`` rounds and its slowest worker has ``min_clock``
        (of ``n`` workers under ``mode``: the push's; a pull's, the table's). ``epoch``: the waiter's, ended by a
        rollback to another (the caller's ``check_epoch`` then says so)."""
        workers = n if n is not None else t.mode[1]

        def ready() -> bool:
            return t.rounds >= min_round and (min_clock <= 0 or self._slowest(t, workers) >= min_clock)

        def rolled_back() -> bool:
            if epoch is None:
                return False
            try:
                self.check_epoch(epoch)
            except StoreError:
                return True
            return False

        def done() -> bool:  # or the shard awaits a rollback: its tables are its checkpoint's, nothing owed comes
            return ready() or self.halted() or rolled_back()

        if ready():
            return
        self.waiting += 1
        self.lock.notify_all()  # whoever watches the waits (a test at an exact point) looks again
        try:
            ok = self.lock.wait_for(done, timeout)
        finally:
            self.waiting -= 1
        if not ok:
            name = label(t.spec.name)
            if t.rounds < min_round:
                waiting = t.policy.waiting_on() if t.policy is not None else ""
                raise DeadlineExceeded(f"row table {name}: waited {timeout:.1f}s for round {min_round} (at "
                                       f"{t.rounds}): {waiting}")
            behind = {w: t.pushed.get(w, -1) + 1 for w in sorted(self._expected(workers))
                      if t.pushed.get(w, -1) + 1 < min_clock}
            raise DeadlineExceeded(f"row table {name}: waited {timeout:.1f}s for every worker to reach clock "
                                   f"{min_clock} ({mode or t.mode[0]}); behind: {behind}")

    @staticmethod
    def _ready(t: RowTable, worker: int) -> int:
        """The rounds ``t`` will have applied once ``worker``'s newest push is."""
        return t.rounds + (1 if t.policy is not None and t.policy.holds(worker) else 0)

    def _take(self, t: RowTable, spec: SyncSpec, n: int, worker: int, step: int, keys: np.ndarray,
              grads: torch.Tensor, skip: bool) -> bool:
        """Under the lock: offer a push to the table's policy (one of ``spec`` over ``n`` workers: another mode
        or worker count applies what the old one held first) and apply what it hands over. Whether this push
        was skipped (an inf/nan), when applied now."""
        if t.mode != (str(spec), n) or t.policy is None:
            if t.policy is not None:
                self._apply_updates(t, t.policy.flush())
            t.policy = make_policy(spec, n)
            t.policy.track_live(self._expected(n))
            t.mode = (str(spec), n)
        t.pushed[worker] = step
        grad = RowGrad([keys], [grads])
        updates = t.policy.offer(Contribution(worker, step, 0, skip), cast(Received, {ROWS: grad}))
        return self._apply_updates(t, updates) and skip

    def _apply_updates(self, t: RowTable, updates: list[Update]) -> bool:
        """Under the lock: each update an optimizer step of the table (a barrier's its round, the mean of its
        pushes); True when one was applied. Wakes the waits."""
        for u in updates:
            grad = cast(RowGrad, u.grads[ROWS])
            keys, grads = grad.joined()
            skip = any(c.found_inf for c in u.contributions)  # each push's inf/nan check, made when taken in
            self._apply(t, keys, grads, max(c.step for c in u.contributions), skip)
            if t.policy is not None and t.policy.spec.barrier:
                t.rounds += 1
        if updates:
            self.lock.notify_all()
        return bool(updates)

    def live_changed(self) -> None:
        """Under the lock: the job's membership changed (an eviction, a leave, a rejoin): each barrier's round
        may be complete now, without the gone."""
        for t in self.tables.values():
            if t.policy is not None:
                self._apply_updates(t, t.policy.live_changed(self._expected(t.mode[1])))

    def hold(self, name: str, dim: int, worker: int, step: int, index: int, keys: np.ndarray,
             grads: torch.Tensor, versions: np.ndarray | None = None, epoch: int | None = None) -> None:
        """Hold expert gradients (rows of uint64 ``keys``, pulled at ``versions``: -1 not known) as hold
        ``index`` of ``worker``'s ``step`` for the step's last Backward or push (server/experts/heldgrads.py), recorded
        for the backup; a hold held already is not. ``epoch``: as ``push``'s."""
        versions = np.full(len(keys), -1, dtype=np.int64) if versions is None else versions
        with self.lock:
            if epoch is not None:
                self.check_epoch(epoch)
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
            self._take(t, SyncSpec.parse(args["sync"]), args["n"], args["worker"], args["step"], keys,
                       tensors["grads"], bool(args["skip"]))

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

    def assign(self, name: str, dim: int, keys: np.ndarray, values: torch.Tensor, epoch: int | None = None) -> int:
        """Create the rows of distinct ``keys`` not held yet with ``values`` (their first values; rows held
        keep theirs): the rows created. ``epoch``: as ``push``'s."""
        if values.shape != (len(keys), dim) or not bool(torch.isfinite(values).all()):
            raise InvalidArgument(f"row table {label(name)}: expected {len(keys)} finite rows of dim {dim}, got "
                                  f"{list(values.shape)}")
        if len(np.unique(keys)) != len(keys):
            raise InvalidArgument(f"row table {label(name)}: expected distinct keys to assign, got "
                                  f"{len(keys) - len(np.unique(keys))} repeated")
        with self.lock:
            if epoch is not None:
                self.check_epoch(epoch)
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
            meta[name] = {"spec": t.spec.to_json(), "steps": t.steps, "rounds": t.rounds,
                          "mode": [t.mode[0], t.mode[1]], "counts": dict(t.counts),
                          "seen": [[k, c] for k, c in t.seen.items()],
                          "pushed": [[w, st] for w, st in t.pushed.items()]}
            held = t.policy.held_state() if t.policy is not None else None
            if held is not None and held.contributions:  # a barrier's round in progress: its pushes so far
                keys, grads = cast(RowGrad, held.sums[ROWS]).joined()
                meta[name]["held"] = {"count": held.counts[ROWS], "rounds": held.rounds,
                                      "contributions": [[c.worker_id, c.step, c.found_inf, c.late]
                                                        for c in held.contributions]}
                tensors[f"{HELD}/{name}/keys"] = torch.from_numpy(keys.view(np.int64).copy())
                tensors[f"{HELD}/{name}/grads"] = grads.clone()
            tensors[f"rows/{name}/keys"] = torch.from_numpy(t.keys[:n].view(np.int64).copy())
            tensors[f"rows/{name}/last"] = t.last[:n].clone()
            tensors[f"rows/{name}/updates"] = t.updates[:n].clone()
            tensors[f"rows/{name}/weight"] = t.weights[:n].clone()
            for k, st in t.state.items():
                tensors[f"rows/{name}/state/{k}"] = st[:n].clone()
        return meta, tensors

    def restore(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Replace every table with a snapshot's (``snapshot``); a snapshot of no tables empties them."""
        tables = self.built(meta, tensors)
        with self.lock:
            self.install_locked(tables)

    def built(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, RowTable]:
        """The tables of a snapshot (``snapshot``), made outside the lock, for ``install_locked``."""
        tables: dict[str, RowTable] = {}
        for name, m in meta.items():
            spec = RowTableSpec.from_json(m["spec"])
            # (a checkpoint of before the tables' sync policies: its bsp steps, numbered from 0, were its rounds)
            rounds = m["rounds"] if "rounds" in m else m.get("bsp_done", -1) + 1
            t = RowTable(spec, make_row_optimizer(spec.optimizer), index=self.index(), steps=m["steps"],
                         rounds=rounds, seen={int(k): int(c) for k, c in m["seen"]}, counts=dict(m["counts"]),
                         pushed={int(w): int(st) for w, st in m["pushed"]})
            mode, n = m.get("mode") or ["", 0]
            if mode:
                t.policy, t.mode = make_policy(SyncSpec.parse(mode), n), (mode, n)
                held = m.get("held")
                if held is not None:
                    grad = RowGrad([tensors[f"{HELD}/{name}/keys"].numpy().view(np.uint64)],
                                   [tensors[f"{HELD}/{name}/grads"]])
                    t.policy.restore_held(HeldState(cast(Grads, {ROWS: grad}), {ROWS: held["count"]},
                                                    [Contribution(w, st, 0, bool(f), bool(late))
                                                     for w, st, f, late in held["contributions"]],
                                                    held["rounds"]))
            keys = tensors[f"rows/{name}/keys"].numpy().view(np.uint64)
            t.create(keys, tensors[f"rows/{name}/weight"])
            t.last[: len(keys)] = tensors[f"rows/{name}/last"]
            t.updates[: len(keys)] = tensors[f"rows/{name}/updates"]
            for k in t.state:
                t.state[k][: len(keys)] = tensors[f"rows/{name}/state/{k}"]
            tables[name] = t
        return tables

    def install_locked(self, tables: dict[str, RowTable]) -> None:
        """Under the lock: ``built``'s tables replace every table (the store's restore, in the same hold of
        the lock as the dense state and the rollback's epoch)."""
        for t in tables.values():
            if t.policy is not None:
                t.policy.track_live(self._expected(t.mode[1]))
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
