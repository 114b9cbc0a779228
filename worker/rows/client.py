"""A worker's calls on row tables (docs/sparse.md): register, pull and push rows by key.

``RowClient`` is ``PSClient.rows``. Keys come as an int64 (or uint64) tensor
of any shape, unsorted and repeated; the client sends each distinct key
once, to the shard its hash names (protos/rows.py), in messages of at most
``chunk_bytes``, to every shard in parallel (``Transport.each``: retried
while a shard is unavailable). A pull answers rows in the keys' shape,
``[*keys.shape, dim]``; a push sums the gradient rows of repeated keys
before sending (the shard sums again what it gets, so either side may).
Every push reaches every shard, an empty one too: a table's step count
(SparseAdam's bias correction) is the same on every shard.

Thread-safety: as the PSClient, one thread at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from shardps.protos import codec, framing
from shardps.protos.optim import SGD, OptimizerSpec
from shardps.protos.rows import RowTableSpec, as_u64, hash_key, label, rows_per_message, shard_of
from shardps.protos.shardps.v1 import ps_pb2
from shardps.protos.syncspec import SyncSpec
from shardps.worker.datapath.transport import Transport
from shardps.worker.errors import ShardError, Unreachable

# At most this many keys in one PullRows request (8 bytes each: well under gRPC's 4 MiB message limit).
MAX_PULL_KEYS = 1 << 18
MAX_TRACKED = 64  # pulls of a table whose versions are kept for its next push
T = TypeVar("T")


@dataclass(frozen=True)
class Split:
    """Distinct keys of a request split by shard: ``unique`` (sorted uint64), where each sits in the request
    (``where``: a position of it) and, where keys repeat, ``repeats``: for each key asked, its index among
    the distinct keys (None when every key asked is distinct: see ``inverse``)."""

    unique: np.ndarray  # distinct uint64 keys, sorted
    where: np.ndarray  # [len(unique)] int64: a position in the request of each distinct key
    repeats: torch.Tensor | None  # [n] int64: index into ``unique`` of each key asked; None: no key repeats
    owner: np.ndarray  # [len(unique)]: the shard of each distinct key
    num_shards: int

    @property
    def distinct(self) -> bool:
        """Every key asked is distinct (``where`` is a permutation of the request)."""
        return self.repeats is None

    def inverse(self) -> torch.Tensor:
        """[n] int64: for each key asked, its index among the distinct keys."""
        if self.repeats is not None:
            return self.repeats
        inv = np.empty(len(self.where), dtype=np.int64)
        inv[self.where] = np.arange(len(self.where))
        return torch.from_numpy(inv)

    def of(self, shard: int) -> np.ndarray:
        """Indices (into ``unique``) of the distinct keys ``shard`` holds."""
        return np.flatnonzero(self.owner == shard)


def split(keys: np.ndarray, num_shards: int) -> Split:
    """``keys`` (uint64, flat) sorted once: distinct where no neighbour is equal (as ``np.unique``, whose
    ``return_inverse`` sorts the same way), each distinct key's shard."""
    order = np.argsort(keys)
    ordered = keys[order]
    head = np.empty(len(keys), dtype=bool)
    head[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=head[1:])
    if head.all():
        return Split(ordered, order, None, shard_of(ordered, num_shards), num_shards)
    unique, where = ordered[head], order[head]
    inv = np.empty(len(keys), dtype=np.int64)
    inv[order] = np.cumsum(head) - 1
    return Split(unique, where, torch.from_numpy(inv), shard_of(unique, num_shards), num_shards)


def finite(t: torch.Tensor) -> bool:
    """No inf or nan in ``t``: its least and greatest values (a NaN propagates into both) are finite; one pass,
    no tensor of flags (``isfinite(t).all()`` takes about 10x as long on this machine)."""
    if not t.numel():
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def naming(name: str, call: str, transport: Transport, fn: Callable[[], T]) -> T:
    """``fn()``, a row call on the shards; a shard's failure is re-raised as the same ``ShardError`` type with
    details that name the table and the call (a shard's refusal names the table already). A shard that
    did not answer, with no backup this client knows of, says how a client learns the backups."""
    try:
        return fn()
    except ShardError as e:
        table = f"row table {label(name)}"
        if e.details.startswith(table):
            raise
        details = f"{table}: {call}: {e.details}"
        if isinstance(e, Unreachable) and e.shard is not None and not transport.backups[e.shard]:
            details += (f" (this client knows no backup of shard {e.shard}: under --replicas 2 it learns them when "
                        "it registers row tables or dense tensors, or by attach())")
        raise type(e)(e.address, e.shard, e.code, details) from e


