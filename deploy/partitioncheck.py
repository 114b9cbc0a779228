"""The partition harness's checker (deploy/partitions.py): what a run's logs and final weights prove.

Pure functions of what the run recorded, so each rule is tested on its own
(tests/test_partitioncheck.py). Inputs:

- ``logs[w]``: worker ``w``'s pushes in order (deploy/partitionworker.py):
  ``{"outcome": "acked" | "dropped" | "pending", "acks": [[shard, version,
  server, epoch, duplicate], ...]}``;
- ``parts``: ``[name, start, stop, shard]`` for every part of every tensor
  (which shard holds each coordinate);
- ``weights``: each tensor's values as the shards' serving primaries hold
  them at the end;
- ``per_worker``: the coordinates a worker owns (push ``i`` of worker ``w``
  adds 1.0 at ``w * per_worker + i``).

The rules:

- an acknowledged push is exactly 1.0 on every shard (0.0: lost);
- a push dropped at a rejoin, or never answered, is 0.0 or 1.0 (unknown);
- nothing is 2.0 or more (applied twice), or not a whole number;
- a coordinate no push was made for is 0.0;
- no two acknowledgements that applied a push name one version of one shard
  (two servers, or one twice, acknowledged the same version);
- a shard's epochs never go down as its versions go up, nor in the order one
  worker saw them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Tally:
    """What one run's check found: the counts of each outcome (a push on one shard each) and the violations."""

    acked: int = 0
    dropped: int = 0
    pending: int = 0
    unknown_applied: int = 0  # of the dropped and pending: those that are in the weights
    acks: int = 0
    duplicates: int = 0  # acknowledgements of a push sent again, that a shard had already taken in
    violations: list[str] = field(default_factory=list)

    @property
    def lost(self) -> int:
        return sum(v.startswith("lost") for v in self.violations)

    @property
    def doubled(self) -> int:
        return sum(v.startswith("applied") for v in self.violations)

    @property
    def split(self) -> int:
        return sum(v.startswith("version") for v in self.violations)


def shard_of(parts: list[list[Any]]) -> dict[tuple[str, int], int]:
    """(tensor, coordinate) -> shard, for every coordinate of every part."""
    out: dict[tuple[str, int], int] = {}
    for name, start, stop, shard in parts:
        for x in range(start, stop):
            out[(name, x)] = shard
    return out


def check(logs: list[list[dict[str, Any]]], parts: list[list[Any]], weights: dict[str, list[float]],
          per_worker: int) -> Tally:
    tally = Tally()
    where = shard_of(parts)
    for name, values in weights.items():
        for x, v in enumerate(values):
            w, i = divmod(x, per_worker)
            pushes = logs[w] if w < len(logs) else []
            shard = where.get((name, x), -1)
            what = f"worker {w}'s push {i} on shard {shard} ({name}[{x}] = {v})"
            if v != int(v):
                tally.violations.append(f"not a whole number: {what}")
                continue
            if v >= 2:
                tally.violations.append(f"applied {int(v)} times: {what}")
                continue
            if i >= len(pushes):
                if v != 0:
                    tally.violations.append(f"never made, yet applied: {what}")
                continue
            outcome = pushes[i]["outcome"]
            if outcome == "acked":
                tally.acked += 1
                if v != 1:
                    tally.violations.append(f"lost, acknowledged: {what}")
            else:
                setattr(tally, outcome, getattr(tally, outcome) + 1)
                tally.unknown_applied += int(v == 1)
    check_acks(logs, tally)
    return tally


def check_acks(logs: list[list[dict[str, Any]]], tally: Tally) -> None:
    """The acknowledgement log's rules: one acknowledgement a version of a shard, epochs that never go down."""
    applied: Counter[tuple[int, int]] = Counter()
    by: dict[tuple[int, int], set[str]] = {}
    epochs: dict[int, list[tuple[int, int]]] = {}
    for w, pushes in enumerate(logs):
        seen: dict[int, int] = {}
        for i, p in enumerate(pushes):
            for shard, version, server, epoch, duplicate in p["acks"]:
                tally.acks += 1
                if seen.get(shard, 0) > epoch:
                    tally.violations.append(f"epoch went down: worker {w}'s push {i} acknowledged by shard {shard} "
                                            f"at {server} in epoch {epoch}, after epoch {seen[shard]}")
                seen[shard] = max(seen.get(shard, 0), epoch)
                if duplicate:
                    tally.duplicates += 1
                    continue
                applied[(shard, version)] += 1
                by.setdefault((shard, version), set()).add(server)
                epochs.setdefault(shard, []).append((version, epoch))
    for (shard, version), n in sorted(applied.items()):
        if n > 1:
            tally.violations.append(f"version {version} of shard {shard} acknowledged {n} times, by "
                                    f"{', '.join(sorted(by[(shard, version)]))}")
    for shard, pairs in sorted(epochs.items()):
        pairs.sort()
        for (v0, e0), (v1, e1) in zip(pairs, pairs[1:], strict=False):
            if e1 < e0:
                tally.violations.append(f"epoch went down: shard {shard} acknowledged version {v0} in epoch {e0} "
                                        f"and version {v1} in epoch {e1}")
