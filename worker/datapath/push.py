"""The plain push: one step's whole gradient to every shard, framed by ``PushFramer``.

``push`` is ``PSClient.push``'s body: it casts each gradient to its push
dtype (same host: as it is copied into each shard's push segment, the
segments written in parallel), decides ``found_inf`` from the bytes the
shards will read (a cast can overflow: 1e5 is inf in float16), then sends
each shard the messages its path (``worker/datapath/paths.py``: gRPC, or the
segment's, should the shard still share this machine) makes, and returns
each shard's answer. It writes nothing of the client's: the caller takes
``JobView.of_push`` of the answers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from shardps.protos import codec
from shardps.protos.results import PushResult
from shardps.protos.shardps.v1 import ps_pb2
from shardps.worker.compress import Compressor, Encoded
from shardps.worker.datapath import pushorder
from shardps.worker.datapath.paths import ShardPath, Staged
from shardps.worker.datapath.pull import PullInFlight
from shardps.worker.datapath.pushframes import PushFramer
from shardps.worker.datapath.route import Route


def pull_after_fields(pull_after: tuple[torch.dtype | None, int] | None) -> dict[str, Any]:
    """The PushRequest fields that ask a shard to answer with its weights (``push(pull_after=...)``)."""
    if pull_after is None:
        return {}
    pull_dtype, min_clock = pull_after
    return {"pull_after": True, "pull_min_clock": min_clock,
            "pull_dtype": codec.to_wire_dtype(pull_dtype) if pull_dtype is not None else ps_pb2.DTYPE_UNSPECIFIED}


def push(route: Route, grads: Mapping[str, torch.Tensor], step: int, bases: Sequence[int], *,
         owners: Mapping[str, set[int]], loss_scale: float = 0.0, found_inf: bool | None = None,
         pull_after: tuple[torch.dtype | None, int] | None = None, window: int | None = None,
         then: PullInFlight | None = None,
         compressor: Compressor | None = None) -> list[PushResult]:
    """Send ``grads`` (registered names, checked shapes) of ``step`` to every shard; one result per shard.

    ``bases``: each shard's base version; ``owners``: each tensor's shards.
    The other arguments are ``PSClient.push``'s. Blocks until every shard
    answered (each RPC within the transport's deadline); raises the first
    failure. ``window``: at most that many shards' Pushes at once, in
    ``pushorder.push_order`` (None: every shard at once); ``then``: a pull
    made with ``start_later``, each shard's begun as that shard answers (on
    a failure: abandoned before it is raised).
    ``compressor``: the tensors it compresses go as its chunks
    (worker/compress.py), in the messages on either path.
    """
    assert route.shard_map is not None
    route.paths.revive()  # a data connection lost since: made again in the background
    layouts = route.layouts
    flats: dict[str, torch.Tensor] = {}  # flat CPU gradients, in their push dtype but for ``direct`` ones
    direct: set[str] = set()  # cast as they are written ahead (into shared memory): no buffer in between
    paths = list(route.paths)  # one view of them for the choice, the writes and the check below
    sparse: dict[str, torch.Tensor] = {}  # compressed: not in ``flats``, sent as the compressor's chunks
    for name, g in grads.items():
        lay = layouts[name]
        if tuple(g.shape) != lay.shape:
            raise ValueError(f"gradient of {name!r}: expected shape {lay.shape}, got {tuple(g.shape)}")
        if compressor is not None and compressor.compresses(name):
            sparse[name] = g
            continue
        dtype = codec.to_torch_dtype(lay.push_dtype)
        g = g.detach()
        shards = owners.get(name, ())  # none for an empty tensor
        if g.dtype != dtype and g.device.type == "cpu" and shards and all(paths[i].writes_ahead for i in shards):
            flats[name] = g.reshape(-1)
            direct.add(name)
        else:
            flats[name] = g.to("cpu", dtype).contiguous().view(-1)
    packed = compressor.encode(sparse) if compressor is not None else Encoded()
    # Same host: every shard's parts into its push segment first, the shards in parallel; the bytes the
    # shards will read are those checked for inf/nan.
    ahead = [i for i, path in enumerate(paths) if path.writes_ahead]
    staged: list[Staged | None] = [None] * route.num_shards
    for i, w in zip(ahead, route.transport.fan_out(lambda i: paths[i].stage(flats), ahead) if ahead else ()):
        staged[i] = w
    if found_inf is None:
        checked = [v for i in ahead for v in paths[i].read_values(staged[i], flats, direct, route)]
        found_inf = not (all(codec.all_finite(f) for n, f in flats.items() if n not in direct)
                         and all(codec.all_finite(v) for v in checked))
    found_inf = found_inf or not packed.finite  # a compressed gradient with an inf/nan was left out
    more = pull_after_fields(pull_after)

    def requests(shard: int) -> tuple[ShardPath, Iterator[bytes]]:
        path = route.paths.ready(shard, route.transport.timeout)  # as the call starts: a retry takes it anew

        def frames(segment: str) -> PushFramer:
            return PushFramer(worker_id=route.worker_id, step=step, base_version=bases[shard], loss_scale=loss_scale,
                              epoch=route.epoch, sync=route.sync_said, found_inf=bool(found_inf), fields=more,
                              shm=segment, packed=packed.of(shard), fence_epoch=route.transport.fence_epochs[shard])

        return path, path.push_messages(frames, staged[shard] if path is paths[shard] else None, flats, direct,
                                        route)

    return send(route, requests, window, then, carry=pull_after is None)


def send(route: Route, requests: Callable[[int], tuple[ShardPath, Iterator[bytes]]], window: int | None,
         then: PullInFlight | None, *, carry: bool = False) -> list[PushResult]:
    """Each shard's Push (``requests(shard)``: the path that made its messages, and them): all at once, or
    ``window`` at a time in ``push_order``; ``then``'s pull of a shard begun as that shard answers, and
    abandoned if any push fails (nothing may write into its destinations once the caller handles the
    failure). ``carry``: a shard on a data connection gets its pull in its push's frame
    (``PullInFlight.carry``), made by the server as the push is taken in: no frame of its own."""
    try:
        return _send(route, requests, window, then, carry)
    except BaseException:
        if then is not None:
            then.abandon()
        raise


def _send(route: Route, requests: Callable[[int], tuple[ShardPath, Iterator[bytes]]], window: int | None,
          then: PullInFlight | None, carry: bool) -> list[PushResult]:
    t = route.transport

    def answered(shard: int, result: PushResult) -> None:
        if then is not None:
            then.begin(shard, result.ready_version, result.pulled)

    def call(shard: int) -> PushResult:
        via, messages = requests(shard)
        return PushResult.from_proto(t.push(shard, messages, via=via))

    def soon(shard: int, done: Callable[[PushResult | None, Exception | None], None]) -> bool:
        """The shard's Push as a frame that waits for nothing, where its path is a data connection: its
        answer (and so the shard's pull, and the window's next push) handled by the connection's thread."""
        if not route.paths.usable(shard):  # its connection is being made: through ``call``, which waits for it
            return False
        via, messages = requests(shard)
        push_soon = getattr(via, "push_soon", None)
        if push_soon is None:  # the path changed in between (a fail-over)
            return False

        def pushed(answer: ps_pb2.PushResponse | None, error: Exception | None) -> None:
            done(PushResult.from_proto(answer) if answer is not None else None, error)

        carried = then.carry(shard, via) if carry and then is not None else None
        if carried is None:
            push_soon(messages, t.timeout, pushed)
            return True
        assert then is not None
        try:
            call = push_soon(messages, t.timeout, pushed, carry=carried)
        except BaseException:
            then.uncarry(shard)  # begun as the push answers, by whichever path makes it
            raise
        then.carried(shard, getattr(via, "conn"), -call)  # noqa: B009 - a ConnPath (push_soon)
        return True

    def one(shard: int) -> PushResult:
        result = call(shard)
        answered(shard, result)
        return result

    framed = any(hasattr(p, "push_soon") for p in route.paths)
    if (window is None or window >= route.num_shards) and not framed:
        return t.each(one)
    order = (list(range(route.num_shards)) if window is None or window >= route.num_shards
             else pushorder.push_order(t.addresses, route.worker_id))
    got = t.in_order(call, order, window=min(window or route.num_shards, route.num_shards), then=answered,
                     soon=soon if framed else None)
    return [got[i] for i in range(route.num_shards)]
