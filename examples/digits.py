"""An MLP on the UCI handwritten digits (8x8 pixels, 10 classes).

The data ships with the package (``data/digits.csv.gz``, CC BY 4.0, see
``data/README.md``). The train/test split is fixed (a permutation drawn with
seed 0, 360 test images); ``--seed`` only changes the model's initial values
and the batch order.
"""

from __future__ import annotations

import gzip
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

import numpy as np
import torch
from torch import nn

from shardps.protos.optim import SPECS, Adafactor, OptimizerSpec, spec_from_name

SPLIT_SEED = 0
NUM_TEST = 360


@dataclass
class Digits:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def load_digits() -> Digits:
    """The fixed split, pixels scaled to [0, 1]."""
    raw = resources.files("shardps.examples").joinpath("data/digits.csv.gz").read_bytes()
    arr = np.loadtxt(gzip.decompress(raw).decode().splitlines(), delimiter=",", dtype=np.float32)
    if arr.shape != (1797, 65):
        raise ValueError(f"digits.csv.gz: expected 1797 rows of 65 columns, got {arr.shape}")
    perm = np.random.default_rng(SPLIT_SEED).permutation(len(arr))
    arr = arr[perm]
    x = torch.from_numpy(arr[:, :64] / 16.0)
    y = torch.from_numpy(arr[:, 64].astype(np.int64))
    return Digits(x[NUM_TEST:], y[NUM_TEST:], x[:NUM_TEST], y[:NUM_TEST])


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((model(x).argmax(dim=1) == y).float().mean())


def batches(n: int, batch_size: int, epoch: int, seed: int) -> list[torch.Tensor]:
    """The global batches of an epoch: the same on every worker."""
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    perm = torch.randperm(n, generator=g)
    return [perm[i : i + batch_size] for i in range(0, n - batch_size + 1, batch_size)]


def train_worker(addresses: list[str] | None, worker_id: int | None, num_workers: int | None, *,
                 sync: str = "bsp", optimizer: str = "adam", lr: float | None = None, epochs: int = 20,
                 batch_size: int = 64, seed: int = 0, progress: bool = False,
                 metrics_port: int | None = None, metrics_host: str | None = None,
                 on_step: Callable[[int, float], None] | None = None, security: Any = None,
                 backups: list[str] | None = None, client: Any = None, wire: str = "fp32",
                 overlap: bool = False, compress: str = "none", compress_warmup: int = 0,
                 push_window: int | None = None) -> dict[str, object]:
    """One worker's training run; returns its summary (steps, last loss, seconds, rollbacks).

    ``addresses``, ``worker_id``, ``num_workers``, ``metrics_port`` and
    ``metrics_host`` left as None come from the ``SHARDPS_*`` environment
    (see ``shardps.connect``); ``metrics_port`` serves the worker's
    Prometheus metrics. ``on_step(step, loss)`` is called after every step
    (the demo's loss curve). When the job rolls back to a checkpoint
    (``shardps.RolledBack``), training goes on from the step it names, on
    the same batches as the first time. ``client``: an already connected
    ``PSClient`` to train with (the caller closes it) instead of connecting.
    ``wire="bf16"``: gradients up and weights down in bf16 (the masters stay
    fp32 on the servers); ``overlap``: ``DistributedOptimizer(overlap=True)``;
    ``push_window``: ``DistributedOptimizer(push_window=...)`` (shards pushed that many at a time);
    ``compress`` (``topk:0.01``, ``powersgd:4``; ``shardps.compress.parse``):
    gradients compressed with error feedback, the first ``compress_warmup``
    pushes dense.
    """
    import shardps

    data = load_digits()
    model = make_model(seed)
    own = client is None
    if client is None:
        client = shardps.connect(addresses, worker_id=worker_id, num_workers=num_workers, security=security,
                                 backups=backups, metrics_port=metrics_port, metrics_host=metrics_host)
    worker_id, num_workers = client.worker_id, client.num_workers
    loss_fn = nn.CrossEntropyLoss()
    plan = [(e, b) for e in range(epochs) for b in batches(len(data.x_train), batch_size, e, seed)]
    bar = None
    t0 = time.perf_counter()
    loss_val = float("nan")
    losses: list[float] = []
    try:
        if wire not in ("fp32", "bf16"):
            raise ValueError(f"wire must be 'fp32' or 'bf16', got {wire!r}")
        half = torch.bfloat16 if wire == "bf16" else None
        spec = shardps.compress.parse(compress, warmup_steps=compress_warmup)
        opt = shardps.DistributedOptimizer(model, client, optimizer=make_spec(optimizer, lr), sync=sync,
                                           grad_dtype=half, pull_dtype=half, overlap=overlap,
                                           push_window=push_window,
                                           compress=None if isinstance(spec, shardps.compress.Dense) else spec)
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(plan), desc=f"worker {worker_id} [{sync}]", unit="step", mininterval=0.5)
        step = first = opt.local_steps  # a worker rejoining a running job goes on from its clock
        if first >= len(plan):
            print(already_complete(worker_id, first, len(plan), epochs, client.stats()), file=sys.stderr, flush=True)
        while step < len(plan):
            epoch, idx = plan[step]
            mine = idx[worker_id::num_workers]
            try:
                loss = loss_fn(model(data.x_train[mine]), data.y_train[mine])
                loss.backward()
                opt.step()
            except shardps.RolledBack as e:  # the model holds the weights of step e.step: redo from there
                opt.zero_grad()
                del losses[max(0, e.step - first):]  # losses[i] is step first + i's
                step = e.step
                if bar is not None:
                    bar.n = step
                    bar.refresh()
                continue
            opt.zero_grad()
            step += 1
            loss_val = loss.item()
            losses.append(round(loss_val, 5))
            opt.record_loss(loss_val)
            if on_step is not None:
                on_step(step, loss_val)
            if bar is not None:
                bar.set_postfix(epoch=epoch + 1, loss=f"{loss_val:.3f}", refresh=False)
                bar.update(1)
        opt.synchronize()
    finally:
        if bar is not None:
            bar.close()
        if own:
            client.close()
    return {"worker_id": worker_id, "steps": opt.local_steps, "pushes": opt.pushes,
            "failovers": client.failovers_total, "rollbacks": opt.rollbacks,
            "final_loss": loss_val if losses else None, "already_complete": first >= len(plan),
            "seconds": time.perf_counter() - t0, "train_accuracy": accuracy(model, data.x_train, data.y_train),
            "losses": losses}


