"""Experts run where they live (``service Experts``, experts.proto; shardps.nn.MoE's "send" placement).

An expert is a row of a row table (server/rows/tables.py): its parameters
flattened in the order of the module's ``named_parameters()``. A worker
registers the experts' program once per table (TorchScript of one expert
module, ``torch.jit.load``: no pickle), then sends the tokens of the experts
this shard holds: ``Forward`` runs each expert on its tokens with the row's
current values; ``Backward`` runs it again with autograd, answers the
tokens' gradient and pushes the experts' parameter gradients into the table
as a ``PushRows`` of the same (worker, step, num_workers) would
(``RowTables.push``: the table's optimizer, bsp, exactly once, replication);
with ``hold`` it keeps them (``RowTables.hold``, server/experts/heldgrads.py: replicated to
the backup) for the step's first Backward without hold to push with its own
(a step of several micro-batches).

Thread-safety: a program runs under its own lock (its parameters are loaded
from the row of each call); the rows under the store's.
"""

from __future__ import annotations

import io
import threading
import warnings
from collections.abc import Callable

import grpc
import numpy as np
import torch

from shardps.protos.rows import ROW_ITEMSIZE
from shardps.protos.shardps.v1 import experts_pb2, experts_pb2_grpc
from shardps.server.errors import Aborted, FailedPrecondition, InvalidArgument
from shardps.server.metrics import ServerMetrics
from shardps.server.rows.tables import RowTables
from shardps.server.rpc import unary_errors

MAX_WAIT_S = 300.0


