"""The other RPCs, replication ops sent to backups, raw bytes, and ``make_case`` over them all."""

from __future__ import annotations

import json
import os
import struct
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardps.protos.dataconn import FRAME_SEGMENT
from shardps.protos.shardps.v1 import ps_pb2
from shardps.protos.syncspec import SyncSpec
from shardps.testing.fuzz.bugs import avoiding
from shardps.testing.fuzz.cases import (
    CLIENT_STREAM,
    EXCHANGE_TIMEOUT,
    INT32,
    INT64,
    REQUEST_TYPES,
    SHORT_TIMEOUT,
    TIMEOUT,
    WIRE_DTYPES,
    Case,
    ShardInfo,
    Source,
    Target,
    shifted,
    wild_int,
)
from shardps.testing.fuzz.draws import _text, bad_sync_string, unknown_name
from shardps.testing.fuzz.gen_push import gen_push
from shardps.testing.fuzz.gen_register import gen_register
from shardps.testing.fuzz.gen_rows import gen_pull_rows, gen_push_rows, gen_register_rows

# -- the other RPCs -----------------------------------------------------------------


def _names(src: Source, sh: ShardInfo, avoid: bool) -> list[str]:
    names = [n for n in sorted(sh.tensors) if src.boolean()]
    if src.integer(0, 3) == 0:
        names.insert(src.integer(0, len(names)), unknown_name(src, sh.tensors, avoid))
    if names and src.integer(0, 5) == 0:
        names.append(src.choice(names))  # a name twice
    return names


def _chunk_bytes(src: Source) -> int:
    return src.choice([0, 0, 1024, 4096, 3 << 20, src.integer(1024, 3 << 20), wild_int(src, *INT64)])


def _slices(src: Source, sh: ShardInfo, avoid: bool) -> list[ps_pb2.TensorSlice]:
    """Slices of a sliced Pull (a tensor-parallel rank's, server/datapath/slicepull.py): of held tensors or not, with
    dims, parts, indexes and blocks that fit or not (a dim out of range, parts < 1, an index outside the
    parts, blocks that do not divide the dim)."""
    out = []
    for _ in range(src.integer(1, 3)):
        names = sorted(sh.tensors)
        name = src.choice(names) if names and src.integer(0, 3) else unknown_name(src, sh.tensors, avoid)
        ndim = len(sh.tensors[name].shape) if name in sh.tensors else 2
        parts = src.choice([1, 2, 3, 4, src.integer(-2, 0), wild_int(src, *INT32)])
        out.append(ps_pb2.TensorSlice(
            name=name, dim=src.choice([0, ndim - 1, src.integer(-2, ndim + 1), wild_int(src, *INT32)]),
            parts=parts, index=src.choice([0, max(0, parts - 1), parts, src.integer(-2, 4), wild_int(src, *INT32)]),
            blocks=src.choice([0, 1, 1, 2, 3, src.integer(-2, 5), wild_int(src, *INT32)])))
    return out


def gen_pull(src: Source, t: Target, avoid: bool) -> Case:
    sh = src.choice(t.shards)
    req = ps_pb2.PullRequest(worker_id=wild_int(src, *INT32), names=_names(src, sh, avoid),
                             dtype=src.choice([0, 0, *WIRE_DTYPES, wild_int(src, *INT32)]),  # type: ignore[arg-type]
                             chunk_bytes=_chunk_bytes(src))
    if src.integer(0, 2) == 0:
        req.slices.extend(_slices(src, sh, avoid))
    # Mostly nothing to wait for; now and then a version or clock that will not come (a short deadline).
    req.min_version = src.choice([0, 0, src.integer(0, max(0, sh.version)), wild_int(src, INT64[0], sh.version),
                                  wild_int(src, *INT64)])
    req.min_clock = src.choice([0, 0, src.integer(0, sh.slowest_clock), wild_int(src, INT64[0], sh.slowest_clock),
                                wild_int(src, *INT64)])
    req.epoch = wild_int(src, *INT64) if src.integer(0, 5) == 0 else sh.epoch  # another epoch: ABORTED
    may_block = (req.min_version > sh.version or req.min_clock > sh.slowest_clock) and req.epoch == sh.epoch
    # Now and then answered in the frame's pull buffer: none, too small, or room enough for most.
    buffer_bytes = 0
    if src.integer(0, 3) == 0:
        req.shm = FRAME_SEGMENT
        buffer_bytes = src.choice([0, src.integer(1, 4096), 1 << 20])
    return Case("pull", "Pull", sh.index, messages=[req], may_succeed=True, may_block=may_block,
                timeout=SHORT_TIMEOUT if may_block else TIMEOUT, buffer_bytes=buffer_bytes)


