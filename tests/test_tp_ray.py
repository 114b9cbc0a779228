"""DP x PP x TP on a real Ray cluster: 2 pipeline replicas x 2 stages x TP 2 (8 stage actors, each stage's
two TP ranks kept on one node), Adam on the servers; each step's loss and the weights after equal one
process training the unsplit model with torch's Adam on the whole batch. The servers are in this process
(LocalCluster), as in tests/test_pipeline_ray.py."""

from __future__ import annotations

import copy

import pytest
import torch

import shardps
import shardps.ray as sray
from shardps.examples import shakespeare as gpt

pytestmark = pytest.mark.cluster

VOCAB, LAYERS, CONTEXT = 13, 2, 8  # 13 does not divide by 2: the last rank's vocabulary slice is shorter


def test_two_replicas_of_two_stages_of_tp2_equal_one_process(ray_cluster):
    model = gpt.make_model(VOCAB, dim=16, heads=4, layers=LAYERS, context=CONTEXT, seed=2)
    ref = copy.deepcopy(model)
    # eps 1e-3: see tests/test_tp_servers.py (a gradient of zero but for rounding, the key bias's)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2, eps=1e-3)
    with shardps.LocalCluster(2) as servers, \
            sray.Pipeline(model, balance=[2, 2], chunks=2, servers=servers, replicas=2, num_cpus=0.5,
                          optimizer=shardps.optim.Adam(lr=1e-2, eps=1e-3), tensor_parallel=2,
                          tp_plan=gpt.tp_plan(LAYERS)) as pipe:
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randint(VOCAB, (8, CONTEXT), generator=g), torch.randint(VOCAB, (8, CONTEXT), generator=g)
            loss = pipe.train_step(x, y, gpt.TPCharLoss(VOCAB))
            opt.zero_grad()
            ref_loss = gpt.CharLoss()(ref(x), y)
            ref_loss.backward()
            opt.step()
            assert loss == pytest.approx(float(ref_loss.detach()), rel=1e-5)
        got = pipe.state_dict()
        logits = pipe.eval(x[:2])
        nodes = pipe.node_ids
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.detach(), rtol=1e-5, atol=1e-6, msg=n)
    with torch.no_grad():
        torch.testing.assert_close(logits, ref(x[:2]), rtol=1e-5, atol=1e-5)  # the vocabulary slices joined
    for rep in range(2):  # rows replica * 2 + rank: a stage's two TP ranks on one node (STRICT_PACK)
        assert [nodes[rep * 2][s] for s in range(2)] == [nodes[rep * 2 + 1][s] for s in range(2)]