class RowClient:
    """Row tables over the shards of ``transport``."""

    def __init__(self, transport: Transport, worker_id: int, chunk_bytes: int,
                 epoch: Callable[[], int | None] | None = None) -> None:
        self.transport = transport
        self.epoch = epoch  # the client's rollback epoch, carried by every push (the shards fence on it)
        self.worker_id = worker_id
        self.chunk_bytes = codec.check_chunk_bytes(chunk_bytes)
        self.specs: dict[str, RowTableSpec] = {}
        self.wire_bytes = 0  # key, row and version bytes sent and received by this client's row calls
        # Per table, the (distinct keys, their row versions) of the pulls since its last push (the newest
        # MAX_TRACKED): handed back with the push, so the shards count each row's staleness.
        self.pulled: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        # Per table, what its next call on each shard must see first (docs/sync.md): the rounds that apply this
        # client's last push there (its ``ready``), and, under ssp, the clock every worker must have.
        self.ready: dict[str, list[int]] = {}
        self.waited: dict[str, list[int]] = {}  # the rounds a call on each shard has waited for already
        self.min_clock: dict[str, list[int]] = {}  # per shard, the ssp clock still to wait for there (0: none)

    def register(self, name: str, dim: int, *, optimizer: OptimizerSpec | None = None, keys: str = "int64",
                 init: dict[str, float | str] | None = None, seed: int = 0, admit: int = 0,
                 expire: int = 0) -> RowTableSpec:
        """Declare the row table ``name`` on every shard (the same spec again: a no-op). ``optimizer``:
        ``SparseAdam``, ``RowwiseAdagrad`` or ``SGD`` with ``lr`` alone (default ``SGD(lr=0.01)``);
        ``keys``: "int64" (ids given as int64/uint64 tensors) or "hash" (any str/bytes/int, see ``keys_of``);
        ``init``: a new row's distribution (default normal(0, 1), as ``torch.nn.Embedding``); ``admit`` > 1:
        a row is stored once that many pushes carried its key; ``expire`` > 0: rows not pushed for that
        many of the table's steps are dropped (docs/sparse.md)."""
        opt = optimizer if optimizer is not None else SGD(lr=0.01)
        spec = (RowTableSpec(name, dim, opt, keys, seed=seed, admit=admit, expire=expire) if init is None
                else RowTableSpec(name, dim, opt, keys, init, seed=seed, admit=admit, expire=expire))
        msg = ps_pb2.RegisterRowsRequest(table=spec.to_proto())
        t = self.transport
        answers = naming(name, "RegisterRows", t,
                         lambda: t.each(lambda i: t.rows(i).RegisterRows(msg, timeout=t.timeout)))
        for i, a in enumerate(answers):  # each shard's backup (--replicas 2), as a dense Register learns them
            t.backups[i] = a.backup
        self.specs[name] = spec
        return spec

    def keys_of(self, name: str, values: list[object]) -> torch.Tensor:
        """Keys of a ``keys="hash"`` table for any str, bytes or int values (BLAKE2b, 64 bits)."""
        return torch.tensor([hash_key(v) for v in values], dtype=torch.uint64)

    def _spec(self, name: str) -> RowTableSpec:
        spec = self.specs.get(name)
        if spec is None:
            raise KeyError(f"row table {name!r} is not registered by this client (registered: {sorted(self.specs)})")
        return spec

    def pull(self, name: str, keys: torch.Tensor, *, track: bool = True) -> torch.Tensor:
        """The rows of ``keys`` (any shape, repeated keys allowed): ``[*keys.shape, dim]`` fp32. ``track``:
        keep their versions for the next push (row staleness; off for pulls no push follows)."""
        dim = self._spec(name).dim
        s = split(as_u64(keys), self.transport.num_shards)
        # Each row goes once from its message to where it belongs: its place in the answer when no key
        # repeats, else its place among the distinct rows (the answer is then gathered from those). NumPy
        # places them: one thread per shard's answer, where torch's index ops spread over threads that, on
        # a busy machine, wait for each other.
        rows = torch.empty(keys.numel() if s.distinct else len(s.unique), dim)
        into = rows.numpy()
        versions = np.zeros(len(s.unique), dtype=np.int64)
        t = self.transport

        waits = self.waits(name)
        # A pull that waits for a round or clock says its epoch: a rollback while it waits ends it ABORTED (the
        # rounds it waits for will not come), which the optimizer turns into its own rollback (RolledBack).
        epoch = None if self.epoch is None else self.epoch()

        def pull_shard(shard: int) -> int:
            idx = s.of(shard)
            got = 0
            call = t.pull_rows(shard)
            min_round, min_clock = waits[shard]
            said = {"epoch": epoch} if epoch is not None and (min_round or min_clock) else {}
            # a shard owed a wait is asked even with no keys of it (a pull that only waits)
            for lo in range(0, max(1, len(idx)) if min_round or min_clock else len(idx), MAX_PULL_KEYS):
                part = idx[lo:lo + MAX_PULL_KEYS]
                req = ps_pb2.PullRowsRequest(table=name, key_dtype="uint64", keys=s.unique[part].tobytes(), dim=dim,
                                             min_round=min_round, min_clock=min_clock, **said)
                dest = s.where[part] if s.distinct else part
                for buf in call(req, timeout=t.timeout):
                    first, data, vers = framing.read_pull_rows(buf)
                    n = len(vers) // 8
                    if len(data) != n * dim * 4 or first + n > len(part):
                        raise ValueError(f"row table {label(name)}: PullRows answered {len(data)} row bytes and "
                                         f"{len(vers)} version bytes at row {first} of {len(part)}, dim {dim}")
                    if n:
                        into[dest[first:first + n]] = np.frombuffer(data, dtype="<f4").reshape(n, dim)
                        versions[part[first:first + n]] = np.frombuffer(vers, dtype="<i8")
                    got += len(data) + len(vers)
                got += len(req.keys)
            return got

        self.wire_bytes += sum(naming(name, "PullRows", t, lambda: t.each(pull_shard)))
        self.waited_for(name, waits)
        if track:
            self.pulled.setdefault(name, []).append((s.unique, versions))
            del self.pulled[name][:-MAX_TRACKED]
        out = rows if s.distinct else torch.from_numpy(np.take(into, s.inverse().numpy(), axis=0))
        return out.view(*keys.shape, dim)

    def waits(self, name: str) -> list[tuple[int, int]]:
        """Per shard, the (min_round, min_clock) a call on ``name`` must still wait for there: the rounds that
        apply this client's last push not yet waited for, and the ssp clock (docs/sync.md)."""
        n = self.transport.num_shards
        ready = self.ready.get(name, [0] * n)
        waited = self.waited.get(name, [0] * n)
        clocks = self.min_clock.get(name, [0] * n)
        return [(r if r > w else 0, c) for r, w, c in zip(ready, waited, clocks, strict=True)]

    def forget_waits(self) -> None:
        """The job rolled back (``PSClient.recover``): the tables' rounds are their checkpoint's, nothing this
        client pushed since is owed."""
        self.ready.clear()
        self.waited.clear()
        self.min_clock.clear()

    def waited_for(self, name: str, waits: list[tuple[int, int]], shards: Iterable[int] | None = None) -> None:
        """The calls on ``shards`` (default all) that carried ``waits`` were answered: they waited for those."""
        n = self.transport.num_shards
        waited = self.waited.setdefault(name, [0] * n)
        clocks = self.min_clock.setdefault(name, [0] * n)
        for shard in range(n) if shards is None else shards:
            waited[shard] = max(waited[shard], waits[shard][0])
            clocks[shard] = 0

    def _bases(self, name: str, keys: np.ndarray) -> np.ndarray:
        """The version each distinct uint64 key's row had when first pulled since the table's last push
        (-1: not pulled); forgets those pulls."""
        got = self.pulled.pop(name, [])
        if not got:
            return np.full(len(keys), -1, dtype=np.int64)
        k = np.concatenate([a for a, _ in got])
        v = np.concatenate([b for _, b in got])
        order = np.lexsort((v, k))  # by key, then version: the oldest first
        k, v = k[order], v[order]
        first = np.r_[True, k[1:] != k[:-1]]
        k, v = k[first], v[first]
        at = np.minimum(np.searchsorted(k, keys), len(k) - 1)
        return np.where(k[at] == keys, v[at], -1).astype(np.int64)

    def push(self, name: str, keys: torch.Tensor, grads: torch.Tensor, step: int, *, num_workers: int = 1,
             sync: str = "", assign: bool = False, worker: int | None = None, found_inf: bool | None = None) -> int:
        """One optimizer step of the table from the gradient rows ``grads`` (``[*keys.shape, dim]``) of
        ``keys``; repeated keys' rows are summed. Returns the distinct rows updated over all shards.

        ``sync``: the job's sync mode (docs/sync.md), over ``num_workers`` workers (the table's pushers); "":
        bsp when ``num_workers`` > 1, else asp. Under a barrier (bsp, every:X) the step is applied once every
        worker pushed it, with the mean of their gradients; this call returns once the shards took it in,
        and the next pull of the table (or, on a shard it does not pull from, the next push) waits for that
        round. Under ssp:S the next pull waits until every worker pushed ``step + 1 - S`` steps, and a push
        of step t until they pushed t - S. ``assign``: ``grads`` are the rows' first
        values (rows not held yet are created with them; no step). ``worker``: the worker id the push
        carries (default this client's; a pipeline stage pushes a table as its replica, one of
        ``num_workers``). ``found_inf``: the step is skipped on every shard (no row changes); None: when
        some gradient of the push is inf or nan, whichever shard its row lives on (every shard is told,
        so all skip alike)."""
        dim = self._spec(name).dim
        worker_id = self.worker_id if worker is None else worker
        g = grads.detach().reshape(-1, dim).to(torch.float32, copy=False)
        if g.shape[0] != keys.numel():
            raise ValueError(f"row table {name!r}: {keys.numel()} keys but gradients of shape {list(grads.shape)}")
        s = split(as_u64(keys), self.transport.num_shards)
        summed = torch.zeros(len(s.unique), dim).index_add_(0, s.inverse(), g.cpu())
        if found_inf is None:
            found_inf = not assign and not finite(summed)
        bases = np.full(len(s.unique), -1, dtype=np.int64) if assign else self._bases(name, s.unique)
        per = rows_per_message(dim + 2, self.chunk_bytes)  # + the base version
        t = self.transport
        epoch = None if self.epoch is None else self.epoch()
        waits = [(0, 0)] * t.num_shards if assign else self.waits(name)

        def messages(shard: int) -> Iterator[ps_pb2.PushRowsRequest]:
            idx = s.of(shard)
            for lo in range(0, max(1, len(idx)), per):
                part = idx[lo:lo + per]
                grad_rows = summed.index_select(0, torch.from_numpy(part))
                yield ps_pb2.PushRowsRequest(table=name, key_dtype="uint64", keys=s.unique[part].tobytes(),
                                             grads=grad_rows.numpy().tobytes(), dim=dim,
                                             worker_id=worker_id, step=step, num_workers=num_workers,
                                             assign=assign, base_versions=bases[part].tobytes(), found_inf=found_inf,
                                             epoch=epoch, sync=sync, min_round=waits[shard][0])

        def push_shard(shard: int) -> tuple[int, int]:
            answer = t.rows(shard).PushRows(messages(shard), timeout=t.timeout)
            return int(answer.rows), int(answer.ready)

        answers = naming(name, "PushRows", t, lambda: t.each(push_shard))
        self.wire_bytes += len(s.unique) * (8 + 4 * dim + 8)
        if not assign:
            self.took(name, [r for _, r in answers], waits, step, sync)
        return sum(rows for rows, _ in answers)

    def took(self, name: str, ready: list[int], waits: list[tuple[int, int]], step: int, sync: str) -> None:
        """The shards took this client's push of ``step`` of ``name`` in, each answering the rounds that apply
        it (``ready``; a call that carried ``waits`` has waited for them): what the next calls wait for."""
        self.waited_for(name, waits)
        self.ready[name] = list(ready)
        spec = SyncSpec.parse(sync) if sync else None
        if spec is not None and spec.bounded:
            self.min_clock[name] = [spec.min_clock(step + 1)] * len(ready)