def gen_pull_state(src: Source, t: Target, avoid: bool) -> Case:
    sh = src.choice(t.shards)
    req = ps_pb2.PullStateRequest(names=_names(src, sh, avoid), chunk_bytes=_chunk_bytes(src))
    return Case("pull_state", "PullState", sh.index, messages=[req], may_succeed=True)


def gen_exchange(src: Source, t: Target, avoid: bool) -> Case:
    sh = src.choice(t.shards)
    name = src.choice([*sorted(sh.tensors), unknown_name(src, sh.tensors, avoid)])
    req = ps_pb2.ExchangeRequest(tensor=name, round=wild_int(src, *INT64), tag=src.choice(["row", "col", "", "rms"]),
                                 from_shard=wild_int(src, *INT32))
    return Case("exchange", "Exchange", sh.index, messages=[req], may_succeed=True, may_block=True,
                timeout=EXCHANGE_TIMEOUT)


def gen_set_sync(src: Source, t: Target, avoid: bool) -> Case:
    """SetSync to the job's own mode (a no-op) or to a string that is no mode: never a real switch."""
    sh = src.choice(t.shards)
    if src.boolean():
        s = src.choice([sh.sync, sh.sync.upper(), f"  {sh.sync}\t", sh.sync.capitalize()])
    else:
        s = bad_sync_string(src, avoid)
    return Case("set_sync", "SetSync", sh.index, messages=[ps_pb2.SetSyncRequest(sync=s)], may_succeed=True)


def gen_stats(src: Source, t: Target, avoid: bool) -> Case:
    sh = src.choice(t.shards)
    return Case("stats", "Stats", sh.index, messages=[ps_pb2.StatsRequest()], may_succeed=True)


def gen_heartbeat(src: Source, t: Target, avoid: bool) -> Case:
    """A registered worker renews its lease (no state); any other worker id is refused."""
    sh = src.choice(t.shards)
    w = src.choice([*sh.registered, wild_int(src, *INT32)])
    return Case("heartbeat", "Heartbeat", sh.index, messages=[ps_pb2.HeartbeatRequest(worker_id=w)],
                may_succeed=True)


def gen_connect(src: Source, t: Target, avoid: bool) -> Case:
    """Where a worker's data connection goes (no state the fingerprint sees: a token on the data port); any
    worker id is answered by a serving shard."""
    sh = src.choice(t.shards)
    w = src.choice([*sh.registered, wild_int(src, *INT32)])
    return Case("connect", "Connect", sh.index, messages=[ps_pb2.ConnectRequest(worker_id=w)], may_succeed=True)


def gen_leave(src: Source, t: Target, avoid: bool) -> Case:
    """A worker id outside the job leaves: refused. (A real Leave changes membership, so the fuzzer,
    which asserts that nothing changes, sends only these; tests/test_leave.py covers the rest.)"""
    sh = src.choice(t.shards)
    w = wild_int(src, *INT32)
    if 0 <= w < max(1, sh.num_workers):
        w = -1 - w
    return Case("leave", "Leave", sh.index, messages=[ps_pb2.LeaveRequest(worker_id=w)])


def gen_rollback(src: Source, t: Target, avoid: bool) -> Case:
    """Rollback to the epoch the shard is in or an older one is a no-op; a newer one needs a
    checkpoint, and these jobs have none: refused."""
    sh = src.choice(t.shards)
    req = ps_pb2.RollbackRequest(version=src.choice([0, sh.version, wild_int(src, *INT64)]),
                                 epoch=src.choice([sh.epoch, shifted(sh.epoch, 1, *INT64), wild_int(src, *INT64)]))
    return Case("rollback", "Rollback", sh.index, messages=[req], may_succeed=True)


