"""The transport: a channel to every shard, retries, fail-over to backups, the fan-out over shards.

The worker's calls to the shards go through here. Every failure leaves it as a
``ShardError`` of the type its status names (``worker/errors.py``), mapped
here once; the client, the heartbeats and the optimizer above it see only
those. ``call`` retries a shard that is UNAVAILABLE (and fails over to its
backup when it has one); ``each`` runs a call on every shard in parallel.
The health check and the diagnosis of a failed connection are in
``worker/datapath/reach.py`` (light enough for a container's healthcheck).
(Just over 400 lines: one class holds every service's endpoints, retries and fan-out over the shards.)
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import grpc.experimental
import torch

from shardps.protos.security import Security
from shardps.protos.shardps.v1 import experts_pb2_grpc, ps_pb2, ps_pb2_grpc
from shardps.worker.datapath import pushorder
from shardps.worker.datapath.paths import Calls, ShardPath
from shardps.worker.datapath.reach import StatusError, explain_unreachable, health_status, status_of
from shardps.worker.errors import ShardError, shard_error

log = logging.getLogger("shardps.worker")

ROWS = "shardps.v1.Rows"  # row tables (worker/rows/client.py)
WORKERS = "shardps.v1.Workers"  # the worker data path; the operator's calls go to shardps.v1.Operator
SINGLE_THREADED_UNARY_STREAM = (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)
T = TypeVar("T")


def gather(futures: Sequence[Future[Any]], timeout: float) -> list[Any]:
    """Every future's result once all ended (each within ``timeout`` seconds); then the first failure raised."""
    results: list[Any] = []
    first: BaseException | None = None
    for f in futures:
        try:
            results.append(f.result(timeout=timeout))
        except BaseException as e:  # noqa: BLE001 - re-raised below, once all ended
            first = first or e
    if first is not None:
        raise first
    return results


