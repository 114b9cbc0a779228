"""The gRPC face of a shard: decode, call the store, encode, map errors.

``create_server(store, "127.0.0.1:0")`` returns a started server and the
port it bound (what it starts beside the server is a ``Served``,
``served(server)``): the three services of ps.proto, one per audience (``Workers``,
``Operator``, ``Peers``; server/auth.py checks each caller's token against
the audience of the service it calls), with ``grpc.health.v1`` beside them
(open, and SERVING under "" and each service's name). ``connect`` gives the
store its gRPC peers and replica link.

(Over 400 lines: one handler per RPC of ps.proto, each a few lines of
decoding and encoding; splitting the module would scatter the RPC table.)
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shardps.protos import codec
from shardps.protos.dataconn import FRAME_SEGMENT
from shardps.protos.deadlines import Deadlines
from shardps.protos.security import KEEPALIVE_SERVER_OPTIONS, Security
from shardps.protos.shardps.v1 import experts_pb2_grpc, ps_pb2, ps_pb2_grpc
from shardps.server.auth import TokenAuthInterceptor
from shardps.server.datapath.assembly import Landing, landing
from shardps.server.datapath.dataconn import DataPort
from shardps.server.datapath.reader import Item, Lent
from shardps.server.datapath.shm import SegmentCache, Segments
from shardps.server.datapath.slicepull import decode_slices
from shardps.server.datapath.wire import (
    decode_pull,
    decode_push,
    decode_register,
    encode_state,
    state_chunk_bytes,
)
from shardps.server.errors import Unavailable
from shardps.server.exchange import PeerChannels, encode_partial
from shardps.server.experts.service import ExpertsServicer
from shardps.server.metrics import ServerMetrics
from shardps.server.replication.transport import GrpcReplicaLink, read_ops
from shardps.server.rows.service import RowsServicer
from shardps.server.rpc import safe_deserializer, stream_errors, unary_errors
from shardps.server.store import ShardStore

log = logging.getLogger("shardps.server")

WORKERS = "shardps.v1.Workers"
OPERATOR = "shardps.v1.Operator"
PEERS = "shardps.v1.Peers"
ROWS = "shardps.v1.Rows"
EXPERTS = "shardps.v1.Experts"  # experts.proto: experts run where they live (server/experts/service.py)
SERVICES = (WORKERS, OPERATOR, PEERS, ROWS, EXPERTS)
DEFAULT_MAX_WAIT_S = 300.0
# Room for a chunk of MAX_CHUNK_BYTES plus its header.
MAX_MESSAGE_BYTES = codec.MAX_CHUNK_BYTES + (64 << 10)

def deadline_margin(remaining: float) -> float:
    """Seconds a wait ends before the caller's deadline: a tenth of it, at most 2 s."""
    return min(2.0, 0.1 * remaining)


class _Servicer:
    """What the three services share: the store, the metrics, the waits' limits."""

    def __init__(self, store: ShardStore, *, max_wait_s: float = DEFAULT_MAX_WAIT_S,
                 chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES, metrics: ServerMetrics | None = None,
                 segments: SegmentCache | None = None) -> None:
        self.store = store
        self.metrics = metrics
        self.segments = segments if segments is not None else SegmentCache()  # the same-host fast path
        self.max_wait_s = max_wait_s
        self.chunk_bytes = codec.check_chunk_bytes(chunk_bytes)

    def _stats(self, request: ps_pb2.StatsRequest, context: grpc.ServicerContext) -> ps_pb2.StatsResponse:
        """Operator.Stats, Workers.Describe and Peers.Describe: the shard's ``ShardStats``."""
        return self.store.stats().to_proto()

    def _rollback(self, request: ps_pb2.RollbackRequest, context: grpc.ServicerContext) -> ps_pb2.RollbackResponse:
        """Operator.Rollback and Workers.Recover: roll back to a checkpoint in a new epoch."""
        version, epoch = self.store.recover(request.version, request.epoch)
        return ps_pb2.RollbackResponse(version=version, epoch=epoch)

    def _fence_epoch(self) -> int:
        """The shard's fencing epoch (--coordinator; 0 without one)."""
        fence = self.store.replica.fence
        return fence.epoch if fence is not None else 0

    def _timeout(self, context: grpc.ServicerContext) -> float:
        """How long a wait may block: the server's max wait, and less than the caller's deadline.

        The wait gives up a little before the caller's deadline, so that the
        caller reads this server's account of what it waited for (a
        DEADLINE_EXCEEDED naming the missing workers) rather than a bare
        deadline of its own.
        """
        return self.wait_limit(context.time_remaining())

    def wait_limit(self, remaining: float | None) -> float:
        """``_timeout`` for a caller with ``remaining`` seconds left (None: no deadline)."""
        if remaining is None:
            return self.max_wait_s
        return max(0.0, min(remaining - deadline_margin(remaining), self.max_wait_s))


