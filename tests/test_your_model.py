"""Models the project did not write: Hugging Face transformers decoder LMs through every axis shardps has.

Families (tiny configs, random weights, nothing downloaded): Llama with a tied head and grouped key/value
heads, Llama untied, Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms: ``replicated_with_grad_allreduce``),
and GPT-2 (tied, ``Conv1D`` layers, no plan). For each family:

- bsp with 2 workers through the servers equals torch's Adam on the union batch in one process;
- ``shardps.Stream`` equals resident training, bit for bit;
- TP 2 with the model's own plan (``tp.split(model, "auto", group)``) equals the dense model: loss and every
  gradient (GPT-2: refused by name, it carries no plan and its ``Conv1D`` is not split);
- ``TPOptimizer`` through the servers equals torch's Adam on the dense model after 3 steps;
- a pipeline of 2 stages (``examples/hf_stages.py``) equals the unsplit model, tie included.

Each prints its largest difference (``-s`` shows them; docs/your-model.md quotes them).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
import transformers  # the dev extra (make venv)
from torch import nn

import shardps
import shardps.tp as tp
from shardps.examples.hf_stages import decoder_stages
from shardps.worker.pipeline.local import LocalPipeline
from tests.helpers import run_workers
from tests.test_tp import _RNG, run_tp

VOCAB, T, BATCH = 61, 8, 4  # 61: the vocabulary splits unevenly over 2 ranks (31 + 30 rows)
ADAM = {"lr": 1e-2, "eps": 1e-3}  # eps 1e-3: see tests/test_tp_servers.py (biases whose gradient is rounding)


def _llama(tie: bool) -> nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=tie, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg)


def _qwen2() -> nn.Module:
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=False, attn_implementation="sdpa")
    return transformers.Qwen2ForCausalLM(cfg)


def _qwen3() -> nn.Module:
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=32, tie_word_embeddings=False,
                                   attn_implementation="sdpa")
    return transformers.Qwen3ForCausalLM(cfg)


def _gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                  attn_implementation="sdpa")
    return transformers.GPT2LMHeadModel(cfg)


FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "llama-tied": lambda: _llama(True), "llama": lambda: _llama(False), "qwen2": _qwen2, "qwen3": _qwen3,
    "gpt2": _gpt2,
}
WITH_PLAN = ["llama-tied", "llama", "qwen2", "qwen3"]


def build(family: str) -> nn.Module:
    with _RNG:
        torch.manual_seed(0)
        return FAMILIES[family]()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(VOCAB, (BATCH, T), generator=g), torch.randint(VOCAB, (BATCH, T), generator=g)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return lm_loss(model(input_ids=x).logits, y)


def _max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> float:
    assert got.keys() == want.keys(), (sorted(set(got) ^ set(want)))[:4]
    worst = 0.0
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{what} {n}: {m}")
        worst = max(worst, float((got[n] - want[n]).abs().max()))
    return worst


def _torch_adam(model: nn.Module, steps: int) -> dict[str, torch.Tensor]:
    opt = torch.optim.Adam(model.parameters(), **ADAM)
    for step in range(steps):
        loss_of(model, *batch(step)).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.cluster
@pytest.mark.parametrize("family", list(FAMILIES))
def test_bsp_with_two_workers_equals_one_process_on_the_union(family, cluster2):
    want = _torch_adam(build(family), 3)

    def worker(k: int) -> dict[str, torch.Tensor]:
        model = build(family)
        with shardps.connect(cluster2.addresses, worker_id=k, num_workers=2) as client:
            opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.Adam(**ADAM), sync="bsp")
            for step in range(3):
                x, y = batch(step)
                half = slice(k * BATCH // 2, (k + 1) * BATCH // 2)
                loss_of(model, x[half], y[half]).backward()
                opt.step()
                opt.zero_grad()
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    for k, got in enumerate(run_workers(worker, 2, 120.0)):
        print(f"{family} bsp x2 worker {k}: max |diff| {_max_diff(got, want, f'worker {k}'):.3g}")


@pytest.mark.cluster
@pytest.mark.parametrize("family", list(FAMILIES))
def test_streamed_equals_resident_bit_for_bit(family, make_cluster):
    def train(stream: shardps.Stream | None) -> dict[str, torch.Tensor]:
        model = build(family)
        with shardps.connect(make_cluster(2).addresses) as client:
            opt = shardps.DistributedOptimizer(model, client, optimizer=shardps.optim.Adam(**ADAM), stream=stream)
            for step in range(3):
                loss_of(model, *batch(step)).backward()
                opt.step()
                opt.zero_grad()
            if opt.stream is not None:
                assert opt.stream.held() == {}
                return opt.stream.weights()
            return {n: p.detach().clone() for n, p in model.named_parameters()}

    resident, streamed = train(None), train(shardps.Stream(16 * 1024))
    assert resident.keys() == streamed.keys()
    for n in resident:
        assert torch.equal(streamed[n], resident[n]), f"{family} {n}: streaming changed the weights"


@pytest.mark.parametrize("family", WITH_PLAN)
def test_tp2_with_the_models_own_plan_equals_the_dense_model(family):
    model = build(family)
    x, y = batch(0)
    dense = copy.deepcopy(model)
    want_loss = loss_of(dense, x, y)
    want_loss.backward()
    want = {n: p.grad for n, p in dense.named_parameters()}

    def rank(k: int, group: tp.TPGroup):
        m = tp.split(copy.deepcopy(model), "auto", group)
        if family == "llama-tied":
            assert m.lm_head.weight is m.model.embed_tokens.weight
        loss = loss_of(m, x, y)
        loss.backward()
        return loss.item(), tp.gather_grads(m, group)

    for k, (loss, grads) in enumerate(run_tp(2, rank, timeout=60)):
        assert loss == pytest.approx(want_loss.item(), rel=1e-5)
        print(f"{family} TP 2 rank {k}: loss {abs(loss - want_loss.item()):.3g}, "
              f"max |grad diff| {_max_diff(grads, want, f'rank {k}'):.3g}")


def test_the_plans_kinds_are_mapped_or_refused_by_name():
    plan = tp.plan_of(build("qwen3"))
    assert plan["model.embed_tokens"] == "vocab" and plan["lm_head"] == "column_gather"
    assert plan["model.layers.*.self_attn.q_norm"] == "partial_grad"
    assert plan["model.layers.*.self_attn.o_proj"] == "row" and plan["model.layers.*.mlp.up_proj"] == "column"
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    for kind in ALL_PARALLEL_STYLES:  # every kind transformers names: mapped, or refused by name
        if kind in tp.TRANSFORMERS_KINDS:
            continue
        model = build("llama")
        model._tp_plan = {"model.layers.*.mlp.up_proj": kind}
        with pytest.raises(ValueError, match=rf"'model.layers.\*.mlp.up_proj': transformers kind '{kind}' has no "
                                             rf"shardps equivalent; supported: "):
            tp.split(model, "auto")
        assert type(model.model.layers[0].mlp.up_proj) is nn.Linear


def test_gpt2_is_refused_by_name_with_the_reason():
    model = build("gpt2")
    with pytest.raises(ValueError, match="GPT2LMHeadModel carries no tensor-parallel plan .* pass one"):
        tp.split(model, "auto")
    with pytest.raises(ValueError, match=r"transformer.h.0.mlp.c_fc is a Conv1D; 'column' splits nn.Linear modules "
                                         r"\(transformers' Conv1D, GPT-2's layer, stores its weight transposed"):
        tp.split(model, {"transformer.h.*.mlp.c_fc": "column", "transformer.h.*.mlp.c_proj": "row"})


def test_grouped_kv_heads_that_do_not_divide_are_refused():
    model = build("llama")  # 4 query heads, 2 key/value heads of 8
    with pytest.raises(ValueError, match=r"k_proj \(2 heads of 8\): 2 attention heads do not split over a TP "
                                         r"group of 4"):
        tp.split(model, "auto", tp.TPGroup(None, 0, 4))
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear


@pytest.mark.cluster
@pytest.mark.parametrize("family", WITH_PLAN)
def test_tp_optimizer_through_the_servers_equals_dense_adam(family, cluster2):
    want = _torch_adam(build(family), 3)
    model = build(family)

    def rank(k: int, group: tp.TPGroup):
        m = tp.split(copy.deepcopy(model), "auto", group)
        with shardps.connect(cluster2.addresses, worker_id=k, num_workers=2) as client:
            opt = tp.TPOptimizer(m, client, group, optimizer=shardps.optim.Adam(**ADAM), sync="bsp")
            for step in range(3):
                loss_of(m, *batch(step)).backward()
                opt.step()
                opt.zero_grad()
        return {n: t for n, t in tp.gather(m, group).items() if n in want}

    for k, got in enumerate(run_tp(2, rank, timeout=90)):
        print(f"{family} TPOptimizer TP 2 rank {k}: max |diff| {_max_diff(got, want, f'rank {k}'):.3g}")


@pytest.mark.parametrize("family, schedule", [(f, "gpipe") for f in FAMILIES] + [("llama-tied", "1f1b")])
def test_a_pipeline_of_two_stages_equals_the_unsplit_model(family, schedule):
    model = build(family)
    x, y = batch(0)
    seq, balance = decoder_stages(model, 2)
    hf_name = {id(p): n for n, p in model.named_parameters()}
    seq_to_hf = {n: hf_name[id(p)] for n, p in seq.named_parameters()}
    pipe = LocalPipeline(seq, balance=balance, chunks=2, schedule=schedule)
    loss = pipe.train_step(x, y, lm_loss)
    dense = loss_of(model, x, y)
    dense.backward()
    assert loss == pytest.approx(dense.item(), rel=1e-5)
    got = {seq_to_hf[n]: g for n, g in pipe.gradients().items()}
    print(f"{family} pipeline 2 stages {schedule}: max |grad diff| "
          f"{_max_diff(got, {n: p.grad for n, p in model.named_parameters()}, 'pipeline'):.3g}")


def test_stages_refuse_a_model_whose_mask_they_cannot_build():
    """Found in review: under eager attention, or with a sliding window, the stages' missing mask gave wrong
    logits without a word."""
    with _RNG:
        eager = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            attn_implementation="eager"))
        mistral = transformers.MistralForCausalLM(transformers.MistralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, attn_implementation="sdpa"))
    with pytest.raises(ValueError, match="uses attn_implementation='eager'; the stages pass no attention mask"):
        decoder_stages(eager, 2)
    with pytest.raises(ValueError, match=r"has a sliding attention window \(4096\)"):
        decoder_stages(mistral, 2)
