"""A parameter server on Ray's object store, written as Ray's documented example does it.

One ``ParameterServer`` actor holds the model and an SGD optimizer;
``DataWorker`` actors get the weights (an object reference), compute the
gradients of their batch and return them as numpy arrays; the server sums
them, steps, and returns the new weights, which the next round hands to the
workers:

    weights = ps.get_weights.remote()
    for step in range(steps):
        grads = [w.compute_gradients.remote(weights) for w in workers]
        weights = ps.apply_gradients.remote(*grads)

Synchronous, like bsp. A step's time is from one round's weights to the
next's (``ray.get`` each round).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import ray
import torch


@ray.remote
class ParameterServer:
    def __init__(self, dims: tuple[int, ...], lr: float, threads: int) -> None:
        from baselines.common import mlp

        torch.set_num_threads(threads)
        self.model = mlp(dims)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)

    def get_weights(self) -> dict[str, np.ndarray]:
        return {k: v.numpy() for k, v in self.model.state_dict().items()}

    def apply_gradients(self, *gradients: list[np.ndarray]) -> dict[str, np.ndarray]:
        summed = [np.stack(g).sum(axis=0) for g in zip(*gradients)]
        self.opt.zero_grad()
        for p, g in zip(self.model.parameters(), summed):
            p.grad = torch.from_numpy(g)
        self.opt.step()
        return self.get_weights()


@ray.remote
class DataWorker:
    def __init__(self, dims: tuple[int, ...], rank: int, batch_size: int, threads: int) -> None:
        from baselines.common import mlp

        torch.set_num_threads(threads)
        self.model, self.dims, self.rank, self.batch_size, self.step = mlp(dims), dims, rank, batch_size, 0

    def compute_gradients(self, weights: dict[str, np.ndarray]) -> list[np.ndarray]:
        from baselines.common import batch, loss_fn

        self.model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
        x, y = batch(self.step, self.rank, self.batch_size, self.dims)
        self.step += 1
        self.model.zero_grad()
        loss_fn(self.model(x), y).backward()
        return [p.grad.numpy() for p in self.model.parameters()]


def run(dims: tuple[int, ...], workers: int, batch_size: int, steps: int, threads: int = 1,
        timeout: float = 300.0, ps_resources: dict[str, float] | None = None,
        worker_resources: list[dict[str, float]] | None = None) -> list[list[float]]:
    """Step times of the driver's loop (one list: the workers move in lockstep). ``ps_resources`` and
    ``worker_resources`` (one each) pin the actors to nodes that offer them (a node per host)."""
    ps = ParameterServer.options(resources=ps_resources or {}).remote(dims, 0.01, threads)
    ws = [DataWorker.options(resources=(worker_resources or [{}] * workers)[r]).remote(dims, r, batch_size, threads)
          for r in range(workers)]
    try:
        weights: Any = ps.get_weights.remote()
        ray.get(weights, timeout=timeout)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            grads = [w.compute_gradients.remote(weights) for w in ws]
            weights = ps.apply_gradients.remote(*grads)
            ray.wait([weights], timeout=timeout, fetch_local=False)
            times.append(time.perf_counter() - t0)
        return [times]
    finally:
        for a in [ps, *ws]:
            ray.kill(a)
