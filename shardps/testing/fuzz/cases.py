"""What a fuzz case is and where its choices come from: the services, the sources of choices, what the
fuzzer knows about the server (``Target``), ``Case``, and the names, values and optimizer params it draws."""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from google.protobuf import text_format

from shardps.protos.shardps.v1 import ps_pb2, ps_pb2_grpc

T = TypeVar("T")
PACKAGE = "shardps.v1"
# The services of ps.proto, one per audience, and their methods (every method a case may call).
SERVICES: dict[str, tuple[str, ...]] = {
    "Workers": ("Register", "Heartbeat", "Leave", "Describe", "Recover", "TakeOver", "Connect"),
    "Operator": ("Stats", "SetSync", "Checkpoint", "Rollback", "Promote", "AttachReplica", "PullState"),
    "Peers": ("Exchange", "Replicate"),  # and Describe, which the workers' service has too
    "Rows": ("RegisterRows", "PullRows", "PushRows"),  # row tables (docs/sparse.md)
}
SERVICE_OF = {m: svc for svc, methods in SERVICES.items() for m in methods}


def method_path(method: str) -> str:
    """The full gRPC path of one of ps.proto's methods: /shardps.v1.<its service>/<method>."""
    return f"/{PACKAGE}.{SERVICE_OF[method]}/{method}"


class Stubs:
    """The generated stub of every service over one channel; ``stubs.Method`` is the method of its service."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._by_service = {svc: getattr(ps_pb2_grpc, f"{svc}Stub")(channel) for svc in SERVICES}

    def __getattr__(self, method: str) -> Any:
        return getattr(self._by_service[SERVICE_OF[method]], method)


INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
UINT32 = (0, 2**32 - 1)
UINT64 = (0, 2**64 - 1)
ITEMSIZE = {ps_pb2.FLOAT32: 4, ps_pb2.FLOAT16: 2, ps_pb2.BFLOAT16: 2}
WIRE_DTYPES = (ps_pb2.FLOAT32, ps_pb2.FLOAT16, ps_pb2.BFLOAT16)
SHORT_TIMEOUT = 0.2  # requests that may wait on purpose (a version, a clock, a peer's partial)
EXCHANGE_TIMEOUT = 0.05  # Exchange always waits: nothing is ever published in these jobs
TIMEOUT = 5.0  # everything else: none of these should take more than milliseconds
# Stats that move without a change of state: pulls served and pulls parked in a wait right now.
VOLATILE_STATS = ("pull_bytes_total", "pulls_total", "waiting_pulls", "push_received_bytes_total")

# Status codes a refused request may get. Anything else (UNKNOWN, INTERNAL,
# UNAVAILABLE, CANCELLED...) is a violation unless it matches KNOWN_BUGS.
# ABORTED is the designed answer to a request of another rollback epoch,
# RESOURCE_EXHAUSTED to one asking for more than a shard takes, PERMISSION_DENIED to a Push or
# Pull frame naming another worker than its data connection's.
REFUSALS = frozenset({"INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "OUT_OF_RANGE",
                      "DEADLINE_EXCEEDED", "ABORTED", "RESOURCE_EXHAUSTED", "PERMISSION_DENIED"})


# -- where the choices come from ---------------------------------------------


class Source:
    """Every choice a generator makes. Subclasses: RandomSource, HypothesisSource."""

    def integer(self, lo: int, hi: int) -> int:
        raise NotImplementedError

    def boolean(self) -> bool:
        raise NotImplementedError

    def choice(self, seq: Sequence[T]) -> T:
        raise NotImplementedError

    def binary(self, min_size: int, max_size: int) -> bytes:
        raise NotImplementedError

    def text(self, max_size: int) -> str:
        raise NotImplementedError

    def double(self) -> float:
        raise NotImplementedError


_CODEPOINT_RANGES = ((0x20, 0x7E), (0x00, 0x1F), (0xA0, 0x24F), (0x300, 0x36F), (0x590, 0x6FF),
                     (0x4E00, 0x4E80), (0xFFF0, 0xFFFF), (0x1F600, 0x1F64F), (0x10FFF0, 0x10FFFF))
_SPECIAL_DOUBLES = (math.nan, math.inf, -math.inf, 0.0, -0.0, 5e-324, -5e-324, 1.7976931348623157e308,
                    -1.7976931348623157e308, 1.0, -1.0, 0.5, 65536.0, 1e-300)


class RandomSource(Source):
    """Choices from a seeded ``random.Random`` (the benchmark: fast, reproducible by seed)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def boolean(self) -> bool:
        return self.rng.random() < 0.5

    def choice(self, seq: Sequence[T]) -> T:
        return seq[self.rng.randrange(len(seq))]

    def binary(self, min_size: int, max_size: int) -> bytes:
        return self.rng.randbytes(self.rng.randint(min_size, max_size))

    def text(self, max_size: int) -> str:
        n = self.rng.randint(0, max_size)
        if n > 64:  # long strings: cheap and mostly ASCII
            return "".join(self.rng.choice("abcdefghij\u00e9\u4e00\U0001f600") for _ in range(n))
        out = []
        for _ in range(n):
            lo, hi = self.rng.choice(_CODEPOINT_RANGES)
            out.append(chr(self.rng.randint(lo, hi)))
        return "".join(out)

    def double(self) -> float:
        mode = self.rng.randrange(3)
        if mode == 0:
            return self.rng.choice(_SPECIAL_DOUBLES)
        if mode == 1:
            return self.rng.uniform(-1e6, 1e6)
        return struct.unpack("<d", self.rng.randbytes(8))[0]


