"""Each shard's data path, chosen once per shard (``ShardPaths``): shared memory, the TCP bulk path or gRPC.

The paths themselves are in worker/paths.py (``GrpcPath``, ``ShmPath``) and
worker/tcppath.py (``TcpPath``); this module is the one place the choice is
made, and undone when a shard fails over or a connection ends. Thread-safety
as worker/paths.py says.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, overload

from shardps.protos.shardmap import ShardMap
from shardps.protos.shardps.v1 import ps_pb2
from shardps.worker import tcppath
from shardps.worker.layout import Layout
from shardps.worker.paths import GrpcPath, ShardPath, ShmPath
from shardps.worker.shm import ShmLink

if TYPE_CHECKING:
    from shardps.worker.transport import Transport


class ShardPaths(Sequence[ShardPath]):
    """Each shard's path, in shard order: gRPC until ``open`` finds a shard on this machine (module docstring).

    Read by the data path (``paths[shard]``, ``list(paths)``); changed only by
    ``open`` (the thread that drives the client), ``off`` and ``close``.
    """

    def __init__(self, worker_id: int, num_shards: int) -> None:
        self._worker_id = worker_id
        self._grpc = [GrpcPath(i) for i in range(num_shards)]
        self._paths: list[ShardPath] = list(self._grpc)

    @overload
    def __getitem__(self, shard: int) -> ShardPath: ...

    @overload
    def __getitem__(self, shard: slice) -> Sequence[ShardPath]: ...

    def __getitem__(self, shard: int | slice) -> ShardPath | Sequence[ShardPath]:
        return self._paths[shard]

    def __len__(self) -> int:
        return len(self._paths)

    def __iter__(self) -> Iterator[ShardPath]:
        return iter(self._paths)

    def open(self, smap: ShardMap, layouts: dict[str, Layout], readable: Sequence[bool],
             answers: Sequence[ps_pb2.RegisterResponse] = (), transport: Transport | None = None) -> None:
        """After Register: shared memory for every shard that read the probe (``readable``) and whose segments
        can be made (``ShmLink.open`` logs why not); else, given the shards' ``answers`` and the
        ``transport``, the TCP bulk path (worker/tcppath.py) to each that gave a data port, unless
        ``SHARDPS_TCP`` is 0 or the transport has TLS or a token; gRPC for the others."""
        tcp = transport is not None and tcppath.wanted(transport.security)
        for i in range(len(self._paths)):
            self.off(i)
            if readable[i]:
                link = ShmLink.open(self._worker_id, i, smap, layouts)
                if link is not None:
                    self._paths[i] = ShmPath(link, self._grpc[i])
            elif tcp and answers and answers[i].data_port:
                assert transport is not None
                path = tcppath.TcpPath.open(transport.addresses[i], answers[i], self._grpc[i], smap, layouts,
                                            transport.timeout, self.lost)
                if path is not None:
                    self._paths[i] = path

    def lost(self, path: ShardPath) -> None:
        """``path``'s connection ended: its shard takes gRPC from now on (if ``path`` is still its path)."""
        if self._paths[path.shard] is path:
            self.off(path.shard)

    def off(self, shard: int) -> None:
        """Shard ``shard`` no longer shares this machine (it failed over to its backup): gRPC from now on, its
        segments closed (a push writing them meanwhile sends its share over gRPC)."""
        path, self._paths[shard] = self._paths[shard], self._grpc[shard]
        path.close()

    def close(self) -> None:
        """Every shard back to gRPC, every segment closed (the client closes). Idempotent."""
        for i in range(len(self._paths)):
            self.off(i)

    @property
    def links(self) -> list[ShmLink | None]:
        """Each shard's shared-memory link, None for gRPC (a snapshot, for tests and diagnostics)."""
        return [p.link if isinstance(p, ShmPath) else None for p in self._paths]
