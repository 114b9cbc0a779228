"""Who serves a shard is etcd's to say: a shard's record, the primary's lease, takeover as a transaction.

Without a coordinator a backup takes over when a worker cannot reach the
primary and the backup cannot either (server/replication/state.py): a partition
answers that like a crash, and two primaries acknowledge writes
(docs/operations.md, "Known hole"). With ``shardps server --coordinator
etcd://HOST:PORT[,HOST:PORT...]`` (or ``SHARDPS_COORDINATOR``) the decision
is etcd's (Raft: a majority of its members agrees on every change):

- Each shard has a *record*, ``/shardps/<job>/shards/<i>``, a JSON object:
  ``primary`` (its address), ``epoch`` (the fencing token: raised by every
  change of primary) and ``alone`` (the primary serves without its backup).
  Beside it, ``.../lease``: the holder key, attached to the primary's etcd
  lease, gone when that lease expires.
- Every change of the record is a transaction on its revision (and on the
  holder key's absence or ownership), so two servers cannot both win.
- The primary renews its lease in the background (a keep-alive every third
  of the time-to-live), never once per push. It holds the shard while
  ``holds()``: its last renewal, counted from when the keep-alive was *sent*
  (so never later than etcd counts it), plus the time-to-live, less a margin
  for the drift of the two clocks, is ahead of its own monotonic clock. It
  acknowledges a write only then; otherwise it answers UNAVAILABLE, naming
  the reason.
- A backup takes over only by winning the transaction after the old
  primary's holder key is gone (its lease expired in etcd), raising the
  epoch. While the key is there the takeover is refused, naming the holder.
- A primary whose backup is lost may go on alone only once a transaction
  records ``alone`` (``go_alone``); the backup's copy is then stale, and its
  takeover is refused while the record says so.
- A record that is not such a JSON object (a key changed by hand) is never
  guessed at: ``CoordinatorError`` names the key, and the shard refuses
  writes.

The client is etcd's own v3 gRPC API through grpcio (the generated messages
and stubs of ``aetcd``, a maintained etcd client whose stubs import with this
project's protobuf; its asyncio client is not used: every call here is a
blocking call with a deadline, in the server's threads). docs/operations.md
says why that and not another client.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from aetcd.rpc import kv_pb2 as kvpb
from aetcd.rpc import rpc_pb2 as etcdpb
from aetcd.rpc import rpc_pb2_grpc as etcdrpc

from shardps.server.checks import check_job, parse_coordinator
from shardps.server.replication.roles import FenceError

__all__ = ["CoordinatorError", "Etcd", "LocalEtcd", "ShardLease", "ShardRecord", "Superseded", "check_job", "parse",
           "local_etcd"]

parse = parse_coordinator

log = logging.getLogger("shardps.coordinator")

SCHEME = "etcd://"
DEFAULT_JOB = "shardps"  # the keys' prefix: /shardps/<job>/shards/<i>; jobs that share an etcd need their own
DEFAULT_TTL_S = 5  # the primary's lease: a takeover waits this long after the primary was last heard
DEFAULT_MARGIN_S = 1.0  # the primary stops acknowledging this long before its lease could expire in etcd
CALL_TIMEOUT_S = 2.0  # one call to etcd


class CoordinatorError(FenceError):
    """The coordinator cannot be reached, or says something this server will not act on."""


class Superseded(CoordinatorError):
    """Another server is the shard's primary: ``record`` says which, at which epoch."""

    def __init__(self, message: str, record: ShardRecord) -> None:
        super().__init__(message)
        self.record = record


@dataclass(frozen=True)
class ShardRecord:
    """What etcd says of one shard (the module's docstring). ``revision``: the record's mod revision,
    0 when there is none yet; ``holder``: the holder key's create revision, 0 when no lease holds it."""

    primary: str
    epoch: int
    alone: bool
    revision: int = 0
    holder: int = 0

    def value(self) -> bytes:
        return json.dumps({"primary": self.primary, "epoch": self.epoch, "alone": self.alone}).encode()

    @staticmethod
    def parse(key: str, raw: bytes, revision: int, holder: int) -> ShardRecord:
        try:
            d = json.loads(raw)
            ok = (isinstance(d, dict) and isinstance(d.get("primary"), str) and d["primary"]
                  and isinstance(d.get("epoch"), int) and not isinstance(d["epoch"], bool) and d["epoch"] > 0
                  and isinstance(d.get("alone"), bool))
        except ValueError:
            ok = False
        if not ok:
            shown = raw[:200].decode(errors="replace")
            raise CoordinatorError(f"etcd key {key} holds {shown!r}, not a shard record "
                                   f'{{"primary": "HOST:PORT", "epoch": N > 0, "alone": false|true}}: '
                                   f"this shard refuses writes until it is fixed (it never guesses)")
        return ShardRecord(d["primary"], d["epoch"], d["alone"], revision, holder)


