"""Roles, replica states and op kinds: every (state, event) -> next state or error, as tables."""

from __future__ import annotations

import json

import pytest

from shardps.protos.shardps.v1 import ps_pb2
from shardps.server.replication.roles import (
    REPLICA_TRANSITIONS,
    ROLE_TRANSITIONS,
    InvalidTransition,
    OpKind,
    ReplicaEvent,
    ReplicaState,
    Role,
    RoleEvent,
    next_replica_state,
    next_role,
)

P, B, S, D = Role.PRIMARY, Role.BACKUP, Role.STARTING, Role.DEPOSED
ERR = "error"

ROLE_TABLE = {
    # state: {START, SETTLED, PROMOTE, DEPOSED}
    P: {RoleEvent.START: S, RoleEvent.SETTLED: ERR, RoleEvent.PROMOTE: P, RoleEvent.DEPOSED: D},
    B: {RoleEvent.START: ERR, RoleEvent.SETTLED: ERR, RoleEvent.PROMOTE: P, RoleEvent.DEPOSED: ERR},
    S: {RoleEvent.START: ERR, RoleEvent.SETTLED: P, RoleEvent.PROMOTE: ERR, RoleEvent.DEPOSED: D},
    D: {RoleEvent.START: ERR, RoleEvent.SETTLED: D, RoleEvent.PROMOTE: ERR, RoleEvent.DEPOSED: D},
}


@pytest.mark.parametrize("state, event", [(s, e) for s in Role for e in RoleEvent])
def test_role_transitions(state, event):
    want = ROLE_TABLE[state][event]
    if want == ERR:
        with pytest.raises(InvalidTransition):
            next_role(state, event)
    else:
        assert next_role(state, event) is want


N, R, SY, SD, DG, DP = (ReplicaState.NONE, ReplicaState.RESYNC, ReplicaState.SYNCING, ReplicaState.SYNCED,
                        ReplicaState.DEGRADED, ReplicaState.DEPOSED)
E = ReplicaEvent
REPLICA_TABLE = {
    # state: {ATTACH, BEGIN_SYNC, CONFIRMED, FAILED, ABORTED, PROMOTED}
    N: {E.ATTACH: R, E.BEGIN_SYNC: ERR, E.CONFIRMED: ERR, E.FAILED: ERR, E.ABORTED: ERR, E.PROMOTED: ERR},
    R: {E.ATTACH: R, E.BEGIN_SYNC: SY, E.CONFIRMED: R, E.FAILED: DG, E.ABORTED: R, E.PROMOTED: DP},
    SY: {E.ATTACH: R, E.BEGIN_SYNC: SY, E.CONFIRMED: SD, E.FAILED: DG, E.ABORTED: R, E.PROMOTED: DP},
    SD: {E.ATTACH: R, E.BEGIN_SYNC: SY, E.CONFIRMED: SD, E.FAILED: DG, E.ABORTED: R, E.PROMOTED: DP},
    DG: {E.ATTACH: R, E.BEGIN_SYNC: SY, E.CONFIRMED: DG, E.FAILED: DG, E.ABORTED: R, E.PROMOTED: DP},
    DP: {E.ATTACH: ERR, E.BEGIN_SYNC: DP, E.CONFIRMED: DP, E.FAILED: DP, E.ABORTED: DP, E.PROMOTED: DP},
}


@pytest.mark.parametrize("state, event", [(s, e) for s in ReplicaState for e in ReplicaEvent])
def test_replica_state_transitions(state, event):
    want = REPLICA_TABLE[state][event]
    if want == ERR:
        with pytest.raises(InvalidTransition):
            next_replica_state(state, event)
    else:
        assert next_replica_state(state, event) is want


def test_the_tables_list_nothing_else():
    assert {k for k, v in ROLE_TRANSITIONS.items()} == {(s, e) for s, row in ROLE_TABLE.items()
                                                        for e, v in row.items() if v != ERR}
    assert set(REPLICA_TRANSITIONS) == {(s, e) for s, row in REPLICA_TABLE.items() for e, v in row.items() if v != ERR}


@pytest.mark.parametrize("enum_type, values", [
    (Role, ["primary", "backup", "starting", "deposed"]),
    (ReplicaState, ["none", "resync", "syncing", "synced", "degraded", "deposed"]),
    (OpKind, ["snapshot", "configure", "register_worker", "register_tensors", "submit", "leave", "evict",
              "set_sync", "pulled", "rows"]),
])
def test_wire_and_stats_values_are_the_strings_they_were(enum_type, values):
    assert [m.value for m in enum_type] == values
    for m in enum_type:
        assert m == m.value and str(m) == m.value and f"{m}" == m.value and json.dumps(m) == f'"{m.value}"'
    assert ps_pb2.StatsResponse(role=Role.BACKUP, replica_state=ReplicaState.SYNCED).SerializeToString() == \
        ps_pb2.StatsResponse(role="backup", replica_state="synced").SerializeToString()


def _op_stream(numel: int = (1 << 18) + 5) -> list[ps_pb2.ReplicateRequest]:
    """One submit op whose tensor bytes take two messages (over BLOB_BYTES)."""
    import torch

    from shardps.server.replication.transport import Op, op_messages

    op = Op(7, str(OpKind.SUBMIT), {"worker": 1, "step": 2}, {"w@0": torch.arange(numel, dtype=torch.float32)})
    return [ps_pb2.ReplicateRequest.FromString(m) for m in op_messages(op, 0, 2, "127.0.0.1:1", "run")]


def test_an_op_is_read_whole_and_its_later_messages_carry_its_bytes_only():
    from shardps.server.replication.transport import read_ops

    msgs = _op_stream()
    assert len(msgs) == 2
    [(head, op)] = list(read_ops(iter(msgs)))
    assert (op.seq, op.kind, op.args, head.incarnation) == (7, "submit", {"worker": 1, "step": 2}, "run")
    assert op.tensors["w@0"][-1].item() == (1 << 18) + 4


@pytest.mark.parametrize("field, value", [("op", "leave"), ("args_json", "{}"), ("shard_index", 1),
                                          ("num_shards", 3), ("primary", "10.0.0.1:1"), ("incarnation", "other")])
def test_an_op_whose_later_message_disagrees_is_refused(field, value):
    """The same check as a Push stream's (server/datapath/headers.py): nothing of the op is handed on to be replayed."""
    from shardps.server.errors import InvalidArgument
    from shardps.server.replication.transport import read_ops

    msgs = _op_stream()
    setattr(msgs[1], field, value)
    with pytest.raises(InvalidArgument, match=f"Replicate stream mixes headers: message 2 has {field} "):
        list(read_ops(iter(msgs)))
    same = _op_stream()
    setattr(same[1], field, getattr(same[0], field))  # repeating the op's own value is fine
    assert len(list(read_ops(iter(same)))) == 1


def test_a_cut_op_is_refused():
    from shardps.server.errors import InvalidArgument
    from shardps.server.replication.transport import read_ops

    with pytest.raises(InvalidArgument, match=r"op 7 sent 1048576 tensor bytes, its layout says 1048[56]\d\d"):
        list(read_ops(iter(_op_stream()[:1])))
