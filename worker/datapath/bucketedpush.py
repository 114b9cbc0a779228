"""``BucketedPush``: a push that streams while backward runs.

One Push per shard, opened at once, fed gradient buckets as they are
handed in (``add``), closed by ``finish(found_inf)`` with a last,
chunk-less message carrying the step's inf/nan flag (the shard ORs it over
the stream, server/datapath/wire.py). A retried shard (UNAVAILABLE) is sent the
whole stream again from its start: the requests are generated from the
buckets kept until ``finish`` (with ``hold_gradients=False``, a streamed
worker's: from what its shards' push segments hold, the gradients
themselves freed as handed in). Every message is framed by ``PushFramer``
(``worker/datapath/pushframes.py``), as the shard's path (``worker/datapath/paths.py``) has
it: over gRPC or through the shard's push segment.

The RPCs run on the transport's threads (one per shard) and never block
without a deadline: the client's timeout per RPC, and for waits on them the
timeout plus the transport's recovery time. ``finish`` returns the shards'
answers and hands what they say about the job (``JobView.of_push``) to
``on_result``, the client's ``apply``, in the caller's thread: nothing
here writes the client's state.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from shardps.protos import codec
from shardps.protos.results import PushResult
from shardps.protos.shardps.v1 import ps_pb2
from shardps.worker.datapath.paths import Flat, SegmentParts, ShardPath
from shardps.worker.datapath.pushframes import PushFramer
from shardps.worker.datapath.route import Route
from shardps.worker.datapath.transport import gather
from shardps.worker.job.jobview import JobView


class BucketedPushAborted(Exception):
    """Raised inside a push stream's request generator to cancel its RPC: the shard then applies nothing."""


