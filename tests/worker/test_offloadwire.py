"""worker/pipeline/offloadwire.py: a real ``ByteStore`` on loopback and ``SocketSink``s over TCP and Unix
connections: bundles come back bit for bit, a pipeline's gradients with offload through it equal one
process's, and what goes wrong (a wrong token, a bundle not there, a frame that breaks the protocol, a
store gone) is an ``OffloadError`` naming the store and the bundle, the store serving everyone else."""

from __future__ import annotations

import socket
import time

import pytest
import torch
from torch import nn

from shardps.worker.pipeline.linkconnect import connect
from shardps.worker.pipeline.local import LocalPipeline
from shardps.worker.pipeline.offload import Offloader
from shardps.worker.pipeline.offloadwire import (
    HELLO,
    HELLO_MAGIC,
    PART,
    PUT,
    REQUEST,
    REQUEST_MAGIC,
    ByteStore,
    OffloadError,
    SocketSink,
)

HOST = "127.0.0.1"
# the client's own address: equal to the store's, it takes the Unix socket; another, TCP
VIAS = {"unix": HOST, "tcp": "tcp-only"}


@pytest.fixture
def store():
    s = ByteStore(HOST, timeout=10)
    yield s
    s.close()


def sink_for(store: ByteStore, via: str = "unix", token: bytes | None = None, timeout: float = 10) -> SocketSink:
    return SocketSink(lambda: (store.address, token or store.token), VIAS[via], timeout=timeout)


def bundle() -> dict[str, tuple[torch.Tensor, torch.dtype, torch.device]]:
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(64, 48, generator=g)
    return {"0": (torch.randn(300, 7, generator=g), torch.float32, torch.device("cpu")),
            "1": (torch.randn(40, 40, generator=g).to(torch.bfloat16), torch.float32, torch.device("cpu")),
            "2": (torch.randint(0, 255, (1000,), generator=g, dtype=torch.uint8), torch.uint8, torch.device("cpu")),
            "3": (wide.t(), torch.float32, torch.device("cpu"))}  # not contiguous: sent as its values


@pytest.mark.parametrize("via", sorted(VIAS))
def test_a_bundle_comes_back_bit_for_bit_and_the_store_counts_it(store, via):
    sink = sink_for(store, via)
    try:
        put = bundle()
        sink.put("s0/0/0", put)
        sink.prefetch("s0/0/0")
        got = sink.get("s0/0/0")
        assert sorted(got) == sorted(put)
        for key, (t, dtype, device) in put.items():
            back, back_dtype, back_device = got[key]
            assert (back_dtype, back_device, back.dtype, back.shape) == (dtype, device, t.dtype, t.shape)
            assert torch.equal(back, t)
        nbytes = sum(t.numel() * t.element_size() for t, _, _ in put.values())
        assert store.info() == {"bytes": nbytes, "peak_bytes": nbytes, "bundles": 1}
        sink.drop("s0/0/0")
        sink.put("s0/1/1", {"0": put["0"]})  # after the drop, in order: the store holds only this one
        assert torch.equal(sink.get("s0/1/1")["0"][0], put["0"][0])
        assert store.info() == {"bytes": 300 * 7 * 4, "peak_bytes": nbytes, "bundles": 1}
        sink.drop("s0/1/1")
        sink.flush()  # what a stage does at the end of its step
        assert store.info() == {"bytes": 0, "peak_bytes": nbytes, "bundles": 0}
    finally:
        sink.close()


def test_a_bundle_larger_than_the_sockets_buffers_both_ways(store):
    sink = sink_for(store, "tcp")
    try:
        big = torch.randn(24 << 18)  # 24 MiB
        sink.put("big", {"0": (big, big.dtype, big.device)})
        assert torch.equal(sink.get("big")["0"][0], big)
    finally:
        sink.close()


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256),
                         nn.ReLU(), nn.Linear(256, 4))


