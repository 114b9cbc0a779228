"""Roles, replica states and op kinds: every (state, event) -> next state or error, as tables."""

from __future__ import annotations

import json

import pytest

from shardps.protos.shardps.v1 import ps_pb2
from shardps.server.replica import (
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
              "set_sync", "pulled"]),
])
def test_wire_and_stats_values_are_the_strings_they_were(enum_type, values):
    assert [m.value for m in enum_type] == values
    for m in enum_type:
        assert m == m.value and str(m) == m.value and f"{m}" == m.value and json.dumps(m) == f'"{m.value}"'
    assert ps_pb2.StatsResponse(role=Role.BACKUP, replica_state=ReplicaState.SYNCED).SerializeToString() == \
        ps_pb2.StatsResponse(role="backup", replica_state="synced").SerializeToString()
