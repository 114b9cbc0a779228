"""A wait that runs out tells the caller what it waited for, whichever deadline is shorter."""

from __future__ import annotations

import grpc
import pytest
import torch

import shardps


@pytest.mark.cluster
@pytest.mark.parametrize("client_timeout, max_wait", [(8.0, 300.0), (30.0, 2.0)])  # a margin of 0.8 s
def test_the_servers_account_of_a_barrier_wait_reaches_the_worker(make_cluster, client_timeout, max_wait):
    """The client's deadline (120 s by default) used to fire before the server's max wait (300 s):
    the user read a bare DEADLINE_EXCEEDED. Now the server gives up a little before the caller's
    deadline and says whom it waited for; with a shorter max wait, that one speaks first."""
    cluster = make_cluster(2, lease_s=60.0, max_wait_s=max_wait)
    with shardps.connect(cluster.addresses, worker_id=0, num_workers=2, timeout=client_timeout) as client:
        client.register({"w": torch.zeros(8)}, shardps.optim.SGD(lr=0.1), sync="bsp")
        pushed = client.push({"w": torch.ones(8)}, step=0)  # worker 1 never comes
        with pytest.raises(shardps.ShardError) as err:
            client.pull(min_versions=[r.ready_version for r in pushed])
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "has gradients from workers [0], missing [1]" in err.value.details, err.value.details
