"""PSClient: one worker's connection to every shard.

Routes tensors by the shard map, pushes and pulls over all shards in
parallel (one thread per shard), and gives every RPC a deadline. Failures
surface as ``ShardError`` carrying the gRPC status code and the shard.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import torch

from shardps.protos import codec, env, framing
from shardps.protos.amp import LossScaling
from shardps.protos.exposition import MetricsEndpoint, serve_metrics
from shardps.protos.optim import OptimizerSpec, spec_from_proto
from shardps.protos.security import Security
from shardps.protos.shardmap import ShardMap, TensorInfo, build_shard_map
from shardps.protos.shardps.v1 import ps_pb2, ps_pb2_grpc
from shardps.worker.metrics import WorkerMetrics

log = logging.getLogger("shardps.worker")

SERVICE = "shardps.v1.ParameterServer"
DEFAULT_TIMEOUT_S = 120.0
DEFAULT_RECOVERY_TIMEOUT_S = 60.0
DEFAULT_MAX_WHOLE_BYTES = 256 << 20
T = TypeVar("T")

OptimizerChoice = OptimizerSpec | Callable[[str, torch.Tensor], OptimizerSpec]


class ShardError(RuntimeError):
    """An RPC to one shard failed: ``code`` is the grpc.StatusCode (``shard`` None: an endpoint of no known shard)."""

    def __init__(self, address: str, shard: int | None, code: grpc.StatusCode, details: str) -> None:
        where = f"shard {shard} ({address})" if shard is not None else address
        super().__init__(f"{where}: {code.name}: {details}")
        self.address, self.shard, self.code, self.details = address, shard, code, details


def explain_unreachable(security: Security, details: str) -> str:
    """What a failed connection's gRPC details mean for this client's settings ("" if nothing to add).

    gRPC reports a refused TLS handshake in words of its transport ("Socket
    closed", "Hostname Verification Check failed"); this names the cause
    and the setting that fixes it.
    """
    d = details
    if "Hostname Verification" in d or "No match found for server name" in d:
        name = security.server_name or "the host in its address"
        return (f"TLS handshake failed: the server's certificate does not carry {name}; pass the name it carries "
                f"as server_name (--server-name, SHARDPS_TLS_SERVER_NAME)")
    if "CERTIFICATE_VERIFY_FAILED" in d:
        return ("TLS handshake failed: the server's certificate is not signed by the CA this client trusts "
                "(tls_ca, --tls-ca, SHARDPS_TLS_CA)")
    if "WRONG_VERSION_NUMBER" in d or ("handshake" in d.lower() and not security.tls_cert and security.tls):
        return "TLS handshake failed: the server does not speak TLS (drop tls_ca) or refused this client"
    if "Tls handshake failed" in d or "SSL_ERROR" in d:
        return "TLS handshake failed"
    if "Socket closed" in d or "Connection reset" in d:
        if security.tls and not security.tls_cert:
            return ("the server closed the connection during the TLS handshake: it requires a client "
                    "certificate (mutual TLS) and this client has none (tls_cert/tls_key, --tls-cert/--tls-key, "
                    "SHARDPS_TLS_CERT/SHARDPS_TLS_KEY)")
        if not security.tls:
            return ("the server closed the connection: if it serves TLS, this client speaks plaintext "
                    "(give the CA: tls_ca, --tls-ca, SHARDPS_TLS_CA)")
        return "the server closed the connection during the TLS handshake: it does not accept this client's certificate"
    if "Connection refused" in d:
        return "nothing listens there (connection refused)"
    return ""


@dataclass(frozen=True)
class Layout:
    """How a tensor travels: full shape, wire dtype, optimizer, gradient dtype."""

    shape: tuple[int, ...]
    dtype: int
    optimizer: OptimizerSpec
    grad_dtype: int = 0  # 0: the same as dtype

    @property
    def push_dtype(self) -> int:
        return self.grad_dtype or self.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class PushResult:
    version: int
    applied: bool
    duplicate: bool
    sync: str
    loss_scale: float = 0.0
    ready_version: int = 0  # the first version that includes the gradient pushed


class PSClient:
    """A worker's client for all shards. Use ``shardps.connect`` to make one.

    Thread-safety: one thread drives a client at a time (it uses its own
    pool to talk to the shards in parallel).
    """

    def __init__(self, addresses: Sequence[str], worker_id: int = 0, num_workers: int = 1, *,
                 timeout: float = DEFAULT_TIMEOUT_S, chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES,
                 part_bytes: int | None = None, security: Security | None = None,
                 recovery_timeout: float = DEFAULT_RECOVERY_TIMEOUT_S, backups: Sequence[str] | None = None,
                 metrics_port: int | None = None, metrics_host: str | None = None) -> None:
        if not addresses:
            raise ValueError("need at least one server address")
        if not 0 <= worker_id < num_workers:
            raise ValueError(f"worker_id must be in [0, {num_workers}), got {worker_id}")
        self.addresses = list(addresses)
        self.worker_id = worker_id
        self.num_workers = num_workers
        self.timeout = timeout
        self.chunk_bytes = codec.check_chunk_bytes(chunk_bytes)
        self.part_bytes = part_bytes
        self.security = security if security is not None else Security.from_env()
        self.recovery_timeout = recovery_timeout
        self.retries_total = 0
        self.failovers_total = 0
        # Each shard's backup (--replicas 2): given, learnt when registering and from heartbeats.
        if backups is not None and len(backups) != len(self.addresses):
            raise ValueError(f"backups: one address (or '') per shard: {len(self.addresses)} shards, "
                             f"{len(backups)} backups")
        self.backups = list(backups) if backups is not None else [""] * len(self.addresses)
        self._failover_lock = threading.Lock()
        self._retired: list[grpc.Channel] = []
        self._channels: list[grpc.Channel] = []
        self._stubs: list[ps_pb2_grpc.ParameterServerStub] = []
        self._push_raw: list[Any] = []
        self._pull_raw: list[Any] = []
        for i, a in enumerate(self.addresses):
            self._install(i, a, self.security.channel(a))
        self._pool = ThreadPoolExecutor(max_workers=len(self.addresses), thread_name_prefix="psclient")
        self.shard_map: ShardMap | None = None
        self.layouts: dict[str, Layout] = {}
        self.versions = [0] * len(self.addresses)
        self.sync = ""
        self.loss_scale = 0.0  # the scale the shards want next (0: loss scaling is off)
        self.slowest_clock = 0  # the lowest worker clock seen by the last pull (ssp)
        self.clock = 0  # steps this worker had pushed when it registered
        self.lease_s = 0.0  # the job's worker lease (0: none)
        self.epoch = 0  # the job's rollback epoch this client is in
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._registered = False  # registered as a worker: close() says goodbye (Leave)
        self._closed = False
        # A worker's own /metrics (arguments, then SHARDPS_METRICS_PORT/HOST): served once it registers.
        self._metrics_port = env.pick_int(metrics_port, env.METRICS_PORT)
        self._metrics_host = env.pick(metrics_host, env.METRICS_HOST, "127.0.0.1") or "127.0.0.1"
        self.metrics: WorkerMetrics | None = None
        self.metrics_endpoint: MetricsEndpoint | None = None

    @property
    def num_shards(self) -> int:
        return len(self.addresses)

    def _install(self, shard: int, address: str, channel: grpc.Channel) -> None:
        """Talk to ``shard`` at ``address`` over ``channel`` from now on."""
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        # Push and Pull with chunk.data framed by hand (protos/framing.py): the
        # same wire format, one copy of the data on each side.
        push = channel.stream_unary(f"/{SERVICE}/Push", request_serializer=None,
                                    response_deserializer=ps_pb2.PushResponse.FromString, _registered_method=True)
        pull = channel.unary_stream(f"/{SERVICE}/Pull", request_serializer=ps_pb2.PullRequest.SerializeToString,
                                    response_deserializer=framing.parse_pull_response, _registered_method=True)
        if shard == len(self._channels):
            self._channels.append(channel)
            self._stubs.append(stub)
            self._push_raw.append(push)
            self._pull_raw.append(pull)
        else:
            self._retired.append(self._channels[shard])  # closed with the client: a heartbeat may use it now
            self._channels[shard], self._stubs[shard] = channel, stub
            self._push_raw[shard], self._pull_raw[shard] = push, pull
        self.addresses[shard] = address

    def _moved_to(self, shard: int) -> str:
        """Where a deposed primary says its shard went ("" if it does not answer or was not deposed)."""
        try:
            s = self._stubs[shard].Stats(ps_pb2.StatsRequest(), timeout=min(2.0, self.timeout))
        except grpc.RpcError:
            return ""
        return s.backup if s.role == "deposed" else ""

    def _fail_over(self, shard: int, failed: str, details: str) -> bool:
        """Ask shard's backup to take over (--replicas 2); True once requests should go there.

        The backup refuses while the primary still answers its health
        check, so a primary that is only slow keeps its shard.
        """
        with self._failover_lock:
            if self.addresses[shard] != failed:  # another thread failed over already
                return True
            backup = self.backups[shard] or self._moved_to(shard)
            if not backup:
                return False
            channel = self.security.channel(backup)
            try:
                r = ps_pb2_grpc.ParameterServerStub(channel).Promote(
                    ps_pb2.PromoteRequest(reason=f"worker {self.worker_id}: {failed} unavailable: {details[:200]}"),
                    timeout=min(10.0, self.timeout))
            except grpc.RpcError as e:
                channel.close()
                log.warning("shard %d: its backup at %s did not take over: %s: %s", shard, backup,
                            e.code().name if hasattr(e, "code") else "?", e.details() if hasattr(e, "details") else e)
                return False
            self._install(shard, backup, channel)
            self.backups[shard] = ""
            self.failovers_total += 1
        log.warning("shard %d: %s is unavailable; failed over to its backup at %s (version %d)", shard, failed,
                    backup, r.version)
        return True

    # -- plumbing -----------------------------------------------------------

    def _call(self, shard: int, fn: Callable[[], T]) -> T:
        """``fn()`` against one shard, retried while the shard is UNAVAILABLE.

        Every call shardps makes is safe to repeat (pushes are deduplicated
        per (worker, step) on the shard), so a lost reply or a restarting
        server costs a retry, not a wrong result. Between tries it waits for
        a back-off that grows from 50 ms to 2 s, for at most
        ``recovery_timeout`` seconds, then raises naming the shard. With a
        backup (``--replicas 2``) an unavailable shard fails over to it.
        """
        start = time.monotonic()
        backoff = 0.05
        tries = 0
        while True:
            address = self.addresses[shard]
            try:
                return fn()
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
                details = (e.details() if hasattr(e, "details") else str(e)) or ""
                if code == grpc.StatusCode.UNAVAILABLE and self._fail_over(shard, address, details):
                    continue
                waited = time.monotonic() - start
                if code != grpc.StatusCode.UNAVAILABLE or waited >= self.recovery_timeout:
                    if code == grpc.StatusCode.UNAVAILABLE:
                        hint = explain_unreachable(self.security, details)
                        details = f"{hint}: {details}" if hint else details
                    if code == grpc.StatusCode.UNAVAILABLE and tries:
                        details = f"still unavailable after {waited:.0f}s and {tries} retries: {details}"
                    raise ShardError(self.addresses[shard], shard, code, details) from None
            tries += 1
            self.retries_total += 1
            if tries == 1:
                log.warning("shard %d (%s) unavailable: retrying for up to %.0fs", shard, self.addresses[shard],
                            self.recovery_timeout)
            remaining = self.recovery_timeout - (time.monotonic() - start)
            # The shard is another process (maybe restarting): nothing local to wait on.
            time.sleep(max(0.0, min(backoff, remaining)))
            backoff = min(2.0, backoff * 2)

    def _each(self, fn: Callable[[int], T], shards: Iterable[int] | None = None) -> list[T]:
        """Run ``fn(shard)`` for every shard in parallel; raise the first failure."""
        idx = list(range(self.num_shards)) if shards is None else list(shards)
        futs = [self._pool.submit(self._call, i, lambda i=i: fn(i)) for i in idx]
        results, first_err = [], None
        for f in futs:
            try:
                results.append(f.result())
            except BaseException as e:  # noqa: BLE001 - re-raised below, after all finished
                first_err = first_err or e
                results.append(None)
        if first_err is not None:
            raise first_err
        return results

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until every shard's channel is connected (TimeoutError names the laggards).

        A shard with a known backup whose primary does not answer within a
        few seconds fails over to it.
        """
        t = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + t
        futs = [grpc.channel_ready_future(c) for c in self._channels]
        missing = []
        for i, (a, f) in enumerate(zip(list(self.addresses), futs)):
            try:
                patience = max(0.0, deadline - time.monotonic())
                f.result(timeout=min(patience, 5.0) if self.backups[i] else patience)
            except grpc.FutureTimeoutError:
                if not (self.backups[i] and self._fail_over(i, a, "not answering when connecting")):
                    missing.append(a)
            finally:
                f.cancel()
        if missing:
            reasons = [f"{a}: {why}" for a in missing if (why := self._probe(a))]
            raise TimeoutError(f"no parameter server answered within {t:.0f}s at {missing}"
                               + (f" ({'; '.join(reasons)})" if reasons else ""))

    def _probe(self, address: str) -> str:
        """Why ``address`` does not answer, from one short health check ("" when it answers now)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        channel = self.security.channel(address)
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2.0)
            return ""
        except grpc.RpcError as e:
            details = (e.details() if hasattr(e, "details") else str(e)) or ""
            return explain_unreachable(self.security, details) or details
        finally:
            channel.close()

    def _require_layout(self, names: Iterable[str]) -> None:
        if self.shard_map is None:
            raise RuntimeError("no tensors known yet: call register() or attach() first")
        unknown = [n for n in names if n not in self.layouts]
        if unknown:
            raise KeyError(f"unknown tensors {unknown[:5]}; registered: {len(self.layouts)}")

    # -- registration -------------------------------------------------------

    def register(self, tensors: Mapping[str, torch.Tensor], optimizer: OptimizerChoice, *,
                 sync: str = "bsp", provides_values: bool | None = None,
                 grad_dtype: torch.dtype | None = None, loss_scaling: LossScaling | None = None,
                 max_whole_bytes: int = DEFAULT_MAX_WHOLE_BYTES, staleness_remedy: str = "none") -> list[str]:
        """Register ``tensors`` on their shards (idempotent across workers).

        Only a worker that provides values (by default worker 0) creates
        tensors, from its values; the others wait until they exist. Every
        worker of a job must pass the same tensors and settings. Returns the
        names this call created.

        ``grad_dtype`` (fp16/bf16) makes gradients travel in that dtype;
        ``loss_scaling`` turns on dynamic loss scaling on the shards;
        ``staleness_remedy`` ("lr-scale", "dc-asgd:LAMBDA") corrects stale
        gradients under asp/ssp (see shardps.server.remedies).
        Tensors whose optimizer is not elementwise (Adafactor, SM3) stay on
        one shard up to ``max_whole_bytes``; larger ones are split one row
        block per shard and their statistics reduced across those shards.
        """
        if provides_values is None:
            provides_values = self.worker_id == 0
        gwire = codec.to_wire_dtype(grad_dtype) if grad_dtype is not None else 0
        layouts: dict[str, Layout] = {}
        infos = []
        for name, t in tensors.items():
            opt = optimizer(name, t) if callable(optimizer) else optimizer
            wire = codec.to_wire_dtype(t.dtype)
            layouts[name] = Layout(tuple(t.shape), wire, opt, gwire if gwire != wire else 0)
            if t.numel() == 0:
                continue
            infos.append(TensorInfo(name, tuple(t.shape), t.element_size(), opt.elementwise))
        smap = build_shard_map(infos, self.num_shards, part_bytes=self.part_bytes,
                               max_whole_bytes=max_whole_bytes)
        flats = {n: tensors[n].detach().to("cpu").contiguous().view(-1) for n in tensors} if provides_values else {}
        scaling = loss_scaling.to_proto() if loss_scaling is not None else None

        def requests(shard: int) -> Iterator[ps_pb2.RegisterRequest]:
            parts = smap.parts_for(shard)
            by_name: dict[str, list[tuple[int, int]]] = {}
            for p in parts:
                by_name.setdefault(p.name, []).append((p.start, p.stop))
            specs = []
            for n, rs in by_name.items():
                lay = layouts[n]
                holders = smap.holders(n)
                specs.append(ps_pb2.TensorSpec(
                    name=n, shape=list(lay.shape), dtype=lay.dtype, grad_dtype=lay.push_dtype,  # type: ignore[arg-type]
                    optimizer=lay.optimizer.to_proto(), parts=[ps_pb2.Part(start=a, stop=b) for a, b in rs],
                    peers=self.addresses if holders else [], holders=holders))
            yield ps_pb2.RegisterRequest(worker_id=self.worker_id, num_workers=self.num_workers,
                                         sync=sync, tensors=specs, provides_values=provides_values,
                                         loss_scaling=scaling, staleness_remedy=staleness_remedy)
            if provides_values:
                for p in parts:
                    flat = flats[p.name]
                    for off, data in codec.encode_range(flat, p.start, p.stop, self.chunk_bytes):
                        yield ps_pb2.RegisterRequest(chunk=ps_pb2.Chunk(
                            name=p.name, offset=off, dtype=layouts[p.name].dtype, data=data))  # type: ignore[arg-type]

        responses = self._each(lambda i: self._stubs[i].Register(
            requests(i), timeout=self.timeout, wait_for_ready=True))
        created: list[str] = []
        for i, r in enumerate(responses):
            if (r.shard_index, r.num_shards) != (i, self.num_shards):
                raise ValueError(
                    f"server {self.addresses[i]} is shard {r.shard_index} of {r.num_shards}, but was "
                    f"given as shard {i} of {self.num_shards}: list addresses in shard order"
                )
            self.versions[i] = r.version
            created.extend(r.created)
            self.backups[i] = r.backup
        self.shard_map, self.layouts, self.sync = smap, layouts, responses[0].sync
        self.loss_scale = responses[0].loss_scale
        # The step to go on from: the lowest any shard expects. A push that reached some shards and
        # not others (a crash, a checkpoint taken between them) is sent again: the shards that took
        # it in acknowledge it as a duplicate, the others apply it, so every shard sees every step.
        self.clock = min(r.worker_clock for r in responses)
        self.lease_s = max(r.lease_seconds for r in responses)
        self.epoch = max(r.epoch for r in responses)
        self._registered = True
        self._serve_metrics()
        self.start_heartbeats()
        return created

    def _serve_metrics(self) -> None:
        """Serve this worker's /metrics when a port was given (argument or SHARDPS_METRICS_PORT)."""
        if self._metrics_port is None or self.metrics_endpoint is not None:
            return
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry()
        metrics = WorkerMetrics(registry, self.worker_id)
        try:
            self.metrics_endpoint = serve_metrics(registry, self._metrics_host, self._metrics_port)
        except OSError as e:
            raise OSError(f"worker {self.worker_id}: cannot serve metrics on {self._metrics_host}:"
                          f"{self._metrics_port} (metrics_port or {env.METRICS_PORT}): {e.strerror}") from None
        self.metrics = metrics

    def attach(self) -> None:
        """Learn the tensors and their placement from the shards (for pull-only clients)."""
        stats = self._each(lambda i: self._stubs[i].Stats(ps_pb2.StatsRequest(), timeout=self.timeout,
                                                          wait_for_ready=True))
        from shardps.protos.shardmap import Part

        parts, layouts = [], {}
        for i, s in enumerate(stats):
            for t in s.tensors:
                spec = t.spec
                gd = spec.grad_dtype if spec.grad_dtype != spec.dtype else 0
                layouts[spec.name] = Layout(tuple(spec.shape), spec.dtype, spec_from_proto(spec.optimizer), gd)
                parts.extend(Part(spec.name, p.start, p.stop, i) for p in spec.parts)
            self.versions[i] = s.version
            self.backups[i] = s.backup
        infos = tuple(TensorInfo(n, lay.shape, codec.itemsize(lay.dtype)) for n, lay in sorted(layouts.items()))
        self.shard_map = ShardMap(self.num_shards, tuple(sorted(parts, key=lambda p: (p.name, p.start))), infos)
        self.layouts = layouts
        self.sync = stats[0].sync
        self.loss_scale = stats[0].loss_scale
        self.epoch = max(s.epoch for s in stats)

    # -- data path ----------------------------------------------------------

    def push(self, grads: Mapping[str, torch.Tensor], step: int,
             base_versions: Sequence[int] | None = None, *, loss_scale: float = 0.0,
             found_inf: bool | None = None) -> list[PushResult]:
        """Send gradients (one per named tensor) to their shards; one result per shard.

        Every shard gets a Push, an empty one if it owns none of ``grads``,
        so barriers see every worker. ``base_versions`` defaults to the
        versions of the last pull. ``loss_scale``: the scale the gradients
        were computed with (the shards unscale them). ``found_inf`` defaults
        to whether any gradient, as sent, holds an inf or nan; every shard is
        told, so all skip such a step together.
        """
        self._require_layout(grads)
        assert self.shard_map is not None
        bases = list(self.versions if base_versions is None else base_versions)
        flats: dict[str, torch.Tensor] = {}
        for name, g in grads.items():
            lay = self.layouts[name]
            if tuple(g.shape) != lay.shape:
                raise ValueError(f"gradient of {name!r}: expected shape {lay.shape}, got {tuple(g.shape)}")
            flats[name] = g.detach().to("cpu", codec.to_torch_dtype(lay.push_dtype)).contiguous().view(-1)
        if found_inf is None:
            found_inf = not all(codec.all_finite(f) for f in flats.values())

        def requests(shard: int) -> Iterator[bytes]:
            # Serialized PushRequests, the data copied once from the gradient (framing.py).
            prefix, suffix = framing.header(ps_pb2.PushRequest, worker_id=self.worker_id, step=step,
                                            base_version=bases[shard], found_inf=found_inf,
                                            loss_scale=loss_scale, epoch=self.epoch)
            sent = False
            for p in self.shard_map.parts_for(shard):  # type: ignore[union-attr]
                flat = flats.get(p.name)
                if flat is None:
                    continue
                lay = self.layouts[p.name]
                for _, _, msg in framing.chunk_messages(prefix, framing.PUSH_CHUNK_FIELD, suffix, p.name,
                                                        lay.push_dtype, lay.shape, flat, p.start, p.stop,
                                                        self.chunk_bytes):
                    yield msg
                    sent = True
            if not sent:
                yield prefix + suffix

        responses = self._each(lambda i: self._push_raw[i](requests(i), timeout=self.timeout))
        out = [PushResult(r.version, r.applied, r.duplicate, r.sync, r.loss_scale, r.ready_version)
               for r in responses]
        self.sync = out[0].sync or self.sync
        self.loss_scale = out[0].loss_scale
        return out

    def pull(self, names: Iterable[str] | None = None, *, out: Mapping[str, torch.Tensor] | None = None,
             min_versions: Sequence[int] | int | None = None, dtype: torch.dtype | None = None,
             min_clock: int = 0) -> dict[str, torch.Tensor]:
        """Fetch weights from every shard in parallel.

        ``out`` tensors (any device) are filled in place; otherwise new CPU
        tensors are returned. ``min_versions`` makes each shard wait (up to
        the client's timeout) until it has reached that version;
        ``min_clock`` until every worker has pushed that many steps (ssp).
        """
        wanted = list(self.layouts if names is None else names)
        self._require_layout(wanted)
        assert self.shard_map is not None
        if isinstance(min_versions, int) or min_versions is None:
            mins = [min_versions or 0] * self.num_shards
        else:
            mins = list(min_versions)
        wire = codec.to_wire_dtype(dtype) if dtype is not None else ps_pb2.DTYPE_UNSPECIFIED
        result: dict[str, torch.Tensor] = {}
        staging: dict[str, torch.Tensor] = {}  # flat CPU views written by the shard threads
        for n in wanted:
            lay = self.layouts[n]
            tdt = dtype or codec.to_torch_dtype(lay.dtype)
            target = out.get(n) if out is not None else None
            if target is None:
                target = torch.empty(lay.shape, dtype=tdt)
            elif tuple(target.shape) != lay.shape:
                raise ValueError(f"out[{n!r}]: expected shape {lay.shape}, got {tuple(target.shape)}")
            result[n] = target
            direct = target.device.type == "cpu" and target.is_contiguous() and target.dtype == tdt
            staging[n] = target.detach().view(-1) if direct else torch.empty(lay.numel, dtype=tdt)
        owners: dict[int, list[str]] = {}
        for p in self.shard_map.parts:
            if p.name in staging:
                owners.setdefault(p.server, [])
                if not owners[p.server] or owners[p.server][-1] != p.name:
                    owners[p.server].append(p.name)

        def fetch(shard: int) -> int:
            req = ps_pb2.PullRequest(worker_id=self.worker_id, names=owners[shard],
                                     min_version=mins[shard], dtype=wire, chunk_bytes=self.chunk_bytes,  # type: ignore[arg-type]
                                     min_clock=min_clock, epoch=self.epoch)
            version = -1
            with torch.no_grad():
                # chunk.data is a view of the received message: decode copies nothing,
                # copy_ is the one copy on this side.
                for resp in self._pull_raw[shard](req, timeout=self.timeout):
                    c = resp.chunk
                    values = codec.decode(c.data, c.dtype)
                    dst = staging[c.name]
                    if c.offset < 0 or c.offset + values.numel() > dst.numel():
                        raise ValueError(f"shard {shard} sent {c.name!r} [{c.offset}, +{values.numel()}) "
                                         f"outside its {dst.numel()} elements")
                    dst[c.offset : c.offset + values.numel()].copy_(values)
                    version = resp.version
                    self.loss_scale = resp.loss_scale
                    self.sync = resp.sync or self.sync
                    self.slowest_clock = resp.slowest_clock
            return version

        shards = sorted(owners)
        versions = self._each(fetch, shards)
        for s, v in zip(shards, versions):
            if v >= 0:
                self.versions[s] = v
        with torch.no_grad():
            for n, target in result.items():
                flat = staging[n]
                if flat.data_ptr() != target.data_ptr() or target.device.type != "cpu":
                    target.copy_(flat.view(target.shape))
        return result

    def export_state(self, names: Iterable[str] | None = None) -> dict[str, dict[str, Any]]:
        """Weights and optimizer state from every shard, as a state_dict-style mapping.

        ``{name: {"weight": full fp32 tensor, "optimizer": {part_start: {key: tensor}}, "version": {shard: v}}}``:
        optimizer state stays per part (factored state is sized by the part).
        """
        wanted = list(self.layouts if names is None else names)
        self._require_layout(wanted)
        assert self.shard_map is not None
        owners: dict[int, list[str]] = {}
        for p in self.shard_map.parts:
            if p.name in wanted and p.name not in owners.setdefault(p.server, []):
                owners[p.server].append(p.name)

        def fetch(shard: int) -> tuple[int, list[tuple[str, int, int, str, torch.Tensor]]]:
            req = ps_pb2.PullStateRequest(names=owners[shard], chunk_bytes=self.chunk_bytes)
            items: list[tuple[str, int, int, str, torch.Tensor]] = []
            version = -1
            for r in self._stubs[shard].PullState(req, timeout=self.timeout):
                c = r.chunk
                values = codec.decode(c.data, c.dtype)
                if c.offset == 0:  # the first chunk of a state tensor carries its shape
                    items.append((r.name, r.part_start, r.part_stop, r.key,
                                  torch.empty(tuple(r.shape), dtype=values.dtype)))
                dst = items[-1][4].view(-1)
                dst[c.offset : c.offset + values.numel()].copy_(values)
                version = r.version
            return version, items

        shards = sorted(owners)
        out: dict[str, dict[str, Any]] = {
            n: {"weight": torch.empty(self.layouts[n].shape, dtype=torch.float32), "optimizer": {}, "version": {}}
            for n in wanted
        }
        for shard, (version, items) in zip(shards, self._each(fetch, shards)):
            for name, start, stop, key, t in items:
                entry = out[name]
                entry["version"][shard] = version
                if key == "weight":
                    entry["weight"].view(-1)[start:stop].copy_(t.reshape(-1))
                else:
                    entry["optimizer"].setdefault(start, {})[key] = t
        return out

    def recover(self) -> int:
        """After an ABORTED answer: bring every shard to one rollback epoch; return our next step.

        If a shard restarted from its checkpoint (it says ``recovering``), or
        the shards are in different epochs (a rollback in progress), every
        shard rolls back to the newest checkpoint version that all of them
        hold. Idempotent: workers may do this concurrently. Then this client
        takes the shards' epoch, versions and its own clock.
        """
        stats = self._each(lambda i: self._stubs[i].Stats(ps_pb2.StatsRequest(), timeout=self.timeout))
        epochs = [s.epoch for s in stats]
        recovering = any(s.recovering for s in stats)
        if recovering or len(set(epochs)) > 1:
            common = set.intersection(*(set(s.checkpoint_versions) for s in stats))
            if not common:
                held = {i: list(s.checkpoint_versions) for i, s in enumerate(stats)}
                raise RuntimeError(f"cannot recover: no checkpoint version is held by every shard ({held})")
            version, epoch = max(common), max(epochs) + (1 if recovering else 0)
            log.warning("worker %d: rolling the job back to version %d (epoch %d)", self.worker_id, version, epoch)
            self._each(lambda i: self._stubs[i].Rollback(ps_pb2.RollbackRequest(version=version, epoch=epoch),
                                                         timeout=self.timeout))
            stats = self._each(lambda i: self._stubs[i].Stats(ps_pb2.StatsRequest(), timeout=self.timeout))
        self.epoch = max(s.epoch for s in stats)
        self.versions = [s.version for s in stats]
        self.sync = stats[0].sync or self.sync
        self.loss_scale = stats[0].loss_scale
        return min(s.worker_clocks.get(self.worker_id, -1) for s in stats) + 1  # as in register()

    def checkpoint(self) -> list[tuple[int, str]]:
        """Ask every shard to write a checkpoint now: [(version, path)] per shard."""
        res = self._each(lambda i: self._stubs[i].Checkpoint(ps_pb2.CheckpointRequest(), timeout=self.timeout))
        return [(r.version, r.path) for r in res]

    def set_sync(self, sync: str) -> list[str]:
        """Switch the running job's sync mode on every shard; workers follow from their next step."""
        res = self._each(lambda i: self._stubs[i].SetSync(ps_pb2.SetSyncRequest(sync=sync), timeout=self.timeout,
                                                          wait_for_ready=True))
        self.sync = res[0].sync
        return [r.sync for r in res]

    def stats(self) -> list[dict[str, Any]]:
        """Per-shard status as plain dicts: version, tensors, bytes, counters, staleness counts."""
        res = self._each(lambda i: self._stubs[i].Stats(ps_pb2.StatsRequest(), timeout=self.timeout))
        return [stats_to_dict(r) for r in res]

    def start_heartbeats(self, interval: float | None = None) -> None:
        """Renew this worker's lease on every shard in the background (every lease / 3 by default).

        Push and Pull renew it too; heartbeats keep a worker that computes
        for longer than its lease from being evicted.
        """
        if self._hb_thread is not None or not self.lease_s:
            return
        every = interval or self.lease_s / 3

        def loop() -> None:
            while not self._hb_stop.wait(every):
                for i, stub in enumerate(list(self._stubs)):
                    if self._hb_stop.is_set():
                        return
                    try:
                        r = stub.Heartbeat(ps_pb2.HeartbeatRequest(worker_id=self.worker_id), timeout=every)
                    except grpc.RpcError as e:  # the data path reports failures; here only log them
                        log.debug("heartbeat to shard %d failed: %s", i, e.code())
                        continue
                    except ValueError:  # the channel was closed under it (close() gave up waiting)
                        return
                    if r.backup:  # a backup attached since registering (after a takeover, a spare)
                        with self._failover_lock:
                            if self._stubs[i] is stub:
                                self.backups[i] = r.backup

        self._hb_thread = threading.Thread(target=loop, name=f"worker{self.worker_id}-heartbeat", daemon=True)
        self._hb_thread.start()

    def stop_heartbeats(self) -> None:
        """Stop renewing the lease in the background (the worker is evicted once it lasts longer)."""
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=10)

    def leave(self, timeout: float = 5.0) -> None:
        """Tell every shard this worker is done, so barriers go on without it at once (not after its lease).

        ``close()`` does this for a registered worker. Best effort: a shard
        that does not answer within ``timeout`` evicts the worker later.
        """
        if not self._registered:
            return
        self._registered = False

        def bye(i: int) -> None:
            try:
                self._stubs[i].Leave(ps_pb2.LeaveRequest(worker_id=self.worker_id), timeout=timeout)
            except grpc.RpcError as e:
                log.info("worker %d: shard %d did not take its leave (%s); its lease will expire",
                         self.worker_id, i, e.code() if hasattr(e, "code") else e)

        for f in [self._pool.submit(bye, i) for i in range(self.num_shards)]:
            f.result()

    def close(self, *, leave: bool = True) -> None:
        """Say goodbye (a registered worker), stop heartbeats and metrics, close the channels. Idempotent.

        ``leave=False`` keeps the worker's place in the job instead (until
        its lease runs out): for a process that hands its worker id over to
        another one, which registers with it.
        """
        if self._closed:
            return
        self._closed = True
        self.stop_heartbeats()
        try:
            if leave:
                self.leave(timeout=min(5.0, self.timeout))
        finally:
            self._pool.shutdown(wait=True)
            for c in self._channels + self._retired:
                c.close()
            if self.metrics_endpoint is not None:
                self.metrics_endpoint.close()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(addresses: Sequence[str] | str | None = None, worker_id: int | None = None,
            num_workers: int | None = None, *, timeout: float = DEFAULT_TIMEOUT_S,
            chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES, part_bytes: int | None = None,
            ready_timeout: float | None = 60.0, security: Security | None = None,
            recovery_timeout: float = DEFAULT_RECOVERY_TIMEOUT_S, backups: Sequence[str] | str | None = None,
            metrics_port: int | None = None, metrics_host: str | None = None) -> PSClient:
    """Connect to the shards at ``addresses`` (in shard order; a comma-separated string works).

    Every setting comes from its argument, else its environment variable,
    else the default: ``addresses`` (``SHARDPS_ADDRESSES``), ``worker_id``
    (``SHARDPS_WORKER_ID``, 0), ``num_workers`` (``SHARDPS_NUM_WORKERS``, 1),
    ``backups`` (``SHARDPS_BACKUPS``, when the addresses come from it too), ``security`` (``SHARDPS_TLS_*``,
    ``SHARDPS_AUTH_TOKEN[_FILE]``), ``metrics_port`` / ``metrics_host``
    (``SHARDPS_METRICS_PORT`` / ``_HOST``: a registered worker serves its
    Prometheus metrics there).

    Waits up to ``ready_timeout`` seconds for every shard to accept a
    connection (None: do not wait). ``backups`` (``--replicas 2``): each
    shard's backup, in shard order; workers also learn them when they
    register, so give them for a worker that may start after a server died.
    """
    from_env = addresses is None
    if addresses is None:
        addresses = env.get_list(env.ADDRESSES)
        if addresses is None:
            raise ValueError(f"no server addresses: pass addresses= or set {env.ADDRESSES}=HOST:PORT,...")
    if isinstance(addresses, str):
        addresses = [a.strip() for a in addresses.split(",") if a.strip()]
    if backups is None and from_env:  # the backups of those shards, not of shards passed here
        backups = env.get_list(env.BACKUPS)
    if isinstance(backups, str):
        backups = [a.strip() for a in backups.split(",")]
    wid = env.pick_int(worker_id, env.WORKER_ID, 0)
    nw = env.pick_int(num_workers, env.NUM_WORKERS, 1)
    assert wid is not None and nw is not None
    client = PSClient(addresses, wid, nw, timeout=timeout, chunk_bytes=chunk_bytes,
                      part_bytes=part_bytes, security=security, recovery_timeout=recovery_timeout, backups=backups,
                      metrics_port=metrics_port, metrics_host=metrics_host)
    if ready_timeout is not None:
        try:
            client.wait_ready(ready_timeout)
        except BaseException:
            client.close()
            raise
    return client