class Transport:
    """Channels to the shards at ``addresses`` (in shard order) and threads to call them in parallel.

    ``backups``: each shard's backup ('' for none; ``--replicas 2``), learnt
    later too (``set_backup``). ``timeout`` is every RPC's deadline;
    ``recovery_timeout`` how long an UNAVAILABLE shard is retried.

    ``stub(i)`` talks to shard i's ``Workers`` service with the worker token
    (``security.token_for("worker")``); ``operator(i)`` to its ``Operator``
    service with the operator token (over the same channel when both tokens
    are the same, else over one opened for it).
    """

    def __init__(self, addresses: Sequence[str], *, security: Security, timeout: float, recovery_timeout: float,
                 backups: Sequence[str] | None = None, worker_id: int = 0) -> None:
        self.addresses = list(addresses)
        # each shard's fencing epoch (--coordinator; 0: none), learnt from Register and a takeover's answer
        self.fence_epochs = [0] * len(self.addresses)
        self.security = security
        self.timeout = timeout
        self.recovery_timeout = recovery_timeout
        self.worker_id = worker_id  # named in the reason a backup is asked to take over
        self.retries_total = 0
        self.failovers_total = 0
        if backups is not None and len(backups) != len(self.addresses):
            raise ValueError(f"backups: one address (or '') per shard: {len(self.addresses)} shards, "
                             f"{len(backups)} backups")
        self.backups = list(backups) if backups is not None else [""] * len(self.addresses)
        self._failover_lock = threading.Lock()
        # called with a shard and its new primary's answer once it failed over (under the fail-over lock)
        self.on_moved: Callable[[int, ps_pb2.PromoteResponse], None] | None = None
        self._retired: list[grpc.Channel] = []
        self._channels: list[grpc.Channel] = []
        self._stubs: list[ps_pb2_grpc.WorkersStub] = []
        self._operator_channels: dict[str, grpc.Channel] = {}
        for i, a in enumerate(self.addresses):
            self._install(i, a, self._channel(a))
        # Per shard: a push stream and a pull in flight can each hold a thread for a whole backward or
        # forward (overlap), and a heartbeat must still get through meanwhile.
        self._pool = ThreadPoolExecutor(max_workers=3 * len(self.addresses), thread_name_prefix="psclient")
        self.closed = False  # ``close`` began: a call that fails now is not made again

    @property
    def num_shards(self) -> int:
        return len(self.addresses)

    # -- the shards' endpoints (Workers, Operator, Rows) --------------------

    def _channel(self, address: str) -> grpc.Channel:
        # A stream's responses (PullRows) are read in the caller's thread: without this option gRPC starts a
        # thread to drive the channel for every call made while no other call is under way, and every
        # response crosses from that thread to the caller's.
        return self.security.channel(address, role="worker", options=[SINGLE_THREADED_UNARY_STREAM])

    def stub(self, shard: int) -> ps_pb2_grpc.WorkersStub:
        """The ``Workers`` stub that talks to ``shard`` now (after a fail-over: its backup)."""
        return self._stubs[shard]

    def operator(self, shard: int) -> ps_pb2_grpc.OperatorStub:
        """An ``Operator`` stub to where ``shard`` is served now, sending the operator token."""
        with self._failover_lock:
            address = self.addresses[shard]
            if self.security.token_for("operator") == self.security.token_for("worker"):
                channel = self._channels[shard]
            else:
                channel = self._operator_channels.get(address) or self._operator_channels.setdefault(
                    address, self.security.channel(address, role="operator"))
        return ps_pb2_grpc.OperatorStub(channel)  # type: ignore[no-untyped-call]

    def rows(self, shard: int) -> ps_pb2_grpc.RowsStub:
        """A ``Rows`` stub (row tables, worker/rows/client.py) on the channel that talks to ``shard`` now."""
        return ps_pb2_grpc.RowsStub(self._channels[shard])  # type: ignore[no-untyped-call]

    def pull_rows(self, shard: int) -> Any:
        """``Rows.PullRows`` on the channel that talks to ``shard`` now, its answers left as bytes (read with
        ``framing.read_pull_rows``: the rows stay views of the received bytes)."""
        return self._channels[shard].unary_stream(  # type: ignore[call-arg]
            f"/{ROWS}/PullRows", request_serializer=ps_pb2.PullRowsRequest.SerializeToString,
            response_deserializer=None, _registered_method=True)

    def experts(self, shard: int) -> experts_pb2_grpc.ExpertsStub:
        """An ``Experts`` stub (experts run where they live, worker/experts/send.py) on ``shard``'s channel."""
        return experts_pb2_grpc.ExpertsStub(self._channels[shard])  # type: ignore[no-untyped-call]

    def stubs(self) -> list[ps_pb2_grpc.WorkersStub]:
        """The current stubs, one per shard (a snapshot)."""
        return list(self._stubs)

    def push(self, shard: int, requests: Iterator[bytes], *, stream: bool = False,
             via: ShardPath) -> ps_pb2.PushResponse:
        """A Push of serialized PushRequests (``framing``) to ``shard``, made by ``via``'s ``calls`` (the shard's
        data connection, worker/datapath/dataconn.py). ``stream``: its messages come while the caller computes
        (each goes as it comes)."""
        return _calls(shard, via).push(requests, self.timeout, stream=stream)

    def pull(self, shard: int, request: ps_pb2.PullRequest, *, via: ShardPath,
             place: Callable[[str, int, int, int], torch.Tensor | None] | None = None) -> Iterator[Any]:
        """A Pull from ``shard``: its responses (``framing.read_pull_response``), made by ``via``'s ``calls``,
        its parts landing where ``place`` says (``Calls.pull``)."""
        return _calls(shard, via).pull(request, self.timeout, place)

    def set_backup(self, shard: int, backup: str, stub: ps_pb2_grpc.WorkersStub | None = None) -> None:
        """``shard``'s backup is ``backup`` (learnt from ``stub``'s answer: kept only while it serves the shard)."""
        with self._failover_lock:
            if stub is None or self._stubs[shard] is stub:
                self.backups[shard] = backup

    def _install(self, shard: int, address: str, channel: grpc.Channel) -> None:
        """Talk to ``shard`` at ``address`` over ``channel`` from now on."""
        stub = ps_pb2_grpc.WorkersStub(channel)  # type: ignore[no-untyped-call]
        if shard == len(self._channels):
            self._channels.append(channel)
            self._stubs.append(stub)
        else:
            self._retired.append(self._channels[shard])  # closed with the client: a heartbeat may use it now
            self._channels[shard], self._stubs[shard] = channel, stub
        self.addresses[shard] = address

    # -- fail-over ------------------------------------------------------------

    def _moved_to(self, shard: int) -> str:
        """Where a deposed primary says its shard went ("" if it does not answer or was not deposed)."""
        try:
            s = self._stubs[shard].Describe(ps_pb2.StatsRequest(), timeout=min(2.0, self.timeout))
        except grpc.RpcError:
            return ""
        return s.backup if s.role == "deposed" else ""

    def _silent(self, shard: int) -> bool:
        """After a call's deadline passed: whether the shard, which has a backup, answers nothing at all, not
        even Describe within 2 s. A stopped process (SIGSTOP, a long pause) keeps its TCP connections, which
        neither gRPC's pings nor the kernel's keepalive then find broken; a shard that is only slow (a round
        that waits for another worker) answers, and keeps its call's error."""
        if not self.backups[shard]:
            return False
        try:
            self._stubs[shard].Describe(ps_pb2.StatsRequest(), timeout=min(2.0, self.timeout))
        except grpc.RpcError:
            return True
        return False

    def _fail_over(self, shard: int, failed: str, details: str) -> bool:
        """Ask shard's backup to take over (--replicas 2); True once requests should go there.

        The backup refuses while the primary still answers its health
        check, so a primary that is only slow keeps its shard (``TakeOver``,
        the worker's Promote, cannot be forced).
        """
        with self._failover_lock:
            if self.addresses[shard] != failed:  # another thread failed over already
                return True
            backup = self.backups[shard] or self._moved_to(shard)
            if not backup:
                return False
            channel = self._channel(backup)
            try:
                r = ps_pb2_grpc.WorkersStub(channel).TakeOver(  # type: ignore[no-untyped-call]
                    ps_pb2.TakeOverRequest(reason=f"worker {self.worker_id}: {failed} unavailable: {details[:200]}",
                                           offer_data=True, worker_id=self.worker_id),
                    timeout=min(10.0, self.timeout))
            except grpc.RpcError as e:
                channel.close()
                log.warning("shard %d: its backup at %s did not take over: %s: %s", shard, backup,
                            e.code().name if hasattr(e, "code") else "?", e.details() if hasattr(e, "details") else e)
                return False
            self._install(shard, backup, channel)
            self.fence_epochs[shard] = r.fence_epoch or self.fence_epochs[shard]
            self.backups[shard] = ""
            self.failovers_total += 1
            if self.on_moved is not None:
                self.on_moved(shard, r)
        log.warning("shard %d: %s is unavailable; failed over to its backup at %s (version %d)", shard, failed,
                    backup, r.version)
        return True

    # -- calls ----------------------------------------------------------------

    def at(self, shard: int, address: str, fn: Callable[[], None]) -> bool:
        """``fn()`` if ``shard`` is still served at ``address`` (no fail-over moved it), under the fail-over
        lock (a fail-over waits for it, and one in between wins); whether it ran."""
        with self._failover_lock:
            if self.addresses[shard] != address:
                return False
            fn()
            return True

    def failed_once(self, shard: int, e: Exception) -> ShardError | None:
        """A call to ``shard`` made outside ``call`` (a frame that waited for nothing) failed with ``e``: None
        when it is to be made again through ``call`` (UNAVAILABLE: its retries, a fail-over; counted in
        ``retries_total``), else the ShardError to raise, as ``call`` would."""
        code, details = status_of(e)
        if self.closed:  # its connection closed with the client: CANCELLED, as a gRPC call under way would be
            return shard_error(self.addresses[shard], shard, grpc.StatusCode.CANCELLED,
                               f"the client closed while the call was under way ({details})")
        if code == grpc.StatusCode.UNAVAILABLE:
            self.retries_total += 1  # made again: a retry, as ``call``'s are counted
            return None
        return shard_error(self.addresses[shard], shard, code, details)

    def attempt(self, shard: int, fn: Callable[[], T]) -> T:
        """``fn()`` against one shard, once: a failure raises its ShardError (no retry, no fail-over)."""
        try:
            return fn()
        except grpc.RpcError as e:
            code, details = status_of(e)
            raise shard_error(self.addresses[shard], shard, code, details) from None

    def call(self, shard: int, fn: Callable[[], T]) -> T:
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
                code, details = status_of(e)
                if code == grpc.StatusCode.UNAVAILABLE and self._fail_over(shard, address, details):
                    continue
                if (code == grpc.StatusCode.DEADLINE_EXCEEDED and self._silent(shard)
                        and self._fail_over(shard, address, f"no answer within the deadline: {details}")):
                    continue
                waited = time.monotonic() - start
                if code != grpc.StatusCode.UNAVAILABLE or waited >= self.recovery_timeout:
                    if code == grpc.StatusCode.UNAVAILABLE:
                        hint = explain_unreachable(self.security, details)
                        details = f"{hint}: {details}" if hint else details
                    if code == grpc.StatusCode.UNAVAILABLE and tries:
                        details = f"still unavailable after {waited:.0f}s and {tries} retries: {details}"
                    raise shard_error(self.addresses[shard], shard, code, details) from None
            tries += 1
            self.retries_total += 1
            if tries == 1:
                log.warning("shard %d (%s) unavailable: retrying for up to %.0fs", shard, self.addresses[shard],
                            self.recovery_timeout)
            remaining = self.recovery_timeout - (time.monotonic() - start)
            # The shard is another process (maybe restarting): nothing local to wait on.
            time.sleep(max(0.0, min(backoff, remaining)))
            backoff = min(2.0, backoff * 2)

    def each(self, fn: Callable[[int], T], shards: Iterable[int] | None = None) -> list[T]:
        """Run ``fn(shard)`` for every shard in parallel (each retried as ``call``); raise the first failure."""
        return self.fan_out(lambda i: self.call(i, lambda: fn(i)), shards)

    def submit_each(self, fn: Callable[[int], T], shards: Iterable[int] | None = None) -> list[Future[T]]:
        """Start ``fn(shard)`` for every shard (each retried as ``call``) and return at once: one future
        per shard, in order (for streams that run while the caller computes)."""
        idx = list(range(self.num_shards)) if shards is None else list(shards)
        return [self._pool.submit(self.call, i, functools.partial(fn, i)) for i in idx]

    def in_order(self, fn: Callable[[int], T], order: Sequence[int], *, window: int,
                 then: Callable[[int, T], None] | None = None,
                 soon: Callable[[int, Callable[[T | None, Exception | None], None]], bool] | None = None
                 ) -> dict[int, T]:
        """``fn(shard)`` for the shards of ``order`` (each retried as ``call``), started in that order, at
        most ``window`` at once, ``then(shard, result)`` as each succeeds (``worker/datapath/pushorder.py``);
        ``soon(shard, done)``: the shard's call as a frame that waits for nothing, where its path has one
        (made again through ``call`` should it fail UNAVAILABLE)."""
        return pushorder.in_order(self._pool, lambda i: self.call(i, lambda: fn(i)), order, window=window,
                                 wait_s=self.timeout + self.recovery_timeout + 5.0, then=then,
                                 soon=_Soon(soon, self) if soon is not None else None)

    def fan_out(self, fn: Callable[[int], T], shards: Iterable[int] | None = None) -> list[T]:
        """Run ``fn(shard)`` for every shard in parallel, as it is; once all ended, raise the first failure.

        The first shard's call runs in the caller's thread, the others in the pool: one shard (or
        one shard's share) costs no hand-over between threads.
        """
        idx = list(range(self.num_shards)) if shards is None else list(shards)
        if not idx:
            return []
        futs = [self._pool.submit(fn, i) for i in idx[1:]]
        results: list[T] = []
        first_err: BaseException | None = None
        try:
            results.append(fn(idx[0]))
        except Exception as e:  # noqa: BLE001 - re-raised below, after all finished (an interrupt: at once)
            first_err = e
        for f in futs:
            try:
                results.append(f.result())
            except BaseException as e:  # noqa: BLE001 - re-raised below, after all finished
                first_err = first_err or e
        if first_err is not None:
            raise first_err
        return results

    # -- connecting -------------------------------------------------------------

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
            reasons = [f"{a}: {why}" for a in missing if (why := self.probe(a))]
            raise TimeoutError(f"no parameter server answered within {t:.0f}s at {missing}"
                               + (f" ({'; '.join(reasons)})" if reasons else ""))

    def probe(self, address: str) -> str:
        """Why ``address`` does not answer, from one short health check ("" when it answers now)."""
        try:
            health_status(address, security=self.security, timeout=2.0)
            return ""
        except ShardError as e:
            return explain_unreachable(self.security, e.details) or e.details

    def close(self) -> None:
        """Close every channel, then stop the threads. Idempotent. Closing a channel cancels the calls under
        way on it (CANCELLED in their threads): a Pull started ahead of a step that never comes (overlap's, or
        one waiting for a worker that will not push) would otherwise hold this until its deadline. A frame
        under way on a data connection (closed after this by ``ShardPaths.close``) ends CANCELLED too
        (``failed_once``)."""
        self.closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        for c in self._channels + self._retired + list(self._operator_channels.values()):
            c.close()
        self._pool.shutdown(wait=True)


