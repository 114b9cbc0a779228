"""Embedding tables on the servers as ordinary modules: ``shardps.nn.Embedding`` and ``EmbeddingBag``.

A row module holds no weights. Its forward pulls the rows of the batch's
distinct ids from the servers (worker/rows/client.py) into a leaf tensor that
records its gradient; ``DistributedOptimizer.step()`` pushes those
gradients (``RowModules.step``), and the servers' sparse optimizer updates
only those rows. ``RowModules.attach`` finds the row modules of a model,
names their tables after their module path (unless named) and registers
them; the dense part of the model is untouched and syncs as before.

Sync: a table follows the job's mode, as the dense part does (bsp,
every:X, asp, ssp:S, and a live switch: each push names the mode the
optimizer is in; docs/sync.md), unless its module names one of its own
(``sync="bsp"`` or ``"asp"``: PERSIA's hybrid, a bsp dense part with asp
embeddings).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from shardps.protos.optim import SGD, OptimizerSpec
from shardps.worker.errors import ShardError
from shardps.worker.rows.client import RowClient

ROW_SYNCS = ("bsp", "asp")


class _Rows(nn.Module):
    """What Embedding and EmbeddingBag share: the table, the client, the rows pulled this step."""

    write_from_every_worker = False  # the first values (``pretrained``) written by every worker, not only one

    def __init__(self, num_embeddings: int | None, embedding_dim: int, *, name: str | None,
                 optimizer: OptimizerSpec | None, sync: str | None, init: dict[str, float | str] | None) -> None:
        super().__init__()
        if sync is not None and sync not in ROW_SYNCS:
            raise ValueError(f"a row table's sync is one of {ROW_SYNCS}, got {sync!r}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.table, self.optimizer, self.sync, self.init = name, optimizer or SGD(lr=0.01), sync, init
        self.pretrained: torch.Tensor | None = None  # from_pretrained: the rows' first values
        self.rows: RowClient | None = None
        self.num_workers = 1  # the workers that push the table (the job's, or a pipeline stage's replicas)
        self.job_sync = ""  # the job's mode as the optimizer last said (attach, then each step)
        self.worker: int | None = None  # the worker id its pushes carry (None: the client's)
        self.clock: Callable[[], int] | None = None  # the step the optimizer's next step() pushes
        self.pull_failed: Callable[[ShardError], None] | None = None  # the optimizer's (a rollback: RolledBack)
        self._pulled: list[tuple[torch.Tensor, torch.Tensor]] = []  # (distinct ids, their rows: a leaf)
        # every:X: the (ids, gradient rows) of the local steps before the one that pushes, and how many steps
        self._held: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._held_steps = 0

    def _lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the batch's ids as indices into their distinct rows, those rows as a leaf with a gradient)."""
        if self.rows is None or self.table is None:
            raise RuntimeError(f"{type(self).__name__} {self.table or ''}: its table lives on the servers; give the "
                               f"model to shardps.DistributedOptimizer before the first forward")
        if ids.dtype not in (torch.int64, torch.int32, torch.uint64):
            raise TypeError(f"row table {self.table!r}: ids must be int64, int32 or uint64, got {ids.dtype}")
        if self.num_embeddings is not None and ids.numel() and (int(ids.min()) < 0 or
                                                                 int(ids.max()) >= self.num_embeddings):
            raise IndexError(f"row table {self.table!r}: ids out of range [0, {self.num_embeddings})")
        uniq, inverse = torch.unique(ids.to(torch.int64).cpu(), return_inverse=True)
        try:
            rows = self.rows.pull(self.table, uniq, track=torch.is_grad_enabled()).to(ids.device)
        except ShardError as e:
            if self.pull_failed is not None:  # the optimizer's: a rollback met here raises RolledBack
                self.pull_failed(e)
            raise
        if torch.is_grad_enabled():
            rows.requires_grad_()
            self._pulled.append((uniq, rows))
        return inverse.to(ids.device), rows

    def push(self, step: int, now: bool = True, sync: str = "") -> None:
        """Push the gradients of the rows pulled since the last push (an empty push when none: every
        worker pushes at every step that pushes, so bsp steps and the optimizer's step count stay together).
        ``now`` False (every:X, a local step before the one that pushes): hold them instead; the push then
        carries the mean over the steps held, as the dense gradients' (repeated ids' rows are summed). ``sync``:
        the job's mode now (the module's own ``sync`` wins)."""
        assert self.rows is not None and self.table is not None
        got = [(k, r.grad.detach()) for k, r in self._pulled if r.grad is not None]  # on their device until sent
        self._pulled.clear()
        if not now:
            self._held += got
            self._held_steps += 1
            return
        got, steps = self._held + got, self._held_steps + 1
        self.reset()
        dim = self.embedding_dim
        grads = torch.cat([g for _, g in got]).cpu() if got else torch.zeros(0, dim)
        if steps > 1:
            grads = grads / steps
        self.rows.push(self.table, torch.cat([k for k, _ in got]) if got else torch.zeros(0, dtype=torch.int64),
                       grads, step, num_workers=self.num_workers, sync=self.sync or sync, worker=self.worker)

    def reset(self) -> None:
        """Forget the gradients held (pushed, or a rollback or rejoin made them stale)."""
        self._held, self._held_steps = [], 0

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, table={self.table!r}, optimizer={self.optimizer}"


