"""``PullInFlight``: a pull from every shard whose tensors can be waited for one by one.

One Pull per shard, started at once (``start``), writing each chunk into its
destination as it arrives; ``wait(names)`` returns once those tensors are
complete, ``result()`` once all are. The tensors of each shard come in the
order asked (the model's order: the first layers first). ``PSClient.pull``
is ``start`` then ``result``; ``result`` hands the pull's ``view`` (what the
shards said about the job: ``worker/job/jobview.py``) to ``on_result``, the
client's ``apply``, in the thread that takes the result. Each shard's path
(``worker/datapath/paths.py``) names the segment a Pull asks for (same host) and reads
its answers' chunks.

A shard on a data connection (worker/datapath/dataconn.py) is asked with a frame
that waits for nothing (``ConnPath.pull_soon``): the connection's reading
thread reads its answer straight into the destinations and ends the shard
here, with no thread of the transport's and no hand-over between threads.
Should that frame fail UNAVAILABLE (the connection ended), the shard is
asked again through the transport (its retries, a fail-over). A pull
begun with ``start_later`` may instead ride each shard's push frame
(``carry``, worker/datapath/push.py): the server makes it as the push is
taken in; one it did not make (the push refused), or that failed before
the push answered, begins as the push answers (``begin``), by whichever
path the push took. The other
shards' RPCs run on the transport's threads (one per shard; the shards whose
Push answered with their weights are copied, and with ``start(inline=True)``
the first shard's RPC made, in the caller's thread). No wait is without a
deadline: the client's timeout per RPC, and for waits on them the timeout
plus the transport's recovery time. The threads that end a shard write only
this object's state (the destinations, what each shard said), never the
client's; one condition wakes whoever waits for a tensor or the end.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import grpc
import torch

from shardps.protos import codec, framing, shm
from shardps.protos.shardps.v1 import ps_pb2
from shardps.protos.slices import TensorSlice
from shardps.worker.datapath.dataconn import NotMade
from shardps.worker.datapath.paths import ShardPath
from shardps.worker.datapath.route import Route
from shardps.worker.job.jobview import JobView


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
        for p in client.shard_map.parts:
            if p.name not in order:
                continue
            sl = self._slices.get(p.name)
            runs = ([p.stop - p.start] if sl is None
                    else [k for _, k, _ in sl.pieces(client.layouts[p.name].shape, p.start, p.stop)])
            if not runs:
                continue
            self._missing[p.name] += sum(runs)
            got = self._owners.setdefault(p.server, [])
            if p.name not in got:
                got.append(p.name)
        for got in self._owners.values():
            got.sort(key=order.__getitem__)
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)  # waiters on tensors (``wait``) and on the end (``result``)
        self._done: set[str] = set()  # tensors complete
        self._tensor_waiters = 0  # threads in ``wait``
        self._received: dict[int, dict[str, int]] = {s: {} for s in self._owners}
        t = client.transport
        self._wait_s = t.timeout + t.recovery_timeout + 5.0
        self._shards = sorted(self._owners)
        self._error: BaseException | None = None
        self._finished = False
        self._broken = False
        self._said: tuple[str, float, int] | None = None  # (sync, loss scale, slowest clock) last answered
        self._later: set[int] = set()  # start_later: the shards not begun yet
        # Shards whose Pull rides their Push's frame (``carry``): "out" until the Push answered, then "pushed".
        self._carried: dict[int, str] = {}
        self._abandoned = False  # ``abandon``: nothing begins any more
        self._ended: dict[int, int | BaseException] = {}  # each shard's version, or why it failed
        # shard -> (its connection, call, its path, the pull segment it names) while a frame is out
        self._calls: dict[int, tuple[Any, int, Any, str]] = {}
        self._versions: tuple[tuple[int, int], ...] = ()  # (shard, version) once every shard answered
        for n, m in self._missing.items():
            if m == 0:
                self._complete(n)

    def start(self, *, inline: bool = False) -> PullInFlight:
        """Start every shard's Pull; ``inline``: the first shard's in this thread, before returning (for a
        caller that waits for the result anyway: no hand-over between threads for it). The shards whose
        Push answered with their weights need no call: their copies run in this thread, before returning.
        A shard on a data connection (worker/datapath/dataconn.py) is asked with a frame that waits for nothing: its
        answer is read and put in place by the connection's thread."""
        here = [s for s in self._shards if s in self._answered]
        remote = [s for s in self._shards if s not in self._answered]
        framed = [s for s in remote if self._soon(s)]
        rest = [s for s in remote if s not in framed]
        if inline and rest:
            here.append(rest.pop(0))
        self._threaded(rest)  # the calls go out first
        for s in here:
            self._inline(s)
        return self

    def start_later(self) -> PullInFlight:
        """Start no Pull yet: each shard's starts with ``begin`` (as that shard answers the step's push),
        and the shards that own none of the tensors are done. ``wait`` and ``result`` work as after
        ``start``."""
        with self._lock:
            self._later = set(self._shards)
        return self

    def begin(self, shard: int, min_version: int, answered: Sequence[bytes] = ()) -> None:
        """Start ``shard``'s Pull (``start_later``) from ``min_version`` on; ``answered``: the
        PullResponses its push answered with, copied in this thread instead of a call. A Pull its Push
        carries (``carry``) is on its way already: only its version is noted."""
        with self._lock:
            if self._carried.get(shard) == "out":
                self._carried[shard] = "pushed"
                self._mins[shard] = min_version
                return
            if shard not in self._later:  # owns none of the tensors, or begun already
                return
            self._later.discard(shard)
        self._mins[shard] = min_version
        if answered and not self._slices:
            self._answered[shard] = list(answered)
            self._inline(shard)
        elif not self._soon(shard):
            self._threaded([shard])

    def carry(self, shard: int, path: Any) -> tuple[ps_pb2.PullRequest, Any, Callable[..., None]] | None:
        """``shard``'s Pull to ride its Push's frame (``ConnPath.push_soon(carry=)``: the server makes it from
        the version the Push's answer names, no frame of its own): its request, where its parts land, what
        ends it; None where it cannot (not begun with ``start_later``, a path without frames, slices).
        ``carried`` once the frame is out, ``uncarry`` if it could not be sent."""
        if self._slices or not getattr(path, "carries", False):
            return None
        with self._lock:
            if shard not in self._later:
                return None
            self._later.discard(shard)
            self._carried[shard] = "out"
        segment = path.take_pull(self._room(shard, path))
        return (self._request(shard, path, segment), self._place,
                functools.partial(self._answered_carried, shard, path, segment))

    def carried(self, shard: int, conn: Any, key: int) -> None:
        """``shard``'s carried Pull is out on ``conn`` as call ``key`` (``abandon`` cancels it)."""
        with self._lock:
            if shard not in self._ended and shard in self._carried:
                self._calls[shard] = (conn, key, None, "")  # (its segment: the frame's, ConnPath's)

    def uncarry(self, shard: int) -> None:
        """``shard``'s Push frame did not go out: its Pull begins as the Push answers (``begin``)."""
        with self._lock:
            if self._carried.pop(shard, None) is None:
                return
            self._calls.pop(shard, None)
        self._again_later(shard, RuntimeError("the step's push failed before this shard's pull began"))

    def _again_later(self, shard: int, error: BaseException) -> None:
        """``shard``'s Pull is to begin as its Push answers (``begin``), or, once the pull was abandoned,
        ends with ``error``."""
        with self._lock:
            if not self._abandoned:
                self._later.add(shard)
                return
        self._end(shard, error)

    def _answered_carried(self, shard: int, path: Any, segment: str, responses: list[Any] | None,
                          error: Exception | None) -> None:
        """The connection's reading thread: ``shard``'s carried Pull answered (or failed). One its server did
        not make, or that failed before its Push answered, begins anew as the Push answers (``begin``)."""
        with self._lock:
            self._calls.pop(shard, None)
            state = self._carried.pop(shard, None)
        if error is not None and state != "pushed":
            path.unpulled(segment)
            self._again_later(shard, error)
            return
        if isinstance(error, NotMade):  # its Push was refused, and taken in since (a retry): pulled anew
            path.unpulled(segment)
            if self._given_up(shard, error):
                return
            if not self._soon(shard):
                self._threaded([shard])
            return
        self._answered_soon(shard, path, segment, responses, error)

    def _given_up(self, shard: int, error: BaseException) -> bool:
        """Whether the pull was abandoned (the step's push failed): ``shard`` then ends with ``error`` instead of
        being asked again (``abandon`` waits only for the calls it knows of)."""
        with self._lock:
            abandoned = self._abandoned
        if abandoned:
            self._end(shard, error)
        return abandoned

    def _inline(self, shard: int) -> None:
        """``shard``'s Pull made in this thread (retried as ``Transport.call``)."""
        try:
            version = self._client.transport.call(shard, functools.partial(self._fetch, shard))
        except BaseException as e:  # noqa: BLE001 - raised by result(), as the others' failures
            self._end(shard, e)
            return
        self._end(shard, version)

    def _threaded(self, shards: Sequence[int]) -> None:
        """The Pulls of ``shards``, each in a transport thread (retried as ``Transport.call``)."""
        t = self._client.transport
        for s, f in zip(shards, t.submit_each(self._fetch, shards)):
            f.add_done_callback(functools.partial(self._end_future, s))

    def _end_future(self, shard: int, f: Future[int]) -> None:
        e = f.exception()
        self._end(shard, e if e is not None else f.result())

    def _soon(self, shard: int) -> bool:
        """``shard``'s Pull as a frame that waits for nothing, where its path is a data connection
        (``ConnPath.pull_soon``) and it asks no slices: its answer ends it in the connection's reading
        thread. False where it cannot be sent so (nothing done)."""
        path = self._client.paths[shard]
        soon = getattr(path, "pull_soon", None)
        if soon is None or not self._client.paths.usable(shard) or self._slices or shard in self._answered:
            return False
        try:
            segment = path.take_pull(self._room(shard, path))
        except grpc.RpcError:  # no room for another pull segment: through the transport, which says so
            return False
        t = self._client.transport
        try:
            req = self._request(shard, path, segment)
            call = soon(req, t.timeout, self._place, functools.partial(self._answered_soon, shard, path, segment))
        except grpc.RpcError:  # the connection ended meanwhile: through the transport's retries instead
            path.unpulled(segment)
            return False
        except BaseException:
            path.unpulled(segment)
            raise
        with self._lock:
            if shard not in self._ended:
                self._calls[shard] = (getattr(path, "conn"), call, path, segment)  # noqa: B009 - pull_soon's
        return True

    def _answered_soon(self, shard: int, path: Any, segment: str, responses: list[Any] | None,
                       error: Exception | None) -> None:
        """The connection's reading thread: ``shard``'s framed Pull answered."""
        with self._lock:
            self._calls.pop(shard, None)
        t = self._client.transport
        if error is not None:
            path.unpulled(segment)
            failure = t.failed_once(shard, error)
            if failure is None:  # UNAVAILABLE: asked again through the transport (its retries, a fail-over)
                if not self._given_up(shard, error):
                    self._threaded([shard])
            else:
                self._end(shard, failure)
            return
        assert responses is not None
        try:
            version = self._take(shard, path, iter(responses), None, segment)
        except Exception as e:  # noqa: BLE001 - raised by result(), as the others' failures
            self._end(shard, e)
            return
        self._end(shard, version)

    def abandon(self) -> None:
        """The step's push failed: begin no more shards, and wait (within the deadline) for those begun,
        so that nothing writes into the destinations afterwards."""
        with self._lock:
            self._abandoned = True
            later, self._later = self._later, set()
            calls, self._calls = dict(self._calls), {}
        for s in later:
            self._end(s, RuntimeError("the step's push failed before this shard's pull began"))
        for s, (conn, call, path, segment) in calls.items():
            if conn.cancel(call):  # never answered: it ends here
                if path is not None:
                    path.unpulled(segment)
                self._end(s, RuntimeError("the step's push failed: this shard's pull was given up"))
        deadline = time.monotonic() + self._wait_s
        with self._cv:
            self._cv.wait_for(lambda: len(self._ended) == len(self._shards), max(0.0, deadline - time.monotonic()))

    def _end(self, shard: int, outcome: int | BaseException) -> None:
        """``shard``'s Pull ended: its version, or why it failed (every waiter is woken then)."""
        with self._cv:
            if shard in self._ended:
                return
            self._ended[shard] = outcome
            failed = isinstance(outcome, BaseException)
            if failed:
                self._broken = True
            if failed or len(self._ended) == len(self._shards):
                self._cv.notify_all()

    def _complete(self, name: str) -> None:
        if name in self._staged:
            target = self.result_tensors[name]
            with torch.no_grad():
                target.copy_(self._staging[name].view(target.shape), non_blocking=target.device.type == "cuda")
                if target.device.type == "cuda":
                    torch.cuda.current_stream(target.device).synchronize()
        with self._cv:
            self._done.add(name)
            if self._tensor_waiters:  # a wake-up is a hand-over between threads: only for whoever waits
                self._cv.notify_all()

    def _room(self, shard: int, path: ShardPath) -> int:
        """The most bytes ``shard``'s answer may lay out in a shared-memory segment: its parts of the tensors
        asked, in fp32 (the widest wire dtype), each on a 64-byte boundary (server/datapath/reader.py
        ``_shm_layout``; a slice's runs lie in those parts). 0 for a path without one (not counted)."""
        smap = self._client.shard_map
        if smap is None or not path.writes_ahead:
            return 0
        asked = set(self._owners[shard])
        return sum(shm.aligned((p.stop - p.start) * 4) for p in smap.parts_for(shard) if p.name in asked)

    def _request(self, shard: int, path: ShardPath, segment: str) -> ps_pb2.PullRequest:
        """``shard``'s PullRequest, for ``path``, into ``segment`` (``path.take_pull()``'s); a retry starts the
        shard over: what it sent before counts no more."""
        client = self._client
        with self._lock:
            for n, k in self._received[shard].items():
                if n not in self._done:
                    self._missing[n] += k
            self._received[shard] = {}
        asked = self._owners[shard]
        sliced = [ps_pb2.TensorSlice(name=n, dim=sl.dim, parts=sl.parts, index=sl.index, blocks=sl.blocks)
                  for n in asked if (sl := self._slices.get(n)) is not None]
        return ps_pb2.PullRequest(worker_id=client.worker_id, names=[n for n in asked if n not in self._slices],
                                  min_version=self._mins[shard], dtype=self._wire,  # type: ignore[arg-type]
                                  chunk_bytes=client.chunk_bytes, min_clock=self._min_clock, epoch=client.epoch,
                                  shm=segment, slices=sliced,
                                  fence_epoch=client.transport.fence_epochs[shard])

    def _fetch(self, shard: int) -> int:
        client = self._client
        path = client.paths.ready(shard, client.transport.timeout)  # as the call starts: a retry takes it anew
        given = self._answered.pop(shard, None)  # the Push answered with them: no Pull (a retry asks anew)
        segment = path.take_pull(self._room(shard, path)) if given is None else ""
        try:
            req = self._request(shard, path, segment)
            responses = (map(framing.read_pull_response, given) if given is not None
                         else client.transport.pull(shard, req, via=path, place=self._place))
        except BaseException:
            path.unpulled(segment)
            raise
        return self._take(shard, path, responses, given, segment)

    def _take(self, shard: int, path: ShardPath, responses: Iterable[Any], given: Sequence[bytes] | None,
              segment: str) -> int:
        """``shard``'s answers into their destinations (read from ``segment``, the Pull's, which is free for the
        next Pull once they are, and given up where reading them failed); its version (-1: none came)."""
        if torch.is_grad_enabled():  # (a data connection's reading thread has it off for good)
            with torch.no_grad():
                return self._take(shard, path, responses, given, segment)
        try:
            version, done = self._read(shard, path, responses, given, segment)
        except BaseException:
            path.unpulled(segment)
            raise
        path.pulled(segment)  # every answer read: nothing of it is read again (free before anyone is woken)
        for name in done:
            self._complete(name)
        return version

    def _read(self, shard: int, path: ShardPath, responses: Iterable[Any], given: Sequence[bytes] | None,
              segment: str) -> tuple[int, list[str]]:
        """``_take``'s reading: the version and the tensors this completed."""
        client = self._client
        version = -1
        received = self._received[shard]
        done: list[str] = []
        # The path reads a view (of the received message, or of our pull segment): decode copies nothing,
        # copy_ is the one copy.
        for resp in responses:
            c = resp.chunk
            values = path.read(c, segment)
            dst = self._staging.get(c.name)
            if dst is None and given is not None and c.name not in client.layouts:
                continue  # a Push is answered with every tensor of its shard: others' (pipeline stages')
            n = values.numel()
            if dst is None or c.offset < 0 or c.offset + n > dst.numel():
                size = "a tensor not asked for" if dst is None else f"its {dst.numel()} elements"
                raise ValueError(f"shard {shard} sent {c.name!r} [{c.offset}, +{n}) outside {size}")
            if n and values.data_ptr() != dst.data_ptr() + c.offset * dst.element_size():
                dst[c.offset : c.offset + n].copy_(values)  # else it landed there already
            version = resp.version
            self._said = (resp.sync, resp.loss_scale, resp.slowest_clock)  # one store: the latest answer wins
            with self._lock:
                received[c.name] = received.get(c.name, 0) + n
                self._missing[c.name] -= n
                if self._missing[c.name] == 0 and c.name not in self._done:
                    done.append(c.name)
        return version, done

    def _place(self, name: str, offset: int, wire_dtype: int, nbytes: int) -> torch.Tensor | None:
        """Where a part of ``name`` arriving on a data connection may land as it comes (worker/datapath/dataconn.py):
        its destination's own flat elements where the wire dtype is theirs, else None (read, then copied)."""
        dst = self._staging.get(name)  # a slice's: the slice (its offsets are the slice's)
        if dst is None or codec.to_torch_dtype(wire_dtype) != dst.dtype:
            return None
        n = nbytes // dst.element_size()
        if offset < 0 or offset + n > dst.numel() or n * dst.element_size() != nbytes:
            return None  # refused by _fetch, naming it
        return dst[offset : offset + n]

    def wait(self, names: Sequence[str], timeout: float | None = None) -> bool:
        """Block until ``names`` are complete; False when the pull failed first (``result()`` raises it)."""
        deadline = time.monotonic() + (self._wait_s if timeout is None else timeout)
        with self._cv:
            self._tensor_waiters += 1
            try:
                for n in names:
                    if not self._cv.wait_for(lambda n=n: n in self._done or self._broken,  # type: ignore[misc]
                                             max(0.0, deadline - time.monotonic())):
                        raise TimeoutError(f"tensor {n!r} was not pulled within the deadline")
            finally:
                self._tensor_waiters -= 1
            return not self._broken

    def done(self) -> bool:
        with self._lock:
            return len(self._ended) == len(self._shards)

    def result(self) -> dict[str, torch.Tensor]:
        """Wait for every shard; the destination tensors. Raises the first shard's failure (again on each
        call). The first that succeeds hands ``view`` to ``on_result`` (``PSClient.apply``), in this thread."""
        if not self._finished:
            deadline = time.monotonic() + self._wait_s
            with self._cv:
                # every shard ended, or one failed and the others ended (a barrier must see every shard)
                ended = self._cv.wait_for(lambda: len(self._ended) == len(self._shards),
                                          max(0.0, deadline - time.monotonic()))
                outcomes = dict(self._ended)
            failures = [o for s in self._shards if isinstance(o := outcomes.get(s), BaseException)]
            if not ended and not failures:
                missing = [s for s in self._shards if s not in outcomes]
                failures = [TimeoutError(f"the pull of shards {missing} did not end within {self._wait_s:.0f}s")]
            if failures:
                self._error = failures[0]
                self._finished = True
                raise self._error
            self._versions = tuple((s, v) for s in self._shards if isinstance(v := outcomes[s], int) and v >= 0)
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