def gen_checkpoint(src: Source, t: Target, avoid: bool) -> Case:
    """These jobs have no checkpoint directory: refused."""
    sh = src.choice(t.shards)
    return Case("checkpoint", "Checkpoint", sh.index, messages=[ps_pb2.CheckpointRequest()], may_succeed=True)


def gen_replicate(src: Source, t: Target, avoid: bool) -> Case:
    """Replication ops sent to a primary (which holds no backup): refused, whatever they say."""
    sh = src.choice(t.shards)
    msgs = []
    for _ in range(src.integer(1, 4)):
        args = src.choice(['{}', '{"worker": 0}', '{"_layout": [["k", "float32", [2], 0]], "_nbytes": 8}',
                           '{"version": 0, "meta": {}}', "[" * 50, _text(src, avoid)])
        msgs.append(ps_pb2.ReplicateRequest(
            seq=wild_int(src, *INT64), op=src.choice(["snapshot", "submit", "register_worker", "evict", "set_sync",
                                                      _text(src, avoid)]),
            args_json=args, tensors=src.binary(0, 64), shard_index=src.choice([sh.index, wild_int(src, *INT32)]),
            num_shards=src.choice([len(t.shards), wild_int(src, *INT32)]), primary=_text(src, avoid)))
    return Case("replicate", "Replicate", sh.index, messages=msgs)


REPLICATE_DEFECTS = ("mixed_headers", "cut", "extra_bytes", "malformed", "bad_args")


def gen_replicate_backup(src: Source, t: Target, avoid: bool) -> Case:
    """One op of a Replicate stream sent to a shard's backup, in two or more messages, with a defect that the
    backup must find before it replays anything (a replayed op out of order would make it ask for the whole
    state: a change). Without backups, ``gen_replicate``."""
    if not t.backups:
        return gen_replicate(src, t, avoid)
    shard = src.choice(t.backups)
    n = src.integer(2, 6)  # float32 elements
    data = struct.pack(f"<{n}f", *(float(i) for i in range(n)))
    args = {"worker": 0, "step": 0, "base_version": 0, "nbytes": 4 * n, "found_inf": False,
            "_layout": [["w@0", "float32", [n], 0]], "_nbytes": len(data)}
    seq = wild_int(src, *INT64)
    head = ps_pb2.ReplicateRequest(seq=seq, op=src.choice(["submit", "snapshot", "leave"]),
                                   args_json=json.dumps(args), shard_index=shard, num_shards=len(t.shards),
                                   primary=_text(src, avoid, long_ok=False), incarnation=src.choice(["", "run"]))
    cut = src.integer(1, len(data) - 1)
    pieces = [data[:cut], data[cut:]]
    defect = src.choice(REPLICATE_DEFECTS)
    msgs = [head, ps_pb2.ReplicateRequest(seq=seq)]
    if defect == "mixed_headers":
        field_name = src.choice(["op", "args_json", "shard_index", "num_shards", "primary", "incarnation"])
        texts = {"op": "evict", "args_json": "{}", "primary": "elsewhere:1", "incarnation": "another"}
        value: Any = texts[field_name] if field_name in texts else \
            shifted(getattr(head, field_name), src.integer(1, 5), *INT32)  # shard_index, num_shards: int32
        setattr(msgs[1], field_name, value)
    elif defect == "cut":
        pieces[1] = pieces[1][: src.integer(0, len(pieces[1]) - 1)]
    elif defect == "extra_bytes":
        pieces[1] += src.binary(1, 16)
    elif defect == "bad_args":
        head.args_json = src.choice(["[" * 50, "[]", "{", '"x"', '{"_layout": 1, "_nbytes": 0}'])
    for m, piece in zip(msgs, pieces):
        m.tensors = piece
    raw = [m.SerializeToString() for m in msgs]
    if defect == "malformed":
        raw.insert(src.integer(1, len(raw)), src.choice([b"\xff", b"\x0a\x05ab", src.binary(1, 16)]))
        if all(_parses("Replicate", b) is not None for b in raw):
            raw.insert(1, b"\xff")
        return Case("replicate_backup", "Replicate", shard, raw=raw, malformed=True, defects=(defect,),
                    to_backup=True)
    return Case("replicate_backup", "Replicate", shard, messages=msgs, defects=(defect,), to_backup=True)