class Etcd:
    """Blocking calls to etcd's KV, Lease and Maintenance services, each with a deadline, over one channel to
    the first endpoint that answers (the next on UNAVAILABLE)."""

    def __init__(self, endpoints: Sequence[str], timeout: float = CALL_TIMEOUT_S) -> None:
        if not endpoints:
            raise ValueError("etcd: no endpoints")
        self.endpoints, self.timeout = list(endpoints), timeout
        self._at = 0
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._open(0)

    def _open(self, at: int) -> None:
        if self._channel is not None:
            self._channel.close()
        self._at = at % len(self.endpoints)
        self._channel = grpc.insecure_channel(self.endpoints[self._at])
        self.kv = etcdrpc.KVStub(self._channel)
        self.lease = etcdrpc.LeaseStub(self._channel)
        self.maintenance = etcdrpc.MaintenanceStub(self._channel)

    @property
    def where(self) -> str:
        return ",".join(self.endpoints)

    def call(self, what: str, fn: Any, request: Any, timeout: float | None = None) -> Any:
        """``fn(request)`` with a deadline; on UNAVAILABLE the next endpoint, once each; CoordinatorError
        naming the endpoints and ``what`` when none answers."""
        last: grpc.RpcError | None = None
        for _ in range(len(self.endpoints)):
            try:
                return fn(self, request, timeout or self.timeout)
            except grpc.RpcError as e:
                last = e
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    break
                with self._lock:
                    self._open(self._at + 1)
        assert last is not None
        raise CoordinatorError(f"etcd at {self.where}: {what} failed: {last.code().name} "
                               f"{last.details() or ''}".rstrip())

    def check(self, timeout: float) -> None:
        """Raise CoordinatorError naming the endpoints unless one answers within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.call("status", lambda s, r, t: s.maintenance.Status(r, timeout=t), etcdpb.StatusRequest(),
                          timeout=min(self.timeout, max(0.1, deadline - time.monotonic())))
                return
            except CoordinatorError as e:
                if time.monotonic() >= deadline:
                    raise CoordinatorError(f"the coordinator etcd://{self.where} does not answer "
                                           f"(within {timeout:g}s): {e}") from None
            with self._lock:
                self._open(self._at + 1)

    def get(self, key: str) -> tuple[bytes | None, int, int]:
        """(value or None, mod revision, create revision) of ``key``."""
        r = self.call(f"get {key}", lambda s, q, t: s.kv.Range(q, timeout=t), etcdpb.RangeRequest(key=key.encode()))
        if not r.kvs:
            return None, 0, 0
        kv = r.kvs[0]
        return bytes(kv.value), int(kv.mod_revision), int(kv.create_revision)

    def txn(self, what: str, compare: list[Any], success: list[Any]) -> bool:
        r = self.call(what, lambda s, q, t: s.kv.Txn(q, timeout=t),
                      etcdpb.TxnRequest(compare=compare, success=success))
        return bool(r.succeeded)

    def wait_gone(self, key: str, timeout: float) -> bool:
        """Wait until ``key`` does not exist (a lease's key: until etcd lets the lease expire), at most
        ``timeout`` seconds, on a watch from the revision it was read at; whether it is gone."""
        now = self.call(f"get {key}", lambda s, q, t: s.kv.Range(q, timeout=t), etcdpb.RangeRequest(key=key.encode()))
        if not now.kvs:
            return True
        revision = int(now.header.revision)
        done = threading.Event()

        def requests() -> Iterator[Any]:  # the stream stays open until the answer came or the deadline passed
            yield etcdpb.WatchRequest(create_request=etcdpb.WatchCreateRequest(key=key.encode(),
                                                                               start_revision=revision + 1))
            done.wait(timeout + 5.0)  # the call's deadline ends it first; ``done`` as it returns

        try:
            for answer in etcdrpc.WatchStub(self._channel).Watch(requests(), timeout=timeout):
                if any(ev.type == kvpb.Event.DELETE for ev in answer.events) or answer.canceled:
                    return True
        except grpc.RpcError as e:
            # the deadline: ours (DEADLINE_EXCEEDED), or etcd's own copy of it, which it answers UNKNOWN
            if not (e.code() == grpc.StatusCode.DEADLINE_EXCEEDED or "deadline exceeded" in (e.details() or "")):
                raise CoordinatorError(f"etcd at {self.where}: watch {key} failed: {e.code().name} "
                                       f"{e.details() or ''}".rstrip()) from None
        finally:
            done.set()
        return self.get(key)[0] is None

    def put(self, key: str, value: bytes) -> None:
        self.call(f"put {key}", lambda s, q, t: s.kv.Put(q, timeout=t),
                  etcdpb.PutRequest(key=key.encode(), value=value))

    def grant(self, ttl: int) -> int:
        r = self.call("lease grant", lambda s, q, t: s.lease.LeaseGrant(q, timeout=t),
                      etcdpb.LeaseGrantRequest(TTL=ttl))
        if r.error:
            raise CoordinatorError(f"etcd at {self.where}: lease grant refused: {r.error}")
        return int(r.ID)

    def keep_alive(self, lease: int, timeout: float) -> int:
        """One renewal: the lease's remaining time-to-live (0: it expired)."""
        def once(s: Etcd, q: Any, t: float) -> int:
            for answer in s.lease.LeaseKeepAlive(iter([q]), timeout=t):
                return int(answer.TTL)
            return 0
        ttl: int = self.call("lease keep-alive", once, etcdpb.LeaseKeepAliveRequest(ID=lease), timeout=timeout)
        return ttl

    def revoke(self, lease: int) -> None:
        with contextlib.suppress(CoordinatorError):
            self.call("lease revoke", lambda s, q, t: s.lease.LeaseRevoke(q, timeout=t),
                      etcdpb.LeaseRevokeRequest(ID=lease))

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()


def _put(key: str, value: bytes, lease: int = 0) -> Any:
    return etcdpb.RequestOp(request_put=etcdpb.PutRequest(key=key.encode(), value=value, lease=lease))


def _mod(key: str, revision: int) -> Any:
    return etcdpb.Compare(result=etcdpb.Compare.EQUAL, target=etcdpb.Compare.MOD, key=key.encode(),
                          mod_revision=revision)


def _created(key: str, revision: int) -> Any:
    """``key``'s create revision is ``revision`` (0: the key does not exist)."""
    return etcdpb.Compare(result=etcdpb.Compare.EQUAL, target=etcdpb.Compare.CREATE, key=key.encode(),
                          create_revision=revision)


class ShardLease:
    """One server's hold on one shard in etcd (the module's docstring): ``claim`` as its primary at start,
    ``take_over`` as its backup, ``go_alone`` when its backup is lost; ``holds`` says whether it may
    acknowledge a write now, ``why_not`` why not. The lease is renewed by a thread of its own."""

    def __init__(self, etcd: Etcd, job: str, shard: int, address: str, ttl: int = DEFAULT_TTL_S,
                 margin: float = DEFAULT_MARGIN_S) -> None:
        if ttl < 2 or not 0 < margin < ttl:
            raise ValueError(f"coordinator lease: ttl {ttl}s and margin {margin}s: need ttl >= 2 and "
                             f"0 < margin < ttl")
        self.etcd, self.shard, self.address, self.ttl, self.margin = etcd, shard, address, ttl, margin
        self.key = f"/shardps/{job}/shards/{shard}"
        self.holder_key = self.key + "/lease"
        self.record: ShardRecord | None = None  # as this server last wrote or read it
        self._lease = 0
        self._valid_until = 0.0  # monotonic: acknowledge only before this
        self._renewed_at = 0.0
        self._lost = ""  # why the hold ended for good (another primary, the lease expired)
        self._mu = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._together_pending = False  # this server no longer serves alone; etcd may still record it so
        self._together_at = -1e9  # when back_together last asked etcd (monotonic)

    # -- reading ------------------------------------------------------------------------------

    def read(self) -> ShardRecord | None:
        raw, revision, _ = self.etcd.get(self.key)
        _, _, holder = self.etcd.get(self.holder_key)
        if raw is None:
            return None
        return ShardRecord.parse(self.key, raw, revision, holder)

    @property
    def epoch(self) -> int:
        return self.record.epoch if self.record is not None else 0

    @property
    def alone(self) -> bool:
        return self.record is not None and self.record.alone

    def holds(self) -> bool:
        return not self._lost and time.monotonic() < self._valid_until

    def why_not(self) -> str:
        """Why this server may not acknowledge a write of its shard now ("" when it may)."""
        if self._lost:
            return self._lost
        now = time.monotonic()
        if now >= self._valid_until:
            if not self._lease:
                return f"shard {self.shard} holds no lease in etcd at {self.etcd.where}"
            return (f"shard {self.shard}'s lease in etcd at {self.etcd.where} was last renewed "
                    f"{now - self._renewed_at:.1f}s ago (time-to-live {self.ttl}s, margin {self.margin:g}s): "
                    f"not sure it is still the primary")
        return ""

    # -- changing the record ------------------------------------------------------------------

    def _hold(self, lease: int, sent: float, record: ShardRecord) -> None:
        with self._mu:
            self._lease, self.record, self._lost = lease, record, ""
            self._renewed_at = sent
            self._valid_until = sent + self.ttl - self.margin
        if self._thread is None:
            self._thread = threading.Thread(target=self._renew, name=f"shardps-lease-{self.shard}", daemon=True)
            self._thread.start()

    def _win(self, what: str, compare: list[Any], record: ShardRecord) -> bool:
        """Grant a lease and write ``record`` with the holder key on it, if ``compare`` holds."""
        sent = time.monotonic()
        lease = self.etcd.grant(self.ttl)
        ok = self.etcd.txn(what, compare, [_put(self.key, record.value()),
                                           _put(self.holder_key, self.address.encode(), lease)])
        if not ok:
            self.etcd.revoke(lease)
            return False
        raw, revision, _ = self.etcd.get(self.key)
        _, _, holder = self.etcd.get(self.holder_key)
        self._hold(lease, sent, ShardRecord(record.primary, record.epoch, record.alone, revision, holder))
        return True

    def claim(self, timeout: float) -> ShardRecord:
        """As the shard's primary at start: create its record (epoch 1), or hold a record that names this
        server again once no lease holds it (a restart: the same epoch, since no other server served the
        shard meanwhile). ``Superseded`` when another server is the primary; CoordinatorError when the
        record does not free up within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            current = self.read()
            if current is None:
                if self._win(f"claim shard {self.shard}", [_created(self.key, 0), _created(self.holder_key, 0)],
                             ShardRecord(self.address, 1, False)):
                    return self._record()
            elif current.primary != self.address:
                raise Superseded(
                    f"etcd at {self.etcd.where} names {current.primary} the primary of shard {self.shard} "
                    f"(epoch {current.epoch}; key {self.key}), not this server at {self.address}", current)
            elif current.holder == 0:  # a restart: the same primary, the same epoch (the record did not change)
                if self._win(f"claim shard {self.shard}", [_mod(self.key, current.revision),
                                                           _created(self.holder_key, 0)],
                             ShardRecord(self.address, current.epoch, current.alone)):
                    return self._record()
            if time.monotonic() >= deadline:
                raise CoordinatorError(
                    f"shard {self.shard}: a lease still holds its key {self.holder_key} in etcd at "
                    f"{self.etcd.where} (a previous run of this server?) after {timeout:g}s")
            # the old lease's expiry is etcd's to decide (its clock): watch its key go
            self.etcd.wait_gone(self.holder_key, max(0.1, deadline - time.monotonic()))

    def take_over(self, expected_primary: str) -> ShardRecord:
        """As the shard's backup: become its primary (epoch + 1) if the record still names
        ``expected_primary``, its backup is not out, and no lease holds it. CoordinatorError naming why
        not otherwise (nothing changes)."""
        current = self.read()
        if current is None:
            raise CoordinatorError(f"shard {self.shard} has no record in etcd at {self.etcd.where} (key "
                                   f"{self.key}): no primary ever claimed it; not taking over")
        if current.primary == self.address and self.holds():
            return current
        if current.primary != expected_primary:
            raise CoordinatorError(f"etcd names {current.primary} the primary of shard {self.shard} (epoch "
                                   f"{current.epoch}), not {expected_primary} whose copy this backup holds")
        if current.alone:
            raise CoordinatorError(f"etcd records that the primary of shard {self.shard} at {current.primary} "
                                   f"went on without its backup (epoch {current.epoch}): this backup's copy is "
                                   f"stale; not taking over")
        if current.holder:
            raise CoordinatorError(f"the primary of shard {self.shard} at {current.primary} still holds its lease "
                                   f"in etcd (key {self.holder_key}, time-to-live up to {self.ttl}s): "
                                   f"not taking over")
        if not self._win(f"take over shard {self.shard}", [_mod(self.key, current.revision),
                                                           _created(self.holder_key, 0)],
                         ShardRecord(self.address, current.epoch + 1, False)):
            raise CoordinatorError(f"shard {self.shard}'s record in etcd changed while this backup took it "
                                   f"over: not taking over (ask again)")
        return self._record()

    def go_alone(self) -> bool:
        """As the primary whose backup is lost: record that it serves alone, if it still holds the shard
        (its lease, the record it wrote). False (and it must refuse writes) otherwise."""
        rec = self.record
        if rec is None or not self.holds():
            return False
        if rec.alone:
            return True
        alone = ShardRecord(rec.primary, rec.epoch, True)
        try:
            ok = self.etcd.txn(f"shard {self.shard} goes alone",
                               [_mod(self.key, rec.revision), _created(self.holder_key, rec.holder)],
                               [_put(self.key, alone.value())])
        except CoordinatorError as e:
            log.warning("shard %d: cannot record in etcd that it goes on without its backup: %s", self.shard, e)
            return False
        if ok:
            _, revision, _ = self.etcd.get(self.key)
            with self._mu:
                self.record = ShardRecord(rec.primary, rec.epoch, True, revision, rec.holder)
                self._together_pending = False
        return ok

    def wants_together(self) -> bool:
        """Whether etcd may still record that this primary serves alone (``back_together`` not done yet)."""
        rec = self.record
        return rec is not None and (rec.alone or self._together_pending)

    def back_together(self) -> bool:
        """As the primary whose backup holds every change again (its replication synced after it went on
        alone): record that it serves with its backup, so that the backup may take over once more. This
        server's own record says so first: from then on, losing the backup again takes ``go_alone``'s
        transaction before anything is acknowledged, on the same revision as this one, so etcd orders the
        two. Asked at most every third of the time-to-live; True once etcd records it."""
        now = time.monotonic()
        with self._mu:
            rec = self.record
            if rec is None or not (rec.alone or self._together_pending):
                return True
            if now - self._together_at < self.ttl / 3:
                return False
            self._together_at, self._together_pending = now, True
            self.record = ShardRecord(rec.primary, rec.epoch, False, rec.revision, rec.holder)
        if not self.holds():
            return False
        together = ShardRecord(rec.primary, rec.epoch, False)
        try:
            self.etcd.txn(f"shard {self.shard} has its backup again",
                          [_mod(self.key, rec.revision), _created(self.holder_key, rec.holder)],
                          [_put(self.key, together.value())])
            current = self.read()  # whoever won: what etcd holds now (this transaction may have landed unseen)
        except CoordinatorError as e:
            log.warning("shard %d: cannot record in etcd that its backup is back: %s", self.shard, e)
            return False
        if (current is None or current.alone or current.primary != self.address or current.epoch != rec.epoch
                or current.holder != rec.holder):
            return False
        with self._mu:
            if self.record is not None and not self.record.alone:
                self.record = ShardRecord(rec.primary, rec.epoch, False, current.revision, rec.holder)
                self._together_pending = False
        log.warning("shard %d: its backup holds every change again; etcd no longer records it alone", self.shard)
        return True

    def _record(self) -> ShardRecord:
        assert self.record is not None
        return self.record

    # -- the lease ------------------------------------------------------------------------------

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            lease = self._lease
            sent = time.monotonic()
            try:
                left = self.etcd.keep_alive(lease, timeout=max(0.2, self._valid_until - sent))
            except CoordinatorError as e:
                log.warning("shard %d: lease renewal failed: %s", self.shard, e)
                continue
            if left <= 0 and not self._reclaim():
                return
            with self._mu:
                if lease == self._lease:
                    self._renewed_at = sent
                    self._valid_until = max(self._valid_until, sent + self.ttl - self.margin)

    def _reclaim(self) -> bool:
        """The lease expired in etcd (this server was cut off from it longer than its time-to-live, or etcd
        was down): hold the shard again, at the same epoch, if the record is unchanged (it still names this
        server) and no other lease holds it, by a transaction on the record's revision (a backup's takeover,
        the other way to win it, is one too). False, for good, when another server took it."""
        try:
            current = self.read()
            if (current is not None and current.primary == self.address and current.holder == 0
                    and self.record is not None and current.epoch == self.record.epoch
                    and self._win(f"reclaim shard {self.shard}", [_mod(self.key, current.revision),
                                                                  _created(self.holder_key, 0)],
                                  ShardRecord(self.address, current.epoch, current.alone))):
                # the same epoch: the record did not change in between (the transaction's compare), so no other
                # server served the shard, and the workers' epoch stays good
                log.warning("shard %d: its lease in etcd had expired; held again at epoch %d", self.shard,
                            self.epoch)
                return True
        except CoordinatorError as e:
            log.warning("shard %d: lease expired and etcd cannot be asked yet: %s", self.shard, e)
            return True  # not lost for good: asked again at the next renewal
        with self._mu:
            who = f"{current.primary} at epoch {current.epoch}" if current is not None else "no one"
            self._lost = (f"shard {self.shard}'s lease in etcd at {self.etcd.where} expired and etcd now names "
                          f"{who} its primary: this server does not serve it")
        log.error("%s", self._lost)
        return False

    def close(self, release: bool = True) -> None:
        """Stop renewing; ``release``: revoke the lease too (a clean stop: a backup may take over at once)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.etcd.timeout * 2)
        if release and self._lease:
            self.etcd.revoke(self._lease)
        with self._mu:
            self._valid_until = 0.0
            self._lost = self._lost or f"shard {self.shard}: this server stopped holding it"


