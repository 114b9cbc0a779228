"""The plain push: one step's whole gradient to every shard, framed by ``PushFramer``.

``push`` is ``PSClient.push``'s body: it casts each gradient to its push
dtype (same host: as it is copied into each shard's push segment, the
segments written in parallel), decides ``found_inf`` from the bytes the
shards will read (a cast can overflow: 1e5 is inf in float16), then sends
each shard its messages (gRPC, or the segment's, should the shard still
share this machine) and returns each shard's answer. It writes nothing of
the client's: the caller takes ``JobView.of_push`` of the answers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from shardps.protos import codec, shm
from shardps.protos.results import PushResult
from shardps.protos.shardps.v1 import ps_pb2
from shardps.worker.pushframes import PushFramer
from shardps.worker.route import Route


def pull_after_fields(pull_after: tuple[torch.dtype | None, int] | None) -> dict[str, Any]:
    """The PushRequest fields that ask a shard to answer with its weights (``push(pull_after=...)``)."""
    if pull_after is None:
        return {}
    pull_dtype, min_clock = pull_after
    return {"pull_after": True, "pull_min_clock": min_clock,
            "pull_dtype": codec.to_wire_dtype(pull_dtype) if pull_dtype is not None else ps_pb2.DTYPE_UNSPECIFIED}


def push(route: Route, grads: Mapping[str, torch.Tensor], step: int, bases: Sequence[int], *,
         owners: Mapping[str, set[int]], loss_scale: float = 0.0, found_inf: bool | None = None,
         pull_after: tuple[torch.dtype | None, int] | None = None) -> list[PushResult]:
    """Send ``grads`` (registered names, checked shapes) of ``step`` to every shard; one result per shard.

    ``bases``: each shard's base version; ``owners``: each tensor's shards.
    The other arguments are ``PSClient.push``'s. Blocks until every shard
    answered (each RPC within the transport's deadline); raises the first
    failure.
    """
    smap = route.shard_map
    assert smap is not None
    layouts = route.layouts
    flats: dict[str, torch.Tensor] = {}  # flat CPU gradients, in their push dtype but for ``direct`` ones
    direct: set[str] = set()  # cast as they are copied into shared memory: no buffer in between
    links = list(route.shm_links)  # one view of them for the choice, the writes and the check below
    for name, g in grads.items():
        lay = layouts[name]
        if tuple(g.shape) != lay.shape:
            raise ValueError(f"gradient of {name!r}: expected shape {lay.shape}, got {tuple(g.shape)}")
        dtype = codec.to_torch_dtype(lay.push_dtype)
        g = g.detach()
        shards = owners.get(name, ())  # none for an empty tensor
        if g.dtype != dtype and g.device.type == "cpu" and shards and all(links[i] for i in shards):
            flats[name] = g.reshape(-1)
            direct.add(name)
        else:
            flats[name] = g.to("cpu", dtype).contiguous().view(-1)
    # Same host: every shard's parts into its push segment first, the shards in parallel; the bytes the
    # shards will read are those checked for inf/nan.
    linked = [i for i, link in enumerate(links) if link is not None]
    written: list[list[tuple[ps_pb2.Chunk, torch.Tensor]] | None] = [None] * route.num_shards

    def write(i: int) -> list[tuple[ps_pb2.Chunk, torch.Tensor]] | None:
        link = links[i]
        assert link is not None
        try:
            return link.write(flats)
        except shm.SegmentClosed:  # the shard failed over meanwhile: its share goes over gRPC
            return None

    for i, w in zip(linked, route.transport.fan_out(write, linked) if linked else ()):
        written[i] = w
    if found_inf is None:
        checked = [v for w in written if w for c, v in w if c.name in direct]
        for i in linked:
            if written[i] is None:  # what gRPC will carry for it instead, cast as it will be
                checked += [flats[p.name][p.start : p.stop].to(codec.to_torch_dtype(layouts[p.name].push_dtype))
                            for p in smap.parts_for(i) if p.name in direct]
        found_inf = not (all(codec.all_finite(f) for n, f in flats.items() if n not in direct)
                         and all(codec.all_finite(v) for v in checked))
    more = pull_after_fields(pull_after)

    def requests(shard: int) -> Iterator[bytes]:
        link, chunks = route.shm_links[shard], written[shard]
        same_host = link is not None and link is links[shard] and chunks is not None
        frames = PushFramer(worker_id=route.worker_id, step=step, base_version=bases[shard], loss_scale=loss_scale,
                            epoch=route.epoch, found_inf=bool(found_inf), fields=more,
                            shm=link.push.name if same_host and link is not None else "")
        if same_host:  # the bytes are in the segment: the messages say where
            assert chunks is not None
            yield from frames.shm_chunks([c for c, _ in chunks], last=True)
            return
        yield from frames.ending(grpc_messages(route, frames, shard, flats, direct))

    t = route.transport
    return [PushResult.from_proto(r) for r in t.each(lambda i: t.push(i, requests(i)))]


def grpc_messages(route: Route, frames: PushFramer, shard: int, flats: Mapping[str, torch.Tensor],
                  direct: set[str]) -> Iterator[bytes]:
    """``shard``'s parts of ``flats`` as gRPC chunk messages (``direct`` ones cast to their push dtype)."""
    assert route.shard_map is not None
    for p in route.shard_map.parts_for(shard):
        flat = flats.get(p.name)
        if flat is None:
            continue
        lay = route.layouts[p.name]
        if p.name in direct:  # meant for shared memory, but this shard's went off (a fail-over)
            flat = flat.to(codec.to_torch_dtype(lay.push_dtype))
        yield from frames.chunks(p.name, lay.push_dtype, lay.shape, flat, p.start, p.stop, route.chunk_bytes)
