"""What a push or a pull needs from its client, read only: ``Route``.

The data path (``worker/datapath/push.py``, ``worker/datapath/bucketedpush.py``,
``worker/datapath/pull.py``) is given its client as a ``Route``: who sends, where
each tensor goes (layouts, shard map), how (the transport, each shard's
path: ``worker/datapath/paths.py``) and the client's reusable host buffers. Every
member is read only, so nothing on the data path can write the client's
state: what the shards answer comes back as a value (``worker/job/jobview.py``).
``PSClient`` is one (structurally: this module imports no client).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from shardps.worker.datapath.buffers import HostBuffers
from shardps.worker.datapath.paths import ClientRoute
from shardps.worker.datapath.transport import Transport

if TYPE_CHECKING:
    from shardps.worker.datapath.shardpaths import ShardPaths


class Route(ClientRoute, Protocol):
    """A registered client as its pushes and pulls see it (read only; see the module docstring): its
    ``ClientRoute`` (shard map, layouts, chunk size) and the members below."""

    @property
    def worker_id(self) -> int: ...

    @property
    def epoch(self) -> int:
        """The rollback epoch every request carries."""
        ...

    @property
    def sync_said(self) -> tuple[str, int]:
        """The job's sync mode as this client knows it, and the sync switch it came from: every Push says
        them (a step straddling a live switch then counts under one mode on every shard)."""
        ...

    @property
    def num_shards(self) -> int: ...

    @property
    def paths(self) -> ShardPaths:
        """Per shard, how its bytes travel (gRPC, shared memory or a data connection); read as each call
        starts: a fail-over turns a shard's shared memory off, a lost connection is made again (``revive``)."""
        ...

    @property
    def transport(self) -> Transport: ...

    @property
    def buffers(self) -> HostBuffers:
        """Pinned host buffers and CUDA copy streams, kept across steps."""
        ...