class WorkersServicer(_Servicer, ps_pb2_grpc.WorkersServicer):
    """The worker data path (``service Workers``): the worker token.

    ``data``: the process's data port (server/datapath/dataconn.py) and this shard's route on it, when it has one:
    Push and Pull then also come as frames (``push_frames``, ``pull_frames``).
    """

    data: tuple[DataPort, int] | None = None

    @unary_errors
    def Register(self, request_iterator: Iterator[ps_pb2.RegisterRequest],
                 context: grpc.ServicerContext) -> ps_pb2.RegisterResponse:
        self.store.replica.check_serving()
        j = decode_register(request_iterator)
        answer = self.store.path.join(j.worker_id, j.num_workers, j.sync, j.scaling, j.remedy, j.specs, j.values,
                                 self._timeout(context)).to_proto()
        answer.shm = j.shm
        answer.fence_epoch = self._fence_epoch()
        if self.data is not None:  # the data connection: where to connect, with which token, which route
            port, answer.data_route = self.data
            answer.data_port, answer.data_token = port.offer(j.worker_id)
        return answer

    def push_frames(self, requests: Iterator[ps_pb2.PushRequest], segments: Segments,
                    landed: Landing | None = None) -> ps_pb2.PushResponse:
        """A Push (its messages, their bytes where ``segments`` say): the gRPC handler's and the data
        connection's; StoreError for a refused one (nothing applied). ``landed``: the staging buffers some of
        its chunks were read into (``landing``)."""
        store = self.store
        store.replica.check_serving()
        alloc = landed.take if landed is not None else store.applier.pool.take
        g = decode_push(requests, store.table.spec, alloc, segments, store.path.takes_chunked)
        store.replica.check_fence(g.fence_epoch, f"worker {g.worker_id}'s push of step {g.step}")
        res = store.path.submit(g.worker_id, g.step, g.base_version, g.grads, g.nbytes, found_inf=g.found_inf,
                           loss_scale=g.loss_scale, epoch=g.epoch, checked=True, weights=g.weights,
                           sync=g.sync, sync_switch=g.sync_switch)
        t0 = time.perf_counter()
        store.replica.replicated()  # acknowledged only once the backup holds it (--replicas 2)
        if self.metrics is not None and store.replica.replicator is not None:
            self.metrics.replication_seconds.labels(self.metrics.shard).observe(time.perf_counter() - t0)
        answer = res.to_proto()
        if g.pull_after is not None:  # a small model's step in one call, when the weights are ready at once
            answer.pulled.extend(store.path.weights_now(g.worker_id, res.ready_version, g.pull_after.wire_dtype,
                                                   g.pull_after.min_clock, g.epoch, self.chunk_bytes))
            if answer.pulled and self.metrics is not None:  # a Pull that waited for nothing, as _pull counts
                self.metrics.observe_wait(0.0, str(store.job.sync or ""))
        return answer

    def landing(self, messages: Sequence[ps_pb2.PushRequest]) -> Landing | None:
        """Where a framed Push's chunks may be read straight into their parts' staging buffers (server/datapath/
        assembly.py), or None where its parts are not staged (slices, chunks kept as received: asp)."""
        first = messages[0] if messages else None
        store = self.store
        if first is None or first.slices or store.path.takes_chunked(first.loss_scale):
            return None
        chunks = [(m.chunk.shm_offset, m.chunk.shm_bytes, m.chunk) for m in messages
                  if m.shm == FRAME_SEGMENT and m.HasField("chunk") and m.chunk.shm_bytes > 0]
        return landing(chunks, store.table.spec, store.applier.pool.take) if chunks else None

    def pull_frames(self, request: ps_pb2.PullRequest, timeout: float, segments: Segments) -> Iterator[bytes]:
        """Whole PullResponse messages, framed once per version (see datapath/reader.py): they go out as they
        are (see add_servicers), a large Pull's while the rest are being framed. A Pull naming slices (a
        tensor-parallel rank's) is answered with just those (server/datapath/slicepull.py). ``timeout``: the most
        its wait may take (``wait_limit``); ``segments``: where a Pull naming one writes its weights."""
        self.store.replica.check_serving()
        self.store.replica.check_fence(request.fence_epoch, f"worker {request.worker_id}'s pull")
        slices = decode_slices(request)
        q = decode_pull(request, self.chunk_bytes, segments)
        messages: Iterable[bytes]
        if slices:
            waited, messages = self.store.path.pull_slices(q.worker_id, q.names, slices, q.wire_dtype, q.chunk_bytes,
                                                      min_version=q.min_version, min_clock=q.min_clock,
                                                      epoch=q.epoch, timeout=timeout, segment=q.segment)
        else:
            waited, framed = self.store.path.pull(q.worker_id, q.names, q.wire_dtype, q.chunk_bytes,
                                             min_version=q.min_version, min_clock=q.min_clock, epoch=q.epoch,
                                             timeout=timeout, segment=q.segment)
            messages = (msg for *_, msg in framed)
        if self.metrics is not None and (q.min_version or q.min_clock):
            self.metrics.observe_wait(waited, str(self.store.job.sync or ""))
        return iter(messages)

    def pull_soon(self, request: ps_pb2.PullRequest, timeout: float, segments: Segments, deadlines: Deadlines,
                  answer: Callable[[list[bytes] | None, memoryview | Lent | None, BaseException | None], None]) -> bool:
        """``pull_frames`` without a thread that waits (server/parked.py): the messages and the bytes they
        point into, or the failure, given to ``answer`` once (in this thread, or in the one whose change
        made the weights ready, or at the deadline); False, with nothing done, where the Pull needs a
        thread: it names slices or no segment, or the store has a backup. A failure before any wait is
        raised."""
        store = self.store
        if request.slices or not request.shm or not store.path.parks():
            return False
        store.replica.check_serving()
        store.replica.check_fence(request.fence_epoch, f"worker {request.worker_id}'s pull")
        q = decode_pull(request, self.chunk_bytes, segments)
        assert q.segment is not None
        metrics, waits = self.metrics, bool(q.min_version or q.min_clock)

        def done(waited: float, items: list[Item] | None, payload: memoryview | Lent | None,
                 error: BaseException | None) -> None:
            if error is None and metrics is not None and waits:
                metrics.observe_wait(waited, str(store.job.sync or ""))
            answer([msg for *_, msg in items] if items is not None else None, payload, error)

        store.path.pull_soon(q.worker_id, q.names, q.wire_dtype, min_version=q.min_version, min_clock=q.min_clock,
                             epoch=q.epoch, timeout=timeout, segment=q.segment, deadlines=deadlines, answer=done)
        return True

    @unary_errors
    def Heartbeat(self, request: ps_pb2.HeartbeatRequest, context: grpc.ServicerContext) -> ps_pb2.HeartbeatResponse:
        version, live, backup = self.store.heartbeat(request.worker_id)
        return ps_pb2.HeartbeatResponse(version=version, live_workers=live, backup=backup)

    @unary_errors
    def Leave(self, request: ps_pb2.LeaveRequest, context: grpc.ServicerContext) -> ps_pb2.LeaveResponse:
        version, live = self.store.goodbye(request.worker_id)
        self.segments.forget(request.worker_id)
        if self.data is not None:
            self.data[0].forget(request.worker_id, self.data[1])
        return ps_pb2.LeaveResponse(version=version, live_workers=live)

    Describe = unary_errors(_Servicer._stats, "Describe")
    Recover = unary_errors(_Servicer._rollback, "Recover")

    @unary_errors
    def TakeOver(self, request: ps_pb2.TakeOverRequest, context: grpc.ServicerContext) -> ps_pb2.PromoteResponse:
        shard_index, version, epoch = self.store.replica.take_over(request.reason)
        answer = ps_pb2.PromoteResponse(shard_index=shard_index, version=version, epoch=epoch,
                                        fence_epoch=self._fence_epoch())
        if request.offer_data and self.data is not None:  # the worker's Push and Pull go on as frames
            port, answer.data_route = self.data
            answer.data_port, answer.data_token = port.offer(request.worker_id)
        return answer

    @unary_errors
    def Connect(self, request: ps_pb2.ConnectRequest, context: grpc.ServicerContext) -> ps_pb2.ConnectResponse:
        """Where the worker's data connection to this shard goes now (its connection was lost, or the process
        restarted: a new port and token): refused where the shard does not serve."""
        self.store.replica.check_serving()
        if self.data is None:
            raise Unavailable(f"shard {self.store.shard_index} serves no data port")
        port, route = self.data
        answer = ps_pb2.ConnectResponse(data_route=route)
        answer.data_port, answer.data_token = port.offer(request.worker_id)
        return answer


