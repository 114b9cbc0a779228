"""PSClient: one worker's connection to every shard.

Routes tensors by the shard map (``register``/``attach``; layouts:
``worker/layout.py``), pushes gradients and pulls weights over all shards in
parallel (``worker/datapath/push.py``, ``bucketedpush.py``, ``pull.py``: they return
what the shards said, a ``JobView`` the client takes in ``apply``), exports
state and recovers from a rollback. Channels, deadlines, retries and
fail-over are the transport's, the lease the heartbeats'; failures surface
as ``ShardError`` (``worker/errors.py``); operator calls are
``worker/operator.py``'s.

Over 400 lines: one class whose methods (register, attach, push, pull,
recover, leave) read and update the same state (shard map, layouts,
versions, epoch, clock, sync, loss scale); everything else lives in the
modules named above.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from shardps.exposition import MetricsEndpoint
from shardps.protos import codec, env
from shardps.protos.amp import LossScaling
from shardps.protos.results import PushResult
from shardps.protos.security import Security
from shardps.protos.shardmap import ShardMap
from shardps.protos.shardps.v1 import ps_pb2
from shardps.worker import export, layout, operator
from shardps.worker.compress import Compressor
from shardps.worker.datapath import push
from shardps.worker.datapath.bucketedpush import BucketedPush
from shardps.worker.datapath.buffers import HostBuffers
from shardps.worker.datapath.pull import PullInFlight
from shardps.worker.datapath.shardpaths import ShardPaths
from shardps.worker.datapath.shm import ShmLink, shm_probe
from shardps.worker.datapath.transport import Transport
from shardps.worker.errors import ShardError
from shardps.worker.job import recovery
from shardps.worker.job.heartbeat import Heartbeats
from shardps.worker.job.jobview import JobView
from shardps.worker.layout import DEFAULT_MAX_WHOLE_BYTES, Layout, OptimizerChoice
from shardps.worker.metrics import WorkerMetrics, serve_worker_metrics
from shardps.worker.rows.client import RowCalls, RowClient

# Importable from here as before: ShardError (worker/errors.py); Layout, OptimizerChoice, DEFAULT_MAX_WHOLE_BYTES
# (worker/layout.py).
__all__ = ["DEFAULT_MAX_WHOLE_BYTES", "Layout", "OptimizerChoice", "PSClient", "PushResult", "ShardError", "connect"]

log = logging.getLogger("shardps.worker")

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_RECOVERY_TIMEOUT_S = 60.0


class PSClient(RowCalls):
    """A worker's client for all shards. Use ``shardps.connect`` to make one.

    Thread-safety: one thread drives a client at a time (it uses its own
    pool to talk to the shards in parallel).
    """

    # A superset of the tensors registered whose shard map register() plans (a TP rank's: worker/tp/servers.py).
    plan_over: Mapping[str, torch.Tensor] | None = None

    def __init__(self, addresses: Sequence[str], worker_id: int = 0, num_workers: int = 1, *,
                 timeout: float = DEFAULT_TIMEOUT_S, chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES,
                 part_bytes: int | None = None, security: Security | None = None,
                 recovery_timeout: float = DEFAULT_RECOVERY_TIMEOUT_S, backups: Sequence[str] | None = None,
                 metrics_port: int | None = None, metrics_host: str | None = None, shm: bool | None = None) -> None:
        if not addresses:
            raise ValueError("need at least one server address")
        if not 0 <= worker_id < num_workers:
            raise ValueError(f"worker_id must be in [0, {num_workers}), got {worker_id}")
        self.worker_id, self.num_workers = worker_id, num_workers
        self.chunk_bytes = codec.check_chunk_bytes(chunk_bytes)
        self.part_bytes = part_bytes
        # Each shard's backup (--replicas 2): given, learnt when registering and from heartbeats.
        self.transport = Transport(addresses, security=security if security is not None else Security.from_env(),
                                   timeout=timeout, recovery_timeout=recovery_timeout, backups=backups,
                                   worker_id=worker_id)
        self.shard_map: ShardMap | None = None
        self.layouts: dict[str, Layout] = {}
        self.versions = [0] * len(self.addresses)
        self.sync = ""
        self.sync_switch = 0  # the job's sync switch ``sync`` came from (0: the job's first mode)
        self.loss_scale = 0.0  # the scale the shards want next (0: loss scaling is off)
        self.slowest_clock = 0  # the lowest worker clock seen by the last pull (ssp)
        self.clock = 0  # steps this worker had pushed when it registered
        self.ready_versions = [0] * len(self.addresses)  # each shard's, from which its last push is in (Register)
        self.lease_s = 0.0  # the job's worker lease (0: none)
        self.epoch = 0  # the job's rollback epoch this client is in
        self.heartbeats = Heartbeats(self.transport, worker_id)
        # The same-host fast path (worker/datapath/shm.py): asked for (argument, SHARDPS_SHM, on by default); each
        # shard's path (worker/datapath/paths.py): shared memory if it read this worker's probe at Register, else the
        # bytes in the data connection's frames.
        self.use_shm = env.pick_bool(shm, env.SHM, True)
        self.buffers = HostBuffers()  # pinned host memory and CUDA copy streams, kept across steps
        self.paths = ShardPaths(worker_id, len(self.addresses))
        self._tensor_shards: tuple[ShardMap | None, dict[str, set[int]]] = (None, {})  # per shard map
        # failed over to a backup: the shard's calls on this worker's connection to the backup's process
        self.transport.on_moved = self.paths.moved
        self._registered = self._closed = False  # registered as a worker: close() says goodbye (Leave)
        # row tables (docs/sparse.md); their pushes carry the epoch once this client registered tensors (it
        # knows the job's epoch then: a client of row tables alone pushes unchecked, as before)
        self.rows = RowClient(self.transport, worker_id, self.chunk_bytes,
                              epoch=lambda: self.epoch if self.layouts else None)
        # A worker's own /metrics (arguments, then SHARDPS_METRICS_PORT/HOST): served once it registers.
        self._metrics_port = env.pick_int(metrics_port, env.METRICS_PORT)
        self._metrics_host = env.pick(metrics_host, env.METRICS_HOST, "127.0.0.1") or "127.0.0.1"
        self.metrics: WorkerMetrics | None = None
        self.metrics_endpoint: MetricsEndpoint | None = None

    # -- the transport's settings and counters (worker/datapath/transport.py) ---------

    @property
    def num_shards(self) -> int:
        return self.transport.num_shards

    @property
    def addresses(self) -> list[str]:
        """Each shard's address, in shard order (after a fail-over: its backup's)."""
        return self.transport.addresses

    @property
    def backups(self) -> list[str]:
        """Each shard's backup ('' when none is known)."""
        return self.transport.backups

    @property
    def security(self) -> Security:
        return self.transport.security

    @property
    def timeout(self) -> float:
        """Every RPC's deadline, in seconds."""
        return self.transport.timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self.transport.timeout = value

    @property
    def recovery_timeout(self) -> float:
        """How long an unavailable shard is retried, in seconds."""
        return self.transport.recovery_timeout

    @recovery_timeout.setter
    def recovery_timeout(self, value: float) -> None:
        self.transport.recovery_timeout = value

    @property
    def retries_total(self) -> int:
        return self.transport.retries_total

    @property
    def failovers_total(self) -> int:
        return self.transport.failovers_total

    @property
    def sync_said(self) -> tuple[str, int]:
        """(sync mode, the sync switch it came from), as every Push says them (``Route.sync_said``)."""
        return self.sync, self.sync_switch

    @property
    def shm_links(self) -> list[ShmLink | None]:
        """Each shard's shared-memory link, None for gRPC (a snapshot of ``paths``, for tests and diagnostics)."""
        return self.paths.links

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until every shard's channel is connected (TimeoutError names the laggards); a shard with a
        known backup whose primary does not answer within a few seconds fails over to it."""
        self.transport.wait_ready(timeout)

    def apply(self, view: JobView) -> None:
        """Take what the shards said about the job (a push's or pull's ``JobView``, or a register's,
        attach's, recover's, set_sync's): the one place the client's ``sync``, ``loss_scale``,
        ``slowest_clock`` and ``versions`` change. Call it from the thread that drives the client."""
        if view.sync and (view.sync_switch is None and not self.sync
                          or view.sync_switch is not None and view.sync_switch >= self.sync_switch):
            self.sync, self.sync_switch = view.sync, view.sync_switch or 0
        if view.loss_scale is not None:
            self.loss_scale = view.loss_scale
        if view.slowest_clock is not None:
            self.slowest_clock = view.slowest_clock
        for shard, version in view.versions:
            self.versions[shard] = version

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
        layouts, smap = layout.plan(tensors, optimizer, self.num_shards, plan_over=self.plan_over,
                                    grad_dtype=grad_dtype, part_bytes=self.part_bytes, max_whole_bytes=max_whole_bytes)
        flats = {n: tensors[n].detach().to("cpu").contiguous().view(-1) for n in tensors} if provides_values else None
        scaling = loss_scaling.to_proto() if loss_scaling is not None else None
        probe = shm_probe(self.worker_id) if self.use_shm else None

        def requests(shard: int) -> Iterator[ps_pb2.RegisterRequest]:
            return layout.register_requests(shard, smap, layouts, worker_id=self.worker_id,
                                            num_workers=self.num_workers, sync=sync, addresses=self.addresses,
                                            values=flats, chunk_bytes=self.chunk_bytes, loss_scaling=scaling,
                                            staleness_remedy=staleness_remedy,
                                            shm_probe=probe[0].name if probe else "",
                                            shm_token=probe[1] if probe else b"")

        t = self.transport

        def register_on(i: int) -> ps_pb2.RegisterResponse:
            r: ps_pb2.RegisterResponse = t.stub(i).Register(requests(i), timeout=self.timeout, wait_for_ready=True)
            self.heartbeats.joined(i, r.lease_seconds)  # kept while another shard is slow to answer
            return r

        try:
            responses = t.each(register_on)
        finally:
            if probe is not None:
                probe[0].close()
        layout.check_shard_order(responses, self.addresses)
        created = [n for r in responses for n in r.created]
        for i, r in enumerate(responses):
            self.backups[i] = r.backup
        self.shard_map, self.layouts = smap, layouts
        self.apply(JobView.of_register(responses))
        # The step to go on from: the lowest any shard expects. A push that reached some shards and
        # not others (a crash, a checkpoint taken between them) is sent again: the shards that took
        # it in acknowledge it as a duplicate, the others apply it, so every shard sees every step.
        # But a worker back after an eviction (a partition: it went on with the shards it reached) goes on
        # from the newest, where every shard behind it evicted it and skips it there (RegisterResponse.skips):
        # from the lowest, the shards ahead would answer its pushes as duplicates, counted in no round, and
        # each shard's round would wait for a push the worker sends the other.
        clocks = [r.worker_clock for r in responses]
        newest = max(clocks)
        behind = [r for r, c in zip(responses, clocks, strict=True) if c < newest]
        self.clock = newest if behind and all(r.skips for r in behind) else min(clocks)
        # The versions to pull from before the next push: where a barrier still holds this worker's last push
        # and the next one is a new step there (a rejoin at the newest clock), one past the shard's version, or
        # that push would be refused (its last one still waits); elsewhere the shard's version.
        self.ready_versions = [max(r.ready_version, r.version) if self.clock >= r.worker_clock else r.version
                               for r in responses]
        self.lease_s = max(r.lease_seconds for r in responses)
        self.epoch = max(r.epoch for r in responses)
        for i, r in enumerate(responses):  # the shards' fencing epochs (--coordinator), carried by every request
            self.transport.fence_epochs[i] = r.fence_epoch
        self.paths.open(smap, layouts, [r.shm for r in responses], responses, self.transport)
        self._registered = True
        self._serve_metrics()
        self.start_heartbeats()
        return created

    def _serve_metrics(self) -> None:
        """Serve this worker's /metrics when a port was given (argument or SHARDPS_METRICS_PORT)."""
        if self._metrics_port is None or self.metrics_endpoint is not None:
            return
        self.metrics, self.metrics_endpoint = serve_worker_metrics(self.worker_id, self._metrics_host,
                                                                   self._metrics_port)

    def attach(self) -> None:
        """Learn the tensors and their placement from the shards (for pull-only clients)."""
        t = self.transport
        stats = t.each(lambda i: t.stub(i).Describe(ps_pb2.StatsRequest(), timeout=self.timeout,
                                                    wait_for_ready=True))
        self.layouts, self.shard_map = layout.from_stats(stats)
        for i, s in enumerate(stats):
            self.backups[i] = s.backup
        self.apply(JobView.of_stats(stats))
        self.epoch = max(s.epoch for s in stats)
        offers = t.each(lambda i: t.stub(i).Connect(ps_pb2.ConnectRequest(worker_id=self.worker_id),
                                                    timeout=self.timeout))
        self.paths.open(self.shard_map, dict(self.layouts), [False] * t.num_shards, offers, t)

    # -- data path ----------------------------------------------------------

    def push(self, grads: Mapping[str, torch.Tensor], step: int,
             base_versions: Sequence[int] | None = None, *, loss_scale: float = 0.0,
             found_inf: bool | None = None, pull_after: tuple[torch.dtype | None, int] | None = None,
             window: int | None = None, then: PullInFlight | None = None,
             compressor: Compressor | None = None) -> list[PushResult]:
        """Send gradients (one per named tensor) to their shards; one result per shard.

        Every shard gets a Push, an empty one if it owns none of ``grads``,
        so barriers see every worker. ``base_versions`` defaults to the
        versions of the last pull. ``loss_scale``: the scale the gradients
        were computed with (the shards unscale them). ``found_inf`` defaults
        to whether any gradient, as sent, holds an inf or nan; every shard is
        told, so all skip such a step together.

        ``pull_after=(dtype, min_clock)``: a shard whose weights are ready at
        once (its version includes this gradient, every clock >= min_clock)
        and small (``SMALL_PULL_BYTES`` at most) answers with them too, as a
        ``pull(dtype=dtype, min_versions=<ready versions>, min_clock=...)``
        of all its tensors would; hand the results to ``pull(answered=...)``.

        ``then``: a pull made with ``pull_async(later=True)``; each shard's
        Pull begins as soon as that shard answered, from its ready version
        (or with the weights it answered with), while the other shards'
        pushes still go up. ``window``: at most that many shards' Pushes at
        once, in ``worker/datapath/pushorder.py``'s order (None: all at once).
        ``compressor``: the tensors it compresses go compressed (worker/compress.py).
        """
        self._require_layout(grads)
        bases = list(self.versions if base_versions is None else base_versions)
        out = push.push(self, grads, step, bases, owners=self._shards_of(), loss_scale=loss_scale,
                        found_inf=found_inf, pull_after=pull_after, window=window, then=then,
                        compressor=compressor)
        self.apply(JobView.of_push(out))
        return out

    def _shards_of(self) -> dict[str, set[int]]:
        """Each tensor's shards (kept until the shard map changes)."""
        smap, found = self._tensor_shards
        if smap is not self.shard_map:
            found = {}
            for p in self.shard_map.parts if self.shard_map is not None else ():
                found.setdefault(p.name, set()).add(p.server)
            self._tensor_shards = (self.shard_map, found)
        return found

    def pull(self, names: Iterable[str] | None = None, *, out: Mapping[str, torch.Tensor] | None = None,
             min_versions: Sequence[int] | int | None = None, dtype: torch.dtype | None = None,
             min_clock: int = 0, answered: Sequence[PushResult] | None = None) -> dict[str, torch.Tensor]:
        """Fetch weights from every shard in parallel.

        ``out`` tensors (any device) are filled in place; otherwise new CPU
        tensors are returned. ``min_versions`` makes each shard wait (up to
        the client's timeout) until it has reached that version;
        ``min_clock`` until every worker has pushed that many steps (ssp).
        ``answered``: the results of a ``push(pull_after=(dtype, min_clock))``
        just before, with ``min_versions`` their ready versions: the shards
        that answered with their weights are not asked again (give every
        tensor, as ``names=None``).
        """
        return self._pull(names, out, min_versions, dtype, min_clock, answered).start(inline=True).result()

    def pull_async(self, names: Iterable[str] | None = None, *, out: Mapping[str, torch.Tensor] | None = None,
                   min_versions: Sequence[int] | int | None = None, dtype: torch.dtype | None = None,
                   min_clock: int = 0, answered: Sequence[PushResult] | None = None,
                   inline: bool = False, later: bool = False) -> PullInFlight:
        """``pull`` started and returned at once: ``wait(names)`` blocks until those tensors are written,
        ``result()`` until all are (and raises a failure; once it succeeds the client takes the pull's
        ``view``: ``apply``, in the thread calling it). Each shard sends its tensors in the order of
        ``names`` (by default the order registered: a model's first layers first). ``inline``: the first
        shard's Pull runs in this thread before returning (for a caller about to wait for the result).
        ``later``: no Pull starts yet; give the pull to ``push(then=...)``, which begins each shard's."""
        pull = self._pull(names, out, min_versions, dtype, min_clock, answered)
        return pull.start_later() if later else pull.start(inline=inline)

    def _pull(self, names: Iterable[str] | None, out: Mapping[str, torch.Tensor] | None,
              min_versions: Sequence[int] | int | None, dtype: torch.dtype | None, min_clock: int,
              answered: Sequence[PushResult] | None = None) -> PullInFlight:
        wanted = list(self.layouts if names is None else names)
        self._require_layout(wanted)
        if isinstance(min_versions, int) or min_versions is None:
            mins = [min_versions or 0] * self.num_shards
        else:
            mins = list(min_versions)
        given = None
        if answered is not None:
            if names is not None and set(wanted) != set(self.layouts):
                raise ValueError("pull(answered=...): a push answers with every tensor of its shard; "
                                 "pull them all (names=None)")
            given = {shard: r.pulled for shard, r in enumerate(answered) if r.pulled}
        return PullInFlight(self, wanted, out=out, min_versions=mins, dtype=dtype, min_clock=min_clock,
                            answered=given, on_result=self.apply)

    def push_bucketed(self, step: int, base_versions: Sequence[int] | None = None, *,
                      loss_scale: float = 0.0, hold_gradients: bool = True) -> BucketedPush:
        """A Push of step ``step`` opened on every shard now and fed bucket by bucket (``add``) while
        backward runs; ``finish()`` closes it and returns one result per shard, as ``push`` (the client ``apply``s
        what they say). ``hold_gradients=False``: a gradient whose shards share this machine is copied into
        their push segments as it is handed in and not referenced after (the caller may free it: a streamed
        worker does); a retry re-sends it from the segments."""
        self._require_layout(())
        return BucketedPush(self, step, list(self.versions if base_versions is None else base_versions),
                            loss_scale, on_result=self.apply, hold_gradients=hold_gradients)

    def export_state(self, names: Iterable[str] | None = None) -> dict[str, dict[str, Any]]:
        """Weights and optimizer state from every shard, as a state_dict-style mapping.

        ``{name: {"weight": full fp32 tensor, "optimizer": {part_start: {key: tensor}}, "version": {shard: v}}}``:
        optimizer state stays per part (factored state is sized by the part; ``worker/export.py``).
        """
        wanted = list(self.layouts if names is None else names)
        self._require_layout(wanted)
        assert self.shard_map is not None
        return export.export_state(self.transport, self.shard_map, self.layouts, wanted, self.chunk_bytes)

    def recover(self) -> int:
        """After an ABORTED answer: bring every shard to one rollback epoch; return our next step.

        If a shard restarted from its checkpoint, or the shards are in
        different epochs, every shard rolls back to the newest checkpoint
        version all of them hold (``worker/job/recovery.py``). Idempotent. Then
        this client takes the shards' epoch, versions and its own clock.
        """
        stats = recovery.bring_together(self.transport, self.worker_id)
        self.epoch, self.sync_switch = max(s.epoch for s in stats), 0  # the shards' sync switch may go back too
        self.rows.forget_waits()  # the row tables went back with the job: their rounds are the checkpoint's
        self.apply(JobView.of_stats(stats))
        return int(min(s.worker_clocks.get(self.worker_id, -1) for s in stats)) + 1  # as in register()

    # -- operator calls: worker/operator.py ------------------------------------

    def checkpoint(self) -> list[tuple[int, str]]:
        """Ask every shard to write a checkpoint now: [(version, path)] per shard (``worker/operator.py``)."""
        return operator.checkpoint(self.transport)

    def set_sync(self, sync: str) -> list[str]:
        """Switch the running job's sync mode on every shard; workers follow from their next step (operator.py)."""
        answers = operator.switch_sync(self.transport, sync)
        self.apply(JobView.newest(answers))
        return [r.sync for r in answers]

    def stats(self) -> list[dict[str, Any]]:
        """Per-shard status as plain dicts: version, tensors, bytes, counters, staleness counts (as
        ``shardps.admin.stats``, read with the worker token: ``Workers.Describe``)."""
        return operator.describe(self.transport)

    # -- the lease ----------------------------------------------------------------

    def start_heartbeats(self, interval: float | None = None) -> None:
        """Renew this worker's lease on every shard in the background (every lease / 3 by default): Push
        and Pull renew it too; heartbeats keep a worker that computes longer than its lease in the job."""
        if not self.lease_s:
            return
        self.heartbeats.start(interval or self.lease_s / 3)

    def stop_heartbeats(self) -> None:
        """Stop renewing the lease in the background (the worker is evicted once it lasts longer)."""
        self.heartbeats.stop()

    def leave(self, timeout: float = 5.0) -> None:
        """Tell every shard this worker is done, so barriers go on without it at once (not after its lease).

        ``close()`` does this for a registered worker. Best effort: a shard
        that does not answer within ``timeout`` evicts the worker later.
        """
        if not self._registered:
            return
        self._registered = False
        self.heartbeats.leave(timeout)

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
            self.transport.close()
            self.paths.close()
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
            metrics_port: int | None = None, metrics_host: str | None = None, shm: bool | None = None) -> PSClient:
    """Connect to the shards at ``addresses`` (in shard order; a comma-separated string works).

    Every setting comes from its argument, else its environment variable, else the default: ``addresses``
    (``SHARDPS_ADDRESSES``), ``worker_id`` (``SHARDPS_WORKER_ID``, 0), ``num_workers`` (``SHARDPS_NUM_WORKERS``,
    1), ``backups`` (``SHARDPS_BACKUPS``, when the addresses come from it too), ``security`` (``SHARDPS_TLS_*``,
    ``SHARDPS_AUTH_TOKEN[_FILE]``), ``metrics_port`` / ``metrics_host`` (``SHARDPS_METRICS_PORT`` / ``_HOST``:
    a registered worker serves its Prometheus metrics there), ``shm`` (``SHARDPS_SHM``, on: tensor bytes to
    and from a shard on this machine go through shared memory, see protos/shm.py).

    Waits up to ``ready_timeout`` seconds for every shard to accept a
    connection (None: do not wait). ``backups`` (``--replicas 2``): each
    shard's backup, in shard order; workers also learn them when they
    register, so give them for a worker that may start after a server died.
    """
    addresses, backups = layout.addresses_and_backups(addresses, backups)
    wid = env.pick_int(worker_id, env.WORKER_ID, 0)
    nw = env.pick_int(num_workers, env.NUM_WORKERS, 1)
    assert wid is not None and nw is not None
    client = PSClient(addresses, wid, nw, timeout=timeout, chunk_bytes=chunk_bytes,
                      part_bytes=part_bytes, security=security, recovery_timeout=recovery_timeout, backups=backups,
                      metrics_port=metrics_port, metrics_host=metrics_host, shm=shm)
    if ready_timeout is not None:
        try:
            client.wait_ready(ready_timeout)
        except BaseException:
            client.close()
            raise
    return client
