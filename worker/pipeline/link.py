"""``GroupLink``: the walker's ``Link`` between pipeline stages in different processes, over a process group.

Stage s is rank s of its pipeline's group (``worker/groups.py``). A value
travels as point-to-point messages from the sender to its neighbour: a
header of ``HEADER_LEN`` int64s, then the tensor itself::

    header: MAGIC | kind (0 forward output, 1 input gradient) | micro-batch | step
            | dtype code (-1: no value) | ndim | shape[0] ... shape[MAX_DIMS - 1]

so shapes and dtypes may change from one message to the next (the last
micro-batch smaller, another sequence length in the next step): the receiver
learns the size from the header. Messages from one rank to another arrive in
the order they were sent (a process group's point-to-point order per pair),
and each stage sends and receives in its own order of the plan, so the
header is also a check: a value that is not the one expected (another
micro-batch, kind or step) is an error that says both.

Used on GPUs (nccl; on CPU ``SocketLink`` carries the values, worker/pipeline/socketlink.py):
the receive of each neighbour's next header is posted ahead (at ``start`` and
as the value before it is taken), and a payload's once its header says its
size, since nccl needs exact sizes; a value counts as taken once its send
completed. Any backend works (the tests run it over gloo).

Sends do not block (in 1F1B both neighbours send before they receive;
blocking sends would deadlock): each returns at once. A sent
tensor is kept until it is known to be taken: when the neighbour hands over a value its own order produces after the
task that took ours (the step's orders, given to ``start``), or at ``flush``,
which waits for the rest at the end of a step. Every wait has a deadline
(``start(timeout)``: the step's; a wait that times out closes the connection,
so there is no polling with short ones), and a neighbour whose process ended
is noticed at once (its connections close): ``LinkError`` says whom this
stage waited for, for what, why, and which of its values that neighbour took
last. ``close()`` drops the group, closing its connections, so that the
neighbours waiting on this stage learn at once that it failed.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardps.worker.pipeline.schedule import Kind, Task

MAGIC = 0x5053  # "PS"
MAX_DIMS = 10
HEADER_LEN = 6 + MAX_DIMS
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_CODE = {d: i for i, d in enumerate(DTYPES)}
_KIND = {Kind.FORWARD: 0, Kind.BACKWARD: 1}
NO_VALUE = -1


def _what(kind: Kind, mb: int) -> str:
    return f"the {'forward output' if kind is Kind.FORWARD else 'input gradient'} of micro-batch {mb}"


class LinkError(RuntimeError):
    """A value did not reach this stage: from stage ``peer``, ``kind`` of micro-batch ``microbatch``.
    ``reason``: ``"lost"`` (the peer's connection closed: its process ended, or it failed and closed its
    group), ``"timeout"`` (the step's deadline passed), ``"mismatch"`` (another value came) or ``"send"``
    (a value this stage sent was not taken). ``taken``: the last of this stage's values the peer took,
    as (kind, micro-batch), when known."""

    def __init__(self, message: str, peer: int, kind: Kind, microbatch: int, reason: str,
                 taken: tuple[Kind, int] | None = None) -> None:
        super().__init__(message)
        self.peer, self.kind, self.microbatch, self.reason, self.taken = peer, kind, microbatch, reason, taken

    def __reduce__(self) -> Any:  # pickles with its fields (it crosses process boundaries)
        return (LinkError, (str(self), self.peer, self.kind, self.microbatch, self.reason, self.taken))


@dataclass
class _Sent:
    """A value sent and not known to be taken: its works (header, payload) and tensors, kept until then."""

    kind: Kind
    mb: int
    peer: int
    works: list[Any]
    tensors: list[torch.Tensor]


@dataclass
class _Posted:
    """The receive of a neighbour's next header, posted ahead."""

    header_work: Any
    header: torch.Tensor


def header_fields(kind: Kind, mb: int, step: int, value: torch.Tensor | None) -> list[int]:
    """The header of ``value`` (None: no value), as ``HEADER_LEN`` ints; refuses what cannot be sent."""
    h = [MAGIC, _KIND[kind], mb, step, NO_VALUE, 0] + [0] * MAX_DIMS
    if value is not None:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"a stage hands its neighbour tensors, got {type(value).__name__} for {_what(kind, mb)}")
        code = _CODE.get(value.dtype)
        if code is None:
            raise TypeError(f"{_what(kind, mb)}: dtype {value.dtype} cannot be sent between stages "
                            f"(known: {', '.join(str(d).removeprefix('torch.') for d in DTYPES)})")
        shape = value.shape
        if len(shape) > MAX_DIMS:
            raise ValueError(f"{_what(kind, mb)}: {len(shape)} dimensions, at most {MAX_DIMS} can be sent")
        h[4], h[5] = code, len(shape)
        h[6:6 + len(shape)] = shape
    return h


