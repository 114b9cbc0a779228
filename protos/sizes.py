"""Message sizes of the wire, apart from protos/codec.py so that ``shardps``'s parser names the default
without importing torch."""

from __future__ import annotations

DEFAULT_CHUNK_BYTES = 1 << 20  # 1 MiB: the best message size for gRPC Python
MAX_CHUNK_BYTES = 3 << 20  # stays under gRPC's default 4 MiB receive limit