class Embedding(_Rows):
    """``torch.nn.Embedding`` whose table lives on the servers (docs/sparse.md); ``num_embeddings`` None:
    any 64-bit id. ``init``: a new row's distribution (default normal(0, 1), as torch's)."""

    def __init__(self, num_embeddings: int | None, embedding_dim: int, *, name: str | None = None,
                 optimizer: OptimizerSpec | None = None, sync: str | None = None,
                 init: dict[str, float | str] | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, name=name, optimizer=optimizer, sync=sync, init=init)

    @classmethod
    def from_pretrained(cls, embeddings: torch.Tensor, *, name: str | None = None,
                        optimizer: OptimizerSpec | None = None, sync: str | None = None) -> Embedding:
        """Rows 0..n-1 start as ``embeddings`` ([n, dim]); written by the worker that provides values."""
        if embeddings.dim() != 2:
            raise ValueError(f"embeddings must be [num_embeddings, dim], got {list(embeddings.shape)}")
        m = cls(embeddings.shape[0], embeddings.shape[1], name=name, optimizer=optimizer, sync=sync)
        m.pretrained = embeddings.detach().to(torch.float32).cpu().clone()
        return m

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        inverse, rows = self._lookup(ids)
        return F.embedding(inverse, rows)


class EmbeddingBag(_Rows):
    """``torch.nn.EmbeddingBag`` (``mode`` "sum" or "mean") whose table lives on the servers."""

    def __init__(self, num_embeddings: int | None, embedding_dim: int, mode: str = "mean", *,
                 name: str | None = None, optimizer: OptimizerSpec | None = None, sync: str | None = None,
                 init: dict[str, float | str] | None = None) -> None:
        if mode not in ("sum", "mean"):
            raise ValueError(f"EmbeddingBag on the servers pools with 'sum' or 'mean', got {mode!r}")
        super().__init__(num_embeddings, embedding_dim, name=name, optimizer=optimizer, sync=sync, init=init)
        self.mode = mode

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        inverse, rows = self._lookup(ids)
        return F.embedding_bag(inverse.view(ids.shape), rows, offsets, mode=self.mode)


class RowModules:
    """The row modules of a model, attached to a client: what ``DistributedOptimizer`` holds of them."""

    def __init__(self, modules: dict[str, _Rows]) -> None:
        self.modules = modules

    def __bool__(self) -> bool:
        return bool(self.modules)

    @classmethod
    def attach(cls, model: nn.Module | Iterable[object], rows: RowClient, *, num_workers: int,
               provides_values: bool, sync: str, clock: Callable[[], int] | None = None,
               worker: int | None = None,
               pull_failed: Callable[[ShardError], None] | None = None) -> RowModules:
        """Find ``model``'s row modules, register their tables (named after their module path unless named)
        and write the rows of ``from_pretrained`` ones (``provides_values``). ``clock``: the step the next
        ``step()`` pushes (the optimizer's; for pushes made before it, as MoE's "send" backward).
        ``worker``: the worker id of their pushes, one of ``num_workers`` (default the client's: a pipeline
        stage is one of the workers that hold its tables, its replica). ``pull_failed``: what a pull in a forward
        that failed calls first (the optimizer's: a rollback raises RolledBack out of the forward)."""
        if not isinstance(model, nn.Module):
            return cls({})
        found = {path or "rows": m for path, m in model.named_modules() if isinstance(m, _Rows)}
        for path, m in found.items():
            m.table = m.table or path
            m.rows = rows
            m.clock = clock
            m.pull_failed = pull_failed
            m.worker = worker
            m.num_workers = num_workers
            m.job_sync = sync
            rows.register(m.table, m.embedding_dim, optimizer=m.optimizer,
                          init={"kind": "zeros"} if m.pretrained is not None else m.init)
            if m.pretrained is not None and (provides_values or m.write_from_every_worker):
                ids = torch.arange(m.pretrained.shape[0])
                rows.push(m.table, ids, m.pretrained, 0, assign=True)
        return cls(found)

    def step(self, step: int, push: bool = True, sync: str = "") -> None:
        """Push every row module's gradients of this step under the job's mode ``sync`` (``push`` False: every:X,
        a local step before the one that pushes; hold them)."""
        for m in self.modules.values():
            m.push(step, push, sync)

    def reset(self) -> None:
        """Forget the gradients held for every:X (a rollback or a rejoin)."""
        for m in self.modules.values():
            m.reset()
