"""The worker's compressor alone (no servers): error feedback's sum, the parts, the chunks, warm-up, the rules."""

from __future__ import annotations

import pytest
import torch

from shardps.compress import DENSE_BELOW, Compressor, Dense, PowerSGD, Rules, TopK, parse
from shardps.optim import SGD
from shardps.protos import codec, compressed
from shardps.worker import layout

SHAPES = {"a.weight": (64, 48), "b.weight": (40, 30, 2), "c.weight": (256, 16), "a.bias": (64,), "small": (8, 8)}


def setup(spec, shards=2, part_bytes=2048, grad_dtype=None, chunk_bytes=codec.DEFAULT_CHUNK_BYTES):
    tensors = {n: torch.zeros(s) for n, s in SHAPES.items()}
    layouts, smap = layout.plan(tensors, SGD(), shards, grad_dtype=grad_dtype, part_bytes=part_bytes)
    return Compressor(spec, tensors, layouts, smap, chunk_bytes), smap


def grads(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {n: torch.randn(s, generator=g) * (1 + step) for n, s in SHAPES.items()}


def expand(enc, name: str, numel: int, shape) -> torch.Tensor:
    """What the shards make of one tensor's chunks: checked and expanded as ChunkAssembler does."""
    out = torch.full((numel,), float("nan"))
    for chunks in enc.chunks.values():
        for c in chunks:
            if c.fields["name"] != name:
                continue
            proto = c.proto()
            compressed.check(proto, shape)
            a = proto.offset
            compressed.expand(proto, shape, out[a : a + compressed.span(proto)])
    return out


@pytest.mark.parametrize("spec", [TopK(0.05), TopK(0.3), PowerSGD(1), PowerSGD(2)], ids=str)
@pytest.mark.parametrize("wire", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_error_feedback_sent_plus_residual_is_the_sum_of_the_gradients(spec, wire):
    comp, _ = setup(spec, grad_dtype=wire, part_bytes=8192, chunk_bytes=1024)  # several parts and chunks
    names = [n for n in SHAPES if comp.compresses(n)]
    assert names == ["a.weight", "b.weight", "c.weight"]
    total_g = {n: torch.zeros(SHAPES[n]).reshape(-1, ).double() for n in names}
    total_sent = {n: torch.zeros_like(total_g[n]) for n in names}
    for step in range(12):
        g = grads(step)
        enc = comp.encode({n: g[n] for n in names})
        assert enc.finite
        for n in names:
            numel = g[n].numel()
            sent = expand(enc, n, numel, SHAPES[n])
            assert not sent.isnan().any()  # every element covered
            total_g[n] += g[n].reshape(-1).double()
            total_sent[n] += sent.double()
    for n in names:
        scale = total_g[n].abs().max().item()
        err = (total_sent[n] + comp.residuals[n].double() - total_g[n]).abs().max().item()
        assert err <= 1e-5 * scale, (n, err, scale)  # fp32 rounding of 12 sums


def test_topk_sends_each_shard_its_parts_values_only_and_the_largest():
    comp, smap = setup(TopK(0.1), chunk_bytes=1024)
    g = grads(0)
    enc = comp.encode({"a.weight": g["a.weight"]})
    flat = g["a.weight"].reshape(-1)
    for p in smap.parts_of("a.weight"):
        mine = [c.proto() for c in enc.of(p.server) if p.start <= c.fields["offset"] < p.stop]
        # the part's chunks tile it, and carry exactly its largest 10 %
        assert mine[0].offset == p.start and tuple(mine[0].shape) == (64, 48)
        assert sum(compressed.span(c) for c in mine) == p.numel
        got = torch.cat([c.offset + torch.frombuffer(c.indices, dtype=torch.int32).long() for c in mine])
        k = -(-p.numel // 10)
        want = torch.topk(flat[p.start : p.stop].abs(), k).indices + p.start
        assert sorted(got.tolist()) == sorted(want.tolist()) and len(got) == k
        assert all(len(c.data) + len(c.indices) <= 1024 + 8 for c in mine)
    assert set(enc.chunks) == {p.server for p in smap.parts_of("a.weight")}


def test_lowrank_chunks_split_a_parts_rows_each_with_q():
    comp, smap = setup(PowerSGD(2), part_bytes=8192, chunk_bytes=1024)
    g = grads(5)["c.weight"]
    enc = comp.encode({"c.weight": g})
    part = smap.parts_of("c.weight")[0]  # 128 rows of 16: P 1 KiB, Q 128 bytes
    mine = [c.proto() for c in enc.of(part.server) if part.start <= c.fields["offset"] < part.stop]
    assert [(c.offset, c.numel) for c in mine] == [(0, 112 * 16), (112 * 16, 16 * 16)]
    assert mine[0].factor == mine[1].factor and len(mine[0].factor) == 16 * 2 * 4
    p = torch.cat([torch.frombuffer(bytearray(c.data), dtype=torch.float32).view(-1, 2) for c in mine])
    torch.testing.assert_close(p.T @ p, torch.eye(2))  # P orthonormal
    torch.testing.assert_close(expand(enc, "c.weight", 4096, (256, 16))[:2048],
                               (p @ torch.frombuffer(bytearray(mine[0].factor), dtype=torch.float32).view(16, 2).T)
                               .reshape(-1))


def test_topk_at_ratio_one_sends_every_value_and_keeps_no_residual():
    comp, _ = setup(TopK(1.0))
    g = grads(3)
    enc = comp.encode({"a.weight": g["a.weight"]})
    assert torch.equal(expand(enc, "a.weight", 64 * 48, (64, 48)), g["a.weight"].reshape(-1))
    assert not comp.residuals["a.weight"].any()


def test_warmup_pushes_go_dense_then_compressed():
    comp, _ = setup(TopK(0.01, warmup_steps=2))
    seen = []
    for _ in range(4):
        seen.append(comp.compresses("a.weight"))
        comp.encode({})
    assert seen == [False, False, True, True]


def test_a_gradient_with_an_inf_is_not_sent_and_leaves_the_residual():
    comp, _ = setup(TopK(0.1))
    comp.encode({"a.weight": grads(0)["a.weight"]})
    before = comp.residuals["a.weight"].clone()
    bad = grads(1)["a.weight"]
    bad[3, 3] = float("inf")
    enc = comp.encode({"a.weight": bad})
    assert not enc.finite and not enc.chunks and torch.equal(comp.residuals["a.weight"], before)


def test_rules_and_defaults_choose_per_tensor():
    comp, _ = setup(TopK(0.01))  # biases and tensors under DENSE_BELOW elements stay dense
    assert set(comp.specs) == {"a.weight", "b.weight", "c.weight"} and 8 * 8 < DENSE_BELOW
    comp, _ = setup(Rules([("a.weight", Dense()), ("c.*", PowerSGD(2))], default=TopK(0.5)))
    assert {n: s.name for n, s in comp.specs.items()} == {"small": "topk", "b.weight": "topk", "a.bias": "topk",
                                                          "c.weight": "powersgd"}
    with pytest.raises(ValueError, match=r"PowerSGD for 'a.bias' of shape \[64\]: it needs a matrix view"):
        setup(Rules([], default=PowerSGD(2)))
    # A part whose factors would not be smaller than its values leaves the tensor dense (8 x 8 at rank 4).
    comp, _ = setup(Rules([("small", PowerSGD(4)), ("a.weight", PowerSGD(4))], default=Dense()))
    assert set(comp.specs) == {"a.weight"}
    with pytest.raises(TypeError, match="rule 0: expected a compression spec"):
        Rules([("*", SGD())], default=TopK(0.1))


def test_specs_are_checked_and_parsed():
    with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\]"):
        TopK(0.0)
    with pytest.raises(ValueError, match=r"rank must be in \[1, 1024\]"):
        PowerSGD(0)
    assert parse("topk:0.01", warmup_steps=5) == TopK(0.01, warmup_steps=5)
    assert parse("powersgd:2") == PowerSGD(2) and parse("none") == Dense()
    with pytest.raises(ValueError, match="expected none, topk:RATIO or powersgd:RANK"):
        parse("randk:3")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", [TopK(0.05), PowerSGD(2)], ids=str)
def test_gradients_on_cuda_are_compressed_there_and_sent_from_the_cpu(spec):
    comp, _ = setup(spec, part_bytes=8192, chunk_bytes=1024)
    total, sent = torch.zeros(64 * 48, dtype=torch.float64), torch.zeros(64 * 48, dtype=torch.float64)
    for step in range(4):
        g = grads(step)["a.weight"]
        enc = comp.encode({"a.weight": g.cuda()})
        assert all(c.values.device.type == "cpu" for cs in enc.chunks.values() for c in cs)
        total += g.reshape(-1).double()
        sent += expand(enc, "a.weight", 64 * 48, (64, 48)).double()
    residual = comp.residuals["a.weight"]
    assert residual.device.type == "cuda"
    assert (sent + residual.cpu().double() - total).abs().max().item() <= 1e-5 * total.abs().max().item()
