"""What a push or a pull needs from its client, read only: ``Route``.

The data path (``worker/push.py``, ``worker/pushstream.py``,
``worker/pull.py``) is given its client as a ``Route``: who sends, where
each tensor goes (layouts, shard map), how (the transport, each shard's
shared-memory link or None) and the client's reusable host buffers. Every
member is read only, so nothing on the data path can write the client's
state: what the shards answer comes back as a value (``worker/jobview.py``).
``PSClient`` is one (structurally: this module imports no client).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from shardps.protos.shardmap import ShardMap
from shardps.worker.buffers import HostBuffers
from shardps.worker.layout import Layout
from shardps.worker.shm import ShmLink
from shardps.worker.transport import Transport


class Route(Protocol):
    """A registered client as its pushes and pulls see it (read only; see the module docstring)."""

    @property
    def worker_id(self) -> int: ...

    @property
    def epoch(self) -> int:
        """The rollback epoch every request carries."""
        ...

    @property
    def chunk_bytes(self) -> int:
        """The largest chunk of a gRPC message, in bytes."""
        ...

    @property
    def num_shards(self) -> int: ...

    @property
    def layouts(self) -> Mapping[str, Layout]: ...

    @property
    def shard_map(self) -> ShardMap | None: ...

    @property
    def shm_links(self) -> Sequence[ShmLink | None]:
        """Per shard, its shared-memory link (None: gRPC); read at each use: a fail-over turns one off."""
        ...

    @property
    def transport(self) -> Transport: ...

    @property
    def buffers(self) -> HostBuffers:
        """Pinned host buffers and CUDA copy streams, kept across steps."""
        ...
