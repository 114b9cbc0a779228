"""Checkpoint files: atomic, hashed, newest complete one wins, no pickle."""

import json

import pytest
import torch

from shardps.server import checkpoint as ck


def test_write_load_round_trip_and_keep(tmp_path):
    for v in (3, 7, 9, 12):
        ck.write(tmp_path, 1, v, {"note": f"v{v}"}, {"w@0/weight": torch.full((4, 3), float(v))}, keep=3)
    assert ck.list_versions(tmp_path, 1) == [7, 9, 12]
    c = ck.latest(tmp_path, 1)
    assert c.version == 12 and c.meta["note"] == "v12" and c.meta["shard_index"] == 1
    assert torch.equal(c.tensors()["w@0/weight"], torch.full((4, 3), 12.0))
    assert ck.latest(tmp_path, 1, at_most=10).version == 9
    assert ck.latest(tmp_path, 0) is None
    # safetensors + JSON only: the tensor file starts with its JSON header length, no pickle opcodes.
    raw = c.tensors_path.read_bytes()
    assert raw[8:9] == b"{" and b"\x80\x04" not in raw[:16]


def test_a_torn_or_corrupt_checkpoint_is_skipped(tmp_path):
    ck.write(tmp_path, 0, 5, {}, {"a": torch.ones(3)})
    ck.write(tmp_path, 0, 6, {}, {"a": torch.zeros(3)})
    newest = ck.shard_dir(tmp_path, 0) / "step-0000000006.safetensors"
    newest.write_bytes(newest.read_bytes()[:-4])  # torn tensor file
    assert ck.latest(tmp_path, 0).version == 5
    with pytest.raises(ValueError, match="does not match its hash"):
        ck.load(tmp_path, 0, 6)
    # A tensor file without its metadata (crash before the JSON) does not count.
    ck.write(tmp_path, 0, 8, {}, {"a": torch.ones(3)})
    (ck.shard_dir(tmp_path, 0) / "step-0000000008.json").unlink()
    assert ck.list_versions(tmp_path, 0) == [5, 6]
    meta = json.loads((ck.shard_dir(tmp_path, 0) / "step-0000000005.json").read_text())
    assert meta["format"] == ck.FORMAT and len(meta["tensors_sha256"]) == 64


def test_no_temporary_files_are_left(tmp_path):
    ck.write(tmp_path, 2, 1, {}, {"a": torch.ones(2)})
    assert sorted(p.name for p in ck.shard_dir(tmp_path, 2).iterdir()) == [
        "step-0000000001.json", "step-0000000001.safetensors"]


def _stepping_store(tmp_path, every: int):
    import shardps
    from shardps.server.store import ShardStore, TensorSpec

    st = ShardStore(0, 1, sync="bsp", num_workers=1)
    st.path.register_tensors([TensorSpec("w", (6,), 1, shardps.optim.SGD(lr=1.0), ((0, 6),))],
                             {("w", 0): torch.zeros(6)})
    st.leases.register(0)
    st.checkpointer.enable(str(tmp_path), every_steps=every)
    return st


def _between_the_lock_and_the_write(st, monkeypatch, what):
    """Run ``what()`` in another thread (joined) once the step that made a checkpoint due has released the
    shard's lock, before the checkpoint is written: the exact point where a thread can lose the processor."""
    import threading

    real = st.checkpointer.write_taken

    def late(taken, current):
        t = threading.Thread(target=what)
        t.start()
        t.join(30)
        return real(taken, current)

    monkeypatch.setattr(st.checkpointer, "write_taken", late)


def test_a_step_based_checkpoint_is_of_the_version_that_made_it_due(tmp_path, monkeypatch):
    """Version 2 makes a checkpoint due (every 2); the next step lands before it is written: the file is still
    version 2's state, so every shard of a bsp job holds the same versions (a shard that wrote version 3 here
    would leave the job no common version to roll back to but older ones)."""
    st = _stepping_store(tmp_path, every=2)
    st.path.submit(0, 0, 0, {("w", 0): torch.ones(6)})
    _between_the_lock_and_the_write(st, monkeypatch,
                                    lambda: st.path.submit(0, 2, 2, {("w", 0): torch.ones(6)}))
    st.path.submit(0, 1, 1, {("w", 0): torch.ones(6)})  # version 2: due; version 3 lands in between
    assert st.job.version == 3 and st.checkpointer.versions() == [2]
    c = st.checkpointer.load(2)
    assert c.version == 2 and any(torch.equal(t, torch.full((6,), -2.0)) for t in c.tensors().values())


def test_a_checkpoint_taken_before_a_rollback_is_not_written_after_it(tmp_path, monkeypatch):
    """The snapshot of version 4 was taken; a rollback to 2 comes before it is written: version 4's state
    belongs to the timeline the job left, and is not written."""
    st = _stepping_store(tmp_path, every=2)
    for step in range(3):
        st.path.submit(0, step, step, {("w", 0): torch.ones(6)})
    assert st.checkpointer.versions() == [2]
    _between_the_lock_and_the_write(st, monkeypatch, lambda: st.rollback(2, epoch=1))
    st.path.submit(0, 3, 3, {("w", 0): torch.ones(6)})  # version 4: due; the rollback comes in between
    assert st.job.version == 2 and st.job.epoch == 1 and st.checkpointer.versions() == [2]
