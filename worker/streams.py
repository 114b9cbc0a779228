"""A push that streams while backward runs, and a pull whose tensors can be waited for one by one.

``PushStream``: one Push per shard, opened at once, fed gradient buckets as
they are handed in (``add``), closed by ``finish(found_inf)`` with a last,
chunk-less message carrying the step's inf/nan flag (the shard ORs it over
the stream, server/wire.py). A retried shard (UNAVAILABLE) is sent the
whole stream again from its start: the requests are generated from the
buckets kept until ``finish``.

``PullInFlight``: one Pull per shard, started at once (``start``), writing
each chunk into its destination as it arrives; ``wait(names)`` returns
once those tensors are complete, ``result()`` once all are. The tensors of
each shard come in the order asked (the model's order: the first layers
first). ``PSClient.pull`` is ``start`` then ``result``.

Both run their RPCs on the transport's threads (one per shard; a Pull's
answered shards are copied, and with ``start(inline=True)`` its first
shard's RPC made, in the caller's thread) and never block without a
deadline: the client's timeout per RPC, and for waits on them the timeout
plus the transport's recovery time.

(Over 400 lines: the two directions of one step's data path, each with its
gRPC and shared-memory forms, sharing the gathering of the shards' results;
apart, each would repeat the other's handling of failures and deadlines.)
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from shardps.protos import codec, framing
from shardps.protos.results import PushResult
from shardps.protos.shardps.v1 import ps_pb2
from shardps.protos.shm import SegmentClosed

if TYPE_CHECKING:
    from shardps.worker.client import PSClient
    from shardps.worker.shm import ShmLink


def _gather(futures: Sequence[Future[Any]], timeout: float) -> list[Any]:
    """Every future's result once all ended (each within ``timeout``); then the first failure raised."""
    results: list[Any] = []
    first: BaseException | None = None
    for f in futures:
        try:
            results.append(f.result(timeout=timeout))
        except BaseException as e:  # noqa: BLE001 - re-raised below, once all ended
            first = first or e
    if first is not None:
        raise first
    return results


def write_shm(client: PSClient, link: ShmLink, shard: int, flats: Mapping[str, torch.Tensor],
              parts: Sequence[tuple[str, int, int]] | None = None) -> list[tuple[ps_pb2.Chunk, torch.Tensor]]:
    """Copy ``shard``'s parts of ``flats`` (any float dtype: cast to each tensor's push dtype as they are
    copied) into its push segment: per part the chunk that says where, and the values written.
    ``parts``: (name, start, stop) of the shard's parts to write, if the caller knows them."""
    assert client.shard_map is not None
    if parts is None:
        parts = [(p.name, p.start, p.stop) for p in client.shard_map.parts_for(shard)]
    out = []
    for name, start, stop in parts:
        flat = flats.get(name)
        if flat is not None:
            lay = client.layouts[name]
            chunk, written = link.write_push(name, lay.push_dtype, flat, start, stop)
            chunk.shape.extend(lay.shape)  # one chunk per part: each says the shape
            out.append((chunk, written))
    return out


def shm_messages(client: PSClient, link: ShmLink, chunks: Sequence[ps_pb2.Chunk], *, step: int, base_version: int,
                 found_inf: bool, loss_scale: float, last: bool = True,
                 fields: Mapping[str, Any] | None = None) -> Iterator[bytes]:
    """PushRequests for ``chunks`` already in ``link``'s push segment (``write_shm``); ``last``: end with
    the stream's last message (carrying ``found_inf``); ``fields``: more PushRequest fields for every
    message (``pull_after``...)."""
    more = dict(fields or {})
    head = dict(worker_id=client.worker_id, step=step, base_version=base_version, found_inf=found_inf,
                loss_scale=loss_scale, epoch=client.epoch, shm=link.push.name, ends_with_last=True, **more)
    requests = [ps_pb2.PushRequest(chunk=c, **head) for c in chunks]
    if not requests and last:
        requests = [ps_pb2.PushRequest(**head)]
    if requests:
        requests[-1].last = last  # with ``last``, the last one says it is
    for r in requests:
        yield r.SerializeToString()


def push_via_shm(client: PSClient, link: ShmLink, shard: int, flats: Mapping[str, torch.Tensor], *, step: int,
                 base_version: int, found_inf: bool, loss_scale: float, last: bool = True,
                 fields: Mapping[str, Any] | None = None,
                 parts: Sequence[tuple[str, int, int]] | None = None) -> Iterator[bytes]:
    """PushRequests for ``shard`` whose chunks lie in its push segment (written here: ``write_shm``, then
    ``shm_messages``)."""
    chunks = [c for c, _ in write_shm(client, link, shard, flats, parts)]
    yield from shm_messages(client, link, chunks, step=step, base_version=base_version, found_inf=found_inf,
                            loss_scale=loss_scale, last=last, fields=fields)


