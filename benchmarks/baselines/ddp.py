"""PyTorch DistributedDataParallel over gloo (NCCL with ``device="cuda"``): the all-reduce baseline.

``run(dims, workers, batch, steps, threads, timeout)`` starts ``workers``
processes (spawn), each a rank of a gloo group on a free loopback port,
wraps the MLP in DDP (25 MB buckets, all-reduce overlapped with backward,
as DDP does by default) and trains with SGD; returns each rank's step times
(forward + backward + all-reduce + optimizer step).
"""

from __future__ import annotations

import datetime
import multiprocessing
import socket
import time
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(args: tuple[int, int, int, tuple[int, ...], int, int, int, float, str]) -> list[float]:
    rank, world, port, dims, batch_size, steps, threads, timeout, device = args
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from baselines.common import batch, loss_fn, mlp

    torch.set_num_threads(threads)
    cuda = device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout))
    try:
        dev = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
        model = DistributedDataParallel(mlp(dims).to(dev), device_ids=[dev.index] if cuda else None)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        times = []
        for step in range(steps):
            x, y = batch(step, rank, batch_size, dims)
            x, y = x.to(dev), y.to(dev)
            t0 = time.perf_counter()
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if cuda:
                torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t0)
        return times
    finally:
        dist.destroy_process_group()


def run(dims: tuple[int, ...], workers: int, batch_size: int, steps: int, threads: int = 1,
        timeout: float = 300.0, device: str = "cpu") -> list[list[float]]:
    port = _free_port()
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers) as pool:
        res: Any = pool.map_async(_rank, [(r, workers, port, dims, batch_size, steps, threads, timeout, device)
                                          for r in range(workers)])
        return list(res.get(timeout))