def already_complete(worker_id: int, step: int, steps: int, epochs: int, stats: list[dict[str, Any]]) -> str:
    """The one line a worker says when the job it joins is already past the steps it would train (servers
    restarted on the job's checkpoints): its step, where the checkpoints are, how to start a new job."""
    versions = sorted({int(v) for s in stats for v in s.get("checkpoint_versions", [])})
    where = (f"checkpoints at versions {', '.join(map(str, versions))} in the servers' --checkpoint-dir"
             if versions else "restored by the servers")
    return (f"shardps worker {worker_id}: the job is already complete: it is at step {step}, and this worker "
            f"trains {steps} steps ({epochs} epochs) ({where}); nothing to train. To start a new job, start the "
            f"servers on an empty --checkpoint-dir (compose: `docker-compose down -v` removes the checkpoint "
            f"volume), or train more with a larger --epochs.")


DEFAULT_LR = {"adam": 3e-3, "adamw": 3e-3, "sgd": 0.1, "sm3": 0.1}
OPTIMIZERS = tuple(SPECS)  # every optimizer the servers know


def make_spec(optimizer: str, lr: float | None = None) -> OptimizerSpec:
    """The spec the example trains with: per-optimizer default learning rates.

    Adafactor without ``lr`` uses its relative step size; with ``lr`` it uses
    that fixed step (relative_step and scale_parameter off).
    """
    name = optimizer.lower()
    if name == "adafactor":
        return Adafactor() if lr is None else Adafactor(lr=lr, relative_step=False, scale_parameter=False)
    return spec_from_name(name, lr=lr if lr is not None else DEFAULT_LR.get(name, 1e-3))


def evaluate(addresses: list[str], seed: int = 0) -> float:
    """Test accuracy of the weights the servers hold now."""
    import shardps

    data = load_digits()
    model = make_model(seed)
    with shardps.connect(addresses) as client:
        client.attach()
        client.pull(out=dict(model.named_parameters()))
    return accuracy(model, data.x_test, data.y_test)


def main_worker(args: object, security: object = None) -> int:
    a = args
    res = train_worker(a.addresses, a.worker_id, a.num_workers, sync=a.sync, optimizer=a.optimizer,  # type: ignore[attr-defined]
                       lr=a.lr, epochs=a.epochs, batch_size=a.batch_size, seed=a.seed,  # type: ignore[attr-defined]
                       progress=a.progress, metrics_port=a.metrics_port, metrics_host=a.metrics_host,  # type: ignore[attr-defined]
                       security=security, backups=getattr(a, "backups", None),
                       wire=getattr(a, "wire", "fp32"), overlap=getattr(a, "overlap", False),
                       compress=getattr(a, "compress", "none"), compress_warmup=getattr(a, "compress_warmup", 0),
                       push_window=getattr(a, "push_window", None))
    print(json.dumps(res), flush=True)
    return 0
