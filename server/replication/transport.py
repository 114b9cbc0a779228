"""Replication's transport: a primary's ops streamed to its backup over gRPC (``Replicator``, ``GrpcReplicaLink``).

The primary records every change of its state as an *op* (a registration,
a worker's gradient as the shard took it in, an eviction, a sync switch, a
whole snapshot after a rollback...) under the store's lock, numbered by
``seq`` in the order it made them. One sender thread streams the ops, in
that order, to the backup (``Replicate`` RPC), which replays each through
the same ShardStore code and so reaches the same state, bit for bit. A
request that changed the state is acknowledged only after the backup has
confirmed its op (``Replicator.wait``): whatever a worker was told is taken
in is on two servers.

States of the primary's replica::

    none ──attach──▶ resync ──▶ syncing ──snapshot confirmed──▶ synced
                                  ▲                                │ backup unreachable
                                  └────────── retry every few s ── degraded
    synced ── backup answers "promoted" ──▶ deposed (the primary stops serving)

While ``degraded`` the primary goes on alone (acknowledging without a
copy, logged and exported as a metric) and keeps trying to re-attach,
sending its whole state first. ``deposed`` fences a primary that was
wrongly taken for dead: its backup took over, so it must not acknowledge
anything more; every request gets UNAVAILABLE naming the new address.

The states and their transitions are ``replica.ReplicaState`` and
``replica.REPLICA_TRANSITIONS``; this module is the gRPC side (the sender,
``GrpcReplicaLink``; ``service Peers`` with the peer token), the store knows it only as ``peers.ReplicaSink``.

A restarted primary (a new ``incarnation``) is refused by a backup that
holds a copy: the backup has acknowledged updates the new run lacks, so the
new run is deposed and the backup takes over.

Not handled (documented in docs/operations.md): a network partition in
which workers reach the backup but not the primary and the backup cannot
reach the primary either, while the primary still serves other clients. A
third party (consensus) would be needed for that; the takeover's check of
the primary's Stats covers the ordinary case of a primary that is merely
slow.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any, cast

import grpc
import torch

from shardps.protos.framing import varint
from shardps.protos.security import Security
from shardps.protos.shardps.v1 import ps_pb2
from shardps.server.datapath.headers import check_continuation
from shardps.server.errors import InvalidArgument
from shardps.server.replication.roles import (
    OpKind,
    ReplicaEvent,
    ReplicaState,
    Role,
    next_replica_state,
)
from shardps.server.replication.snapshot import Packed, pack, unpack
from shardps.server.replication.state import DEFAULT_REPLICA_TIMEOUT_S, Deposed, Op

__all__ = ["DEFAULT_REPLICA_TIMEOUT_S", "Deposed", "GrpcReplicaLink", "Op", "OpKind", "Packed", "Replicator",
           "op_messages", "pack", "primary_serving", "read_ops", "unpack"]

log = logging.getLogger("shardps.server")

BLOB_BYTES = 1 << 20  # tensor bytes per ReplicateRequest
BYTES_PER_S_FLOOR = 20e6  # a batch's deadline grows with its size as if the backup took in 20 MB/s
RETRY_S = 2.0


_TENSORS_KEY = bytes([(ps_pb2.ReplicateRequest.DESCRIPTOR.fields_by_name["tensors"].number << 3) | 2])


def op_messages(op: Op, shard_index: int, num_shards: int, primary: str, incarnation: str = "",
                fence_epoch: int = 0) -> Iterator[bytes]:
    """One op as serialized ReplicateRequests: the header, then its tensors in BLOB_BYTES pieces.

    The header's args carry the tensors' layout; the tensor bytes are
    appended to protobuf's serialization of the other fields by hand (the
    same wire format; one copy instead of three).
    """
    packed = op.packed if op.packed is not None else pack(op.tensors)
    blob = memoryview(cast(Any, packed.buffer.numpy()))
    args = dict(op.args, _layout=packed.layout, _nbytes=packed.nbytes)
    head = ps_pb2.ReplicateRequest(seq=op.seq, op=str(op.kind), args_json=json.dumps(args), shard_index=shard_index,
                                   num_shards=num_shards, primary=primary, incarnation=incarnation,
                                   fence_epoch=fence_epoch).SerializeToString()
    rest = ps_pb2.ReplicateRequest(seq=op.seq).SerializeToString()
    for a in range(0, max(1, len(blob)), BLOB_BYTES):
        piece = blob[a:a + BLOB_BYTES]
        yield b"".join((head if a == 0 else rest, _TENSORS_KEY, varint(len(piece)), piece))


#: What the later messages of one op of a Replicate stream carry (other fields, if set, must be the op's first's).
REPLICATE_OWN = frozenset({"seq", "tensors"})


def read_ops(messages: Iterator[ps_pb2.ReplicateRequest]) -> Iterator[tuple[ps_pb2.ReplicateRequest, Op]]:
    """Group a Replicate stream back into ops: (the op's first message, the op).

    An op is handed on once its last message is in and it is whole (its
    messages agree, its bytes are the count its layout says): the unit a
    backup replays and acknowledges is the op.
    """
    head: ps_pb2.ReplicateRequest | None = None
    pieces: list[bytes] = []

    def done() -> tuple[ps_pb2.ReplicateRequest, Op]:
        assert head is not None
        try:
            args = json.loads(head.args_json or "{}")
            layout = args.pop("_layout", [])
            nbytes = args.pop("_nbytes", 0)
        except (ValueError, TypeError, AttributeError, RecursionError) as e:
            raise InvalidArgument(f"Replicate: op {head.seq}: args do not parse as a JSON object: {e}") from None
        data = bytearray().join(pieces)  # one copy, sized by what came
        if len(data) != nbytes:
            raise InvalidArgument(f"Replicate: op {head.seq} sent {len(data)} tensor bytes, its layout "
                                  f"says {nbytes}")
        return head, Op(head.seq, head.op, args, unpack(layout, data))

    for i, m in enumerate(messages, start=1):
        if head is not None and m.seq != head.seq:
            yield done()
            head, pieces = None, []
        if head is None:
            head, first = m, i
        else:  # the op's later messages carry its bytes (and its seq) only
            check_continuation("Replicate", i - first + 1, head, m, REPLICATE_OWN)
        pieces.append(m.tensors)
    if head is not None:
        yield done()


class Replicator:
    """The primary's side: numbers ops, streams them to the backup, tells waiters when they are safe.

    ``record`` is called under the store's lock; ``wait`` after the store
    released it. ``snapshot`` is a callable taking the store's lock that
    records a full snapshot op (it calls ``begin_sync`` under that lock).
    """

    def __init__(self, shard_index: int, num_shards: int, *, security: Security | None = None,
                 timeout_s: float = DEFAULT_REPLICA_TIMEOUT_S, retry_s: float = RETRY_S,
                 primary_address: str = "") -> None:
        self.shard_index, self.num_shards = shard_index, num_shards
        self.security = security or Security()
        self.timeout_s, self.retry_s = timeout_s, retry_s
        self.primary_address = primary_address
        self.incarnation = uuid.uuid4().hex  # this run of the primary
        self.fence_epoch: Callable[[], int] = lambda: 0  # --coordinator: the primary's fencing epoch, now
        self.address = ""
        self.state = ReplicaState.NONE
        self.seq = 0  # the last op recorded
        self.acked = 0  # the last op the backup confirmed (or that needs no confirmation)
        self.ops_total = 0  # ops the backup confirmed
        self.last_error = ""
        self._queue: list[Op] = []
        self._cond = threading.Condition(threading.Lock())
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._channel: grpc.Channel | None = None
        self._snapshot: Any = None
        # called (outside our lock) when the backup answers "promoted"
        self.on_deposed: Callable[[str], None] | None = None

    # -- under the store's lock -------------------------------------------

    def record(self, kind: str, args: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None,
               packed: Packed | None = None) -> None:
        with self._cond:
            self.seq += 1
            if self.state in (ReplicaState.SYNCING, ReplicaState.SYNCED, ReplicaState.RESYNC):
                self._queue.append(Op(self.seq, kind, args, tensors or {}, packed))
                self._cond.notify_all()
            elif self.state != ReplicaState.DEPOSED:  # deposed: nothing it records is ever acknowledged
                self.acked = self.seq  # no backup to wait for

    def begin_sync(self) -> None:
        """Called under the store's lock just before the snapshot op is recorded."""
        with self._cond:
            self.state = next_replica_state(self.state, ReplicaEvent.BEGIN_SYNC)
            self._queue.clear()

    # -- waiting --------------------------------------------------------------

    def wait(self, seq: int | None, timeout: float) -> None:
        """Return once op ``seq`` (default: every op so far) is on the backup, or there is no backup.

        Raises ``Deposed`` when the backup took over, ``TimeoutError`` after ``timeout``.
        """
        with self._cond:
            target = self.seq if seq is None else seq
            ok = self._cond.wait_for(
                lambda: self.acked >= target or self.state in (ReplicaState.NONE, ReplicaState.DEGRADED,
                                                              ReplicaState.DEPOSED), timeout)
            if self.state == ReplicaState.DEPOSED and self.acked < target:
                raise Deposed(self.address)
            if not ok:
                raise TimeoutError(f"shard {self.shard_index}: the backup at {self.address} did not confirm "
                                   f"op {target} within {timeout:.1f}s (confirmed: {self.acked})")

    @property
    def lag(self) -> int:
        return self.seq - self.acked

    # -- the sender -------------------------------------------------------------

    def attach(self, address: str, snapshot: Any) -> None:
        """Replicate to ``address`` from now on (sending the whole state first); starts the sender."""
        with self._cond:
            if self.state == ReplicaState.DEPOSED:
                raise Deposed(self.address)
            old = self._channel
            self.address, self._snapshot = address, snapshot
            self._channel = self.security.channel(address, role="peer")
            self.state = next_replica_state(self.state, ReplicaEvent.ATTACH)  # the whole state first
            self._queue.clear()
            self._cond.notify_all()
        if old is not None:
            old.close()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"shard{self.shard_index}-replicate",
                                            daemon=True)
            self._thread.start()
        self._wake.set()

    def wait_synced(self, timeout: float,
                    settled: tuple[ReplicaState, ...] = (ReplicaState.SYNCED, ReplicaState.DEPOSED)) -> ReplicaState:
        """The state once it is one of ``settled`` (or after ``timeout``)."""
        with self._cond:
            self._cond.wait_for(lambda: self.state in settled, timeout)
            return self.state

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                state = self.state
            if state == ReplicaState.DEPOSED:
                return
            if state == ReplicaState.DEGRADED and not self._reachable():
                self._wake.wait(self.retry_s)  # a whole snapshot costs a copy of the shard: not for nothing
                self._wake.clear()
                continue
            if state in (ReplicaState.DEGRADED, ReplicaState.RESYNC):
                try:
                    self._snapshot()  # begin_sync + record("snapshot") under the store's lock
                except Exception as e:  # noqa: BLE001 - logged, retried
                    log.error("shard %d: cannot snapshot for the backup: %s", self.shard_index, e)
                    self._wake.wait(self.retry_s)
                    self._wake.clear()
                    continue
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stop.is_set() or self.state != ReplicaState.SYNCING
                                    and self.state != ReplicaState.SYNCED, timeout=1.0)
                batch, self._queue = self._queue, []
                channel = self._channel
            if not batch or channel is None:
                continue
            try:
                self._send(channel, batch)
            except grpc.RpcError as e:
                self._failed(e, batch)
                continue
            with self._cond:
                self.acked = max(self.acked, batch[-1].seq)
                self.ops_total += len(batch)
                if self.state == ReplicaState.SYNCING and any(op.kind == OpKind.SNAPSHOT for op in batch):
                    self.state = next_replica_state(self.state, ReplicaEvent.CONFIRMED)
                    log.info("shard %d: backup at %s in sync (op %d)", self.shard_index, self.address,
                             batch[-1].seq)
                self._cond.notify_all()

    def _reachable(self) -> bool:
        """Whether the backup answers at all (a cheap Describe call)."""
        with self._cond:
            channel = self._channel
        if channel is None:
            return False
        try:
            channel.unary_unary("/shardps.v1.Peers/Describe",  # type: ignore[call-arg]
                                request_serializer=ps_pb2.StatsRequest.SerializeToString,
                                response_deserializer=ps_pb2.StatsResponse.FromString,
                                _registered_method=True)(ps_pb2.StatsRequest(), timeout=min(5.0, self.timeout_s))
            return True
        except grpc.RpcError:
            return False

    def _send(self, channel: grpc.Channel, batch: list[Op]) -> None:
        replicate: Any = channel.stream_unary(  # type: ignore[call-arg]
            "/shardps.v1.Peers/Replicate", request_serializer=None,
            response_deserializer=ps_pb2.ReplicateResponse.FromString, _registered_method=True)

        def messages() -> Iterator[bytes]:
            fence = self.fence_epoch()
            for op in batch:
                yield from op_messages(op, self.shard_index, self.num_shards, self.primary_address, self.incarnation,
                                       fence)

        nbytes = sum(op.packed.nbytes if op.packed is not None else
                     sum(t.numel() * t.element_size() for t in op.tensors.values()) for op in batch)
        replicate(messages(), timeout=self.timeout_s + nbytes / BYTES_PER_S_FLOOR)

    def _failed(self, e: grpc.RpcError, batch: list[Op]) -> None:
        code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
        details = e.details() if hasattr(e, "details") else str(e)
        deposed = code == grpc.StatusCode.FAILED_PRECONDITION
        if deposed:  # the store stops serving first, then the waiters learn it
            log.error("shard %d: the backup at %s took over (%s); this server no longer serves the shard",
                      self.shard_index, self.address, details)
            if self.on_deposed is not None:
                self.on_deposed(self.address)
        with self._cond:
            self.last_error = f"{code.name}: {details}"
            if deposed:
                self.state = next_replica_state(self.state, ReplicaEvent.PROMOTED)
            elif code == grpc.StatusCode.ABORTED:
                # The backup wants the whole state again (a gap, a replay it could not make): the
                # waiters keep waiting for the snapshot, which holds their ops.
                self.state = next_replica_state(self.state, ReplicaEvent.ABORTED)
                log.warning("shard %d: backup at %s asks for a resync: %s", self.shard_index, self.address, details)
            else:
                was = self.state
                self.state = next_replica_state(self.state, ReplicaEvent.FAILED)
                self.acked = self.seq  # going on alone: nothing more to wait for
                if was != ReplicaState.DEGRADED or code != grpc.StatusCode.UNAVAILABLE:
                    log.warning("shard %d: backup at %s failed (%s: %s); going on without a copy, retrying "
                                "every %.0fs", self.shard_index, self.address, code.name, details, self.retry_s)
            self._queue.clear()
            self._cond.notify_all()
        if deposed:
            return
        if code != grpc.StatusCode.ABORTED:  # ABORTED: the backup wants the whole state again, now
            self._wake.wait(self.retry_s)
            self._wake.clear()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s + 5)
        if self._channel is not None:
            self._channel.close()