class Program:
    """One table's expert module: its parameters set from a row for each call."""

    def __init__(self, data: bytes) -> None:
        try:
            with warnings.catch_warnings():  # TorchScript is deprecated for torch.export (which needs shapes)
                warnings.simplefilter("ignore", DeprecationWarning)
                self.module = torch.jit.load(io.BytesIO(data), map_location="cpu")  # type: ignore[no-untyped-call]
        except Exception as e:  # a program that does not load is the request's fault
            raise InvalidArgument(f"expert program: not a TorchScript module ({type(e).__name__}: {e})") from None
        self.data = data
        self.params = [p for _, p in self.module.named_parameters()]
        self.numel = sum(p.numel() for p in self.params)
        self.lock = threading.Lock()

    def _load(self, row: torch.Tensor) -> None:
        at = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(row[at:at + p.numel()].view(p.shape))
                at += p.numel()

    def forward(self, row: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        with self.lock, torch.no_grad():
            self._load(row)
            y: torch.Tensor = self.module(x)
            return y.float()

    def backward(self, row: torch.Tensor, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the gradient of ``x``, the flat gradient of the parameters)."""
        with self.lock:
            self._load(row)
            x = x.clone().requires_grad_()
            for p in self.params:
                p.requires_grad_(True)
                p.grad = None
            y = self.module(x)
            grads = torch.autograd.grad(y, [x, *self.params], dy, allow_unused=True)
            flat = [torch.zeros(p.numel()) if g is None else g.reshape(-1) for p, g in zip(self.params, grads[1:])]
            dx = grads[0] if grads[0] is not None else torch.zeros_like(x)
            return dx.detach(), torch.cat(flat).detach()


def decode(req: experts_pb2.ExpertCall, *, backward: bool) -> tuple[np.ndarray, np.ndarray, torch.Tensor,
                                                                     torch.Tensor | None]:
    """(uint64 experts, int64 token counts, [n, d_model] tokens, [n, d_model] output gradient or None)."""
    name = req.table
    if len(req.experts) % 8 or len(req.counts) != len(req.experts):
        raise InvalidArgument(f"expert table {name!r}: expected 8 bytes per expert and per count, got "
                              f"{len(req.experts)} and {len(req.counts)} bytes")
    experts = np.frombuffer(req.experts, dtype="<u8")
    counts = np.frombuffer(req.counts, dtype="<i8")
    if len(np.unique(experts)) != len(experts) or (counts < 0).any():
        raise InvalidArgument(f"expert table {name!r}: expected distinct experts and counts >= 0")
    n, d = int(counts.sum()), req.d_model
    want = n * d * ROW_ITEMSIZE
    if d == 0 or len(req.tokens) != want or (backward and len(req.grad_out) != want):
        raise InvalidArgument(f"expert table {name!r}: expected {n} tokens x {d} fp32 ({want} bytes) of tokens"
                              f"{' and of grad_out' if backward else ''}, got {len(req.tokens)}"
                              f"{f' and {len(req.grad_out)}' if backward else ''} bytes")
    x = torch.frombuffer(bytearray(req.tokens), dtype=torch.float32).view(n, d) if n else torch.zeros(0, d)
    dy = None
    if backward:
        dy = torch.frombuffer(bytearray(req.grad_out), dtype=torch.float32).view(n, d) if n else torch.zeros(0, d)
    return experts, counts, x, dy


def _split(x: torch.Tensor, counts: np.ndarray) -> list[torch.Tensor]:
    return list(torch.split(x, [int(c) for c in counts]))


def run_forward(program: Program, rows: torch.Tensor, x: torch.Tensor, counts: np.ndarray) -> bytes:
    """The outputs of each expert (row i of ``rows``) on its ``counts[i]`` tokens of ``x``, as fp32 bytes."""
    out = [program.forward(rows[i], part) for i, part in enumerate(_split(x, counts))]
    return torch.cat(out).numpy().tobytes() if out else b""


def run_backward(program: Program, rows: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, counts: np.ndarray,
                 dim: int) -> tuple[bytes, torch.Tensor]:
    """(the tokens' gradient as fp32 bytes, each expert's flat parameter gradient ``[n, dim]``)."""
    dxs, grads = [], []
    for i, (part, dpart) in enumerate(zip(_split(x, counts), _split(dy, counts))):
        dx, g = program.backward(rows[i], part, dpart)
        dxs.append(dx)
        grads.append(g)
    return (torch.cat(dxs).numpy().tobytes() if dxs else b""), (torch.stack(grads) if grads else torch.zeros(0, dim))


def check_program(table: str, program: Program | None, dim: int) -> Program:
    """``program``, or the error that a call for rows of ``dim`` floats gets without a fitting one."""
    if program is None:
        raise FailedPrecondition(f"expert table {table!r}: no expert program registered on this shard "
                                 f"(RegisterExpert first)")
    if program.numel != dim:
        raise InvalidArgument(f"expert table {table!r}: the program has {program.numel} parameters, the call "
                              f"says rows of {dim}")
    return program


class ExpertsServicer(experts_pb2_grpc.ExpertsServicer):
    """``service Experts`` over a shard's ``RowTables``."""

    def __init__(self, rows: RowTables, *, check_serving: Callable[[], None] = lambda: None,
                 replicated: Callable[[], None] = lambda: None, metrics: ServerMetrics | None = None,
                 max_wait_s: float = MAX_WAIT_S, epoch: Callable[[], int] = lambda: 0) -> None:
        self.rows = rows
        self.epoch = epoch  # the shard's rollback epoch: a Backward from another applies nothing
        self.check_serving = check_serving
        self.replicated = replicated  # blocks until the backup holds every change so far (--replicas 2)
        self.metrics = metrics
        self.max_wait_s = max_wait_s
        self.programs: dict[str, Program] = {}
        self.lock = threading.Lock()

    def _program(self, table: str, dim: int) -> Program:
        with self.lock:
            program = self.programs.get(table)
        return check_program(table, program, dim)

    @unary_errors
    def RegisterExpert(self, request: experts_pb2.RegisterExpertRequest,
                       context: grpc.ServicerContext) -> experts_pb2.RegisterExpertResponse:
        self.check_serving()
        program = Program(request.program)
        spec = self.rows.tables.get(request.table)
        if spec is None:
            raise FailedPrecondition(f"expert table {request.table!r}: not a registered row table (RegisterRows "
                                     f"first)")
        if spec.spec.dim != program.numel:
            raise InvalidArgument(f"expert table {request.table!r}: rows of {spec.spec.dim} floats, the program "
                                  f"has {program.numel} parameters")
        with self.lock:
            held = self.programs.get(request.table)
            if held is None or held.data != request.program:
                self.programs[request.table] = program
        return experts_pb2.RegisterExpertResponse(parameters=program.numel)

    @unary_errors
    def Forward(self, request: experts_pb2.ExpertCall, context: grpc.ServicerContext) -> experts_pb2.ExpertAnswer:
        self.check_serving()
        program = self._program(request.table, request.dim)
        experts, counts, x, _ = decode(request, backward=False)
        remaining = context.time_remaining()
        timeout = self.max_wait_s if remaining is None else max(0.0, min(remaining * 0.9, self.max_wait_s))
        # the rounds and the ssp clock the worker's step must see first, as its PullRows would (and as it, ended
        # ABORTED by a rollback while it waits, where the call says its epoch)
        epoch = request.epoch if request.HasField("epoch") else None  # checked by the pull, before and after
        rows, _ = self.rows.pull(request.table, request.dim, experts, min_round=request.min_round,
                                 min_clock=request.min_clock, timeout=timeout, epoch=epoch)
        if not len(experts):
            return experts_pb2.ExpertAnswer()
        return experts_pb2.ExpertAnswer(out=run_forward(program, rows, x, counts))

    @unary_errors
    def Backward(self, request: experts_pb2.ExpertCall, context: grpc.ServicerContext) -> experts_pb2.ExpertAnswer:
        self.check_serving()
        program = self._program(request.table, request.dim)
        experts, counts, x, dy = decode(request, backward=True)
        assert dy is not None
        dx, g = b"", torch.zeros(0, request.dim)
        if len(experts):
            rows, _ = self.rows.pull(request.table, request.dim, experts)
            dx, g = run_backward(program, rows, x, dy, counts, request.dim)
        epoch = request.epoch if request.HasField("epoch") else None
        if epoch is not None and epoch != self.epoch():  # computed before a rollback: its
            return experts_pb2.ExpertAnswer(out=dx)  # worker's dense push is refused, and it replays the step
        if request.hold:  # on the backup too before it is answered: the worker goes on (server/experts/heldgrads.py)
            try:  # the epoch checked again where the rows change: a rollback may have come since
                self.rows.hold(request.table, request.dim, request.worker_id, request.step, request.hold_index,
                               experts, g, epoch=epoch)
            except Aborted:
                return experts_pb2.ExpertAnswer(out=dx)
            self.replicated()
            return experts_pb2.ExpertAnswer(out=dx)
        none = np.zeros(len(experts), dtype=np.int64)
        keys, g, _ = self.rows.held.with_held(request.table, request.worker_id, request.step, experts, g, none)
        remaining = context.time_remaining()
        timeout = self.max_wait_s if remaining is None else max(0.0, min(remaining * 0.9, self.max_wait_s))
        try:
            done = self.rows.push(request.table, request.dim, keys, g, worker=request.worker_id, step=request.step,
                                  num_workers=request.num_workers, sync=request.sync, min_round=request.min_round,
                                  timeout=timeout, epoch=epoch)
        except Aborted:
            return experts_pb2.ExpertAnswer(out=dx)
        self.rows.held.drop(request.table, request.worker_id, request.step)  # kept until the push went through
        self.replicated()
        return experts_pb2.ExpertAnswer(out=dx, rows=done.rows, ready=done.ready)
