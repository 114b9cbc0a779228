"""Matrix factorisation on MovieLens-100K with user and item tables on the servers (docs/sparse.md).

    pip install --no-deps recbole==1.2.1          # the data (make venv does it): recbole/dataset_example/ml-100k/
    python -m shardps.examples.movielens --json   # {"rmse": ..., "reference_rmse": ...}
    shardps demo --example movielens --json       # the same, from the demo command

The ratings (100,000 of 943 users on 1,682 items; GroupLens, University of
Minnesota) are read where the ``recbole`` wheel installed them (found with
``importlib.util.find_spec``, which does not import it) or from ``--data``
(a folder holding ``ml-100k.inter``); they are not shipped with shardps:
the data set's terms do not allow redistributing it. The split is fixed (a
permutation drawn with seed 0, 10 % test). The model: a global mean plus a
user and an item bias plus the dot product of a user and an item vector;
the four tables are ``shardps.nn.Embedding`` modules, stepped on the servers
with SparseAdam, the global mean an ordinary parameter (Adam on the
servers). The reference is the same model in one process with
``nn.Embedding(sparse=True)``, ``torch.optim.SparseAdam`` and
``torch.optim.Adam``, started from the same rows.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import shardps
from shardps.examples.movielens_flags import DEFAULTS as _DEFAULTS
from shardps.nn import Embedding
from shardps.protos.optim import Adam, SparseAdam

SPLIT_SEED = 0
TEST_FRACTION = 0.1


def data_dir(given: str | None) -> Path:
    if given:
        return Path(given)
    spec = importlib.util.find_spec("recbole")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("MovieLens-100K not found: `pip install --no-deps recbole==1.2.1` (its wheel holds "
                                "recbole/dataset_example/ml-100k/), or give --data DIR with ml-100k.inter")
    return Path(spec.origin).parent / "dataset_example" / "ml-100k"


def load(folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, test) as [n, 3] float tensors of (user, item, rating); ids as recbole's tokens (ints)."""
    arr = np.loadtxt(folder / "ml-100k.inter", delimiter="\t", skiprows=1, usecols=(0, 1, 2), dtype=np.float64)
    if arr.shape != (100_000, 3):
        raise ValueError(f"{folder}/ml-100k.inter: expected 100000 ratings, got {arr.shape}")
    perm = np.random.default_rng(SPLIT_SEED).permutation(len(arr))
    t = torch.from_numpy(arr[perm]).float()
    n_test = int(len(t) * TEST_FRACTION)
    return t[n_test:], t[:n_test]


class MF(nn.Module):
    def __init__(self, users: nn.Module, items: nn.Module, user_bias: nn.Module, item_bias: nn.Module,
                 mean: float) -> None:
        super().__init__()
        self.users, self.items, self.user_bias, self.item_bias = users, items, user_bias, item_bias
        self.mean = nn.Parameter(torch.tensor([mean]))

    def forward(self, u: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        dot = (self.users(u) * self.items(i)).sum(-1)
        return self.mean + self.user_bias(u).squeeze(-1) + self.item_bias(i).squeeze(-1) + dot


def rmse(model: nn.Module, test: torch.Tensor) -> float:
    with torch.no_grad():
        pred = model(test[:, 0].long(), test[:, 1].long())
    return float(F.mse_loss(pred, test[:, 2]).sqrt())


def train(model: nn.Module, train_set: torch.Tensor, epochs: int, batch: int, step: Callable[[], None]) -> None:
    for epoch in range(epochs):
        order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(epoch))
        for lo in range(0, len(order), batch):
            b = train_set[order[lo:lo + batch]]
            F.mse_loss(model(b[:, 0].long(), b[:, 1].long()), b[:, 2]).backward()
            step()


DEFAULTS = _DEFAULTS  # run()'s settings, as given here (examples/movielens_flags.py)


def run(data: str | None, *, dim: int, epochs: int, batch: int, lr: float, servers: int) -> dict[str, float | int]:
    """Train the model with its tables on ``servers`` servers (in this process) and the same model in one
    process: their test RMSEs (``rmse``, ``reference_rmse``) and the settings. ``data``: a folder holding
    ml-100k.inter (None: the installed recbole's; FileNotFoundError naming how to install it when there is
    none)."""
    train_set, test = load(data_dir(data))
    mean = float(train_set[:, 2].mean())
    init: dict[str, float | str] = {"kind": "normal", "mean": 0.0, "std": 0.1}
    zeros: dict[str, float | str] = {"kind": "zeros"}
    opt = SparseAdam(lr=lr)
    model = MF(Embedding(None, dim, optimizer=opt, init=init), Embedding(None, dim, optimizer=opt, init=init),
               Embedding(None, 1, optimizer=opt, init=zeros), Embedding(None, 1, optimizer=opt, init=zeros), mean)
    users = torch.unique(torch.cat([train_set[:, 0], test[:, 0]])).long()
    items = torch.unique(torch.cat([train_set[:, 1], test[:, 1]])).long()
    with shardps.LocalCluster(servers) as cluster, shardps.connect(cluster.addresses) as client:
        dopt = shardps.DistributedOptimizer(model, client, optimizer=Adam(lr=lr), sync="bsp")
        start = {n: client.pull_rows(n, users if n.startswith("user") else items)
                 for n in ("users", "items", "user_bias", "item_bias")}

        def step() -> None:
            dopt.step()
            dopt.zero_grad()

        train(model, train_set, epochs, batch, step)
        got = rmse(model, test)

    # The reference: one process, the same rows to start from (tables indexed by id: rows of ids not rated stay
    # as they are).
    n_users, n_items = int(users.max()) + 1, int(items.max()) + 1
    tables = {"users": (n_users, dim, users), "items": (n_items, dim, items),
              "user_bias": (n_users, 1, users), "item_bias": (n_items, 1, items)}
    ref_tables = {}
    for n, (rows, d, ids) in tables.items():
        e = nn.Embedding(rows, d, sparse=True)
        with torch.no_grad():
            e.weight[ids] = start[n]
        ref_tables[n] = e
    ref = MF(ref_tables["users"], ref_tables["items"], ref_tables["user_bias"], ref_tables["item_bias"], mean)
    sparse = torch.optim.SparseAdam([e.weight for e in ref_tables.values()], lr=lr)
    dense = torch.optim.Adam([ref.mean], lr=lr)

    def ref_step() -> None:
        sparse.step()
        dense.step()
        sparse.zero_grad()
        dense.zero_grad()

    train(ref, train_set, epochs, batch, ref_step)
    return {"rmse": got, "reference_rmse": rmse(ref, test), "epochs": epochs, "dim": dim, "batch": batch, "lr": lr,
            "servers": servers, "train": len(train_set), "test": len(test)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", help="a folder holding ml-100k.inter (default: the installed recbole's)")
    for name, default in DEFAULTS.items():
        ap.add_argument(f"--{name}", type=type(default), default=default)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    try:
        out = run(a.data, dim=a.dim, epochs=a.epochs, batch=a.batch, lr=a.lr, servers=a.servers)
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None
    print(json.dumps(out) if a.json else f"test RMSE {out['rmse']:.4f} (one process: {out['reference_rmse']:.4f})")


if __name__ == "__main__":
    main()
