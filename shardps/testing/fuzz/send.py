"""Sending cases (``Fuzzer``, with its state fingerprint) and the health check."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shardps.protos.rows import shard_of
from shardps.protos.shardps.v1 import ps_pb2
from shardps.testing.frames import FrameStub
from shardps.testing.fuzz.cases import (
    CLIENT_STREAM,
    PACKAGE,
    RESPONSE_TYPES,
    SERVER_STREAM,
    SERVICES,
    VOLATILE_STATS,
    Case,
    Stubs,
    Target,
    describe,
    method_path,
)
from shardps.testing.fuzz.job import ROW_DIM, ROW_KEYS, ROW_TABLE
from shardps.worker.datapath.dataconn import ConnectFailed

FRAMED = {"Push", "Pull"}  # not RPCs: frames on a data connection (shardps.testing.frames)

# -- sending ----------------------------------------------------------------------


def held_rows(shard: int, num_shards: int) -> dict[str, Any]:
    """The keys of the job's row table that ``shard`` holds (job.ROW_KEYS on their shard): {table: uint64 keys}."""
    keys = ROW_KEYS.numpy().view("<u8")
    return {ROW_TABLE: keys[shard_of(keys, num_shards) == shard]}


@dataclass
class Outcome:
    code: str  # "OK" or a grpc.StatusCode name
    details: str = ""
    seconds: float = 0.0
    responses: list[Any] = field(default_factory=list)
    bad_response: str = ""  # a success whose answer does not parse or says something it must not