class RowCalls:
    """The row-table calls of ``PSClient``: ``register_rows``, ``pull_rows``, ``push_rows``
    and ``row_keys``, each the ``RowClient`` method of the same job (``client.rows``, which holds the tables'
    specs and the versions pulled)."""

    rows: RowClient

    def register_rows(self, name: str, dim: int, *, keys: str = "int64",
                      init: dict[str, float | str] | None = None, optimizer: OptimizerSpec | None = None,
                      admit: int = 0, expire: int = 0, seed: int = 0) -> RowTableSpec:
        """Declare the row table ``name`` of ``dim``-float rows on every shard (``RowClient.register``)."""
        return self.rows.register(name, dim, optimizer=optimizer, keys=keys, init=init, seed=seed, admit=admit,
                                  expire=expire)

    def pull_rows(self, name: str, keys: torch.Tensor, *, track: bool = True) -> torch.Tensor:
        """The rows of ``keys`` (any shape, repeated allowed): ``[*keys.shape, dim]`` fp32 (``RowClient.pull``)."""
        return self.rows.pull(name, keys, track=track)

    def push_rows(self, name: str, keys: torch.Tensor, grads: torch.Tensor, step: int, *, num_workers: int = 1,
                  sync: str = "", assign: bool = False, found_inf: bool | None = None) -> int:
        """One optimizer step of ``keys``' rows from ``grads`` (``[*keys.shape, dim]``; ``RowClient.push``)."""
        return self.rows.push(name, keys, grads, step, num_workers=num_workers, sync=sync, assign=assign,
                              found_inf=found_inf)

    def row_keys(self, name: str, values: list[object]) -> torch.Tensor:
        """Keys of a ``keys="hash"`` table for any str, bytes or int values (``RowClient.keys_of``)."""
        return self.rows.keys_of(name, values)