class HypothesisSource(Source):
    """Choices drawn by hypothesis (the test: shrinks a failure to a small case).

    ``draw`` is the function an ``@st.composite`` strategy receives.
    """

    def __init__(self, draw: Callable[[Any], Any]) -> None:
        from hypothesis import strategies as st

        self.st = st
        self.draw = draw

    def integer(self, lo: int, hi: int) -> int:
        return self.draw(self.st.integers(lo, hi))

    def boolean(self) -> bool:
        return self.draw(self.st.booleans())

    def choice(self, seq: Sequence[T]) -> T:
        return self.draw(self.st.sampled_from(seq))

    def binary(self, min_size: int, max_size: int) -> bytes:
        return self.draw(self.st.binary(min_size=min_size, max_size=max_size))

    def text(self, max_size: int) -> str:
        return self.draw(self.st.text(max_size=max_size))

    def double(self) -> float:
        return self.draw(self.st.floats())


def shifted(v: int, by: int, lo: int, hi: int) -> int:
    """``v + by`` wrapped into [lo, hi] (a proto field's range, e.g. ``*UINT32``): a value the field holds, and
    never ``v`` itself for 0 < |by| <= hi - lo (a defect that changes a field stays a change at its edges)."""
    return lo + (v - lo + by) % (hi - lo + 1)


def wild_int(src: Source, lo: int, hi: int) -> int:
    """An integer in [lo, hi]: an edge value, a small one or any."""
    mode = src.integer(0, 2)
    if mode == 0:
        edges = [v for v in (lo, hi, 0, -1, 1, lo + 1, hi - 1, 2**31, 2**32, -(2**31) - 1) if lo <= v <= hi]
        return src.choice(edges)
    if mode == 1:
        return src.integer(max(lo, -8), min(hi, 8))
    return src.integer(lo, hi)


# -- what the fuzzer knows about the server ----------------------------------


@dataclass(frozen=True, eq=False)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: int
    push_dtype: int
    parts: tuple[tuple[int, int], ...]  # on this shard
    spec: ps_pb2.TensorSpec  # as Stats reports it: registering it again is a no-op

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, eq=False)
class RowTableInfo:
    spec: ps_pb2.RowTableSpec  # as Stats reports it: registering it again is a no-op
    rows: int  # held on this shard

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True, eq=False)
class ShardInfo:
    index: int
    version: int
    sync: str
    num_workers: int
    registered: tuple[int, ...]
    clocks: dict[int, int]  # last step taken in per worker, -1 before the first
    tensors: dict[str, TensorInfo]
    loss_scale: float
    epoch: int = 0
    row_tables: dict[str, RowTableInfo] = field(default_factory=dict)

    @property
    def slowest_clock(self) -> int:
        """The lowest number of steps any worker has pushed (what Pull's min_clock waits for)."""
        return min((c + 1 for c in self.clocks.values()), default=0)


@dataclass(frozen=True, eq=False)
class Target:
    shards: tuple[ShardInfo, ...]
    backups: tuple[int, ...] = ()  # the shards whose backup the fuzzer can reach

    def parts_elsewhere(self, shard: int, name: str) -> list[tuple[int, int]]:
        return [p for s in self.shards if s.index != shard and name in s.tensors for p in s.tensors[name].parts]


def describe(channels: Sequence[grpc.Channel], timeout: float = 10.0) -> Target:
    """What every shard holds now, from its Stats."""
    shards = []
    for i, ch in enumerate(channels):
        s = ps_pb2_grpc.OperatorStub(ch).Stats(ps_pb2.StatsRequest(), timeout=timeout)
        tensors = {}
        for t in s.tensors:
            spec = ps_pb2.TensorSpec()
            spec.CopyFrom(t.spec)
            tensors[spec.name] = TensorInfo(spec.name, tuple(spec.shape), spec.dtype, spec.grad_dtype or spec.dtype,
                                            tuple((p.start, p.stop) for p in spec.parts), spec)
        clocks = {w: int(s.worker_clocks.get(w, -1)) for w in range(s.num_workers)}
        row_tables = {}
        for r in s.row_tables:
            rspec = ps_pb2.RowTableSpec()
            rspec.CopyFrom(r.spec)
            row_tables[rspec.name] = RowTableInfo(rspec, int(r.rows))
        shards.append(ShardInfo(i, s.version, s.sync, s.num_workers, tuple(sorted(s.registered_workers)), clocks,
                                tensors, s.loss_scale, getattr(s, "epoch", 0), row_tables))
    return Target(tuple(shards))


