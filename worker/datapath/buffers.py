"""``HostBuffers``: the host memory and CUDA streams a client reuses every step.

A pinned host buffer per tensor (a CUDA gradient copied down, a CUDA
parameter's pulled weights staged before their copy up) and one side
stream per device for those copies, so backward does not wait for them.
Made on first use, kept while the sizes hold. Used by the push stream and
the pull (``worker/datapath/bucketedpush.py``, ``worker/datapath/pull.py``) from the thread that
drives the client or its pull threads: each buffer has one user at a time.
"""

from __future__ import annotations

from typing import Any

import torch


class HostBuffers:
    """Pinned buffers by name and a copy stream per CUDA device (see the module docstring)."""

    def __init__(self) -> None:
        self._side_streams: dict[int, Any] = {}
        self._pinned: dict[str, torch.Tensor] = {}

    def side_stream(self, device: torch.device) -> Any:
        """The CUDA stream gradients are copied to host on (one per device)."""
        s = self._side_streams.get(device.index or 0)
        if s is None:
            s = self._side_streams[device.index or 0] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return s

    def pinned(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A pinned host buffer of ``numel`` ``dtype`` for ``name`` (kept: reused every step)."""
        buf = self._pinned.get(name)
        if buf is None or buf.numel() != numel or buf.dtype != dtype:
            buf = self._pinned[name] = torch.empty(numel, dtype=dtype, pin_memory=True)
        return buf