class BucketedPush:
    """One step's Push to every shard, fed bucket by bucket (see the module docstring)."""

    def __init__(self, client: Route, step: int, base_versions: Sequence[int], loss_scale: float = 0.0, *,
                 on_result: Callable[[JobView], None] | None = None, hold_gradients: bool = True) -> None:
        assert client.shard_map is not None
        self._client = client
        # False (a streamed worker's): a CPU gradient whose shards all read a push segment is copied into them
        # in ``add`` and not held after (``SegmentParts``): the segments hold the step's bytes, once.
        self._hold = hold_gradients
        self._on_result = on_result
        self._step = step
        self._bases = list(base_versions)
        self._loss_scale = loss_scale
        self._cond = threading.Condition()
        self._ready: list[tuple[str, Flat]] = []  # (name, flat CPU tensor in its push dtype, see _written)
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
        client.paths.revive()  # a data connection lost since: made again in the background
        self._futures = t.submit_each(self._push)
        self.bytes_added = 0

    def add(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Hand in finished gradients (any device, any dtype: cast to each tensor's push dtype here)."""
        client = self._client
        flats: list[tuple[str, Flat]] = []
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
            paths = [client.paths[i] for i in range(client.num_shards) if name in self._parts[i]]
            flat: Flat
            if g.is_cuda:  # device-to-host on a side stream, into pinned memory: backward does not wait
                flat = self._to_host(name, g, dtype)
            elif (g.device.type == "cpu" and (g.dtype != dtype or not self._hold) and paths
                  and all(p.writes_ahead for p in paths)
                  and (direct := self._write_direct(name, g.detach().reshape(-1), paths)) is not None):
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
            host = [f for n, f in flats  # (those written ahead were checked as written)
                    if n not in self._copies and n not in self._written and isinstance(f, torch.Tensor)]
            self._found_inf = self._found_inf or not finite or not all(codec.all_finite(f) for f in host)
            self._cond.notify_all()

    def _write_direct(self, name: str, flat: torch.Tensor, paths: Sequence[ShardPath]
                      ) -> tuple[torch.Tensor | SegmentParts, bool] | None:
        """Cast ``flat`` into each of its shards' push segments as it is copied (``paths``: its shards', all
        writing ahead); (what the stream keeps of it, whether the bytes written are all finite: they are what
        the shards read, and a cast can overflow). What it keeps: ``flat`` (a retry on a path without shared
        memory casts it again), or, where the gradients are not held, the values written (``SegmentParts``).
        None when a segment was closed meanwhile (a fail-over): the caller casts it into a buffer instead."""
        chunks: dict[int, list[ps_pb2.Chunk]] = {}
        values: dict[int, torch.Tensor] = {}
        finite = True
        for path in paths:
            written = path.stage({name: flat}, [(name, start, stop) for start, stop in self._parts[path.shard][name]])
            if written is None:
                return None
            chunks[path.shard] = [c for c, _ in written]
            finite = finite and all(codec.all_finite(v) for _, v in written)
            values.update((c.offset, v) for c, v in written)
        self._written[name] = chunks
        return (flat if self._hold else SegmentParts(name, values)), finite

    def _to_host(self, name: str, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Start copying a CUDA gradient to a pinned host buffer (the client keeps one per tensor) on a
        side stream; ``_host(name)`` waits for it."""
        side = self._client.buffers.side_stream(g.device)
        buf = self._client.buffers.pinned(name, g.numel(), dtype)
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
        handed in held an inf/nan) and return each shard's answer; raise the first failure. What the answers
        say of the job goes to ``on_result`` (``PSClient.apply``), in this thread."""
        late = False  # CUDA gradients are checked once in host memory
        flats = dict(self._ready)
        for name in list(self._copies):
            self._host(name)
            flat = flats[name]
            late = late or (isinstance(flat, torch.Tensor) and not codec.all_finite(flat))
        with self._cond:
            if found_inf is not None:
                self._found_inf = self._found_inf or found_inf
            self._found_inf = self._found_inf or late
            self._done = True
            self._cond.notify_all()
        responses = gather(self._futures, self._wait_s)
        out = [PushResult.from_proto(r) for r in responses]
        if self._on_result is not None:
            self._on_result(JobView.of_push(out))
        return out

    def abort(self) -> None:
        """Cancel every shard's stream (no shard applies any of it) and wait for the RPCs to end."""
        with self._cond:
            self._aborted = True
            self._cond.notify_all()
        try:
            gather(self._futures, self._wait_s)
        except Exception:  # noqa: BLE001 - the cancelled RPCs fail, as they should
            pass

    def _more(self, sent: int) -> bool:
        return len(self._ready) > sent or self._done or self._aborted

    def _push(self, shard: int) -> ps_pb2.PushResponse:
        """Shard ``shard``'s streamed Push (one try: ``submit_each`` retries it)."""
        path = self._client.paths.ready(shard, self._client.transport.timeout)  # a retry takes it anew
        return self._client.transport.push(shard, self._requests(shard, path), stream=True, via=path)

    def _requests(self, shard: int, path: ShardPath) -> Iterator[bytes]:
        """Shard ``shard``'s PushRequests, as the buckets come: the whole stream from its start at each call."""
        client = self._client
        parts = self._parts[shard]
        frames = PushFramer(worker_id=client.worker_id, step=self._step, base_version=self._bases[shard],
                            loss_scale=self._loss_scale, epoch=client.epoch, sync=client.sync_said,
                            shm=path.push_segment, fence_epoch=client.transport.fence_epochs[shard])
        i = 0
        while True:
            with self._cond:
                if not self._cond.wait_for(functools.partial(self._more, i), timeout=self._wait_s):
                    raise BucketedPushAborted(f"shard {shard}: no gradient handed in for {self._wait_s:.0f}s")
                if self._aborted:
                    raise BucketedPushAborted(f"shard {shard}: the push of step {self._step} was cancelled")
                batch = self._ready[i:]
                done = self._done
                found_inf = self._found_inf
            i += len(batch)
            for name, _ in batch:
                self._host(name)
            yield from path.bucket_messages(frames, batch, self._written, parts, client)
            if done and not batch:
                yield frames.end(found_inf)
                return
