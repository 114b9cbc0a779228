"""Row table requests (``service Rows``: RegisterRows, PullRows, PushRows) built to be refused, or to change
nothing.

The job (``job.prepare_job``) holds one row table, ``job.ROW_TABLE``, whose
rows of ``job.ROW_KEYS`` every shard holds (pushed). A case may succeed
only where it changes nothing: registering the spec Stats reports (a no-op)
and pulling held rows. Everything else carries at least one defect, each
enough on its own for a refusal (a pull of keys not held would create them,
and a push without a defect is a step: both real changes), and the defects
come with keys not held, NaN gradients and an unknown worker now and then, so
that a refusal that came too late (a row created, a step or a count taken)
shows in the state. The answer must name the table, what was expected and
what came: ``rows_detail_ok``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from shardps.protos.rows import MAX_PULL_KEYS
from shardps.protos.shardps.v1 import ps_pb2
from shardps.testing.fuzz.cases import INT32, UINT32, UINT64, Case, Source, Target, shifted, wild_int
from shardps.testing.fuzz.draws import bad_sync_string, unknown_name
from shardps.testing.fuzz.job import ROW_TABLE
from shardps.testing.fuzz.send import held_rows

PULL_DEFECTS = ("unknown_table", "wrong_dim", "key_dtype", "ragged_keys", "repeated_keys", "oversize")
PUSH_DEFECTS = ("unknown_table", "wrong_dim", "key_dtype", "ragged_keys", "short_grads", "long_grads",
                "base_versions", "mixed_headers", "empty_stream", "bsp_worker", "assign_repeated", "assign_nan",
                "bad_sync")
REGISTER_DEFECTS = ("other_spec", "bad_dim", "no_name", "key_kind", "init_json", "init_kind", "optimizer",
                    "unsupported_param")


def _held(sh_index: int, num_shards: int) -> np.ndarray:
    held: np.ndarray = held_rows(sh_index, num_shards)[ROW_TABLE]
    return held


def _keys(src: Source, held: np.ndarray, fresh: bool) -> np.ndarray:
    """Some held keys (distinct, in any order); ``fresh``: with keys no shard holds (they would be created)."""
    picked = [k for k in held.tolist() if src.boolean()]
    if fresh:
        picked.insert(src.integer(0, len(picked)), src.choice([2**62 + 1, 12345, 2**64 - 7, 99]))
    out = np.array(picked, dtype=np.uint64)
    return out[np.argsort(np.array([src.integer(0, 1000) for _ in picked], dtype=np.int64), kind="stable")]


def _table(src: Source, sh_tables: Mapping[str, object], defect: bool, avoid: bool) -> str:
    return unknown_name(src, sh_tables, avoid) if defect else ROW_TABLE


def gen_pull_rows(src: Source, t: Target, avoid: bool) -> Case:
    sh = src.choice(t.shards)
    dim = sh.row_tables[ROW_TABLE].spec.dim
    defects: list[str] = []
    if src.integer(0, 3):
        defects = sorted({src.choice(PULL_DEFECTS) for _ in range(src.integer(1, 2))})
    if "oversize" in defects and src.integer(0, 3):  # 2 MiB a case: rare
        defects.remove("oversize")
    keys = _keys(src, _held(sh.index, len(t.shards)), fresh=bool(defects) and src.boolean())
    if "repeated_keys" in defects:
        keys = np.append(keys, keys[:1] if len(keys) else np.array([5, 5], dtype=np.uint64))
    if "oversize" in defects:
        keys = np.arange(MAX_PULL_KEYS + 1, dtype=np.uint64)
    data = keys.tobytes()
    if "ragged_keys" in defects:
        data += src.binary(1, 7)
    req = ps_pb2.PullRowsRequest(table=_table(src, sh.row_tables, "unknown_table" in defects, avoid),
                                 key_dtype=src.choice(["float32", "", "int32", "u64"]) if "key_dtype" in defects
                                 else src.choice(["int64", "uint64"]), keys=data,
                                 dim=src.choice([0, shifted(dim, 1, *UINT32), shifted(dim, -1, *UINT32),
                                                 wild_int(src, *UINT32)])
                                 if "wrong_dim" in defects else dim)
    if "wrong_dim" in defects and req.dim == dim:
        req.dim = shifted(dim, 1, *UINT32)
    if defects:  # a round or clock to wait for: a defect refuses the pull before any wait
        req.min_round = src.choice([0, 1, wild_int(src, 0, 2**64 - 1)])
        req.min_clock = src.choice([0, 1, wild_int(src, 0, 2**64 - 1)])
    return Case("pull_rows", "PullRows", sh.index, messages=[req], may_succeed=not defects, defects=tuple(defects))


def _grads(src: Source, n: int, dim: int, nan: bool) -> bytes:
    g = np.full((n, dim), 0.5, dtype="<f4")
    if nan and g.size:
        g.reshape(-1)[src.integer(0, g.size - 1)] = src.choice([math.nan, math.inf, -math.inf])
    return g.tobytes()


def gen_push_rows(src: Source, t: Target, avoid: bool) -> Case:
    """A PushRows stream of 1-3 messages with at least one defect: refused before anything changes (no row
    created, no step, no count: a duplicate is counted, so the defects must be found before that)."""
    sh = src.choice(t.shards)
    dim = sh.row_tables[ROW_TABLE].spec.dim
    defects = sorted({src.choice(PUSH_DEFECTS) for _ in range(src.integer(1, 3))})
    head: dict[str, Any] = {"table": _table(src, sh.row_tables, "unknown_table" in defects, avoid),
            "dim": shifted(dim, src.choice([1, -1, 7]), *UINT32) if "wrong_dim" in defects else dim,
            "worker_id": src.choice([0, 1, wild_int(src, 0, INT32[1])]),
            "step": src.choice([0, 1, 5, wild_int(src, 0, 2**64 - 1)]),
            "num_workers": src.choice([0, 1, 2]), "assign": "assign_repeated" in defects or "assign_nan" in defects,
            "found_inf": src.boolean(),
            # the mode a push names and the round it waits for first: a defect refuses it before any wait
            "sync": ((bad_sync_string(src, avoid) or "BSP!") if "bad_sync" in defects
                     else src.choice(["", "", "bsp", "asp", "ssp:1"])),
            "min_round": src.choice([0, 0, 1, wild_int(src, 0, 2**64 - 1)])}
    if "bsp_worker" in defects:
        head["num_workers"] = src.integer(2, 4)
        head["worker_id"] = src.choice([head["num_workers"], wild_int(src, head["num_workers"], INT32[1])])
    held = _held(sh.index, len(t.shards))
    messages = []
    for _ in range(src.integer(1, 3)):
        keys = _keys(src, held, fresh=src.boolean())
        if "assign_repeated" in defects:
            keys = np.append(keys, np.array([11, 11], dtype=np.uint64))
        if "assign_nan" in defects and not len(keys):
            keys = np.array([13], dtype=np.uint64)
        m = ps_pb2.PushRowsRequest(key_dtype="uint64" if src.integer(0, 3) else "int64", keys=keys.tobytes(),
                                   grads=_grads(src, len(keys), max(0, head["dim"]),
                                                "assign_nan" in defects or src.integer(0, 4) == 0), **head)
        if src.boolean():
            m.base_versions = np.zeros(len(keys), dtype="<i8").tobytes()
        messages.append(m)
    m = src.choice(messages)
    if "key_dtype" in defects:
        m.key_dtype = src.choice(["float64", "", "int8", "uint32"])
    if "ragged_keys" in defects:
        m.keys += src.binary(1, 7)
    if "short_grads" in defects:
        m.grads = m.grads[: len(m.grads) - src.integer(1, max(1, len(m.grads)))] if m.grads else b""
        if len(m.grads) == len(m.keys) // 8 * m.dim * 4:  # nothing cut (no keys): make them too long instead
            m.grads += b"\0\0\0\0"
    if "long_grads" in defects:
        m.grads += src.choice([b"\0\0\0\0", b"\0", bytes(4 * max(1, dim))])
    if {"short_grads", "long_grads"} & set(defects) and len(m.grads) == len(m.keys) // 8 * m.dim * 4:
        m.grads += b"\0\0\0\0"  # the cut and the addition cancelled out: the grads must not fit their keys
    if "base_versions" in defects:
        m.base_versions = bytes(8 * (len(m.keys) // 8 + 1)) if src.boolean() else b"\1\2\3"
    if "mixed_headers" in defects:
        if len(messages) == 1:
            messages.append(ps_pb2.PushRowsRequest(**head, key_dtype="uint64"))
        other = messages[-1]
        field = src.choice(["table", "dim", "worker_id", "step", "num_workers", "assign", "sync", "min_round"])
        new = {"table": head["table"] + "x", "dim": shifted(head["dim"], 1, *UINT32),
               "worker_id": shifted(head["worker_id"], 1, *UINT32), "step": shifted(head["step"], 1, *UINT64),
               "num_workers": shifted(head["num_workers"], 1, *UINT32), "assign": not head["assign"],
               "sync": "asp" if head["sync"] != "asp" else "bsp",
               "min_round": shifted(head["min_round"], 1, *UINT64)}[field]
        setattr(other, field, new)
        if field == "dim":
            other.keys, other.grads, other.base_versions = b"", b"", b""
    if "empty_stream" in defects:
        messages = []
    # A bsp push (num_workers > 1) with a defect is refused before it would wait for the others: never blocks.
    return Case("push_rows", "PushRows", sh.index, messages=messages, defects=tuple(defects))


def gen_register_rows(src: Source, t: Target, avoid: bool) -> Case:
    """RegisterRows of the spec the shard holds (a no-op) or of one with a defect: refused (a new valid table
    would be a change)."""
    sh = src.choice(t.shards)
    spec = ps_pb2.RowTableSpec()
    spec.CopyFrom(sh.row_tables[ROW_TABLE].spec)
    defects: list[str] = []
    if src.integer(0, 4):
        defects = sorted({src.choice(REGISTER_DEFECTS) for _ in range(src.integer(1, 2))})
    if defects and src.boolean() and "other_spec" not in defects and "no_name" not in defects:
        spec.name = unknown_name(src, sh.row_tables, avoid)  # a new table's name: a defect must refuse it
    for d in defects:
        if d == "other_spec":
            # dim and seed moved by one within their range (uint32, uint64): "bad_dim" may have set dim to 2**32 - 1
            setattr(spec, *src.choice([("dim", shifted(spec.dim, 1, *UINT32)), ("seed", shifted(spec.seed, 1, *UINT64)),
                                       ("admit", 3), ("expire", 9), ("init_json", '{"kind": "zeros"}')]))
        elif d == "bad_dim":
            spec.dim = src.choice([0, 65537, 2**32 - 1])
        elif d == "no_name":
            spec.name = ""
        elif d == "key_kind":
            spec.keys = src.choice(["", "float", "int32", "HASH"])
        elif d == "init_json":
            spec.init_json = src.choice(["{", "[" * 50, '"normal"', '{"kind": "normal", "std": NaN}', "null"])
        elif d == "init_kind":
            spec.init_json = json.dumps(src.choice([{"kind": "cauchy"}, {"kind": "normal", "scale": 1},
                                                    {"kind": "uniform", "a": "x"}, {"kind": "zeros", "mean": 0}]))
        elif d == "optimizer":
            spec.optimizer.name = src.choice(["adam", "adamw", "adafactor", "nope", ""])
            spec.optimizer.params_json = ""
        elif d == "unsupported_param":
            spec.optimizer.name, spec.optimizer.params_json = src.choice([
                ("sgd", '{"momentum": 0.9}'), ("sgd", '{"weight_decay": 0.1}'), ("sgd", '{"nesterov": true}'),
                ("sm3", '{"momentum": 0.5}'), ("sparse_adam", '{"weight_decay": 0.1}'),
                ("rowwise_adagrad", '{"weight_decay": 0.01}'), ("sparse_adam", '{"amsgrad": true}')])
    return Case("register_rows", "RegisterRows", sh.index, messages=[ps_pb2.RegisterRowsRequest(table=spec)],
                may_succeed=not defects, defects=tuple(defects))


def rows_detail_ok(case: Case, details: str) -> str:
    """'' if a refusal of a row case names its table (or, for a spec that cannot name one, says what is
    wrong); else what is missing."""
    if case.method not in ("PullRows", "PushRows", "RegisterRows") or not case.messages:
        return ""
    m = case.messages[0]
    name = m.table.name if case.method == "RegisterRows" else m.table
    if name and repr(name)[:40] not in details:  # its start: gRPC may cut a long status message
        return f"the refusal does not name the table {name[:100]!r}: {details[:300]}"
    if not any(w in details for w in ("expected", "got", "must", "unknown", "not registered", "registered as",
                                      "unsupported", "takes", "not valid", "does not step")):
        return f"the refusal does not say what was expected and what came: {details[:300]}"
    return ""