class OperatorServicer(_Servicer, ps_pb2_grpc.OperatorServicer):
    """Operating the job (``service Operator``): the operator token."""

    Stats = unary_errors(_Servicer._stats, "Stats")

    @unary_errors
    def SetSync(self, request: ps_pb2.SetSyncRequest, context: grpc.ServicerContext) -> ps_pb2.SetSyncResponse:
        sync, version, switch = self.store.switch_sync(request.sync)
        return ps_pb2.SetSyncResponse(sync=sync, version=version, sync_switch=switch)

    @unary_errors
    def Checkpoint(self, request: ps_pb2.CheckpointRequest,
                   context: grpc.ServicerContext) -> ps_pb2.CheckpointResponse:
        version, path = self.store.checkpoint_request()
        return ps_pb2.CheckpointResponse(version=version, path=path)

    Rollback = unary_errors(_Servicer._rollback, "Rollback")

    @unary_errors
    def Promote(self, request: ps_pb2.PromoteRequest, context: grpc.ServicerContext) -> ps_pb2.PromoteResponse:
        shard_index, version, epoch = self.store.replica.promote(request.reason, request.force)
        return ps_pb2.PromoteResponse(shard_index=shard_index, version=version, epoch=epoch,
                                      fence_epoch=self._fence_epoch())

    @unary_errors
    def AttachReplica(self, request: ps_pb2.AttachReplicaRequest,
                      context: grpc.ServicerContext) -> ps_pb2.AttachReplicaResponse:
        timeout = min(max(0.0, request.timeout_seconds), self._timeout(context))
        state = self.store.replica.attach_replica(request.address, timeout)
        return ps_pb2.AttachReplicaResponse(replica_state=state)

    @stream_errors
    def PullState(self, request: ps_pb2.PullStateRequest,
                  context: grpc.ServicerContext) -> Iterator[ps_pb2.StateChunk]:
        self.store.replica.check_serving()
        chunk_bytes = state_chunk_bytes(request, self.chunk_bytes)
        version, items = self.store.reader.export_state(list(request.names) or self.store.names())
        yield from encode_state(version, items, chunk_bytes)


