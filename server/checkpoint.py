"""Checkpoint files of one shard: safetensors for tensors, JSON for the rest. No pickle.

Layout under the checkpoint directory ``D``::

    D/shard-{i}/step-{version:010d}.safetensors   weights, optimizer state, held gradients
    D/shard-{i}/step-{version:010d}.json          metadata; written last: its presence marks
                                                  a complete checkpoint (with the tensors' sha256)

Both files are written atomically: to a temporary name in the same
directory, fsynced, renamed, and the directory fsynced. ``latest`` returns
the newest complete checkpoint whose tensor file matches its recorded hash,
so a crash mid-write leaves the previous one in force.

``Checkpointer`` is the store's part that owns the files of one shard and
their schedule: when a checkpoint is due, writing a snapshot it is handed
(server/replication/snapshot.py), listing and loading them; the store restores what it
loads (a rollback, a restart).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from shardps.server.errors import FailedPrecondition

log = logging.getLogger("shardps.server")

FORMAT = 1
_NAME = re.compile(r"^step-(\d{10})\.json$")


@dataclass(frozen=True)
class Checkpoint:
    version: int
    meta: dict[str, Any]
    tensors_path: Path

    def tensors(self) -> dict[str, torch.Tensor]:
        return load_file(str(self.tensors_path))


def shard_dir(root: str | Path, shard_index: int) -> Path:
    return Path(root) / f"shard-{shard_index}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, write: Any) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write(root: str | Path, shard_index: int, version: int, meta: dict[str, Any],
          tensors: dict[str, torch.Tensor], keep: int = 3) -> Path:
    """Write one complete checkpoint; keep the newest ``keep``. Returns the JSON path."""
    d = shard_dir(root, shard_index)
    d.mkdir(parents=True, exist_ok=True)
    base = d / f"step-{version:010d}"
    st_path = base.with_suffix(".safetensors")
    contiguous = {k: v.detach().contiguous() for k, v in tensors.items()}
    _atomic_write(st_path, lambda tmp: save_file(contiguous, tmp))
    full = dict(meta, format=FORMAT, version=version, shard_index=shard_index,
                tensors_file=st_path.name, tensors_sha256=_sha256(st_path))
    json_path = base.with_suffix(".json")
    _atomic_write(json_path, lambda tmp: Path(tmp).write_text(json.dumps(full, indent=1, sort_keys=True)))
    for old in list_versions(root, shard_index)[:-keep] if keep > 0 else []:
        for suffix in (".json", ".safetensors"):
            (d / f"step-{old:010d}{suffix}").unlink(missing_ok=True)
    return json_path


def list_versions(root: str | Path, shard_index: int) -> list[int]:
    """Versions with a metadata file (complete checkpoints), oldest first."""
    d = shard_dir(root, shard_index)
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for p in d.iterdir() if (m := _NAME.match(p.name)))


def load(root: str | Path, shard_index: int, version: int) -> Checkpoint:
    """One checkpoint; ValueError if it is incomplete or does not match its hash."""
    d = shard_dir(root, shard_index)
    json_path = d / f"step-{version:010d}.json"
    try:
        meta = json.loads(json_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"checkpoint {json_path}: unreadable metadata: {e}") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"checkpoint {json_path}: format {meta.get('format')}, expected {FORMAT}")
    st_path = d / meta["tensors_file"]
    if not st_path.is_file() or _sha256(st_path) != meta["tensors_sha256"]:
        raise ValueError(f"checkpoint {json_path}: tensor file {st_path.name} is missing or does not match its hash")
    return Checkpoint(version, meta, st_path)


def latest(root: str | Path, shard_index: int, at_most: int | None = None) -> Checkpoint | None:
    """The newest valid checkpoint (at or below ``at_most``), or None."""
    for v in reversed(list_versions(root, shard_index)):
        if at_most is not None and v > at_most:
            continue
        try:
            return load(root, shard_index, v)
        except ValueError:
            continue
    return None



Snapshot = tuple[int, dict[str, Any], dict[str, torch.Tensor]]  # (version, meta, tensors): replication/snapshot.py


class Checkpointer:
    """One shard's checkpoint files and their schedule.

    ``lock`` is the first lock of the store's lock order: one checkpoint
    write or rollback at a time, held over disk I/O (never over a call to
    another server). The schedule (``due``) is read under the store's lock;
    the rest needs no lock but ``lock``.
    """

    def __init__(self, shard_index: int) -> None:
        self.shard_index = shard_index
        self.directory: str | None = None
        self.every_steps, self.every_seconds, self.keep = 0, 0.0, 3
        self.last_time = time.monotonic()
        self.last_version = -1  # the version of the newest checkpoint written or restored
        self.lock = threading.Lock()
        self.checkpoints_total = 0

    def enable(self, directory: str, *, every_steps: int = 0, every_seconds: float = 0.0, keep: int = 3) -> None:
        """Checkpoint into ``directory`` every ``every_steps`` versions and/or after ``every_seconds``.

        Under bsp and every:X all shards apply the same rounds, so step-based
        checkpoints land on the same versions on every shard.
        """
        if every_steps < 0 or every_seconds < 0:
            raise ValueError("checkpoint intervals must be >= 0")
        self.directory, self.every_steps, self.every_seconds, self.keep = directory, every_steps, every_seconds, keep
        self.last_time = time.monotonic()

    def due(self, version: int) -> bool:
        """Whether a checkpoint is due at ``version`` (on a serving primary; the caller checks its role)."""
        if not self.directory or self.last_version == version:
            return False
        if self.every_steps and version % self.every_steps == 0:
            return True
        return bool(self.every_seconds) and time.monotonic() - self.last_time >= self.every_seconds

    def write(self, snapshot: Callable[[], Snapshot]) -> str:
        """Write a checkpoint of what ``snapshot()`` returns (taken under ``lock``); the path of its metadata."""
        if not self.directory:
            raise FailedPrecondition(f"shard {self.shard_index} has no checkpoint directory (--checkpoint-dir)")
        with self.lock:
            return self._write_locked(snapshot())

    def write_taken(self, taken: Snapshot, current: Callable[[], bool]) -> str | None:
        """Write a snapshot taken before (in the hold of the shard's lock that made a step-based checkpoint
        due, so that it is of that version: every shard of a bsp job then holds the same versions), unless
        ``current()`` says, under ``lock``, that the shard has left its timeline since (a rollback: its
        state must not come back); the path of its metadata, or None."""
        if not self.directory:
            raise FailedPrecondition(f"shard {self.shard_index} has no checkpoint directory (--checkpoint-dir)")
        with self.lock:
            if not current():
                log.info("shard %d: checkpoint at version %d not written: the shard rolled back since",
                         self.shard_index, taken[0])
                return None
            return self._write_locked(taken)

    def _write_locked(self, snap: Snapshot) -> str:
        assert self.directory  # (checked by the callers, with the error they raise)
        version, meta, tensors = snap
        path = write(self.directory, self.shard_index, version, meta, tensors, keep=self.keep)
        self.last_version, self.last_time = version, time.monotonic()
        self.checkpoints_total += 1
        log.info("shard %d: checkpoint at version %d: %s", self.shard_index, version, path)
        return str(path)

    def versions(self) -> list[int]:
        """The versions of the complete checkpoints on disk, oldest first ([] without a directory)."""
        return list_versions(self.directory, self.shard_index) if self.directory else []

    def load(self, version: int) -> Checkpoint:
        """The checkpoint at ``version``; FAILED_PRECONDITION when there is none or it does not load."""
        if not self.directory:
            raise FailedPrecondition(f"shard {self.shard_index} has no checkpoint directory")
        try:
            return load(self.directory, self.shard_index, version)
        except ValueError as e:
            raise FailedPrecondition(f"shard {self.shard_index} cannot roll back to version {version}: {e} "
                                     f"(checkpoints: {self.versions()})") from None

    def latest(self, at_most: int | None = None) -> Checkpoint | None:
        """The newest complete checkpoint (at or below ``at_most``), or None (also without a directory)."""
        return latest(self.directory, self.shard_index, at_most) if self.directory else None