class GrpcReplicaLink:
    """``peers.ReplicaLink`` over gRPC: a ``Replicator`` per backup, the primary's health by its Stats."""

    def __init__(self, security: Security | None = None) -> None:
        self.security = security or Security()

    def sink(self, shard_index: int, num_shards: int, *, timeout_s: float, primary_address: str) -> Replicator:
        return Replicator(shard_index, num_shards, security=self.security, timeout_s=timeout_s,
                          primary_address=primary_address)

    def primary_serving(self, address: str) -> bool:
        return primary_serving(address, self.security)


def primary_serving(address: str, security: Security, timeout: float = 1.0) -> bool:
    """Whether the shard's primary at ``address`` answers and still serves the shard.

    Unreachable, shutting down (UNAVAILABLE), deposed, starting or
    restarted from a checkpoint (recovering): not serving.
    """
    from shardps.protos.shardps.v1 import ps_pb2_grpc

    if not address:
        return False
    channel = security.channel(address, role="peer")
    try:
        s = ps_pb2_grpc.PeersStub(channel).Describe(ps_pb2.StatsRequest(), timeout=timeout)  # type: ignore[no-untyped-call]
        return s.role in (Role.PRIMARY, "") and not s.recovering
    except grpc.RpcError:
        return False
    finally:
        channel.close()
