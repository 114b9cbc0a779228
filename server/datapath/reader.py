"""Pull responses framed from one version's weights, shared by the Pulls that ask the same.

``frame`` turns the parts of some tensors into (name, offset, dtype,
payload) items, a payload being either raw chunk bytes or, for
``messages=True``, a whole serialized ``PullResponse``. ``PullCache`` keeps
the framed responses of the current version by weak reference: the Pulls of
that version answered while another one still streams them (under bsp every
worker's, at once after the barrier) share one copy, which lives only as
long as some Pull sends it. The store clears it whenever the weights or the
version change. No lock of its own: called under the store's lock.
``Reader`` is the store's part that reads its weights (``read``,
``read_into``, ``export_state``, ``weights``): it owns the cache, the count
of reads in progress outside the lock and the Pull counters, and is given
the store's lock, the ``TensorTable``, the ``Job`` (version, sync mode) and
callables for the rest (see ``Reader``).

Framing outside the lock. A Pull of more than ``frame_inline_bytes`` is not
framed under the store's lock: under the lock it takes the version, the
header and the tensor entries and counts itself in ``reading``; a thread of
its own then frames the weights into a ``Framing`` while the Pulls holding it
send the responses already framed (framing overlaps sending), and leaves
``reading`` when done. The optimizer step changes weights in place, so the
store's step (and ``submit`` before it offers a gradient) waits for
``reading == 0`` first (``await_reads``); nothing else writes weights in
place (a restore replaces the table's entries, leaving a framing in progress
its own, older tensors). Every other request (pushes being taken in, stats,
heartbeats, another version's Pull) goes on meanwhile. The same-host path
(``read_into``) copies into the worker's segment the same way, outside the
lock, in the Pull's own thread.

Answers lent from the weights. A data connection's Pull (``read_lent``) is
sent from the weights themselves where they go as they are (fp32 on the
wire): no copy, one framing a version for every worker's Pull. Its
``Sender`` (protos/dataconn.py) writes what the socket takes at once, then
the rest as the worker reads; that rest is the one part read outside both
the lock and ``reading``, so a step first *detaches* every answer still
sending (``before_write``: the sender copies its rest, between two writes
that cannot block), then changes the weights. Under bsp a worker's next
push of a part needs its answer read first, so a step finds none to
detach; a worker that reads slowly (asp, ssp, a stalled one) costs that
one copy of its answer's unsent rest, made by the step under the shard's
lock, never a wait for that worker. A cast answer (bf16 on the wire) or one under TLS is a
copy a version that every Pull of it shares (``read_shared``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar

import torch

from shardps.protos import codec, framing, shm
from shardps.protos.shardps.v1 import ps_pb2
from shardps.server.errors import InvalidArgument, Unavailable
from shardps.server.job import Job
from shardps.server.table import TensorEntry, TensorTable

Item = tuple[str, int, int, bytes]  # (tensor name, offset, wire dtype, payload)
Key = tuple[Any, ...]
T = TypeVar("T")


class _Framed(list):  # type: ignore[type-arg]
    """A list of framed Pull responses that the store can refer to weakly."""

    __slots__ = ("__weakref__",)


# Pulls of up to this many payload bytes are framed under the store's lock (less than a millisecond's copy);
# larger ones by a thread of their own, outside it.
FRAME_INLINE_BYTES = 2 << 20
# The longest a Pull waits for the next framed response, and a step for framings to end: framing is a copy
# with no waits in it, so this is reached only by a process stalled for a minute.
FRAMING_TIMEOUT_S = 60.0
# Pulls waiting for a framing are woken for its first response, then every this many (and at its end).
WAKE_EVERY = 4


class Framing:
    """Pull responses of one version being framed by one thread while the Pulls holding it send them.

    Iterating gives the items in order, each as soon as it is framed (waiting up
    to ``timeout`` for the next); an error in the framing is raised to every
    Pull iterating as UNAVAILABLE. Held weakly by ``PullCache`` as a list is.
    """

    __slots__ = ("_items", "_done", "_error", "_cond", "_timeout", "__weakref__")

    def __init__(self, timeout: float = FRAMING_TIMEOUT_S) -> None:
        self._items: list[Item] = []
        self._done = False
        self._error: BaseException | None = None
        self._cond = threading.Condition(threading.Lock())
        self._timeout = timeout

    def produce(self, items: Iterable[Item]) -> None:
        """Append ``items`` as they come; then mark the framing done (failed, if ``items`` raised)."""
        error: BaseException | None = None
        try:
            for i, item in enumerate(items):
                with self._cond:
                    self._items.append(item)
                    if i % WAKE_EVERY == 0:  # the first at once; then in batches (fewer thread switches)
                        self._cond.notify_all()
        except BaseException as e:  # handed to every Pull iterating, not lost in a thread
            error = e
        finally:
            with self._cond:
                self._done, self._error = True, error
                self._cond.notify_all()

    @property
    def failed(self) -> bool:
        return self._error is not None

    def __iter__(self) -> Iterator[Item]:
        at = 0

        def ready() -> bool:
            return at < len(self._items) or self._done

        while True:
            with self._cond:
                if not self._cond.wait_for(ready, self._timeout):
                    raise Unavailable(f"Pull: the weights were not framed within {self._timeout:.0f}s "
                                      f"({len(self._items)} responses framed so far)")
                batch = self._items[at:]
                if not batch:
                    if self._error is not None:
                        raise Unavailable(f"Pull: framing the weights failed: {self._error!r}") from self._error
                    return
            yield from batch
            at += len(batch)


class PullCache:
    def __init__(self) -> None:
        self._framed: dict[Key, tuple[weakref.ref[Any], int]] = {}
        self.hits_total = 0

    def clear(self) -> None:
        self._framed.clear()

    def get(self, key: Key) -> tuple[list[Item] | Framing, int] | None:
        """The responses framed for ``key`` and their payload bytes, while some Pull still holds them."""
        ref, nbytes = self._framed.get(key, (None, 0))
        shared = ref() if ref is not None else None
        if shared is None or (isinstance(shared, Framing) and shared.failed):  # a failed one is framed again
            return None
        self.hits_total += 1
        return shared, nbytes

    def put(self, key: Key, out: list[Item] | Framing, nbytes: int) -> None:
        """Keep ``out`` (a ``frame`` list or a ``Framing``) for ``key`` while some Pull holds it."""
        self._framed = {k: v for k, v in self._framed.items() if v[0]() is not None}
        self._framed[key] = (weakref.ref(out), nbytes)


def _raising(error: BaseException) -> Iterator[Item]:
    raise error
    yield  # a generator: raises when iterated


def payload_bytes(entries: Sequence[TensorEntry], wire_dtype: int | None) -> int:
    """The tensor bytes a Pull of ``entries`` carries in ``wire_dtype`` (each tensor's own with None)."""
    return sum(p.weight.numel() * codec.itemsize(e.spec.dtype if wire_dtype is None else wire_dtype)
               for e in entries for p in e.parts.values())


def frame_items(entries: Sequence[TensorEntry], wire_dtype: int | None, chunk_bytes: int,
                header: tuple[bytes, bytes] | None) -> Iterator[Item]:
    """The parts of ``entries`` as items, one chunk after another.

    ``header``: (prefix, suffix) of ``framing.pull_header``: each payload is
    then a whole PullResponse (the tensor's shape on its first chunk).
    ``wire_dtype=None``: each tensor in its registered dtype.
    """
    for e in entries:
        dt = e.spec.dtype if wire_dtype is None else wire_dtype
        tdt = codec.to_torch_dtype(dt)
        shape: tuple[int, ...] = e.spec.shape
        for start in sorted(e.parts):
            w = e.parts[start].weight.reshape(-1)
            if tdt != torch.float32:
                w = w.to(tdt)
            if header is not None:
                prefix, suffix = header
                for off, _, msg in framing.chunk_messages(
                        prefix, framing.PULL_CHUNK_FIELD, suffix, e.spec.name, dt, shape,
                        w, 0, w.numel(), chunk_bytes, base=start):
                    yield e.spec.name, off, dt, msg
                    shape = ()
                continue
            for off, payload in codec.encode_range(w, 0, w.numel(), chunk_bytes):
                yield e.spec.name, start + off, dt, payload


def frame(entries: Sequence[TensorEntry], wire_dtype: int | None, chunk_bytes: int,
          header: tuple[bytes, bytes] | None) -> tuple[list[Item], int]:
    """``frame_items`` as a list (one the cache can hold when ``header`` is given) and its payload bytes."""
    out: list[Item] = _Framed() if header is not None else []
    out.extend(frame_items(entries, wire_dtype, chunk_bytes, header))
    return out, payload_bytes(entries, wire_dtype)



class Reader:
    """Reads of one shard's weights, consistent per version; see the module docstring.

    Given the store's lock (``cond``; its reads take it), the tensors, the
    ``Job`` (version and sync mode of what it reads), and callables:
    ``settle`` (under the lock: waits out a split tensor's step),
    ``loss_scale`` (the scale workers use next) and ``on_read`` (under the
    lock, with the worker and the names it reads: dc-asgd remembers them).
    """

    def __init__(self, shard_index: int, cond: threading.Condition, table: TensorTable, job: Job, *,
                 settle: Callable[[], None] = lambda: None, loss_scale: Callable[[], float] = lambda: 0.0,
                 on_read: Callable[[int | None, list[str]], None] = lambda worker, names: None,
                 frame_inline_bytes: int = FRAME_INLINE_BYTES) -> None:
        self.shard_index = shard_index
        self._cond, self._table, self._job = cond, table, job
        self._settle, self._loss_scale, self._on_read = settle, loss_scale, on_read
        self.cache = PullCache()
        # ``read_shared``'s weights of this version: (names, wire dtype, slowest clock, loss scale, sync) ->
        # (PullResponses, the buffer they point into, its payload bytes); emptied as the weights change.
        self.shared: dict[tuple[Any, ...], tuple[list[Item], memoryview, int]] = {}
        # Buffers of earlier versions' shared answers that nothing holds any more (no answer still sending
        # them, no entry in ``shared``): the next version's is taken from here. A fresh one each version cost
        # the kernel its pages again (zeroed, faulted in, unmapped: ~5 % of the data connection's CPU per byte).
        self._spare: list[torch.Tensor] = []
        # ``read_lent``'s answers of this version: key as ``shared`` -> (PullResponses, the weights' own bytes in
        # the answer's layout); emptied as the weights change. Answers still sending them: ``_sending`` (each
        # detached, its rest copied, before a step changes the weights).
        self.lent: dict[tuple[Any, ...], tuple[list[Item], list[memoryview | bytes], int]] = {}
        self._sending: set[Lent] = set()
        self._sending_mu = threading.Lock()  # ``_sending``: taken under senders' locks, held around nothing
        self.lent_answers_total = 0  # answers sent from the weights themselves
        self.shared_copies_total = 0  # versions' weights copied into a shared answer buffer
        self.reading = 0  # Pulls framing or copying weights outside the lock; steps wait for 0
        self.writers_waiting = 0  # steps waiting for those Pulls
        self.frame_inline_bytes = frame_inline_bytes  # larger Pulls are framed outside the lock
        self.pull_bytes_total = 0
        self.pulls_total = 0

    def _entries_read(self, names: Sequence[str], worker_id: int | None) -> list[TensorEntry]:
        """Under the lock: the entries of ``names`` (NotFound for one not held), once no step is in flight;
        ``on_read`` is told who reads them."""
        self._settle()
        entries = [self._table.get(n) for n in names]
        for n, e in zip(names, entries):
            if e is None:
                self._table.spec(n)  # raises NotFound
        self._on_read(worker_id, list(names))
        return entries  # type: ignore[return-value]

    def await_reads(self) -> None:
        """Under the lock, before weights change in place: wait until no Pull reads them outside the lock."""
        if not self.reading:
            return
        self.writers_waiting += 1
        self._cond.notify_all()  # for whoever watches writers_waiting (tests)
        try:
            ok = self._cond.wait_for(lambda: not self.reading, timeout=FRAMING_TIMEOUT_S)
        finally:
            self.writers_waiting -= 1
        if not ok:
            raise Unavailable(f"shard {self.shard_index}: {self.reading} Pull(s) still reading the weights "
                              f"after {FRAMING_TIMEOUT_S:.0f}s; the step was not applied")

    def before_write(self) -> None:
        """Under the lock, before a step changes the weights: no Pull reads them, none is framed from them."""
        self.await_reads()
        self._detach_lent()
        self.cache.clear()
        self.shared.clear()
        self.lent.clear()

    def _detach_lent(self) -> None:
        """Under the lock, no Pull reading (``await_reads``): every answer still sending the weights themselves
        (``read_lent``) has its rest copied; nothing reads the weights once this returns."""
        if not self._sending:
            return
        with self._sending_mu:
            pending = [lent._detach for lent in self._sending]
        for detach in pending:
            if detach is not None:
                detach()  # (the sender's lock, then ``_sending_mu`` in ``Lent.sent``: not held here)

    def _done_reading(self) -> None:
        """A read outside the lock ended: a step waiting for none (``await_reads``) is woken, and whoever else
        waits on the lock's condition (a test watching ``reading``); nobody, when nobody waits (the change is
        nothing a parked Pull waits for: no notice to them, which every answer would otherwise cost)."""
        with self._cond:
            self.reading -= 1
            watched = getattr(self._cond, "watched", None)
            if self.writers_waiting or watched is None or watched():
                self._cond.notify_all()

    def _frame_out(self, out: Framing, entries: list[TensorEntry], wire_dtype: int | None, chunk_bytes: int,
                   header: tuple[bytes, bytes]) -> None:
        """The framing thread of a large Pull (counted in ``reading`` by its caller)."""
        try:
            out.produce(frame_items(entries, wire_dtype, chunk_bytes, header))
        finally:
            self._done_reading()

    def read(self, names: Sequence[str], wire_dtype: int | None,
             chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES, *, messages: bool = False,
             slowest_clock: int = 0, worker_id: int | None = None) -> tuple[int, Sequence[Item] | Framing]:
        """A consistent snapshot: (version, [(name, offset, wire dtype, payload)]).

        ``wire_dtype=None`` sends each tensor in its registered dtype. The
        payloads all belong to ``version``.

        ``messages=True``: each payload is instead a whole serialized
        ``PullResponse`` (version, the loss scale and sync mode of that
        moment, ``slowest_clock`` as given, and the chunk, its tensor's shape
        on the tensor's first chunk), framed straight from the weights: one
        copy of the data, made once per version for all the Pulls that ask
        the same (every worker's, under bsp; see datapath/reader.py). Over
        ``frame_inline_bytes`` the result is a ``Framing`` being filled by a
        thread outside the lock (iterate it; see the module docstring);
        otherwise a list, framed under the lock.
        """
        with self._cond:
            entries = self._entries_read(names, worker_id)
            nbytes = payload_bytes(entries, wire_dtype)
            self.pull_bytes_total += nbytes
            self.pulls_total += 1
            job = self._job
            if not messages:
                return job.version, frame(entries, wire_dtype, chunk_bytes, None)[0]
            loss_scale, sync = self._loss_scale(), job.sync_text
            key = (tuple(names), wire_dtype, chunk_bytes, slowest_clock, loss_scale, sync)
            hit = self.cache.get(key)
            if hit is not None:
                return job.version, hit[0]
            header = framing.pull_header(job.version, loss_scale, sync, slowest_clock)
            if nbytes <= self.frame_inline_bytes:
                out, _ = frame(entries, wire_dtype, chunk_bytes, header)
                self.cache.put(key, out, nbytes)
                return job.version, out
            framed = Framing()
            self.cache.put(key, framed, nbytes)
            self.reading += 1
            version = job.version
        try:
            threading.Thread(target=self._frame_out, args=(framed, entries, wire_dtype, chunk_bytes, header),
                             name=f"shard{self.shard_index}-framing", daemon=True).start()
        except BaseException as e:  # no thread (the process is out of them): the Pulls holding it fail at once
            framed.produce(_raising(e))
            self._done_reading()
            raise
        return version, framed

    def read_into(self, names: Sequence[str], wire_dtype: int | None, segment: shm.Segment, *,
                  slowest_clock: int = 0, worker_id: int | None = None) -> tuple[int, list[Item]]:
        """As ``read(messages=True)``, for the same-host fast path: the parts are copied (cast to the wire
        dtype) into ``segment``, one after another from offset 0 (each on a 64-byte boundary), outside the
        lock but of one version (counted in ``reading``: no step runs meanwhile); each item's payload is a
        PullResponse whose chunk says where its part lies (``shm_offset``, ``shm_bytes``) and carries no data.
        INVALID_ARGUMENT when the segment is too small.
        """
        with self._cond:
            layout, end = _shm_layout(self._entries_read(names, worker_id), wire_dtype)
            if end > segment.size:
                raise InvalidArgument(f"Pull: shared-memory segment {segment.name} holds {segment.size} bytes; "
                                      f"the weights asked need {end}")
            version, loss_scale, sync = self._job.version, self._loss_scale(), self._job.sync_text
            self.pull_bytes_total += sum(size for *_, size in layout)
            self.pulls_total += 1
            self.reading += 1
        try:
            out: list[Item] = []
            for e, start, dt, off, size in layout:
                w = e.parts[start].weight.reshape(-1)
                if size:
                    dst = torch.frombuffer(segment.view(off, size), dtype=codec.to_torch_dtype(dt))
                    dst.copy_(w)
                out.append(_placed(e, start, dt, off, size, version, loss_scale, sync, slowest_clock))
        finally:
            self._done_reading()
        return version, out

    def read_shared(self, names: Sequence[str], wire_dtype: int | None, room: int, *, slowest_clock: int = 0,
                    worker_id: int | None = None) -> tuple[int, list[Item], memoryview]:
        """As ``read_into``, into a buffer shared by every Pull of the same weights (under bsp, each worker's
        of a round): the parts copied (cast to the wire dtype) once per version, outside the lock, each on a
        64-byte boundary; the PullResponses say where they lie in it. (version, messages, the buffer's
        payload). The buffer is never written again (the next version gets one of its own), so an answer
        may still be sending it while the weights change. INVALID_ARGUMENT when the weights need more than
        ``room`` bytes (the worker's pull buffer)."""
        with self._cond:
            entries = self._entries_read(names, worker_id)
            said = self._job.version, self._loss_scale(), self._job.sync_text
            key = (tuple(names), wire_dtype, slowest_clock, said[1], said[2])
            begun = self._shared_begin(key, entries, wire_dtype, room)
        return self._shared_copy(key, begun, said, slowest_clock)

    def _shared_begin(self, key: tuple[Any, ...], entries: list[TensorEntry], wire_dtype: int | None,
                      room: int) -> _Shared:
        """Under the lock: ``key``'s shared answer of this version where one was copied (``_Shared.copied``);
        else what to copy, counted in ``reading`` (``_shared_copy`` ends it)."""
        hit = self.shared.get(key)
        if hit is not None:
            _check_room(len(hit[1]), room)
            self.pulls_total += 1
            self.pull_bytes_total += hit[2]
            return _Shared(copied=(hit[0], hit[1]))
        layout, end = _shm_layout(entries, wire_dtype)
        _check_room(end, room)
        self.pulls_total += 1
        payload = sum(size for *_, size in layout)
        self.pull_bytes_total += payload
        self.shared_copies_total += 1
        self.reading += 1
        return _Shared(layout=layout, end=end, payload=payload)

    def _shared_copy(self, key: tuple[Any, ...], shared: _Shared, said: tuple[int, float, str],
                     slowest_clock: int) -> tuple[int, list[Item], memoryview]:
        """Outside the lock, after ``_shared_begin``: the weights copied into a buffer of their own, kept for
        the Pulls of the same (``shared``); (version, messages, payload)."""
        version, loss_scale, sync = said
        if shared.copied is not None:
            return version, *shared.copied
        layout, end, payload = shared.layout, shared.end, shared.payload
        try:
            buf = self._shared_buffer(max(1, end))
            out: list[Item] = []
            for e, start, dt, off, size in layout:
                w = e.parts[start].weight.reshape(-1)
                if size:
                    buf[off : off + size].view(codec.to_torch_dtype(dt)).copy_(w)
                out.append(_placed(e, start, dt, off, size, version, loss_scale, sync, slowest_clock))
            raw: Any = buf.numpy()
            # Back to the spares once the last view of it is gone (answers sent, the version's entry cleared).
            weakref.finalize(raw, self._spare.append, buf)
            view = memoryview(raw)[:end]
            with self._cond:
                self.shared[key] = (out, view, payload)  # of this version: no step runs while ``reading``
        finally:
            self._done_reading()
        return version, out, view

    def read_lent(self, names: Sequence[str], wire_dtype: int | None, room: int, *, slowest_clock: int = 0,
                  worker_id: int | None = None) -> tuple[int, list[Item], Lent | memoryview]:
        """As ``read_shared``, with no copy where the wire dtype is the weights' own (fp32) and they are
        contiguous: the answer's payload is then a ``Lent``, the weights' own bytes in the answer's layout
        (zeros between parts), for a ``Sender`` to write straight from them. The caller sends it, then calls
        ``Lent.close``: until then no step runs (counted in ``reading``, as a copy would be); a rest the socket
        did not take is copied by the sender before the next step changes the weights (``before_write``).
        Where a cast is needed, or another answer of this version copied the weights already, as
        ``read_shared``."""
        with self._cond:
            entries = self._entries_read(names, worker_id)
            said = version, loss_scale, sync = self._job.version, self._loss_scale(), self._job.sync_text
            key = (tuple(names), wire_dtype, slowest_clock, loss_scale, sync)
            hit = self.lent.get(key)
            if hit is None and (key in self.shared or not _lendable(entries, wire_dtype)):
                begun = self._shared_begin(key, entries, wire_dtype, room)
            elif hit is None:
                begun = None
                layout, end = _shm_layout(entries, wire_dtype)
                _check_room(end, room)
                payload = sum(size for *_, size in layout)
            else:
                begun = None
                end, payload = sum(map(len, hit[1])), hit[2]
                _check_room(end, room)
            if begun is None:
                self.pull_bytes_total += payload
                self.pulls_total += 1
                self.lent_answers_total += 1
                self.reading += 1
        if begun is not None:
            return self._shared_copy(key, begun, said, slowest_clock)
        try:
            if hit is None:
                out: list[Item] = []
                views: list[memoryview | bytes] = []
                at = 0
                for e, start, dt, off, size in layout:
                    if off > at:
                        views.append(_ZEROS[: off - at])
                    if size:
                        raw: Any = e.parts[start].weight.reshape(-1).numpy()
                        views.append(memoryview(raw).cast("B"))
                    at = off + size
                    out.append(_placed(e, start, dt, off, size, version, loss_scale, sync, slowest_clock))
                with self._cond:
                    self.lent[key] = hit = (out, views, payload)  # of this version: no step runs while ``reading``
        except BaseException:
            self._done_reading()
            raise
        return version, hit[0], Lent(self, hit[1], end)

    def _shared_buffer(self, nbytes: int) -> torch.Tensor:
        """A buffer of ``nbytes`` for a shared answer: a spare of that size, else a new one (spares of other
        sizes are dropped). Any thread: the list's ``pop`` and ``append`` are atomic."""
        while True:
            try:
                spare = self._spare.pop()
            except IndexError:
                return torch.empty(nbytes, dtype=torch.uint8)
            if spare.numel() == nbytes:
                return spare

    def read_copies(self, names: Sequence[str], worker_id: int | None,
                    copy: Callable[[list[TensorEntry]], tuple[T, int]], *,
                    check: Callable[[], None] = lambda: None) -> tuple[int, float, str, T]:
        """Under the lock, once no step is in flight: ``check()``, then ``copy`` of the entries of ``names``
        (a Pull of its own making, server/datapath/slicepull.py: what it copied and its payload bytes, counted), with
        the version, loss scale and sync mode it is of."""
        with self._cond:
            check()
            out, nbytes = copy(self._entries_read(names, worker_id))
            self.pull_bytes_total += nbytes
            self.pulls_total += 1
            return self._job.version, self._loss_scale(), self._job.sync_text, out

    def export_state(self, names: Sequence[str]) -> tuple[int, list[tuple[str, int, int, str, torch.Tensor]]]:
        """A consistent copy of weights and optimizer state: (version, [(name, start, stop, key, tensor)]).

        ``key`` is "weight" for the fp32 master weights, else the optimizer
        state's own key (e.g. "exp_avg", "step").
        """
        with self._cond:
            self._settle()
            for n in names:
                self._table.spec(n)
            out = []
            for n in names:
                for start, part in sorted(self._table[n].parts.items()):
                    out.append((n, start, part.stop, "weight", part.weight.clone()))
                    for key in sorted(part.state):
                        out.append((n, start, part.stop, key, part.state[key].clone()))
            return self._job.version, out

    def weights(self, name: str) -> dict[int, torch.Tensor]:
        """Copies of the fp32 master weights of ``name``, by part start (for tests and tools)."""
        with self._cond:
            self._settle()
            self._table.spec(name)
            return {s: p.weight.clone() for s, p in self._table[name].parts.items()}


Placed = tuple[TensorEntry, int, int, int, int]  # (entry, part start, wire dtype, offset, bytes)


class _Shared(NamedTuple):
    """``Reader._shared_begin``'s answer: the version's shared answer (messages, payload) where one was copied
    already, else what to copy (``layout``, its ``end`` and ``payload`` bytes)."""

    copied: tuple[list[Item], memoryview] | None = None
    layout: Sequence[Placed] = ()
    end: int = 0
    payload: int = 0


_ZEROS = bytes(shm.aligned(1))  # the bytes between two parts of an answer (each part on a 64-byte boundary)


def _check_room(end: int, room: int) -> None:
    """INVALID_ARGUMENT when an answer of ``end`` bytes does not fit the worker's pull buffer of ``room``."""
    if end > room:
        raise InvalidArgument(f"Pull: the worker's pull buffer holds {room} bytes; the weights asked need {end}")


def _lendable(entries: Sequence[TensorEntry], wire_dtype: int | None) -> bool:
    """Whether an answer of ``entries`` may be sent from their weights themselves: fp32 on the wire (their own
    dtype), each part contiguous."""
    if wire_dtype not in (None, ps_pb2.FLOAT32):
        return False
    return all(e.spec.dtype == ps_pb2.FLOAT32 and p.weight.is_contiguous() for e in entries for p in e.parts.values())


class Lent:
    """A Pull's answer lent from the weights (``Reader.read_lent``): ``views``, the payload's pieces (the parts'
    own bytes, zeros between), ``nbytes`` in all. A ``protos.dataconn.Lender`` for the ``Sender`` that writes
    it: queued (not written whole at once), the answer is in its reader's ``_sending`` until sent or detached.
    ``close``: the answering thread is done with it (the reader's ``reading`` count ends)."""

    __slots__ = ("views", "nbytes", "_reader", "_open", "_detach")

    def __init__(self, reader: Reader, views: list[memoryview | bytes], nbytes: int) -> None:
        self.views, self.nbytes, self._reader = views, nbytes, reader
        self._open = True
        self._detach: Callable[[], None] | None = None

    def queued(self, detach: Callable[[], None]) -> None:
        with self._reader._sending_mu:
            self._detach = detach
            self._reader._sending.add(self)

    def sent(self) -> None:
        with self._reader._sending_mu:
            self._detach = None
            self._reader._sending.discard(self)

    def close(self) -> None:
        """Once the answer was handed to its sender (or failed before): idempotent."""
        if self._open:
            self._open = False
            self._reader._done_reading()


def _shm_layout(entries: Sequence[TensorEntry], wire_dtype: int | None) -> tuple[list[Placed], int]:
    """Where each part of ``entries`` lies in a buffer the worker reads (a segment, a shared answer), each on a
    64-byte boundary, in the wire dtype; and where the last one ends."""
    layout: list[Placed] = []
    at = end = 0
    for e in entries:
        dt = e.spec.dtype if wire_dtype is None else wire_dtype
        itemsize = codec.itemsize(dt)
        for start in sorted(e.parts):
            nbytes = e.parts[start].weight.numel() * itemsize
            layout.append((e, start, dt, at, nbytes))
            end = at + nbytes
            at = shm.aligned(end)
    return layout, end


def _placed(e: TensorEntry, start: int, dt: int, off: int, size: int, version: int, loss_scale: float, sync: str,
            slowest_clock: int) -> Item:
    """The Pull answer of one part laid out by ``_shm_layout``: its chunk says where its bytes lie, no data."""
    first = start == min(e.parts) if e.spec.shape else True
    msg = ps_pb2.PullResponse(
        version=version, loss_scale=loss_scale, sync=sync, slowest_clock=slowest_clock,
        chunk=ps_pb2.Chunk(name=e.spec.name, offset=start, dtype=dt,  # type: ignore[arg-type]
                           shape=e.spec.shape if first else (), shm_offset=off, shm_bytes=size))
    return e.spec.name, start, dt, msg.SerializeToString()