def parse_header(v: Sequence[int]) -> tuple[Kind, int, int, torch.dtype | None, tuple[int, ...]]:
    """(kind, micro-batch, step, dtype or None for no value, shape) of a header's ints; ``ValueError`` if
    they are none."""
    if len(v) != HEADER_LEN or v[0] != MAGIC or v[1] not in (0, 1) or not (NO_VALUE <= v[4] < len(DTYPES)) \
            or not 0 <= v[5] <= MAX_DIMS:
        raise ValueError(f"not a pipeline header: {list(v)}")
    kind = Kind.FORWARD if v[1] == 0 else Kind.BACKWARD
    return kind, v[2], v[3], (None if v[4] == NO_VALUE else DTYPES[v[4]]), tuple(v[6:6 + v[5]])


def encode_header(kind: Kind, mb: int, step: int, value: torch.Tensor | None) -> torch.Tensor:
    """The header of ``value`` (None: no value), as a tensor of ``HEADER_LEN`` int64s."""
    return torch.tensor(header_fields(kind, mb, step, value), dtype=torch.int64)


def decode_header(h: torch.Tensor) -> tuple[Kind, int, int, torch.dtype | None, tuple[int, ...]]:
    """``parse_header`` of a header tensor."""
    return parse_header(h.tolist())


