"""``Streamer``: a model's weights streamed from the servers, unit by unit, for ``DistributedOptimizer(stream=)``.

A streamed parameter keeps its ``Parameter`` object (autograd and the
user's references hold it) but not its storage: ``untyped_storage().resize_(0)``
frees the bytes, ``resize_`` back and a pull into it bring them back (as
FSDP does). Around each unit (``worker/streaming/plan.py``):

    forward pre-hook    hold the unit (pull what is not live), wait for it,
                        start the pulls of the next ``prefetch`` slots
    forward hook        keep a host copy (keep="host", asp, ssp), release
                        the unit; hook its backward on its outputs' grad_fn
    backward pre-hook   hold the unit again (pull, or copy from the host),
                        wait, prefetch the next backward slots
    backward done       release (its inputs' gradients are computed, or,
                        for a first unit, every parameter's gradient is in)
    gradient complete   (post-accumulate-grad hook, once per step even for a
                        tied weight: autograd sums its uses first) handed to
                        the step's ``BucketedPush`` at once, then freed

A weight is live while any slot holds it (a count per tensor). Released,
its storage is kept while the budget allows (the oldest released goes
first when a pull needs room): a weight still there when backward wants
it is not pulled again, and with a budget of the whole model nothing is
pulled twice in a step. A weight tied between two units is pulled for
each use that finds it freed. ``step()`` frees everything.
The pulls of a step's forward ask for the versions the last push said
ready (``weights_from``), as the resident path's pull does; under bsp and
every:X no version can move between a unit's forward and its backward
(this worker has not pushed), so pulling it again gives the same bytes.
Under asp and ssp it could: the forward's copy is kept on the host instead.

Every wait has the pull's deadline (``PullInFlight``). Pull failures go
to the optimizer's ``pull_failed`` (a rollback raises ``RolledBack`` out of
forward or backward, after ``reset``: nothing held).
Not thread-safe: the training thread (and the autograd hooks it runs) only.

Over 400 lines: one class whose hooks share one step's state (hold counts,
slots, pulls in flight, released weights kept, host copies, the push
stream); the pure parts are worker/streaming/plan.py.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from shardps.protos.syncspec import SyncSpec
from shardps.worker.accumulate import Accumulator
from shardps.worker.client import PSClient
from shardps.worker.datapath.bucketedpush import BucketedPush
from shardps.worker.datapath.pull import PullInFlight
from shardps.worker.errors import ShardError
from shardps.worker.streaming.heap import give_back_freed_memory, trim
from shardps.worker.streaming.plan import Slot, Stream, ahead, fits, schedule, units


class Streamed(Protocol):
    """What the streamer needs of its optimizer (``DistributedOptimizer`` is one)."""

    params: dict[str, torch.Tensor]
    client: PSClient
    sync: SyncSpec
    accumulator: Accumulator
    pull_dtype: torch.dtype | None

    def open_bucketed_push(self, *, hold_gradients: bool = True) -> BucketedPush: ...

    def pull_failed(self, e: ShardError) -> None: ...


class Streamer:
    """The hooks and per-step state of a streamed model (see the module docstring)."""

    def __init__(self, opt: Streamed, model: nn.Module, spec: Stream) -> None:
        self.opt = opt
        self.spec = spec
        self.heap_fixed = give_back_freed_memory()  # (the optimizer called it before registering)
        self.params = opt.params
        self.units = units(model, opt.params, spec.modules)
        self.largest_unit_bytes = max(u.nbytes for u in self.units)
        self.model_bytes = sum(p.numel() * p.element_size() for p in opt.params.values())
        for n, p in opt.params.items():
            if not p.is_contiguous():
                raise ValueError(f"Stream: parameter {n!r} is not contiguous: it cannot be pulled in place")
            # A storage of its own, resizable (registering read the old one through numpy, which pins its size;
            # a view of a larger tensor cannot be released alone). The Parameter object stays.
            p.data = torch.empty_like(p.data, memory_format=torch.contiguous_format)
            p.data.untyped_storage().resize_(0)
        trim()  # the weights just released, allocated before the heap's threshold was fixed (worker/streaming/heap.py)
        # A pull is the weights the budget lets live (one unit at least): the pull segments keep that much in
        # memory (and each part's alignment: ShmLink.settle_pull), not the model's share a whole pull wrote.
        self.pull_keep_bytes = max(spec.max_live_bytes, self.largest_unit_bytes)
        opt.client.paths.keep_pull(self.pull_keep_bytes)
        self._size = {n: p.numel() * p.element_size() for n, p in opt.params.items()}
        self._refs: dict[str, int] = dict.fromkeys(opt.params, 0)
        self._inflight: dict[str, PullInFlight] = {}
        self._held: dict[Slot, tuple[str, ...]] = {}
        self._cache: dict[str, None] = {}  # released by every slot, storage kept while the budget allows: oldest first
        self._calls: list[int] = []  # this step's unit calls, in forward order
        self._recorded: list[int] = []  # the last step's: the plan prefetching follows
        self._stack: list[int] = []  # the calls whose forward is running (units can nest)
        self._inputs: dict[int, list[torch.Tensor]] = {}
        self._backed: set[int] = set()
        self._waiting: dict[int, set[str]] = {}  # backward slots released when these gradients are in
        self._host: dict[str, tuple[torch.Tensor, Any]] = {}  # name -> (host copy, its copy's CUDA event)
        self._push: BucketedPush | None = None
        self._handed: set[str] = set()
        self.mins: list[int] = list(opt.client.versions)
        self.min_clock = 0
        self.peak_live_bytes = 0
        self.peak_host_bytes = 0
        self.pulls = 0  # pulls started (one per unit fetched)
        self.pulled_bytes = 0
        self._weight_bytes = 0  # the parameters' live storage bytes (kept by _alloc and _free)
        self.wait_seconds = 0.0  # forward and backward blocked on pulls (the cost prefetching did not hide)
        self.steps = 0
        self.misses_after_first = 0  # slots whose weights were not asked for before their hook (first step aside)
        self.trace: list[int] | None = None  # set to [] to record the live bytes at every boundary
        self._closed = False
        self._handles: list[Any] = []
        for k, u in enumerate(self.units):
            self._handles.append(u.module.register_forward_pre_hook(functools.partial(self._pre_forward, k)))
            self._handles.append(u.module.register_forward_hook(functools.partial(self._post_forward, k)))
        for n, p in opt.params.items():
            hook = functools.partial(self._grad_ready, n)
            self._handles.append(p.register_post_accumulate_grad_hook(hook))  # type: ignore[no-untyped-call]
        self.reset()

    # -- accounting ---------------------------------------------------------------

    def live_bytes(self) -> int:
        """Parameter + gradient storage bytes alive now, read from the tensors themselves."""
        total = 0
        for p in self.params.values():
            total += p.data.untyped_storage().nbytes()
            if p.grad is not None:
                total += p.grad.untyped_storage().nbytes()
        return total

    def host_bytes(self) -> int:
        return sum(h.numel() * h.element_size() for h, _ in self._host.values())

    def reset_peak(self) -> None:
        """Start the peaks (``peak_live_bytes``, ``peak_host_bytes``) over from what is alive now."""
        self.peak_live_bytes = self.live_bytes()
        self.peak_host_bytes = self.host_bytes()

    def _mark(self, grad_bytes: int = 0) -> None:
        """A boundary: the weights live (kept count) plus ``grad_bytes`` (the one gradient alive: each is freed
        as soon as it is handed in) into the peak. With ``trace`` on, read from the tensors and checked."""
        live = self._weight_bytes + grad_bytes
        if self.trace is not None:
            scanned = self.live_bytes()
            assert scanned == live, f"Streamer: {scanned} bytes live, {live} counted"
            self.trace.append(live)
        self.peak_live_bytes = max(self.peak_live_bytes, live)
        if self._host:
            self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes())

    # -- storage ----------------------------------------------------------------

    def _alloc(self, n: str) -> None:
        st = self.params[n].data.untyped_storage()
        if st.nbytes() == 0:
            st.resize_(self._size[n])
            self._weight_bytes += self._size[n]

    def _free(self, n: str) -> None:
        st = self.params[n].data.untyped_storage()
        if st.nbytes():
            st.resize_(0)
            self._weight_bytes -= self._size[n]

    def _keeps_host(self) -> bool:
        return self.spec.keep == "host" or not self.opt.sync.barrier

    def _to_host(self, n: str) -> None:
        t = self.params[n].data
        if not t.is_cuda:
            self._host[n] = (t.clone(), None)
            return
        bufs = self.opt.client.buffers  # pinned, copied on the side stream: the compute stream goes on
        side = bufs.side_stream(t.device)
        buf = bufs.pinned(f"stream:{n}", t.numel(), t.dtype)
        side.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(side):
            buf.copy_(t.view(-1), non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(side)
        t.record_stream(side)  # the storage is not reused (after its release) before the copy has read it
        self._host[n] = (buf, done)

    def _from_host(self, n: str) -> None:
        t = self.params[n].data
        host, event = self._host[n]
        if not t.is_cuda:
            t.view(-1).copy_(host.view(-1))
            return
        side = self.opt.client.buffers.side_stream(t.device)
        if event is not None:
            side.wait_event(event)
        side.wait_stream(torch.cuda.current_stream(t.device))  # the storage was just (re)allocated there
        with torch.cuda.stream(side):
            t.view(-1).copy_(host.view(-1), non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(side)
        torch.cuda.current_stream(t.device).wait_event(done)  # compute waits for the copy, not the host

    # -- holding and releasing ----------------------------------------------------

    def _acquire(self, slot: Slot, k: int) -> None:
        if slot in self._held:
            return
        names = self.units[k].names
        fetch = [n for n in names if self._refs[n] == 0 and n not in self._inflight and n not in self._cache]
        for n in names:
            self._refs[n] += 1
            self._cache.pop(n, None)
        self._held[slot] = names
        self._make_room(sum(self._size[n] for n in fetch))
        net = []
        for n in fetch:
            self._alloc(n)
            if self._use_host_copy(slot, n):
                self._from_host(n)
            else:
                net.append(n)
        if net:
            pull = self.opt.client.pull_async(net, out={n: self.params[n].data for n in net}, min_versions=self.mins,
                                              min_clock=self.min_clock, dtype=self.opt.pull_dtype)
            self.pulls += 1
            self.pulled_bytes += sum(self._size[n] for n in net)
            for n in net:
                self._inflight[n] = pull

    def _use_host_copy(self, slot: Slot, name: str) -> bool:
        """Whether ``slot`` gets ``name`` from its host copy, not a pull (here: a backward's, keep="host")."""
        return slot[0] == "b" and name in self._host

    def _ready(self, names: tuple[str, ...]) -> None:
        """Wait until ``names`` are in (the pull's deadline); a failed pull goes to the optimizer."""
        pulls = {id(p): p for n in names if (p := self._inflight.get(n)) is not None}
        t0 = time.perf_counter()
        try:
            self._take(pulls.values())
        finally:
            self.wait_seconds += time.perf_counter() - t0

    def _take(self, pulls: Iterable[PullInFlight]) -> None:
        for pull in pulls:
            for n in [n for n, q in self._inflight.items() if q is pull]:
                del self._inflight[n]
            try:
                pull.result()
            except ShardError as e:
                self.reset()
                self.opt.pull_failed(e)
                raise

    def _release(self, slot: Slot) -> None:
        names = self._held.pop(slot, None)
        if names is None:
            return
        for n in names:
            self._refs[n] -= 1
            if self._refs[n] == 0:
                pull = self._inflight.pop(n, None)
                if pull is not None:  # a prefetch nobody waited for: it must stop writing first
                    _settle(pull)
                if slot[0] == "f" and torch.is_grad_enabled():  # its backward may want it: kept while room
                    self._cache[n] = None
                else:
                    self._free(n)
        self._make_room(0)

    def _make_room(self, more: int) -> None:
        """Free the oldest released weights until ``more`` bytes fit the budget beside what is live."""
        if not self._cache:
            return
        live = self._weight_bytes
        while self._cache and live + more > self.spec.max_live_bytes:
            n = next(iter(self._cache))
            del self._cache[n]
            self._free(n)
            live -= self._size[n]

    def _unit_at(self, slot: Slot) -> int | None:
        calls = self._recorded if slot[0] == "f" else self._calls
        return calls[slot[1]] if slot[1] < len(calls) else None

    def _prefetch(self, at: Slot) -> None:
        if self.spec.prefetch == 0:
            return
        n_calls = len(self._recorded) if at[0] == "f" else len(self._calls)
        for nxt in ahead(schedule(n_calls), at, self.spec.prefetch):
            if at[0] == "f" and nxt[0] == "b" and not torch.is_grad_enabled():
                return  # a forward without autograd (evaluation) has no backward to prepare
            k = self._unit_at(nxt)
            if k is None:
                return
            names = self.units[k].names
            new = sum(self._size[n] for n in names if self._refs[n] == 0 and n not in self._inflight
                      and n not in self._cache)
            cached = sum(self._size[n] for n in self._cache if n not in names)  # freed to make room if need be
            if not fits(self._weight_bytes - cached, new * (2 if nxt[0] == "b" else 1), self.spec.max_live_bytes):
                return  # the budget is full: it is pulled when its turn comes
            self._acquire(nxt, k)

    # -- the hooks ----------------------------------------------------------------

    def _pre_forward(self, k: int, module: nn.Module, args: Any) -> None:
        if self._closed:
            return
        if not torch.is_grad_enabled():  # an evaluation: no plan, no prefetch, nothing kept after
            pos = -1 - len(self._stack)
            self._stack.append(pos)
            self._acquire(("e", pos), k)
            self._ready(self.units[k].names)
            self._mark()
            return
        pos = len(self._calls)
        self._calls.append(k)
        if pos < len(self._recorded) and self._recorded[pos] != k:
            self._recorded = []  # this forward goes another way: no prefetch until it is recorded again
        self._stack.append(pos)
        self._enter(("f", pos), k)
        if torch.is_grad_enabled():
            self._inputs[pos] = [t for t in _tensors(args) if t.requires_grad]

    def _post_forward(self, k: int, module: nn.Module, args: Any, output: Any) -> None:
        if self._closed:
            return
        pos = self._stack.pop()
        if pos < 0:
            self._release(("e", pos))
            self._mark()
            return
        names = self.units[k].names
        inputs = self._inputs.pop(pos, [])
        outs = [t for t in _tensors(output) if t.requires_grad and t.grad_fn is not None]
        if outs:
            if self._keeps_host():
                for n in names:
                    if n not in self._host:
                        self._to_host(n)
            hook = functools.partial(self._pre_backward, pos, k)
            for t in outs:
                assert t.grad_fn is not None
                t.grad_fn.register_prehook(hook)
            if inputs:
                torch.autograd.graph.register_multi_grad_hook(inputs, functools.partial(self._done, pos),
                                                              mode="all")
            else:  # a first unit: its backward is done when its parameters' gradients are in
                self._waiting[pos] = set(names)
        self._release(("f", pos))
        self._mark()

    def _pre_backward(self, pos: int, k: int, grad_outputs: Any) -> None:
        if self._closed or pos in self._backed:
            return
        self._backed.add(pos)
        self._enter(("b", pos), k)

    def _enter(self, slot: Slot, k: int) -> None:
        """Unit ``k`` is about to run ``slot``: hold it, wait for its weights, prefetch what comes next."""
        if self.steps > 0 and slot not in self._held:
            self.misses_after_first += 1
        self._acquire(slot, k)
        self._ready(self.units[k].names)
        self._prefetch(slot)
        self._mark()

    def _done(self, pos: int, grads: Any) -> None:
        if self._closed:
            return
        self._release(("b", pos))
        self._mark()

    def _grad_ready(self, name: str, param: torch.Tensor) -> None:
        g = param.grad
        if self._closed or g is None:
            return
        self._hand(name, g, "in one step (backward run twice before step()): a streamed model pushes each "
                            "gradient as it is complete; accumulate with sync='every:X' instead")
        self._let_go(name, param, g)

    def _hand(self, name: str, g: torch.Tensor, twice: str) -> None:
        """``name``'s complete gradient to the host sum (every:X, not the pushing step) or the push stream."""
        opt = self.opt
        x = opt.sync.accumulation
        if x > 1 and opt.accumulator.steps + 1 < x:
            opt.accumulator.add_one(name, g)
            return
        if name in self._handed:
            raise RuntimeError(f"Stream: the gradient of {name!r} came twice {twice}")
        value = g if x == 1 else opt.accumulator.mean_with(name, g, x)
        if self._push is None:
            self._push = opt.open_bucketed_push(hold_gradients=False)  # freed as handed in (``_let_go``)
        self._push.add({name: value})
        self._handed.add(name)

    def _let_go(self, name: str, param: torch.Tensor, g: torch.Tensor) -> None:
        """``g`` taken: counted, dropped from the parameter, the backward slots waiting only on it released."""
        self._mark(g.untyped_storage().nbytes())
        param.grad = None
        for pos, waiting in list(self._waiting.items()):
            waiting.discard(name)
            if not waiting:
                del self._waiting[pos]
                self._release(("b", pos))

    # -- step boundaries ------------------------------------------------------------

    def end_step(self) -> BucketedPush | None:
        """The step's end (``step()``): release what is still held (prefetches not used, backward slots of
        outputs without a gradient), forget the host copies; the step's push stream (None: nothing handed in)."""
        for slot in list(self._held):
            self._release(slot)
        for pull in set(self._inflight.values()):
            _settle(pull)
        self._inflight.clear()
        for n in self._cache:  # the next step's weights are new
            self._free(n)
        self._cache.clear()
        self._host.clear()
        if self._calls:
            self._recorded = self._calls
            self.steps += 1
        self._calls, self._stack, self._inputs = [], [], {}
        self._backed, self._waiting, self._handed = set(), {}, set()
        push, self._push = self._push, None
        return push

    def remaining(self, push: BucketedPush) -> dict[str, torch.Tensor]:
        """What goes up at ``step()`` besides what backward handed in: ``every:X`` sums of tensors without
        a gradient in the pushing step."""
        opt = self.opt
        x = opt.sync.accumulation
        out = {}
        for n, p in self.params.items():
            if push.handed_in(n):
                continue
            if p.grad is not None:
                out[n] = p.grad if x == 1 else opt.accumulator.mean_with(n, p.grad, x)
            elif x > 1 and opt.accumulator.sum_of(n) is not None:
                out[n] = opt.accumulator.mean_with(n, None, x)
        return out

    def weights_from(self, min_versions: list[int], min_clock: int) -> None:
        """The next forward's pulls ask for these versions (a push's ready versions) and clock."""
        self.mins, self.min_clock = list(min_versions), min_clock

    def reset(self) -> None:
        """Hold nothing: the push stream (if open) cancelled, pulls in flight settled, every weight, gradient
        and host copy released; the next pulls from the versions the client has now."""
        push = self.end_step()
        if push is not None:
            push.abort()
        for n, p in self.params.items():
            self._refs[n] = 0
            p.grad = None
            self._free(n)
        self.mins, self.min_clock = list(self.opt.client.versions), 0

    def close(self) -> None:
        """Take the hooks off and hold nothing (``reset``); the model keeps its parameters, without storage."""
        self._closed = True
        for h in self._handles:
            h.remove()
        self._handles = []
        self.reset()
        self.opt.client.paths.keep_pull(None)

    def weights(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """The weights the next forward would use, pulled into new CPU tensors (the whole model unless
        ``names``: mind the memory): for a checkpoint or an evaluation outside the stream."""
        return self.opt.client.pull(names, min_versions=self.mins, min_clock=self.min_clock,
                                    dtype=self.opt.pull_dtype)

    def held(self) -> dict[str, int]:
        """Each tensor's live storage bytes, for the tensors that have any (empty between steps)."""
        return {n: b for n, p in self.params.items() if (b := p.data.untyped_storage().nbytes())}


def _settle(pull: PullInFlight) -> None:
    """Wait for ``pull`` to end (its deadline), however it ends: nothing writes into its tensors after."""
    try:
        pull.result()
    except Exception:  # noqa: BLE001 - a prefetch nobody needs any more: its failure is nobody's
        pass


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, Mapping):
        return [t for v in x.values() for t in _tensors(v)]
    return []


__all__ = ["Stream", "Streamer"]
