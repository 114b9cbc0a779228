"""Checkpoint files of one shard: safetensors for tensors, JSON for the rest. No pickle.

Layout under the checkpoint directory ``D``::

    D/shard-{i}/step-{version:010d}.safetensors   weights, optimizer state, held gradients
    D/shard-{i}/step-{version:010d}.json          metadata; written last: its presence marks
                                                  a complete checkpoint (with the tensors' sha256)

Both files are written atomically: to a temporary name in the same
directory, fsynced, renamed, and the directory fsynced. ``latest`` returns
the newest complete checkpoint whose tensor file matches its recorded hash,
so a crash mid-write leaves the previous one in force.

``CheckpointMixin`` is the part of ``ShardStore`` that decides when to
checkpoint, writes its snapshot (server/snapshot.py) and rolls back.
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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from shardps.server.errors import FailedPrecondition
from shardps.server.replica import Role

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


class CheckpointMixin:
    """Checkpoint methods of ``ShardStore`` (it supplies the attributes annotated here)."""

    shard_index: int
    version: int
    epoch: int
    recovering: bool
    role: Role
    checkpoints_total: int
    _ckpt_dir: str | None
    _ckpt_every: int
    _ckpt_seconds: float
    _ckpt_keep: int
    _ckpt_last: float
    _ckpt_version: int
    _ckpt_lock: threading.Lock
    _cond: threading.Condition

    if TYPE_CHECKING:  # the store's own methods
        def snapshot(self) -> tuple[int, dict[str, Any], dict[str, torch.Tensor]]: ...
        def restore(self, version: int, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None: ...
        def _record_snapshot(self) -> None: ...

    def enable_checkpoints(self, directory: str, *, every_steps: int = 0, every_seconds: float = 0.0,
                           keep: int = 3) -> None:
        """Checkpoint into ``directory`` every ``every_steps`` versions and/or after ``every_seconds``.

        Under bsp and every:X all shards apply the same rounds, so step-based
        checkpoints land on the same versions on every shard.
        """
        if every_steps < 0 or every_seconds < 0:
            raise ValueError("checkpoint intervals must be >= 0")
        self._ckpt_dir, self._ckpt_every, self._ckpt_seconds, self._ckpt_keep = (
            directory, every_steps, every_seconds, keep)
        self._ckpt_last = time.monotonic()

    def _checkpoint_due(self) -> bool:
        if not self._ckpt_dir or self._ckpt_version == self.version or self.role != Role.PRIMARY:
            return False
        if self._ckpt_every and self.version % self._ckpt_every == 0:
            return True
        return bool(self._ckpt_seconds) and time.monotonic() - self._ckpt_last >= self._ckpt_seconds

    def checkpoint_now(self) -> str:
        """Write a checkpoint of the current state; return the path of its metadata."""
        if not self._ckpt_dir:
            raise FailedPrecondition(f"shard {self.shard_index} has no checkpoint directory (--checkpoint-dir)")
        with self._ckpt_lock:
            version, meta, tensors = self.snapshot()
            path = write(self._ckpt_dir, self.shard_index, version, meta, tensors, keep=self._ckpt_keep)
            self._ckpt_version, self._ckpt_last = version, time.monotonic()
            self.checkpoints_total += 1
        log.info("shard %d: checkpoint at version %d: %s", self.shard_index, version, path)
        return str(path)

    def checkpoint_versions(self) -> list[int]:
        return list_versions(self._ckpt_dir, self.shard_index) if self._ckpt_dir else []

    def rollback(self, version: int, epoch: int) -> tuple[int, int]:
        """Restore the checkpoint at ``version`` and enter ``epoch`` (no-op if already there).

        Waits in progress end with ABORTED, so their workers resync too.
        """
        with self._ckpt_lock:
            if epoch <= self.epoch and not self.recovering:
                return self.version, self.epoch
            if not self._ckpt_dir:
                raise FailedPrecondition(f"shard {self.shard_index} has no checkpoint directory")
            try:
                c = load(self._ckpt_dir, self.shard_index, version)
            except ValueError as e:
                raise FailedPrecondition(f"shard {self.shard_index} cannot roll back to version {version}: {e} "
                                         f"(checkpoints: {self.checkpoint_versions()})") from None
            self.restore(c.version, c.meta, c.tensors())
            with self._cond:
                self.epoch = max(epoch, self.epoch + 1)
                self.recovering = False
                self._ckpt_version = c.version
                self._record_snapshot()
                self._cond.notify_all()
        log.warning("shard %d: rolled back to version %d, epoch %d", self.shard_index, version, self.epoch)
        return self.version, self.epoch

    def restore_latest(self, at_most: int | None = None) -> int | None:
        """Restore the newest complete checkpoint (at or below ``at_most``); its version, or None."""
        if not self._ckpt_dir:
            return None
        c = latest(self._ckpt_dir, self.shard_index, at_most)
        if c is None:
            return None
        self.restore(c.version, c.meta, c.tensors())
        self._ckpt_version = c.version
        return c.version