class GroupLink:
    """Stage ``stage`` of ``num_stages`` handing values to its neighbours over ``group`` (a process group
    of the pipeline's stages, stage s its rank s; this link owns it). ``device``: where the group's
    tensors live (CPU for gloo, the stage's GPU for nccl)."""

    def __init__(self, group: Any, stage: int, num_stages: int, device: torch.device | None = None) -> None:
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage must be in [0, {num_stages}), got {stage}")
        self.group: Any = group
        self.stage, self.num_stages = stage, num_stages
        self.device = device or torch.device("cpu")
        self.step = 0
        self.timeout = 600.0
        self._deadline = time.monotonic() + self.timeout
        self._sends: list[_Sent] = []  # in the order sent
        self._position: dict[int, dict[tuple[Kind, int], int]] = {}  # neighbour -> (kind, mb) -> index in its order
        self._taken: dict[int, tuple[Kind, int]] = {}  # neighbour -> the last of our values it is known to have
        self._expect: dict[int, int] = {}  # neighbour -> values still to come from it this step
        self._early: dict[int, _Posted] = {}  # neighbour -> the receive of its next header, posted ahead

    def start(self, step: int, timeout: float, orders: Sequence[Sequence[Task]] | None = None) -> None:
        """A step begins: its values carry ``step``, and every wait of it ends ``timeout`` seconds from now.
        ``orders``: every stage's tasks in its order (``StepPlan.orders``): sent values are freed early, and
        the header of the next value from each neighbour is received ahead of the task that needs it (so
        it is sent the moment the neighbour has it, rather than when this stage asks)."""
        if self.group is None:
            raise RuntimeError(f"stage {self.stage}: the pipeline's group was closed (after a failure)")
        self.step, self.timeout = step, timeout
        self._deadline = time.monotonic() + timeout
        self._taken = {}
        self._position = {n: {(t.kind, t.microbatch): i for i, t in enumerate(orders[n])}
                          for n in (self.stage - 1, self.stage + 1) if orders and 0 <= n < len(orders)}
        self._early, self._expect = {}, {}
        if orders:
            own = orders[self.stage]
            self._expect = {n: sum(1 for t in own if t.kind is k) for n, k in
                            ((self.stage - 1, Kind.FORWARD), (self.stage + 1, Kind.BACKWARD))
                            if 0 <= n < self.num_stages}
            for n, k in self._expect_kinds():
                try:
                    self._post_header(n)
                except RuntimeError as e:
                    first = next(t.microbatch for t in own if t.kind is k)
                    raise self._error(e, n, k, first, False) from e

    def _expect_kinds(self) -> list[tuple[int, Kind]]:
        return [(n, Kind.FORWARD if n < self.stage else Kind.BACKWARD) for n in list(self._expect)]

    def _post_header(self, peer: int) -> None:
        """Receive ``peer``'s next value ahead, when one more is to come from it this step."""
        if self._expect.get(peer, 0) > 0 and self.group is not None:
            self._early[peer] = self._post(peer)
            self._expect[peer] -= 1

    def _post(self, peer: int) -> _Posted:
        """Post the receive of ``peer``'s next header."""
        assert self.group is not None
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        return _Posted(self.group.recv([header], peer, 0), header)

    def _left(self) -> dt.timedelta:
        return dt.timedelta(seconds=max(0.001, self._deadline - time.monotonic()))

    def _error(self, e: BaseException, peer: int, kind: Kind, mb: int, sending: bool) -> LinkError:
        what = _what(kind, mb)
        if "Timed out" in str(e) or time.monotonic() >= self._deadline:
            msg = (f"stage {self.stage}: {what} it sent was not taken by stage {peer} within {self.timeout:g}s"
                   if sending else f"stage {self.stage} waited {self.timeout:g}s (the step's deadline) for {what} "
                                   f"from stage {peer}")
            return LinkError(msg, peer, kind, mb, "timeout")
        cause = (str(e).splitlines()[0] if str(e) else type(e).__name__)[:160]
        return LinkError(f"stage {self.stage} lost stage {peer} while {'sending it' if sending else 'waiting for'} "
                         f"{what} ({cause})", peer, kind, mb, "send" if sending else "lost", self._taken_by(peer))

    def _taken_by(self, peer: int) -> tuple[Kind, int] | None:
        """The last value ``peer``, whose connection closed, took from this stage: waits on a closed
        connection end at once (done, or raising)."""
        for sent in [x for x in self._sends if x.peer == peer]:
            try:
                for w in sent.works:
                    w.wait(self._left())
            except RuntimeError:
                break
            self._taken[peer] = (sent.kind, sent.mb)
        return self._taken.get(peer)

    def _done_before(self, peer: int, kind: Kind, mb: int) -> None:
        """``peer`` handed over what its task (kind, mb) made: the values it took in earlier tasks of its
        order are taken (their waits return at once); free them."""
        pos = self._position.get(peer)
        if not pos or (kind, mb) not in pos:
            return
        here, keep = pos[(kind, mb)], []
        for sent in self._sends:
            if sent.peer == peer and pos.get((sent.kind, sent.mb), here) < here:
                try:
                    for w in sent.works:
                        w.wait(self._left())
                except RuntimeError as e:
                    raise self._error(e, peer, sent.kind, sent.mb, True) from e
                self._taken[peer] = (sent.kind, sent.mb)
            else:
                keep.append(sent)
        self._sends = keep

    def send(self, kind: Kind, stage: int, mb: int, value: torch.Tensor | None, /) -> None:
        """Hand stage ``stage``'s ``kind`` value of ``mb`` to its neighbour (the next stage for a forward
        output, the previous for an input gradient). Returns at once; ``flush`` waits for it."""
        if stage != self.stage:
            raise ValueError(f"stage {self.stage} cannot send as stage {stage}")
        peer = stage + 1 if kind is Kind.FORWARD else stage - 1
        if not 0 <= peer < self.num_stages:
            raise ValueError(f"stage {stage} has no neighbour to send {_what(kind, mb)} to")
        if self.group is None:
            raise RuntimeError(f"stage {self.stage}: the pipeline's group was closed (after a failure)")
        header = encode_header(kind, mb, self.step, value).to(self.device)
        payload = None if value is None else value.detach().to(self.device).contiguous()
        try:
            sent = _Sent(kind, mb, peer, [self.group.send([header], peer, 0)], [header])
            self._sends.append(sent)
            if payload is not None:
                sent.tensors.append(payload)
                sent.works.append(self.group.send([payload], peer, 0))
        except RuntimeError as e:
            raise self._error(e, peer, kind, mb, True) from e

    def recv(self, kind: Kind, stage: int, mb: int, /) -> torch.Tensor | None:
        """Stage ``stage``'s ``kind`` value of ``mb`` (the next one it sends here), blocking until it is
        there or the step's deadline; ``LinkError`` when it cannot come or another value came."""
        if abs(stage - self.stage) != 1 or not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {self.stage} receives from its neighbours only, not from stage {stage}")
        if self.group is None:
            raise RuntimeError(f"stage {self.stage}: the pipeline's group was closed (after a failure)")
        try:
            posted = self._early.pop(stage) if stage in self._early else self._post(stage)
            posted.header_work.wait(self._left())
        except RuntimeError as e:
            raise self._error(e, stage, kind, mb, False) from e
        got_kind, got_mb, got_step, dtype, shape = decode_header(posted.header.cpu())
        if (got_kind, got_mb, got_step) != (kind, mb, self.step):
            raise LinkError(f"stage {self.stage} expected {_what(kind, mb)} of step {self.step} from stage {stage}, "
                            f"got {_what(got_kind, got_mb)} of step {got_step}", stage, kind, mb, "mismatch")
        value = None
        try:
            if dtype is not None:
                value = torch.empty(shape, dtype=dtype, device=self.device)
                work = self.group.recv([value], stage, 0)
            self._post_header(stage)  # after the payload's receive: a peer's messages match receives in order
            if value is not None:
                work.wait(self._left())
        except RuntimeError as e:
            raise self._error(e, stage, kind, mb, False) from e
        self._done_before(stage, kind, mb)
        return value

    def flush(self) -> None:
        """Wait until every value sent has been taken by its neighbour (within the step's deadline)."""
        while self._sends:
            sent = self._sends[0]
            try:
                for w in sent.works:
                    w.wait(self._left())
            except RuntimeError as e:
                raise self._error(e, sent.peer, sent.kind, sent.mb, True) from e
            self._taken[sent.peer] = (sent.kind, sent.mb)
            self._sends.pop(0)

    def close(self) -> None:
        """Drop the group (its connections close: neighbours waiting on this stage fail at once)."""
        self._sends, self._early = [], {}
        self.group = None

    @property
    def closed(self) -> bool:
        return self.group is None
