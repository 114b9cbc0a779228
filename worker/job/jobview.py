"""What the shards say about the job in their answers: the value a push or a pull returns.

Every Push and Pull answer carries the job's sync mode and loss scale; a
Pull's also the slowest worker's clock (ssp) and the version each shard
served. The data path (``worker/datapath/push.py``, ``worker/datapath/bucketedpush.py``,
``worker/datapath/pull.py``) only collects them into a ``JobView``; the client takes
them in one place, ``PSClient.apply``, in the thread that drives it. Pool
threads never write the client's fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shardps.protos.results import PushResult


@dataclass(frozen=True)
class JobView:
    """The job as the answers of one push or pull saw it; a field left at its default was not said.

    ``sync``: the job's sync mode ("": not said, keep the one known);
    ``sync_switch``: the job's sync switch that mode came from (None: not
    said, as in a Pull's answer; such a mode is taken only when none is
    known: during a live switch, shards not yet switched still say the old);
    ``loss_scale``: the scale the shards want next (0.0: loss scaling is
    off; None: not said); ``slowest_clock``: the lowest worker clock a Pull
    saw (None: not said); ``versions``: (shard, version) for each shard
    that served weights.
    """

    sync: str = ""
    sync_switch: int | None = None
    loss_scale: float | None = None
    slowest_clock: int | None = None
    versions: tuple[tuple[int, int], ...] = ()

    @staticmethod
    def newest(answers: Sequence[Any]) -> JobView:
        """The sync mode of the answer (``sync``, ``sync_switch``) with the newest sync switch."""
        newest = max(answers, key=lambda r: r.sync_switch)
        return JobView(sync=newest.sync, sync_switch=newest.sync_switch)

    @staticmethod
    def of_register(answers: Sequence[Any]) -> JobView:
        """What the shards' RegisterResponses say: the newest sync switch's mode, the loss scale, versions."""
        return dataclasses.replace(JobView.newest(answers), loss_scale=answers[0].loss_scale,
                                   versions=tuple((i, r.version) for i, r in enumerate(answers)))

    @staticmethod
    def of_stats(stats: Sequence[Any]) -> JobView:
        """What the shards' StatsResponses say (Describe's, a recovery's): the newest sync switch's mode."""
        newest = max(stats, key=lambda s: s.sync_switches_total)
        return JobView(sync=newest.sync, sync_switch=newest.sync_switches_total, loss_scale=stats[0].loss_scale,
                       versions=tuple((i, s.version) for i, s in enumerate(stats)))

    @staticmethod
    def of_push(results: Sequence[PushResult]) -> JobView:
        """What a push's answers say: the first shard's loss scale (every shard answers with the same), the
        newest sync switch any shard had (during a live switch, some shards may not have had it yet)."""
        if not results:
            return JobView()
        return dataclasses.replace(JobView.newest(results), loss_scale=results[0].loss_scale)
