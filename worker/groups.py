"""torch.distributed process groups, each under a name of its own, outside the default world.

A tensor-parallel group inside a stage is one (named ``tp/...``); on GPUs a
pipeline's stages form another beside it (``pp/...``, ``worker/pipeline/link.py``
speaks over it; on CPU their own connections, ``worker/pipeline/linkconnect.py``,
meet under that name in the same store). Each group is built from its own
prefix of one rendezvous store, with its own ranks, backend and deadline.
``torch.distributed.init_process_group`` is never called: there is no default
group for one concept to take from the other. A group is closed by dropping
every reference to it, which closes its connections at once: its peers' waits
fail then, rather than at their deadline.

The rendezvous is a ``TCPStore`` hosted by whoever builds the groups
(``RendezvousServer``: the pipeline's driver); members connect to its
``Rendezvous`` address. gloo on CPU; nccl where the group's tensors live on
CUDA (a CUDA build of torch). Every blocking call has a deadline: the store's
connect, the group's set-up and each operation (``timeout``).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

import torch.distributed

BACKENDS = ("gloo", "nccl")
dist: Any = torch.distributed  # its stores and groups are not in its typed exports


@dataclass(frozen=True)
class Rendezvous:
    """Where the members of a group meet: a ``TCPStore``'s address."""

    host: str
    port: int


class RendezvousServer:
    """Hosts the store that groups meet at (in the process that builds them: the pipeline's driver).
    ``address`` is what members connect to; ``close()`` stops it. Listens on every interface; ``host`` is
    the address members reach this process at."""

    def __init__(self, host: str, timeout: float = 120.0) -> None:
        self._store: Any = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                         timeout=dt.timedelta(seconds=timeout))
        self.address = Rendezvous(host, int(self._store.port))

    def close(self) -> None:
        self._store = None


@dataclass(frozen=True)
class GroupSpec:
    """One group as one member sees it: ``name`` (unique per group and per forming: ``"pp/r0/g1"``),
    this member's ``rank`` of ``size``, the ``backend`` and the deadline in seconds of its set-up and
    of each operation (``timeout``)."""

    name: str
    rank: int
    size: int
    backend: str = "gloo"
    timeout: float = 600.0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a process group needs a name (its prefix in the rendezvous store)")
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"group {self.name}: rank must be in [0, size), got rank {self.rank} of {self.size}")
        if self.backend not in BACKENDS:
            raise ValueError(f"group {self.name}: backend must be one of {', '.join(BACKENDS)}, "
                             f"got {self.backend!r}")
        if not self.timeout > 0:
            raise ValueError(f"group {self.name}: timeout must be > 0 seconds, got {self.timeout}")


def connect_store(rendezvous: Rendezvous, timeout: float) -> Any:
    """A client of the rendezvous store (``TimeoutError``-like ``RuntimeError`` from torch after
    ``timeout`` seconds when it is not there)."""
    return dist.TCPStore(rendezvous.host, rendezvous.port, is_master=False, timeout=dt.timedelta(seconds=timeout))


def open_group(store: Any, spec: GroupSpec, host: str) -> Any:
    """Join group ``spec`` through ``store`` (a rendezvous store, or any ``torch.distributed.Store``);
    ``host``: the address the other members reach this process at. Blocks until every member has
    joined, at most ``spec.timeout`` seconds. The group is this caller's alone: drop it to close it."""
    prefixed = dist.PrefixStore(spec.name + "/", store)
    timeout = dt.timedelta(seconds=spec.timeout)
    if spec.backend == "nccl":
        nccl = getattr(dist, "ProcessGroupNCCL", None)
        if nccl is None:
            raise RuntimeError(f"group {spec.name}: backend nccl needs a CUDA build of torch")
        nopts = nccl.Options()
        nopts._timeout = timeout
        return nccl(prefixed, spec.rank, spec.size, nopts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(prefixed, spec.rank, spec.size, opts)