# -- cases -------------------------------------------------------------------

UNARY = {"Exchange", "SetSync", "Stats", "Heartbeat", "Leave", "Rollback", "Checkpoint", "Promote", "AttachReplica",
         "RegisterRows"}
CLIENT_STREAM = {"Push", "Register", "Replicate", "PushRows"}
SERVER_STREAM = {"Pull", "PullState", "PullRows"}
REQUEST_TYPES: dict[str, Any] = {
    "Push": ps_pb2.PushRequest, "Register": ps_pb2.RegisterRequest, "Pull": ps_pb2.PullRequest,
    "PullState": ps_pb2.PullStateRequest, "Exchange": ps_pb2.ExchangeRequest, "SetSync": ps_pb2.SetSyncRequest,
    "Stats": ps_pb2.StatsRequest, "Heartbeat": ps_pb2.HeartbeatRequest, "Leave": ps_pb2.LeaveRequest,
    "Rollback": ps_pb2.RollbackRequest,
    "Checkpoint": ps_pb2.CheckpointRequest, "Replicate": ps_pb2.ReplicateRequest, "Promote": ps_pb2.PromoteRequest,
    "AttachReplica": ps_pb2.AttachReplicaRequest, "RegisterRows": ps_pb2.RegisterRowsRequest,
    "PullRows": ps_pb2.PullRowsRequest, "PushRows": ps_pb2.PushRowsRequest, "Connect": ps_pb2.ConnectRequest,
}
RESPONSE_TYPES: dict[str, Any] = {
    "Push": ps_pb2.PushResponse, "Register": ps_pb2.RegisterResponse, "Pull": ps_pb2.PullResponse,
    "PullState": ps_pb2.StateChunk, "Exchange": ps_pb2.ExchangeResponse, "SetSync": ps_pb2.SetSyncResponse,
    "Stats": ps_pb2.StatsResponse, "Heartbeat": ps_pb2.HeartbeatResponse, "Leave": ps_pb2.LeaveResponse,
    "Rollback": ps_pb2.RollbackResponse,
    "Checkpoint": ps_pb2.CheckpointResponse, "Replicate": ps_pb2.ReplicateResponse,
    "Promote": ps_pb2.PromoteResponse, "AttachReplica": ps_pb2.AttachReplicaResponse,
    "RegisterRows": ps_pb2.RegisterRowsResponse, "PullRows": ps_pb2.PullRowsResponse,
    "PushRows": ps_pb2.PushRowsResponse, "Connect": ps_pb2.ConnectResponse,
}


@dataclass
class Case:
    """One RPC to one shard, and what answers it may get."""

    kind: str  # the generator: push, register, pull, ..., replicate, promote, attach_replica, raw
    method: str  # the RPC
    shard: int
    messages: list[Any] | None = None  # protobuf requests, sent with the generated stub
    raw: list[bytes] | None = None  # request bytes, sent as they are
    timeout: float = TIMEOUT
    may_succeed: bool = False  # a success is allowed (it changes no state)
    may_block: bool = False  # may legitimately wait until its deadline
    malformed: bool = False  # some raw message is not a valid request message
    defects: tuple[str, ...] = ()  # deliberate faults, each enough for a refusal
    to_backup: bool = False  # sent to the backup of shard ``shard`` (--replicas 2), not to its primary
    buffer_bytes: int = 0  # a framed Pull's pull buffer (where one naming the frame's segment is answered)

    def __repr__(self) -> str:
        where = f"the backup of shard {self.shard}" if self.to_backup else f"shard {self.shard}"
        head = (f"Case({self.kind}: {self.method} to {where}, timeout={self.timeout}, "
                f"defects={list(self.defects)}, may_succeed={self.may_succeed}, malformed={self.malformed}"
                f"{f', buffer_bytes={self.buffer_bytes}' if self.buffer_bytes else ''})")
        lines = [head]
        if self.messages is not None:
            for m in self.messages:
                lines.append(f"  {type(m).__name__}({text_format.MessageToString(m, as_one_line=True)[:2000]})")
        if self.raw is not None:
            for b in self.raw:
                lines.append(f"  bytes.fromhex({b.hex()[:4000]!r})")
        return "\n".join(lines)

    def request_bytes(self) -> list[bytes]:
        if self.raw is not None:
            return list(self.raw)
        return [m.SerializeToString() for m in self.messages or []]