_COUNTERS = ("version", "pushes_total", "applied_updates_total", "gradients_applied_total",
             "push_bytes_total", "pull_bytes_total")


def stats_to_dict(r: ps_pb2.StatsResponse) -> dict[str, Any]:
    """A StatsResponse as plain Python values (ints stay ints)."""
    out: dict[str, Any] = {
        "shard_index": r.shard_index,
        "num_shards": r.num_shards,
        "sync": r.sync,
        "num_workers": r.num_workers,
        "registered_workers": list(r.registered_workers),
        "tensors": [
            {
                "name": t.spec.name,
                "shape": tuple(t.spec.shape),
                "dtype": codec.dtype_name(t.spec.dtype),
                "optimizer": t.spec.optimizer.name,
                "parts": [(p.start, p.stop) for p in t.spec.parts],
                "weight_bytes": t.weight_bytes,
                "optimizer_state_bytes": t.optimizer_state_bytes,
            }
            for t in r.tensors
        ],
        "staleness_counts": {int(k): int(v) for k, v in r.staleness_counts.items()},
        "worker_clocks": {int(k): int(v) for k, v in r.worker_clocks.items()},
        "skipped_steps_total": int(r.skipped_steps_total),
        "duplicate_pushes_total": int(r.duplicate_pushes_total),
        "loss_scale": float(r.loss_scale),
        "sync_switches_total": int(r.sync_switches_total),
        "checkpoint_versions": [int(v) for v in r.checkpoint_versions],
        "evicted_workers": list(r.evicted_workers),
        "evictions_total": int(r.evictions_total),
        "left_workers": list(r.left_workers),
        "leaves_total": int(r.leaves_total),
        "epoch": int(r.epoch),
        "recovering": bool(r.recovering),
        "waiting_pulls": int(r.waiting_pulls),
        "role": r.role,
        "backup": r.backup,
        "replica_state": r.replica_state,
        "replicated_ops_total": int(r.replicated_ops_total),
        "replication_lag_ops": int(r.replication_lag_ops),
    }
    for key in _COUNTERS:
        out[key] = int(getattr(r, key))
    return out