class Fuzzer:
    """Sends cases to the shards at ``addresses`` (one channel each) and fingerprints their state."""

    def __init__(self, addresses: Sequence[str], backups: Sequence[str] = ()) -> None:
        """``backups``: each shard's backup, in shard order (LocalCluster.backup_addresses, --replicas 2)."""
        self.addresses = list(addresses)
        self.channels = [grpc.insecure_channel(a) for a in self.addresses]
        self.backup_channels = {i: grpc.insecure_channel(a) for i, a in enumerate(backups)}
        self._frames: dict[int, FrameStub] = {}
        self.stubs = [Stubs(c) for c in self.channels]
        self._raw: dict[tuple[int, str, bool], Any] = {}

    def _raw_callable(self, case: Case) -> Any:
        """A callable for the case's method with no serializers: bytes go out and come back as they are."""
        key = (case.shard, case.method, case.to_backup)
        fn = self._raw.get(key)
        if fn is None:
            ch = self.backup_channels[case.shard] if case.to_backup else self.channels[case.shard]
            method, path = case.method, method_path(case.method)
            if method in CLIENT_STREAM:
                fn = ch.stream_unary(path)
            elif method in SERVER_STREAM:
                fn = ch.unary_stream(path)
            else:
                fn = ch.unary_unary(path)
            self._raw[key] = fn
        return fn

    def close(self) -> None:
        for stub in self._frames.values():
            stub.close()
        for c in [*self.channels, *self.backup_channels.values()]:
            c.close()

    def __enter__(self) -> Fuzzer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _frame_stub(self, shard: int) -> FrameStub:
        """The shard's Push and Pull as a data connection's frames, made on first use."""
        stub = self._frames.get(shard)
        if stub is None:
            stub = self._frames[shard] = FrameStub(self.addresses[shard])
        return stub

    def _send_frames(self, case: Case, t0: float) -> Outcome:
        """A Push or Pull case as a frame on a data connection (the only way they are made)."""
        msgs = case.request_bytes()
        try:
            stub = self._frame_stub(case.shard)
            if case.method == "Push":
                res: list[Any] = [stub.Push(msgs, timeout=case.timeout)]
            else:
                res = stub.Pull(msgs[0] if msgs else b"", timeout=case.timeout, buffer_bytes=case.buffer_bytes)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            details = e.details() if hasattr(e, "details") else str(e)
            return Outcome(code.name if code is not None else "UNKNOWN", details or "", time.monotonic() - t0)
        except ConnectFailed as e:  # the shard's data port refused the connection: as a server not there
            return Outcome("UNAVAILABLE", str(e), time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - an answer that does not parse
            return Outcome("OK", seconds=time.monotonic() - t0, bad_response=f"answer does not parse: {e}")
        return Outcome("OK", seconds=time.monotonic() - t0, responses=res)

    def send(self, case: Case) -> Outcome:
        t0 = time.monotonic()
        if case.method in FRAMED:
            return self._send_frames(case, t0)
        try:
            if case.raw is not None or case.to_backup:
                fn = self._raw_callable(case)
                case_raw = case.request_bytes()
                if case.method in CLIENT_STREAM:
                    res = [fn(iter(case_raw), timeout=case.timeout)]
                elif case.method in SERVER_STREAM:
                    res = list(fn(case_raw[0], timeout=case.timeout))
                else:
                    res = [fn(case_raw[0], timeout=case.timeout)]
                parsed = []
                for b in res:
                    try:
                        parsed.append(RESPONSE_TYPES[case.method].FromString(b))
                    except Exception as e:  # noqa: BLE001
                        return Outcome("OK", seconds=time.monotonic() - t0, bad_response=f"answer does not parse: {e}")
                res = parsed
            else:
                stub = self.stubs[case.shard]
                fn = getattr(stub, case.method)
                msgs = case.messages or []
                if case.method in CLIENT_STREAM:
                    res = [fn(iter(msgs), timeout=case.timeout)]
                elif case.method in SERVER_STREAM:
                    res = list(fn(msgs[0], timeout=case.timeout))
                else:
                    res = [fn(msgs[0], timeout=case.timeout)]
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            details = e.details() if hasattr(e, "details") else str(e)
            return Outcome(code.name if code is not None else "UNKNOWN", details or "", time.monotonic() - t0)
        out = Outcome("OK", seconds=time.monotonic() - t0, responses=res)
        if case.method == "Register" and res and list(res[0].created):
            out.bad_response = f"Register created tensors {list(res[0].created)}"
        return out

    def fingerprint(self, timeout: float = 10.0) -> str:
        """A digest of every shard's state as its RPCs show it: Stats (less the pull counters), PullState and
        the rows of each row table the shard holds (``held_rows``).

        Equal iff versions, workers, clocks, counters of pushes and steps,
        specs, weights and optimizer state, row tables' counts and rows are.
        """
        h = hashlib.sha256()
        for i, stub in enumerate(self.stubs):
            for table, keys in held_rows(i, len(self.stubs)).items():
                req = ps_pb2.PullRowsRequest(table=table, key_dtype="uint64", keys=keys.tobytes(), dim=ROW_DIM)
                for r in stub.PullRows(req, timeout=timeout):
                    h.update(r.SerializeToString(deterministic=True))
            s = stub.Stats(ps_pb2.StatsRequest(), timeout=timeout)
            for name in VOLATILE_STATS:
                if name in s.DESCRIPTOR.fields_by_name:
                    s.ClearField(name)
            h.update(s.SerializeToString(deterministic=True))
            for chunk in stub.PullState(ps_pb2.PullStateRequest(), timeout=timeout):
                h.update(chunk.SerializeToString(deterministic=True))
        return h.hexdigest()

    def describe(self) -> Target:
        return dataclasses.replace(describe(self.channels), backups=tuple(sorted(self.backup_channels)))


def serving(addresses: Sequence[str], timeout: float = 5.0) -> bool:
    """Every shard answers its health check with SERVING, for the server and for each service."""
    for a in addresses:
        with grpc.insecure_channel(a) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for svc in ("", *(f"{PACKAGE}.{name}" for name in SERVICES)):
                try:
                    r = stub.Check(health_pb2.HealthCheckRequest(service=svc), timeout=timeout)
                except grpc.RpcError:
                    return False
                if r.status != health_pb2.HealthCheckResponse.SERVING:
                    return False
    return True