class PeersServicer(_Servicer, ps_pb2_grpc.PeersServicer):
    """Server to server (``service Peers``): the peer token."""

    @unary_errors
    def Exchange(self, request: ps_pb2.ExchangeRequest,
                 context: grpc.ServicerContext) -> ps_pb2.ExchangeResponse:
        key = (request.tensor, request.round, request.tag)
        partial = self.store.applier.exchange.wait(key, self._timeout(context))
        return ps_pb2.ExchangeResponse(partial=encode_partial(partial))

    @unary_errors
    def Replicate(self, request_iterator: Iterator[ps_pb2.ReplicateRequest],
                  context: grpc.ServicerContext) -> ps_pb2.ReplicateResponse:
        seq, version = self.store.replica.apply_ops(read_ops(request_iterator))
        return ps_pb2.ReplicateResponse(seq=seq, version=version)

    Describe = unary_errors(_Servicer._stats, "Describe")


class _HandlerRecorder:
    """Stands in for a grpc.Server to catch the generated method handlers."""

    def __init__(self) -> None:
        self.handlers: dict[str, Any] = {}

    def add_generic_rpc_handlers(self, generic_rpc_handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service_name: str, method_handlers: dict[str, Any]) -> None:
        self.handlers = dict(method_handlers)


def _pull_response_bytes(msg: bytes | ps_pb2.PullResponse | ps_pb2.PullRowsResponse) -> bytes:
    """A response serializer for handlers that yield finished message bytes (Pull, PullRows) or messages."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def _register(service: str, add: Callable[[Any, Any], None], servicer: _Servicer | RowsServicer | ExpertsServicer,
              server: grpc.Server) -> None:
    recorder = _HandlerRecorder()
    add(servicer, recorder)
    handlers = recorder.handlers
    if service == ROWS:  # PullRows yields its messages framed (framing.pull_rows_message)
        handlers["PullRows"] = handlers["PullRows"]._replace(response_serializer=_pull_response_bytes)
    for name, h in list(handlers.items()):
        handlers[name] = h._replace(request_deserializer=safe_deserializer(name, h.request_deserializer))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)


def add_servicers(store: ShardStore, server: grpc.Server, *, max_wait_s: float = DEFAULT_MAX_WAIT_S,
                  chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES, metrics: ServerMetrics | None = None,
                  segments: SegmentCache | None = None, data: DataPort | None = None
                  ) -> tuple[SegmentCache, tuple[DataPort, int] | None]:
    """The three services of ``store`` on ``server``, as the generated ``add_*Servicer_to_server`` with the
    data path's copies cut.

    Every RPC keeps the generated handler; only PullRows' response serializer (the servicer yields
    finished PullRowsResponse bytes) is replaced, and every request deserializer hands over bytes that do
    not parse as a ``Malformed``. Push and Pull are not RPCs: they come as frames on the data port. Returns the workers'
    shared-memory segments the services map (``segments``, or a new cache), which the caller unmaps, and
    ``data``: the process's data port, which the Workers servicer attaches to, with its route
    (``WorkersServicer.data``).
    """
    segments = segments if segments is not None else SegmentCache()
    kw: dict[str, Any] = dict(max_wait_s=max_wait_s, chunk_bytes=chunk_bytes, metrics=metrics, segments=segments)
    workers = WorkersServicer(store, **kw)
    if data is not None:
        workers.data = (data, data.attach(workers))
    _register(WORKERS, ps_pb2_grpc.add_WorkersServicer_to_server, workers, server)
    _register(OPERATOR, ps_pb2_grpc.add_OperatorServicer_to_server, OperatorServicer(store, **kw), server)
    _register(PEERS, ps_pb2_grpc.add_PeersServicer_to_server, PeersServicer(store, **kw), server)
    rows = RowsServicer(store.rows, check_serving=store.replica.check_serving, check_epoch=store.job.check_same_epoch,
                        replicated=store.replica.replicated,
                        backup=lambda: store.replica.replicator.address if store.replica.replicator is not None else "",
                        chunk_bytes=chunk_bytes, metrics=metrics, max_wait_s=max_wait_s)
    _register(ROWS, ps_pb2_grpc.add_RowsServicer_to_server, rows, server)
    experts = ExpertsServicer(store.rows, check_serving=store.replica.check_serving,
                              replicated=store.replica.replicated,
                              metrics=metrics, max_wait_s=max_wait_s, epoch=lambda: store.job.epoch)
    _register(EXPERTS, experts_pb2_grpc.add_ExpertsServicer_to_server, experts, server)
    return segments, workers.data


@dataclass(frozen=True)
class Served:
    """What ``create_server`` starts beside a ``grpc.Server`` and ``stop_server`` releases (``served(server)``)."""

    executor: futures.ThreadPoolExecutor  # the handler threads: joined by stop_server
    health: health.HealthServicer  # grpc.health.v1, SERVING under "" and each service's name once started
    segments: SegmentCache  # the workers' same-host segments: unmapped by stop_server
    data: tuple[DataPort, int] | None = None  # the process's data port and the shard's route on it
    # set by the first stop_server: the route detached and the port released once, however often it is called
    released: threading.Event = field(default_factory=threading.Event, compare=False)

    def not_serving(self, services: Iterable[str] = ("", *SERVICES)) -> None:
        """Answer NOT_SERVING for ``services`` from now on (a shutdown begins; safe in a signal handler)."""
        for svc in services:
            self.health.set(svc, health_pb2.HealthCheckResponse.NOT_SERVING)


_SERVED: weakref.WeakKeyDictionary[grpc.Server, Served] = weakref.WeakKeyDictionary()


def served(server: grpc.Server) -> Served:
    """What ``create_server`` keeps beside ``server``; KeyError for a server it did not create."""
    return _SERVED[server]


def connect(store: ShardStore, security: Security) -> None:
    """Give ``store`` its gRPC ways to other servers (peers of split tensors, its backup), with ``security``.

    Kept when the store was given its own (tests inject in-process fakes).
    """
    if isinstance(store.applier.peers, PeerChannels):
        store.applier.peers.security = security
    if isinstance(store.replica.replica_link, GrpcReplicaLink):
        store.replica.replica_link.security = security
    store.connect(PeerChannels(security) if store.applier.peers is None else None,
                  GrpcReplicaLink(security) if store.replica.replica_link is None else None)


_TLS: dict[tuple[str | None, str | None, str | None], ssl.SSLContext | None] = {}


def shared_tls(security: Security) -> ssl.SSLContext | None:
    """One TLS context per set of certificate files in a process (the shards of one process share one
    data port)."""
    key = (security.tls_cert, security.tls_key, security.tls_ca)
    if key not in _TLS:
        _TLS[key] = security.server_ssl_context()
    return _TLS[key]


def create_server(store: ShardStore, address: str = "127.0.0.1:0", *, max_workers: int = 32,
                  max_wait_s: float = DEFAULT_MAX_WAIT_S, chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES,
                  metrics: ServerMetrics | None = None, security: Security | None = None,
                  interceptors: Sequence[grpc.ServerInterceptor] = ()) -> tuple[grpc.Server, int]:
    """Start a server for ``store`` on ``address``; return it and the bound port.

    Binding port 0 picks a free port. Raises RuntimeError if the address
    cannot be bound. ``security`` adds TLS (mutual with a CA) and token
    auth; ``interceptors`` run before auth (tests inject faults there: they see
    gRPC calls only). The shard serves the process's data port on its host
    too (server/datapath/dataconn.py): the workers' Pushes and Pulls come there as
    frames (with TLS, TLS too).
    """
    security = security or Security()
    chain = list(interceptors)
    if security.any_token:
        on_reject = (lambda m, code: metrics.rpc_error(m.rsplit("/", 1)[-1], code)) if metrics else None
        chain.append(TokenAuthInterceptor(security.token, on_reject, tokens=security.role_tokens))
        if not security.token_for("peer"):
            log.warning("shard %d checks tokens but has neither the peer token nor the shared one: its calls to "
                        "other servers (replication, split tensors) will be refused", store.shard_index)
    connect(store, security)
    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
        *KEEPALIVE_SERVER_OPTIONS,
    ]
    executor = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"shard{store.shard_index}")
    server = grpc.server(executor, options=options, interceptors=chain)
    host = address.rsplit(":", 1)[0]
    port_ = DataPort.shared(host, shared_tls(security))
    try:
        segments, data = add_servicers(store, server, max_wait_s=max_wait_s, chunk_bytes=chunk_bytes,
                                       metrics=metrics, data=port_)
    except BaseException:
        port_.release()
        raise
    health_servicer = health.HealthServicer()
    _SERVED[server] = Served(executor, health_servicer, segments, data)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    creds = security.server_credentials()
    port = server.add_secure_port(address, creds) if creds is not None else server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"could not bind {address}")
    server.start()
    store.replica.address = f"{address.rsplit(':', 1)[0]}:{port}"
    store.leases.start_reaper()
    for svc in ("", *SERVICES):
        health_servicer.set(svc, health_pb2.HealthCheckResponse.SERVING)
    return server, port


def stop_server(server: grpc.Server, grace: float | None = None, timeout: float = 30.0) -> None:
    """Stop a server from ``create_server`` and wait until it has: RPCs ended, threads joined.

    ``grpc.Server.stop`` only starts the shutdown; returning before it is
    done leaves gRPC's polling thread inside the C core, where interpreter
    exit can abort the process ("terminate called without an active
    exception"). The handler threads of its pool are joined too.
    """
    stopped = server.stop(grace).wait(timeout)
    if not stopped:
        log.warning("a server did not finish stopping within %.0fs", timeout)
    beside = _SERVED.get(server)
    if beside is None:
        return
    first = not beside.released.is_set()
    beside.released.set()
    if beside.data is not None and first:  # frames for this shard are answered UNAVAILABLE from now on
        beside.data[0].detach(beside.data[1])
    # A handler still running after a stop that timed out is not waited for, nor its segments unmapped.
    beside.executor.shutdown(wait=stopped, cancel_futures=True)
    if stopped:
        beside.segments.close()
    if beside.data is not None and first:
        beside.data[0].release()
