"""``push_slices``: a push whose gradients are slices of whole tensors (``PushRequest.slices``).

A tensor-parallel rank holds ``torch.chunk(g, p, dim)[rank]`` of a whole gradient ``g`` and pushes just that
(docs/tensor-parallel.md): each shard gets the slice's elements its parts hold (``TensorSlice.pieces``: flat
runs along dim 0, one run of the slice's rows along a later dim), chunk offsets and shape the slice's, and
puts them in place (server/datapath/slicepush.py); the other ranks' slices of the step fill the rest. Gradients not in
``slices`` go whole, as in any push. The bytes go where the shard's path puts a push's
(``ShardPath.slice_messages``): in its part's place of the frame's push buffer, sent from the slice's memory
(a connection), or of the shard's push segment (same host); the messages only say where. Every shard gets
a Push, an empty one if it holds none of the slices, so barriers see every worker.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from shardps.protos import codec
from shardps.protos.results import PushResult
from shardps.protos.shardps.v1 import ps_pb2
from shardps.protos.slices import TensorSlice
from shardps.worker.datapath.paths import ShardPath, SliceRun
from shardps.worker.datapath.pull import PullInFlight
from shardps.worker.datapath.push import send
from shardps.worker.datapath.pushframes import PushFramer
from shardps.worker.datapath.route import Route


def push_slices(route: Route, grads: Mapping[str, torch.Tensor], slices: Mapping[str, TensorSlice], step: int,
                bases: Sequence[int], *, loss_scale: float = 0.0, window: int | None = None,
                then: PullInFlight | None = None) -> list[PushResult]:
    """Send ``grads`` (each the slice ``slices`` names of its tensor, or the whole tensor) of ``step``; one
    result per shard. The other arguments are ``PSClient.push``'s."""
    assert route.shard_map is not None
    flats: dict[str, torch.Tensor] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, g in grads.items():
        lay = route.layouts[name]
        sl = slices.get(name)
        shapes[name] = sl.shape(lay.shape) if sl is not None else lay.shape
        if tuple(g.shape) != shapes[name]:
            raise ValueError(f"gradient of {name!r}: expected shape {shapes[name]}"
                             f"{' (its slice)' if sl is not None else ''}, got {tuple(g.shape)}")
        flats[name] = g.detach().to("cpu", codec.to_torch_dtype(lay.push_dtype)).contiguous().view(-1)
    found_inf = not all(codec.all_finite(f) for f in flats.values())
    header = [ps_pb2.TensorSlice(name=n, dim=sl.dim, parts=sl.parts, index=sl.index, blocks=sl.blocks)
              for n, sl in slices.items() if n in flats]

    def requests(shard: int) -> tuple[ShardPath, Iterator[bytes]]:
        assert route.shard_map is not None
        path = route.paths.ready(shard, route.transport.timeout)  # as the call starts: a retry takes it anew

        def frames(segment: str) -> PushFramer:
            return PushFramer(worker_id=route.worker_id, step=step, base_version=bases[shard], loss_scale=loss_scale,
                              epoch=route.epoch, sync=route.sync_said, found_inf=found_inf,
                              fields={"slices": header}, fence_epoch=route.transport.fence_epochs[shard], shm=segment)

        runs = []
        for p in route.shard_map.parts_for(shard):
            flat = flats.get(p.name)
            if flat is None:
                continue
            lay, sl = route.layouts[p.name], slices.get(p.name)
            pieces = [(p.start, p.stop - p.start)] if sl is None else [
                (at, n) for at, n, _ in sl.pieces(lay.shape, p.start, p.stop)]
            runs += [SliceRun(p.name, p.start, at, n, flat, lay.push_dtype, shapes[p.name]) for at, n in pieces]
        return path, path.slice_messages(frames, runs, route.chunk_bytes)

    return send(route, requests, window, then)