def gen_promote(src: Source, t: Target, avoid: bool) -> Case:
    """Promote sent to a primary: a no-op."""
    sh = src.choice(t.shards)
    req = ps_pb2.PromoteRequest(reason=_text(src, avoid), force=src.choice([False, True]))
    return Case("promote", "Promote", sh.index, messages=[req], may_succeed=True)


def gen_attach_replica(src: Source, t: Target, avoid: bool) -> Case:
    """AttachReplica to addresses that are no HOST:PORT: refused (a real one would start replicating)."""
    sh = src.choice(t.shards)
    address = src.choice(["", "nohost", "h:0", "h:65536", ":80", "h:port", "h:-1", "h:" + "9" * 30, "x" * 400 + ":1",
                          _text(src, avoid).replace(":", "")])
    req = ps_pb2.AttachReplicaRequest(address=address, timeout_seconds=src.choice([0.0, 0.01, -1.0]))
    return Case("attach_replica", "AttachReplica", sh.index, messages=[req])


GENERATORS: dict[str, Callable[[Source, Target, bool], Case]] = {
    "Push": gen_push, "Register": gen_register, "Pull": gen_pull, "PullState": gen_pull_state,
    "Exchange": gen_exchange, "SetSync": gen_set_sync, "Stats": gen_stats, "Heartbeat": gen_heartbeat,
    "Rollback": gen_rollback, "Checkpoint": gen_checkpoint, "Replicate": gen_replicate, "Promote": gen_promote,
    "Leave": gen_leave, "Connect": gen_connect,
    "RegisterRows": gen_register_rows, "PullRows": gen_pull_rows, "PushRows": gen_push_rows,
}

_WORKER_ID_MINUS_ONE = b"\x08" + b"\xff" * 9 + b"\x01"  # field 1 (worker_id) = -1, as protobuf writes it
# Appended to a row request that parses, so that it is refused whatever the damage made of it (the last value of
# a field wins; a repeated message field merges): dim = 0, a dim no table has. A damaged PullRows that parses
# could pull keys no shard holds (creating them), a PushRows could be a step, a RegisterRows a new table.
_ROWS_DIM_ZERO = {"PullRows": b"\x20\x00", "PushRows": b"\x28\x00", "RegisterRows": b"\x0a\x02\x10\x00"}


def _parses(method: str, b: bytes) -> Any | None:
    try:
        return REQUEST_TYPES[method].FromString(b)
    except Exception:  # noqa: BLE001 - DecodeError and friends: not a valid message
        return None