class StreamAborted(Exception):
    """Raised inside a push stream's request generator to cancel its RPC: the shard then applies nothing."""


class PushStream:
    """One step's Push to every shard, fed bucket by bucket (see the module docstring)."""

    def __init__(self, client: PSClient, step: int, base_versions: Sequence[int], loss_scale: float = 0.0) -> None:
        assert client.shard_map is not None
        self._client = client
        self._step = step
        self._bases = list(base_versions)
        self._loss_scale = loss_scale
        self._cond = threading.Condition()
        self._ready: list[tuple[str, torch.Tensor]] = []  # (name, flat CPU tensor in its push dtype, see _written)
        # Same host: CPU gradients that need a cast are cast as they are copied into every shard's push
        # segment, in ``add`` (its flat above is then the gradient as handed in); each shard's chunks here.
        self._written: dict[str, dict[int, list[ps_pb2.Chunk]]] = {}
        self._names: set[str] = set()
        self._done = False
        self._aborted = False
        self._found_inf = False
        self._copies: dict[str, Any] = {}  # CUDA gradients: the event of their copy to host
        self._parts: list[dict[str, list[tuple[int, int]]]] = [{} for _ in range(client.num_shards)]
        for p in client.shard_map.parts:
            self._parts[p.server].setdefault(p.name, []).append((p.start, p.stop))
        t = client.transport
        self._wait_s = t.timeout + t.recovery_timeout + 5.0
        self._futures = t.submit_each(lambda i: t.push(i, self._requests(i), stream=True))
        self.bytes_added = 0

    def add(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Hand in finished gradients (any device, any dtype: cast to each tensor's push dtype here)."""
        client = self._client
        flats = []
        finite = True
        with self._cond:  # before anything is written into the segments
            if self._done or self._aborted:
                raise RuntimeError("this push stream has ended")
        for name, g in grads.items():
            lay = client.layouts.get(name)
            if lay is None:
                raise KeyError(f"gradient of {name!r}: not a registered tensor")
            if tuple(g.shape) != lay.shape:
                raise ValueError(f"gradient of {name!r}: expected shape {lay.shape}, got {tuple(g.shape)}")
            if name in self._names:
                raise ValueError(f"gradient of {name!r} handed in twice in step {self._step}")
            self._names.add(name)
            dtype = codec.to_torch_dtype(lay.push_dtype)
            links = {i: client.shm_links[i] for i in range(client.num_shards) if name in self._parts[i]}
            if g.is_cuda:  # device-to-host on a side stream, into pinned memory: backward does not wait
                flat = self._to_host(name, g, dtype)
            elif (g.device.type == "cpu" and g.dtype != dtype and links and all(links.values())
                  and (direct := self._write_direct(name, g.detach().reshape(-1), links)) is not None):
                flat, ok = direct
                finite = finite and ok
            else:
                flat = g.detach().to("cpu", dtype).contiguous().view(-1)
            flats.append((name, flat))
            self.bytes_added += flat.numel() * dtype.itemsize
        with self._cond:
            if self._done or self._aborted:
                raise RuntimeError("this push stream has ended")
            self._ready.extend(flats)
            host = [f for n, f in flats if n not in self._copies and n not in self._written]
            self._found_inf = self._found_inf or not finite or not all(codec.all_finite(f) for f in host)
            self._cond.notify_all()

    def _write_direct(self, name: str, flat: torch.Tensor, links: Mapping[int, ShmLink | None]
                      ) -> tuple[torch.Tensor, bool] | None:
        """Cast ``flat`` into each of its shards' push segments as it is copied; (``flat``, whether the bytes
        written are all finite: they are what the shards read, and a cast can overflow). None when a
        segment was closed meanwhile (a fail-over): the caller casts it into a buffer instead."""
        chunks: dict[int, list[ps_pb2.Chunk]] = {}
        finite = True
        try:
            for i, link in links.items():
                assert link is not None
                written = write_shm(self._client, link, i, {name: flat},
                                    [(name, start, stop) for start, stop in self._parts[i][name]])
                chunks[i] = [c for c, _ in written]
                finite = finite and all(codec.all_finite(v) for _, v in written)
        except SegmentClosed:
            return None
        self._written[name] = chunks
        return flat, finite

    def _to_host(self, name: str, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Start copying a CUDA gradient to a pinned host buffer (the client keeps one per tensor) on a
        side stream; ``_host(name)`` waits for it."""
        side = self._client.side_stream(g.device)
        buf = self._client.pinned(name, g.numel(), dtype)
        side.wait_stream(torch.cuda.current_stream(g.device))  # the gradient is complete on the compute stream
        with torch.cuda.stream(side):
            src = g.detach().reshape(-1)
            buf.copy_(src.to(dtype) if src.dtype != dtype else src, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(side)
        g.record_stream(side)
        self._copies[name] = done
        return buf

    def _host(self, name: str) -> None:
        """Wait until ``name``'s bytes are in host memory (CUDA gradients only)."""
        done = self._copies.get(name)
        if done is not None:
            done.synchronize()

    @property
    def found_inf(self) -> bool:
        """Whether a gradient handed in so far holds an inf or nan."""
        with self._cond:
            return self._found_inf

    def handed_in(self, name: str) -> bool:
        return name in self._names

    def finish(self, found_inf: bool | None = None) -> list[PushResult]:
        """Close every shard's stream (``found_inf``: the step's flag, by default whether any gradient
        handed in held an inf/nan) and return each shard's answer; raise the first failure."""
        late = False  # CUDA gradients are checked once in host memory
        flats = dict(self._ready)
        for name in list(self._copies):
            self._host(name)
            late = late or not codec.all_finite(flats[name])
        with self._cond:
            if found_inf is not None:
                self._found_inf = self._found_inf or found_inf
            self._found_inf = self._found_inf or late
            self._done = True
            self._cond.notify_all()
        responses = _gather(self._futures, self._wait_s)
        out = [PushResult.from_proto(r) for r in responses]
        self._client.sync = out[0].sync or self._client.sync
        self._client.loss_scale = out[0].loss_scale
        return out

    def abort(self) -> None:
        """Cancel every shard's stream (no shard applies any of it) and wait for the RPCs to end."""
        with self._cond:
            self._aborted = True
            self._cond.notify_all()
        try:
            _gather(self._futures, self._wait_s)
        except Exception:  # noqa: BLE001 - the cancelled RPCs fail, as they should
            pass

    def _more(self, sent: int) -> bool:
        return len(self._ready) > sent or self._done or self._aborted

    def _requests(self, shard: int) -> Iterator[bytes]:
        """Shard ``shard``'s PushRequests, as the buckets come: the whole stream from its start at each call."""
        client = self._client
        prefix, suffix = framing.header(ps_pb2.PushRequest, worker_id=client.worker_id, step=self._step,
                                        base_version=self._bases[shard], found_inf=False,
                                        loss_scale=self._loss_scale, epoch=client.epoch, ends_with_last=True)
        parts = self._parts[shard]
        link = client.shm_links[shard]
        i = 0
        while True:
            with self._cond:
                if not self._cond.wait_for(functools.partial(self._more, i), timeout=self._wait_s):
                    raise StreamAborted(f"shard {shard}: no gradient handed in for {self._wait_s:.0f}s")
                if self._aborted:
                    raise StreamAborted(f"shard {shard}: the push of step {self._step} was cancelled")
                batch = self._ready[i:]
                done = self._done
                found_inf = self._found_inf
            i += len(batch)
            for name, _ in batch:
                self._host(name)
            if link is not None:  # same host: through the push segment
                chunks = [c for name, _ in batch if name in self._written for c in self._written[name].get(shard, ())]
                if chunks:
                    yield from shm_messages(client, link, chunks, step=self._step, base_version=self._bases[shard],
                                            found_inf=False, loss_scale=self._loss_scale, last=False)
                flats = {name: flat for name, flat in batch if name in parts and name not in self._written}
                if flats:
                    yield from push_via_shm(client, link, shard, flats, step=self._step,
                                            base_version=self._bases[shard], found_inf=False,
                                            loss_scale=self._loss_scale, last=False,
                                            parts=[(n, a, b) for n in flats for a, b in parts[n]])
                if done and not batch:
                    yield from push_via_shm(client, link, shard, {}, step=self._step,
                                            base_version=self._bases[shard], found_inf=found_inf,
                                            loss_scale=self._loss_scale)
                    return
                continue
            for name, flat in batch:
                lay = client.layouts[name]
                if name in self._written and name in parts:  # meant for shared memory, now off (a fail-over)
                    flat = flat.to(codec.to_torch_dtype(lay.push_dtype))
                for start, stop in parts.get(name, ()):
                    for _, _, msg in framing.chunk_messages(prefix, framing.PUSH_CHUNK_FIELD, suffix, name,
                                                            lay.push_dtype, lay.shape, flat, start, stop,
                                                            client.chunk_bytes):
                        yield msg
            if done and not batch:
                last_prefix, last_suffix = framing.header(
                    ps_pb2.PushRequest, worker_id=client.worker_id, step=self._step,
                    base_version=self._bases[shard], found_inf=found_inf, loss_scale=self._loss_scale,
                    epoch=client.epoch, ends_with_last=True, last=True)
                yield last_prefix + last_suffix
                return


class PullInFlight:
    """Weights being pulled from every shard into their destinations (see the module docstring)."""

    def __init__(self, client: PSClient, names: Sequence[str], *, out: Mapping[str, torch.Tensor] | None = None,
                 min_versions: Sequence[int] | None = None, dtype: torch.dtype | None = None,
                 min_clock: int = 0, answered: Mapping[int, Sequence[bytes]] | None = None) -> None:
        assert client.shard_map is not None
        self._client = client
        self._answered = dict(answered or {})  # shard -> the PullResponses its Push answered with
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
            if target is None:
                target = torch.empty(lay.shape, dtype=tdt)
            elif tuple(target.shape) != lay.shape:
                raise ValueError(f"out[{n!r}]: expected shape {lay.shape}, got {tuple(target.shape)}")
            self.result_tensors[n] = target
            # A CPU tensor in one piece is written in place, cast as each chunk is copied when its dtype is
            # not the wire's (pull_dtype=bf16 into fp32 parameters): one pass, no staging.
            direct = target.device.type == "cpu" and target.is_contiguous()
            self._wire_itemsize[n] = tdt.itemsize
            if direct:
                self._staging[n] = target.detach().view(-1)
            else:
                if target.device.type == "cuda":  # pinned (kept by the client): the copy up is asynchronous
                    self._staging[n] = client.pinned(f"pull:{n}", lay.numel, tdt)
                else:
                    self._staging[n] = torch.empty(lay.numel, dtype=tdt)
                self._staged.add(n)
        # Each shard's tensors in the order asked; elements each tensor still waits for.
        order = {n: k for k, n in enumerate(names)}
        self._owners: dict[int, list[str]] = {}
        self._missing: dict[str, int] = dict.fromkeys(names, 0)
        self._messages: dict[int, int] = {}  # how many PullResponses each shard answers with
        for p in client.shard_map.parts:
            if p.name in order:
                self._missing[p.name] += p.stop - p.start
                if client.shm_links[p.server] is not None:  # one per part
                    self._messages[p.server] = self._messages.get(p.server, 0) + 1
                else:  # one per chunk, as the shard frames them
                    per = max(1, client.chunk_bytes // self._wire_itemsize[p.name])
                    self._messages[p.server] = self._messages.get(p.server, 0) + -(-(p.stop - p.start) // per)
                got = self._owners.setdefault(p.server, [])
                if p.name not in got:
                    got.append(p.name)
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
        link = client.shm_links[shard]
        req = ps_pb2.PullRequest(worker_id=client.worker_id, names=self._owners[shard],
                                 min_version=self._mins[shard], dtype=self._wire,  # type: ignore[arg-type]
                                 chunk_bytes=client.chunk_bytes, min_clock=self._min_clock, epoch=client.epoch,
                                 shm=link.pull.name if link is not None else "")
        version = -1
        received = self._received[shard]
        given = self._answered.pop(shard, None)  # the Push answered with them: no Pull (a retry asks anew)
        responses = (map(framing.read_pull_response, given) if given is not None
                     else client.transport.pull(shard, req, one=self._messages.get(shard) == 1))
        with torch.no_grad():
            # chunk.data is a view of the received message: decode copies nothing, copy_ is the one copy.
            for resp in responses:
                c = resp.chunk
                if c.shm_bytes:  # same host: the bytes are in our pull segment
                    if link is None:
                        raise ValueError(f"shard {shard} answered with shared memory this client did not offer")
                    values = codec.decode(link.read(c.shm_offset, c.shm_bytes), c.dtype)
                else:
                    values = codec.decode(c.data, c.dtype)
                dst = self._staging.get(c.name)
                if dst is None and given is not None and c.name not in client.layouts:
                    continue  # a Push is answered with every tensor of its shard: others' (pipeline stages')
                if dst is None or c.offset < 0 or c.offset + values.numel() > dst.numel():
                    size = "a tensor not asked for" if dst is None else f"its {dst.numel()} elements"
                    raise ValueError(f"shard {shard} sent {c.name!r} [{c.offset}, +{values.numel()}) "
                                     f"outside {size}")
                dst[c.offset : c.offset + values.numel()].copy_(values)
                version = resp.version
                client.loss_scale = resp.loss_scale
                client.sync = resp.sync or client.sync
                client.slowest_clock = resp.slowest_clock
                with self._lock:
                    received[c.name] = received.get(c.name, 0) + values.numel()
                    self._missing[c.name] -= values.numel()
                    done = self._missing[c.name] == 0 and not self._events[c.name].is_set()
                if done:
                    self._complete(c.name)
        return version

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
        """Wait for every shard; update the client's versions; the destination tensors. Raises the first
        shard's failure (again on each call)."""
        if not self._finished:
            try:
                versions = _gather(self._futures, self._wait_s)
            except BaseException as e:
                self._error = e
                self._finished = True
                raise
            for s, v in zip(self._shards, versions):
                if v >= 0:
                    self._client.versions[s] = v
            self._finished = True
        if self._error is not None:
            raise self._error
        return self.result_tensors
