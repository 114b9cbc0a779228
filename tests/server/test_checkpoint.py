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
