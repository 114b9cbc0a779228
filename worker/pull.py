"""``PullInFlight``: a pull from every shard whose tensors can be waited for one by one.

One Pull per shard, started at once (``start``), writing each chunk into its
destination as it arrives; ``wait(names)`` returns once those tensors are
complete, ``result()`` once all are. The tensors of each shard come in the
order asked (the model's order: the first layers first). ``PSClient.pull``
is ``start`` then ``result``; ``result`` hands the pull's ``view`` (what the
shards said about the job: ``worker/jobview.py``) to ``on_result``, the
client's ``apply``, in the thread that takes the result. Each shard's path
(``worker/paths.py``) names the segment a Pull asks for (same host) and reads
its answers' chunks.

The RPCs run on the transport's threads (one per shard; the shards whose
Push answered with their weights are copied, and with ``start(inline=True)``
the first shard's RPC made, in the caller's thread) and never block without
a deadline: the client's timeout per RPC, and for waits on them the timeout
plus the transport's recovery time. The shard threads write only this
object's state (the destinations, what each shard said), never the client's.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future

import torch

from shardps.protos import codec, framing
from shardps.protos.shardps.v1 import ps_pb2
from shardps.protos.slices import TensorSlice
from shardps.worker.jobview import JobView
from shardps.worker.route import Route
from shardps.worker.transport import gather


class PullInFlight:
    """Weights being pulled from every shard into their destinations (see the module docstring)."""

    def __init__(self, client: Route, names: Sequence[str], *, out: Mapping[str, torch.Tensor] | None = None,
                 min_versions: Sequence[int] | None = None, dtype: torch.dtype | None = None,
                 min_clock: int = 0, answered: Mapping[int, Sequence[bytes]] | None = None,
                 on_result: Callable[[JobView], None] | None = None,
                 slices: Mapping[str, TensorSlice] | None = None) -> None:
        assert client.shard_map is not None
        self._client = client
        self._on_result = on_result
        # Tensors pulled as one slice each (a tensor-parallel rank's, protos/slices.py): ``out`` holds the
        # slice; the shards answer with its elements only. A Push's answer holds whole tensors: not used then.
        self._slices = dict(slices or {})
        self._answered = dict(answered or {}) if not self._slices else {}  # shard -> its Push's PullResponses
        self._mins = list(min_versions) if min_versions is not None else [0] * client.num_shards
        self._wire = codec.to_wire_dtype(dtype) if dtype is not None else ps_pb2.DTYPE_UNSPECIFIED
        self._min_clock = min_clock
        self.result_tensors: dict[str, torch.Tensor] = {}
        self._staging: dict[str, torch.Tensor] = {}  # flat CPU views written by the shard threads
        self._staged: set[str] = set()  # destinations that need a last copy (a device, or not in one piece)
        self._wire_itemsize: dict[str, int] = {}
        for n in names:
            lay = client.layouts[n]
            tdt = dtype or codec.to_torch_dtype(lay.dtype)
            target = out.get(n) if out is not None else None
            shape = self._slices[n].shape(lay.shape) if n in self._slices else lay.shape
            if target is None:
                target = torch.empty(shape, dtype=tdt)
            elif tuple(target.shape) != shape:
                raise ValueError(f"out[{n!r}]: expected shape {shape}, got {tuple(target.shape)}")
            self.result_tensors[n] = target
            # A CPU tensor in one piece is written in place, cast as each chunk is copied when its dtype is
            # not the wire's (pull_dtype=bf16 into fp32 parameters): one pass, no staging.
            direct = target.device.type == "cpu" and target.is_contiguous()
            self._wire_itemsize[n] = tdt.itemsize
            if direct:
                self._staging[n] = target.detach().view(-1)
            else:
                if target.device.type == "cuda":  # pinned (kept by the client): the copy up is asynchronous
                    self._staging[n] = client.buffers.pinned(f"pull:{n}", target.numel(), tdt)
                else:
                    self._staging[n] = torch.empty(target.numel(), dtype=tdt)
                self._staged.add(n)
        # Each shard's tensors in the order asked; elements each tensor still waits for.
        order = {n: k for k, n in enumerate(names)}
        self._owners: dict[int, list[str]] = {}
        self._missing: dict[str, int] = dict.fromkeys(names, 0)
        self._messages: dict[int, int] = {}  # how many PullResponses each shard answers with
        bare: dict[int, int] = {}  # the same in the messages' chunks alone: a shard asked for a slice (no segment)
        for p in client.shard_map.parts:
            if p.name not in order:
                continue
            sl = self._slices.get(p.name)
            runs = ([p.stop - p.start] if sl is None
                    else [k for _, k, _ in sl.pieces(client.layouts[p.name].shape, p.start, p.stop)])
            if not runs:
                continue
            self._missing[p.name] += sum(runs)
            per = max(1, client.chunk_bytes // self._wire_itemsize[p.name])
            bare[p.server] = bare.get(p.server, 0) + sum(-(-k // per) for k in runs)
            if sl is None:
                self._messages[p.server] = self._messages.get(p.server, 0) + client.paths[p.server].pull_messages(
                    p.stop - p.start, self._wire_itemsize[p.name], client.chunk_bytes)
            got = self._owners.setdefault(p.server, [])
            if p.name not in got:
                got.append(p.name)
        for s, got in self._owners.items():
            if any(n in self._slices for n in got):
                self._messages[s] = bare[s]
        for got in self._owners.values():
            got.sort(key=order.__getitem__)
        self._lock = threading.Lock()
        self._events = {n: threading.Event() for n in names}
        self._received: dict[int, dict[str, int]] = {s: {} for s in self._owners}
        for n, m in self._missing.items():
            if m == 0:
                self._complete(n)
        t = client.transport
        self._wait_s = t.timeout + t.recovery_timeout + 5.0
        self._shards = sorted(self._owners)
        self._futures: list[Future[int]] = []
        self._error: BaseException | None = None
        self._finished = False
        self._broken = False
        self._said: tuple[str, float, int] | None = None  # (sync, loss scale, slowest clock) last answered
        self._pending: dict[int, Future[int]] = {}  # start_later: the shards not begun yet
        self._versions: tuple[tuple[int, int], ...] = ()  # (shard, version) once every shard answered

    def start(self, *, inline: bool = False) -> PullInFlight:
        """Start every shard's Pull; ``inline``: the first shard's in this thread, before returning (for a
        caller that waits for the result anyway: no hand-over between threads for it). The shards whose
        Push answered with their weights need no call: their copies run in this thread, before returning."""
        t = self._client.transport
        here = [s for s in self._shards if s in self._answered]
        remote = [s for s in self._shards if s not in self._answered]
        if inline and remote:
            here.append(remote.pop(0))
        futures = dict(zip(remote, t.submit_each(self._fetch, remote)))  # the calls go out first
        for s in here:
            f: Future[int] = Future()
            try:
                f.set_result(t.call(s, functools.partial(self._fetch, s)))
            except BaseException as e:  # noqa: BLE001 - raised by result(), as the others' failures
                f.set_exception(e)
            futures[s] = f
        self._futures = [futures[s] for s in self._shards]
        for f in self._futures:
            f.add_done_callback(self._ended)
        return self

    def start_later(self) -> PullInFlight:
        """Start no Pull yet: each shard's starts with ``begin`` (as that shard answers the step's push),
        and the shards that own none of the tensors are done. ``wait`` and ``result`` work as after
        ``start``."""
        self._pending = {s: Future() for s in self._shards}
        self._futures = [self._pending[s] for s in self._shards]
        for f in self._futures:
            f.add_done_callback(self._ended)
        return self

    def begin(self, shard: int, min_version: int, answered: Sequence[bytes] = ()) -> None:
        """Start ``shard``'s Pull (``start_later``) from ``min_version`` on; ``answered``: the
        PullResponses its push answered with, copied in this thread instead of a call."""
        with self._lock:
            f = self._pending.pop(shard, None)
        if f is None:  # owns none of the tensors, or begun already
            return
        self._mins[shard] = min_version
        t = self._client.transport
        if answered and not self._slices:
            self._answered[shard] = list(answered)
            try:
                f.set_result(t.call(shard, functools.partial(self._fetch, shard)))
            except BaseException as e:  # noqa: BLE001 - raised by result(), as the others' failures
                f.set_exception(e)
            return
        inner = t.submit_each(self._fetch, [shard])[0]
        inner.add_done_callback(functools.partial(_hand_on, f))

    def abandon(self) -> None:
        """The step's push failed: begin no more shards, and wait (within the deadline) for those begun,
        so that nothing writes into the destinations afterwards."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for f in pending.values():
            f.set_exception(RuntimeError("the step's push failed before this shard's pull began"))
        gather_quietly(self._futures, self._wait_s)

    def _ended(self, f: Future[int]) -> None:
        if f.exception() is not None:  # the shard gave up (after its retries): wake every waiter
            self._broken = True
            for ev in self._events.values():
                ev.set()

    def _complete(self, name: str) -> None:
        if name in self._staged:
            target = self.result_tensors[name]
            with torch.no_grad():
                target.copy_(self._staging[name].view(target.shape), non_blocking=target.device.type == "cuda")
                if target.device.type == "cuda":
                    torch.cuda.current_stream(target.device).synchronize()
        self._events[name].set()

    def _fetch(self, shard: int) -> int:
        client = self._client
        with self._lock:  # a retry starts the shard over: what it sent before counts no more
            for n, k in self._received[shard].items():
                if not self._events[n].is_set():
                    self._missing[n] += k
            self._received[shard] = {}
        path = client.paths[shard]  # read as the call starts: a retry after a fail-over finds gRPC here
        asked = self._owners[shard]
        sliced = [ps_pb2.TensorSlice(name=n, dim=sl.dim, parts=sl.parts, index=sl.index, blocks=sl.blocks)
                  for n in asked if (sl := self._slices.get(n)) is not None]
        req = ps_pb2.PullRequest(worker_id=client.worker_id, names=[n for n in asked if n not in self._slices],
                                 min_version=self._mins[shard], dtype=self._wire,  # type: ignore[arg-type]
                                 chunk_bytes=client.chunk_bytes, min_clock=self._min_clock, epoch=client.epoch,
                                 shm="" if sliced else path.pull_segment, slices=sliced)
        version = -1
        received = self._received[shard]
        given = self._answered.pop(shard, None)  # the Push answered with them: no Pull (a retry asks anew)
        responses = (map(framing.read_pull_response, given) if given is not None
                     else client.transport.pull(shard, req, one=self._messages.get(shard) == 1, via=path,
                                                place=self._place))
        with torch.no_grad():
            # The path reads a view (of the received message, or of our pull segment): decode copies nothing,
            # copy_ is the one copy.
            for resp in responses:
                c = resp.chunk
                values = path.read(c)
                dst = self._staging.get(c.name)
                if dst is None and given is not None and c.name not in client.layouts:
                    continue  # a Push is answered with every tensor of its shard: others' (pipeline stages')
                if dst is None or c.offset < 0 or c.offset + values.numel() > dst.numel():
                    size = "a tensor not asked for" if dst is None else f"its {dst.numel()} elements"
                    raise ValueError(f"shard {shard} sent {c.name!r} [{c.offset}, +{values.numel()}) "
                                     f"outside {size}")
                part = dst[c.offset : c.offset + values.numel()]
                if values.numel() and values.data_ptr() != part.data_ptr():  # else it landed there already
                    part.copy_(values)
                version = resp.version
                self._said = (resp.sync, resp.loss_scale, resp.slowest_clock)  # one store: the latest answer wins
                with self._lock:
                    received[c.name] = received.get(c.name, 0) + values.numel()
                    self._missing[c.name] -= values.numel()
                    done = self._missing[c.name] == 0 and not self._events[c.name].is_set()
                if done:
                    self._complete(c.name)
        return version

    def _place(self, name: str, offset: int, wire_dtype: int, nbytes: int) -> torch.Tensor | None:
        """Where a part of ``name`` arriving on a data connection may land as it comes (worker/dataconn.py):
        its destination's own flat elements where the wire dtype is theirs, else None (read, then copied)."""
        dst = self._staging.get(name)
        if dst is None or name in self._slices or codec.to_torch_dtype(wire_dtype) != dst.dtype:
            return None
        n = nbytes // dst.element_size()
        if offset < 0 or offset + n > dst.numel() or n * dst.element_size() != nbytes:
            return None  # refused by _fetch, naming it
        return dst[offset : offset + n]

    def wait(self, names: Sequence[str], timeout: float | None = None) -> bool:
        """Block until ``names`` are complete; False when the pull failed first (``result()`` raises it)."""
        deadline = time.monotonic() + (self._wait_s if timeout is None else timeout)
        for n in names:
            if not self._events[n].wait(timeout=max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"tensor {n!r} was not pulled within the deadline")
        return not self._broken

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def result(self) -> dict[str, torch.Tensor]:
        """Wait for every shard; the destination tensors. Raises the first shard's failure (again on each
        call). The first that succeeds hands ``view`` to ``on_result`` (``PSClient.apply``), in this thread."""
        if not self._finished:
            try:
                versions = gather(self._futures, self._wait_s)
            except BaseException as e:
                self._error = e
                self._finished = True
                raise
            self._versions = tuple((s, v) for s, v in zip(self._shards, versions) if v >= 0)
            self._finished = True
            if self._on_result is not None:
                self._on_result(self.view)
        if self._error is not None:
            raise self._error
        return self.result_tensors

    @property
    def view(self) -> JobView:
        """What the shards said about the job so far: the latest answer's sync, loss scale and slowest
        clock (as soon as one came in), each shard's version once ``result()`` returned."""
        said = self._said
        if said is None:
            return JobView(versions=self._versions)
        return JobView(sync=said[0], loss_scale=said[1], slowest_clock=said[2], versions=self._versions)


def _hand_on(outer: Future[int], inner: Future[int]) -> None:
    """``inner``'s outcome into ``outer``."""
    e = inner.exception()
    if e is not None:
        outer.set_exception(e)
    else:
        outer.set_result(inner.result())


def gather_quietly(futures: Sequence[Future[int]], timeout: float) -> None:
    """Wait until every future ended (at most ``timeout`` in all), whatever each ended with."""
    deadline = time.monotonic() + timeout
    for f in futures:
        try:
            f.exception(timeout=max(0.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - a timeout or a cancellation: nothing more to wait for
            return
