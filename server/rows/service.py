"""The gRPC face of a shard's row tables (``service Rows``, the worker token): decode, call, encode.

Requests are checked whole before the store sees them (keys' dtype and
length, gradient bytes against keys x dim, every message of a PushRows
stream naming the same table, worker, step and dim); the store
(server/rows/tables.py) checks the table and the dim. Errors name the table, what
was expected and what came.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import numpy as np
import torch

from shardps.protos import codec, framing
from shardps.protos.rows import (
    KEY_DTYPES,
    MAX_PULL_KEYS,
    MAX_PUSH_KEYS,
    ROW_ITEMSIZE,
    RowTableSpec,
    label,
    rows_per_message,
)
from shardps.protos.shardps.v1 import ps_pb2, ps_pb2_grpc
from shardps.server.errors import InvalidArgument, ResourceExhausted
from shardps.server.metrics import ServerMetrics
from shardps.server.rows.tables import RowTables
from shardps.server.rpc import stream_errors, unary_errors


def decode_keys(table: str, key_dtype: str, data: bytes) -> np.ndarray:
    """The uint64 keys of a request; InvalidArgument for another dtype or a length not a multiple of 8."""
    dtype = KEY_DTYPES.get(key_dtype)
    if dtype is None:
        raise InvalidArgument(f"row table {label(table)}: expected keys of dtype {sorted(KEY_DTYPES)}, got "
                              f"{key_dtype!r}")
    if len(data) % 8:
        raise InvalidArgument(f"row table {label(table)}: expected keys of 8 bytes each, got {len(data)} bytes")
    return np.frombuffer(data, dtype=dtype).view(np.uint64)


def decode_push_rows(requests: Iterator[ps_pb2.PushRowsRequest], max_keys: int = MAX_PUSH_KEYS
                     ) -> tuple[ps_pb2.PushRowsRequest, np.ndarray, torch.Tensor, np.ndarray, bool]:
    """(the first message, uint64 keys, [n, dim] fp32 gradients, int64 base versions (-1: not known),
    found_inf: said by any message) of a whole PushRows stream; RESOURCE_EXHAUSTED past ``max_keys`` keys."""
    first: ps_pb2.PushRowsRequest | None = None
    keys: list[np.ndarray] = []
    grads: list[bytes] = []
    bases: list[np.ndarray] = []
    found_inf, total = False, 0
    for m in requests:
        first = first or m
        head = (m.table, m.dim, m.worker_id, m.step, m.num_workers, m.assign, m.hold, m.hold_index, m.sync,
                m.min_round)
        want = (first.table, first.dim, first.worker_id, first.step, first.num_workers, first.assign, first.hold,
                first.hold_index, first.sync, first.min_round)
        if head != want:
            raise InvalidArgument(f"row table {label(first.table)}: every message of a PushRows stream names the same "
                                  f"(table, dim, worker, step, num_workers, assign, hold, hold_index, sync, "
                                  f"min_round): expected "
                                  f"{want}, got {head}")
        if m.hold and m.assign:
            raise InvalidArgument(f"row table {label(m.table)}: expected hold or assign in a PushRows, got both")
        k = decode_keys(m.table, m.key_dtype, m.keys)
        if len(m.grads) != len(k) * m.dim * ROW_ITEMSIZE:
            raise InvalidArgument(f"row table {label(m.table)}: expected {len(k)} x {m.dim} fp32 gradients "
                                  f"({len(k) * m.dim * ROW_ITEMSIZE} bytes), got {len(m.grads)} bytes")
        if m.base_versions and len(m.base_versions) != 8 * len(k):
            raise InvalidArgument(f"row table {label(m.table)}: expected {len(k)} base versions ({8 * len(k)} bytes), "
                                  f"got {len(m.base_versions)} bytes")
        total += len(k)
        if total > max_keys:
            raise ResourceExhausted(f"row table {label(m.table)}: expected at most {max_keys} keys in one PushRows "
                                    f"stream, got {total} so far")
        found_inf = found_inf or m.found_inf
        keys.append(k)
        grads.append(m.grads)
        bases.append(np.frombuffer(m.base_versions, dtype="<i8") if m.base_versions else np.full(len(k), -1))
    if first is None:
        raise InvalidArgument("PushRows: an empty stream")
    data = bytearray().join(grads)  # one copy, writable: the tensor is the request's own
    g = torch.frombuffer(data, dtype=torch.float32) if data else torch.zeros(0)
    return (first, np.concatenate(keys), g.view(-1, max(1, first.dim)), np.concatenate(bases).astype(np.int64),
            found_inf)


class RowsServicer(ps_pb2_grpc.RowsServicer):
    """``service Rows`` over a shard's ``RowTables``."""

    def __init__(self, rows: RowTables, *, check_serving: Callable[[], None],
                 check_epoch: Callable[[int], None] = lambda epoch: None,
                 replicated: Callable[[], None] = lambda: None, backup: Callable[[], str] = lambda: "",
                 chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES, metrics: ServerMetrics | None = None,
                 max_wait_s: float = 300.0) -> None:
        self.rows = rows
        self.max_wait_s = max_wait_s  # the longest a pull or push waits for a round or the ssp clock
        self.check_serving = check_serving
        # ABORTED for a push from another rollback epoch (as a dense Push): a worker's step computed
        # before a rollback is never applied after it
        self.check_epoch = check_epoch
        self.replicated = replicated  # blocks until the backup holds every change so far (--replicas 2)
        self.backup = backup  # where the shard's backup lives ("" without one): RegisterRows says it
        self.chunk_bytes = codec.check_chunk_bytes(chunk_bytes)
        self.metrics = metrics

    @unary_errors
    def RegisterRows(self, request: ps_pb2.RegisterRowsRequest,
                     context: grpc.ServicerContext) -> ps_pb2.RegisterRowsResponse:
        self.check_serving()
        try:
            spec = RowTableSpec.from_proto(request.table)
        except ValueError as e:
            what = str(e)
            named = what if what.startswith("row table ") else f"row table {label(request.table.name)}: {what}"
            raise InvalidArgument(named) from None
        rows = self.rows.register(spec)
        self.replicated()
        return ps_pb2.RegisterRowsResponse(rows=rows, backup=self.backup())

    @stream_errors
    def PullRows(self, request: ps_pb2.PullRowsRequest,
                 context: grpc.ServicerContext) -> Iterator[bytes]:
        self.check_serving()
        keys = decode_keys(request.table, request.key_dtype, request.keys)
        if len(keys) > MAX_PULL_KEYS:
            raise ResourceExhausted(f"row table {label(request.table)}: expected at most {MAX_PULL_KEYS} keys in one "
                                    f"PullRows, got {len(keys)}")
        epoch = request.epoch if request.HasField("epoch") else None  # checked before and after the wait (tables.py)
        remaining = context.time_remaining()
        timeout = self.max_wait_s if remaining is None else max(0.0, min(remaining * 0.9, self.max_wait_s))
        rows, versions = self.rows.pull(request.table, request.dim, keys, min_round=request.min_round,
                                        min_clock=request.min_clock, timeout=timeout,
                                        epoch=epoch)  # checks the keys are distinct
        per = rows_per_message(request.dim + 2, self.chunk_bytes)  # + its version
        r, v = rows.numpy(), versions.numpy()
        for first in range(0, len(keys), per):  # bytes (server/service.py sends them as they are)
            yield framing.pull_rows_message(first, r[first:first + per].data, v[first:first + per].data)

    @unary_errors
    def PushRows(self, request_iterator: Iterator[ps_pb2.PushRowsRequest],
                 context: grpc.ServicerContext) -> ps_pb2.PushRowsResponse:
        self.check_serving()
        head, keys, grads, base, found_inf = decode_push_rows(request_iterator)
        epoch = head.epoch if head.HasField("epoch") else None
        if epoch is not None:
            self.check_epoch(epoch)  # refused before any wait; checked again where the rows change (tables.py)
        if head.assign:
            created = self.rows.assign(head.table, head.dim, keys, grads, epoch=epoch)
            self.replicated()
            return ps_pb2.PushRowsResponse(rows=created)
        if head.hold:  # kept for the step's push (an expert actor's held Backward: server/experts/heldgrads.py)
            self.rows.hold(head.table, head.dim, head.worker_id, head.step, head.hold_index, keys, grads, base,
                           epoch=epoch)
            self.replicated()  # the actor's worker goes on once answered: the backup must hold it too
            return ps_pb2.PushRowsResponse()
        held = self.rows.held
        if held.holds(head.table, head.worker_id, head.step):  # this push applies them, summed with its own
            keys, grads, base = held.with_held(head.table, head.worker_id, head.step, keys, grads, base)
        remaining = context.time_remaining()
        timeout = self.max_wait_s if remaining is None else max(0.0, min(remaining * 0.9, self.max_wait_s))
        done = self.rows.push(head.table, head.dim, keys, grads, worker=head.worker_id, step=head.step,
                              num_workers=head.num_workers, sync=head.sync, min_round=head.min_round,
                              timeout=timeout, base=base, found_inf=found_inf, epoch=epoch)
        held.drop(head.table, head.worker_id, head.step)  # kept until the push went through
        self.replicated()  # acknowledged only once the backup holds it
        return ps_pb2.PushRowsResponse(rows=done.rows, steps=done.steps, skipped=done.skipped, ready=done.ready)