@pytest.mark.parametrize("compress", [None, ("bf16", "relu-mask")])
def test_a_pipeline_offloading_through_the_store_has_the_gradients_of_one_that_keeps_them(store, compress):
    x, y = torch.randn(24, 16, generator=torch.Generator().manual_seed(1)), torch.arange(24) % 4
    ref = LocalPipeline(mlp(), balance=[3, 4], chunks=3, checkpoint="never", offload="activations",
                        compress=compress)
    ref.train_step(x, y, nn.CrossEntropyLoss())
    pipe = LocalPipeline(mlp(), balance=[3, 4], chunks=3, checkpoint="never", offload="activations",
                         compress=compress)
    sinks = [sink_for(store, via) for via in ("unix", "tcp")]
    try:
        for stage, sink in zip(pipe.stages, sinks, strict=True):
            assert isinstance(stage.offloader, Offloader)
            stage.offloader.sink = sink
            stage.offloader.prefix = f"s{stage.index}/"
        pipe.train_step(x, y, nn.CrossEntropyLoss())
        for sink in sinks:
            sink.flush()  # as a stage's step ends (deploy/ray/stage_actor.py): its drops are done
    finally:
        for sink in sinks:
            sink.close()
    got, want = pipe.gradients(), ref.gradients()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    info = store.info()
    assert info["peak_bytes"] > 0 and info["bundles"] == 0 and info["bytes"] == 0, info


def test_a_wrong_token_is_refused_and_the_store_serves_the_next(store):
    bad = sink_for(store, "tcp", token=b"x" * 16)
    with pytest.raises(OffloadError, match=r"the offload store at 127\.0\.0\.1:\d+ refused this stage's greeting"):
        bad.put("g", bundle())
        bad.get("g")
    bad.close()
    good = sink_for(store, "tcp")
    good.put("g", bundle())
    assert torch.equal(good.get("g")["0"][0], bundle()["0"][0])
    good.close()


def test_a_bundle_the_store_does_not_hold_is_an_error_naming_it(store):
    sink = sink_for(store)
    try:
        sink.put("s1/2/5", bundle())
        sink.get("s1/2/5")  # the put is done
        store.close()  # forgets every bundle and ends the connections
        with pytest.raises(OffloadError, match=r"get of s1/2/5 failed \(the offload store at 127\.0\.0\.1:\d+\)"):
            sink.get("s1/2/5")
    finally:
        sink.close()


def test_a_group_never_put_is_named(store):
    sink = sink_for(store)
    with pytest.raises(OffloadError, match=r"offload: s0/9/9 was never put \(or was dropped\)"):
        sink.get("s0/9/9")
    sink.close()


def test_a_frame_that_breaks_the_protocol_ends_its_connection_only(store):
    raw = connect(store.address, "tcp-only", time.monotonic() + 10)
    raw.settimeout(10)
    raw.sendall(HELLO.pack(HELLO_MAGIC, store.token))
    assert raw.recv(64)  # greeted
    raw.sendall(b"\xff" * 40)  # not a request
    assert raw.recv(64) == b""  # the store ended this connection
    raw.close()
    raw2 = connect(store.address, "tcp-only", time.monotonic() + 10)
    raw2.settimeout(10)
    raw2.sendall(HELLO.pack(HELLO_MAGIC, store.token))
    raw2.recv(64)
    # a put whose parts add up to more than its frame says
    raw2.sendall(REQUEST.pack(REQUEST_MAGIC, PUT, 1, 2, 8) + b"g" + PART.pack(8) + PART.pack(8))
    assert raw2.recv(64) == b""
    raw2.close()
    sink = sink_for(store, "tcp")
    sink.put("g", bundle())
    assert torch.equal(sink.get("g")["2"][0], bundle()["2"][0])
    sink.close()
    assert store.info()["bundles"] == 1  # nothing of the broken frames was kept


def test_a_store_that_is_not_there_is_named_within_the_deadline():
    s = socket.create_server((HOST, 0))
    port = s.getsockname()[1]
    s.close()
    sink = SocketSink(lambda: (f"{HOST}|{port}|", b"0" * 16), "tcp-only", timeout=5)
    t0 = time.monotonic()
    with pytest.raises(OffloadError, match=rf"cannot reach the offload store at 127\.0\.0\.1:{port}"):
        sink.put("g", bundle())
        sink.get("g")
    assert time.monotonic() - t0 < 5
    sink.close()