# -- a local etcd (tests, `shardps sim`, LocalCluster) --------------------------------------------


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def etcd_argv(binary: str, data: str, host: str, client_port: int, peer_port: int) -> list[str]:
    """The command line of a one-member etcd serving clients at ``host:client_port``, its data in ``data``
    (the same data: the same member, after a restart)."""
    client, peer = f"http://{host}:{client_port}", f"http://{host}:{peer_port}"
    return [binary, "--name", "shardps", "--data-dir", data, "--listen-client-urls", client,
            "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"shardps={peer}", "--logger", "zap", "--log-level", "warn"]


class LocalEtcd:
    """Debian's ``etcd`` (installed by ``make tools``), one member on free loopback ports, its data in a
    temporary folder: ``url`` (``etcd://127.0.0.1:PORT``) once ``start`` returned; ``stop`` kills it
    (a clean stop, or ``kill=True``: SIGKILL) and ``start`` brings the same member back on the same ports
    and data."""

    def __init__(self, binary: str = "etcd", host: str = "127.0.0.1", *, with_parent: bool = False) -> None:
        """``with_parent``: etcd ends when the process that started it ends, however it ends (a Ray actor
        killed): a shell between them kills it once its stdin, this process's pipe, closes."""
        path = shutil.which(binary)
        if path is None:
            raise FileNotFoundError(f"{binary} is not installed (Debian's etcd-server: `make tools`)")
        self.binary, self.host, self.with_parent = path, host, with_parent
        self.client_port, self.peer_port = _free_port(host), _free_port(host)
        self.data = tempfile.mkdtemp(prefix="shardps-etcd-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"{SCHEME}{host}:{self.client_port}"
        self.endpoints = [f"{host}:{self.client_port}"]

    def start(self, timeout: float = 30.0) -> LocalEtcd:
        self.log = open(os.path.join(self.data, "etcd.log"), "ab")  # noqa: SIM115 (closed in stop)
        argv = etcd_argv(self.binary, os.path.join(self.data, "member"), self.host, self.client_port, self.peer_port)
        if self.with_parent:
            argv = ["sh", "-c", '"$@" </dev/null & pid=$!; read -r _; kill "$pid"; wait "$pid"', "sh", *argv]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE if self.with_parent else None, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        etcd = Etcd(self.endpoints, timeout=1.0)
        try:
            etcd.check(timeout)
        except CoordinatorError:
            self.stop(kill=True)
            tail = open(os.path.join(self.data, "etcd.log"), "rb").read()[-2000:].decode(errors="replace")
            raise CoordinatorError(f"etcd did not start within {timeout:g}s on {self.endpoints[0]}: {tail}") from None
        finally:
            etcd.close()
        return self

    def stop(self, kill: bool = False, timeout: float = 10.0) -> None:
        p, self.proc = self.proc, None
        if p is not None:
            try:  # the whole session: the shell of with_parent and etcd
                os.killpg(p.pid, signal.SIGKILL if kill else signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout)
            if p.stdin is not None:
                p.stdin.close()
            self.log.close()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.data, ignore_errors=True)

    def __enter__(self) -> LocalEtcd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def local_etcd(timeout: float = 30.0) -> Iterator[LocalEtcd]:
    e = LocalEtcd()
    try:
        yield e.start(timeout)
    finally:
        e.close()