def _calls(shard: int, via: ShardPath) -> Calls:
    """Who makes ``shard``'s call on ``via``: its data connection (UNAVAILABLE while it has none: retried)."""
    if via.calls is None:
        raise StatusError(grpc.StatusCode.UNAVAILABLE, f"shard {shard}: no data connection yet: asked again once "
                                                       "it is made")
    return via.calls


class _Soon:
    """``pushorder.Soon`` over the transport: a failure mapped as ``Transport.failed_once``."""

    def __init__(self, start: Callable[[int, Callable[[Any, Exception | None], None]], bool],
                 transport: Transport) -> None:
        self._start, self._transport = start, transport

    def __call__(self, shard: int, done: Callable[[Any, Exception | None], None]) -> bool:
        return self._start(shard, done)

    def settle(self, shard: int, error: Exception) -> Exception | None:
        return self._transport.failed_once(shard, error) if isinstance(error, grpc.RpcError) else error


def unary(address: str, method: str, request: Any, *, timeout: float, security: Security | None = None,
          service: str = "Operator", role: str = "operator", wait_for_ready: bool = False) -> Any:
    """One ``service`` ``method`` call to the endpoint at ``address`` with ``role``'s token (no shard: no
    retry, no fail-over; ``wait_for_ready``: wait, within ``timeout``, for the endpoint to accept a
    connection).

    Failures raise a ShardError naming the endpoint, its details prefixed with ``method``.
    """
    channel = (security if security is not None else Security.from_env()).channel(address, role=role)
    try:
        stub = getattr(ps_pb2_grpc, f"{service}Stub")(channel)
        return getattr(stub, method)(request, timeout=timeout, wait_for_ready=wait_for_ready)
    except grpc.RpcError as e:
        code, details = status_of(e)
        raise shard_error(address, None, code, f"{method}: {details}") from None
    finally:
        channel.close()