def gen_raw(src: Source, t: Target, avoid: bool) -> Case:
    """Random or damaged bytes as request messages of any RPC."""
    # Not Leave: bytes that parse as a LeaveRequest of a worker of the job (an empty message is
    # worker 0's) are a valid goodbye, which changes membership.
    method = src.choice(sorted(set(GENERATORS) - {"Leave"}))
    base = GENERATORS[method](src, t, avoid)
    msgs = base.request_bytes()
    out = []
    for b in msgs:
        mode = src.integer(0, 5)
        if mode == 0 and b:  # truncated
            b = b[: src.integer(0, len(b) - 1)]
        elif mode == 1 and b:  # one byte changed
            i = src.integer(0, len(b) - 1)
            b = b[:i] + bytes([src.integer(0, 255)]) + b[i + 1 :]
        elif mode == 2:  # bytes inserted
            i = src.integer(0, len(b))
            b = b[:i] + src.binary(1, 8) + b[i:]
        elif mode == 3:  # random bytes
            b = src.binary(0, 64)
        out.append(b)
    if method in CLIENT_STREAM and src.integer(0, 3) == 0:
        out.insert(src.integer(0, len(out)), src.binary(0, 32))
    if method not in CLIENT_STREAM:
        out = out[:1] or [b""]
    parsed = [_parses(method, b) for b in out]
    malformed = any(p is None for p in parsed)
    sh = t.shards[base.shard]
    timeout = TIMEOUT
    # Push and Register streams whose messages all parse get worker_id -1 on
    # each (the last value of a field wins): refused before anything is taken in.
    # Where a message is malformed the others stay as they are: the server must
    # refuse the whole stream (it used to apply the part before the malformed
    # message: bug malformed-stream-prefix-applied, avoided while open).
    sanitize = avoiding(avoid, "malformed-stream-prefix-applied") or not malformed
    if method == "Push" and sanitize:
        out = [b + _WORKER_ID_MINUS_ONE if p is not None else b for b, p in zip(out, parsed)]
    elif method == "Register" and out and parsed[0] is not None and sanitize:
        out[0] += _WORKER_ID_MINUS_ONE
    elif method in _ROWS_DIM_ZERO and not malformed:  # a malformed PushRows stream must be refused whole
        out = [b + _ROWS_DIM_ZERO[method] for b in out]
    first = parsed[0] if parsed else None  # None: malformed (not parsed)
    if not malformed and method == "SetSync" and first is not None:
        try:
            switch = str(SyncSpec.parse(first.sync)) != sh.sync
        except ValueError:
            switch = False
        if switch:
            out[0] += b"\x0a\x01!"  # sync = "!"
    elif not malformed and method == "Pull" and first is not None:
        if first.min_version > sh.version or first.min_clock > sh.slowest_clock:
            timeout = SHORT_TIMEOUT
    if method == "Exchange":
        timeout = EXCHANGE_TIMEOUT
    return Case("raw", method, base.shard, raw=out, may_succeed=method not in CLIENT_STREAM, malformed=malformed,
                may_block=timeout < TIMEOUT, timeout=timeout)


KINDS: tuple[tuple[str, Callable[[Source, Target, bool], Case]], ...] = (
    ("push", gen_push), ("push", gen_push), ("push", gen_push), ("push", gen_push), ("push", gen_push),
    ("register", gen_register), ("register", gen_register), ("register", gen_register),
    ("pull", gen_pull), ("pull", gen_pull), ("pull_state", gen_pull_state), ("set_sync", gen_set_sync),
    ("exchange", gen_exchange), ("stats", gen_stats), ("heartbeat", gen_heartbeat), ("rollback", gen_rollback),
    ("checkpoint", gen_checkpoint), ("raw", gen_raw), ("raw", gen_raw), ("raw", gen_raw),
    ("replicate", gen_replicate), ("promote", gen_promote), ("attach_replica", gen_attach_replica),
    ("replicate_backup", gen_replicate_backup),
    ("push_rows", gen_push_rows), ("push_rows", gen_push_rows), ("pull_rows", gen_pull_rows),
    ("register_rows", gen_register_rows),
)


def make_case(src: Source, t: Target, avoid_known_bugs: bool = True) -> Case:
    """One case of any kind, weighted towards the streams that carry data (Push, Register, raw bytes)."""
    _, gen = src.choice(KINDS)
    return gen(src, t, avoid_known_bugs)


@dataclass(frozen=True)
class GeneratorDefect:
    """A generator raised instead of building a case: a bug of the fuzzer, not of the server."""

    error: str  # the exception: "ValueError: Value out of range: 4294967296"
    where: str  # the innermost line of shardps/testing/fuzz that raised: "gen_rows.py:160 in gen_register_rows"


def draw_case(src: Source, t: Target, avoid_known_bugs: bool = True) -> Case | GeneratorDefect:
    """``make_case``, with an exception of a generator returned as a ``GeneratorDefect`` so that a campaign
    can report it and go on (``src`` has then made some of that case's choices: the next case differs from
    the one a fixed generator would draw, and the same seed still gives the same run). Hypothesis' own
    exceptions (a HypothesisSource's control flow) are raised as they are."""
    try:
        return make_case(src, t, avoid_known_bugs)
    except Exception as e:  # noqa: BLE001 - any exception of a generator is a generator defect
        if type(e).__module__.split(".")[0] == "hypothesis":
            raise
        here = os.path.dirname(os.path.abspath(__file__))
        frames = [f for f in traceback.extract_tb(e.__traceback__) if os.path.dirname(f.filename) == here]
        where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name}" if frames else "?"
        return GeneratorDefect(f"{type(e).__name__}: {e}"[:500], where)
