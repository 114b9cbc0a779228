"""What the shards say about the job in their answers: the value a push or a pull returns.

Every Push and Pull answer carries the job's sync mode and loss scale; a
Pull's also the slowest worker's clock (ssp) and the version each shard
served. The data path (``worker/push.py``, ``worker/pushstream.py``,
``worker/pull.py``) only collects them into a ``JobView``; the client takes
them in one place, ``PSClient.apply``, in the thread that drives it. Pool
threads never write the client's fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardps.protos.results import PushResult


@dataclass(frozen=True)
class JobView:
    """The job as the answers of one push or pull saw it; a field left at its default was not said.

    ``sync``: the job's sync mode ("": not said, keep the one known);
    ``loss_scale``: the scale the shards want next (0.0: loss scaling is
    off; None: not said); ``slowest_clock``: the lowest worker clock a Pull
    saw (None: not said); ``versions``: (shard, version) for each shard
    that served weights.
    """

    sync: str = ""
    loss_scale: float | None = None
    slowest_clock: int | None = None
    versions: tuple[tuple[int, int], ...] = ()

    @staticmethod
    def of_push(results: Sequence[PushResult]) -> JobView:
        """What a push's answers say (the first shard's: every shard answers with the same job settings)."""
        if not results:
            return JobView()
        return JobView(sync=results[0].sync, loss_scale=results[0].loss_scale)
