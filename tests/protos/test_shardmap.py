import random

import pytest

from shardps.protos.shardmap import TensorInfo, build_shard_map, part_shape


def transformer_like(layers: int = 12, d: int = 768, vocab: int = 50257, ctx: int = 1024) -> list[TensorInfo]:
    t = [TensorInfo("wte", (vocab, d)), TensorInfo("wpe", (ctx, d))]
    for i in range(layers):
        p = f"h.{i}."
        t += [
            TensorInfo(p + "ln_1.weight", (d,)), TensorInfo(p + "ln_1.bias", (d,)),
            TensorInfo(p + "attn.c_attn.weight", (d, 3 * d)), TensorInfo(p + "attn.c_attn.bias", (3 * d,)),
            TensorInfo(p + "attn.c_proj.weight", (d, d)), TensorInfo(p + "attn.c_proj.bias", (d,)),
            TensorInfo(p + "ln_2.weight", (d,)), TensorInfo(p + "ln_2.bias", (d,)),
            TensorInfo(p + "mlp.c_fc.weight", (d, 4 * d)), TensorInfo(p + "mlp.c_fc.bias", (4 * d,)),
            TensorInfo(p + "mlp.c_proj.weight", (4 * d, d)), TensorInfo(p + "mlp.c_proj.bias", (d,)),
        ]
    return t + [TensorInfo("ln_f.weight", (d,)), TensorInfo("ln_f.bias", (d,))]


def test_transformer_on_4_servers_is_balanced_within_10_percent():
    smap = build_shard_map(transformer_like(), 4)
    loads = smap.server_bytes()
    assert sum(loads) == sum(t.nbytes for t in transformer_like())
    assert max(loads) <= 1.10 * (sum(loads) / 4), loads
    assert smap.imbalance() <= 0.10


@pytest.mark.parametrize("servers", [1, 2, 3, 4, 7])
def test_every_tensor_is_covered_exactly_once_in_row_blocks(servers):
    tensors = transformer_like(layers=2, d=64, vocab=1000, ctx=128) + [TensorInfo("odd", (7, 13)), TensorInfo("s", ())]
    smap = build_shard_map(tensors, servers)
    for t in tensors:
        parts = smap.parts_of(t.name)
        assert parts[0].start == 0 and parts[-1].stop == t.numel
        for a, b in zip(parts, parts[1:]):
            assert a.stop == b.start
        for p in parts:
            assert 0 <= p.server < servers
            if len(t.shape) >= 2:  # row blocks
                assert p.start % t.row_numel == 0 and p.stop % t.row_numel == 0
                assert part_shape(t.shape, p.start, p.stop)[1:] == t.shape[1:]


def test_same_inputs_give_the_same_map_in_any_order():
    tensors = transformer_like(layers=3, d=128, vocab=5000, ctx=256)
    a = build_shard_map(tensors, 3)
    shuffled = list(tensors)
    random.Random(1).shuffle(shuffled)
    assert build_shard_map(shuffled, 3).parts == a.parts


def test_unsplittable_tensors_stay_whole_up_to_the_limit():
    t = [TensorInfo("f", (1024, 1024), splittable=False), TensorInfo("big", (4096, 4096), splittable=False)]
    smap = build_shard_map(t, 4, part_bytes=1 << 20, max_whole_bytes=8 << 20)
    assert len(smap.parts_of("f")) == 1 and smap.holders("f") == []
    # Over the limit: one row block per server, block i on server i.
    assert [(p.start, p.stop, p.server) for p in smap.parts_of("big")] == [
        (i * 1024 * 4096, (i + 1) * 1024 * 4096, i) for i in range(4)]
    assert smap.holders("big") == [0, 1, 2, 3]


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="num_servers"):
        build_shard_map([TensorInfo("a", (3,))], 0)
    with pytest.raises(ValueError, match="duplicate tensor names: \\['a'\\]"):
        build_shard_map([TensorInfo("a", (3,)), TensorInfo("a", (4,))], 2)
