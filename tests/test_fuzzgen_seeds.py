"""The fuzzer's generators never raise: every one, over SEEDS seeds, builds a case whose fields fit their types.

No server: each generator of shardps/testing/fuzz (fuzz.KINDS) is called once a
seed with a seeded RandomSource (as benchmarks/fuzz.py draws) against the
Target that Stats reports for fuzz.prepare_job's job, in the shapes the
fuzzer runs (1 shard; 2 shards; 2 shards with backups; asp, bsp, every:2,
ssp:1), taken in turn by seed. A generator that raises (a value out of its
proto field's range: gen_register_rows set a uint32 dim of 2**32 - 1 plus
one, seed 484 here) is a generator defect: fuzz.draw_case returns it as
a GeneratorDefect, which benchmarks/fuzz.py reports with its seed and case
number, going on and exiting 1 at the end; here it fails the test, naming
the seeds.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from shardps.protos.shardps.v1 import ps_pb2
from shardps.testing import fuzz
from shardps.testing.fuzz.cases import RowTableInfo, ShardInfo, TensorInfo
from shardps.testing.fuzz.job import ROW_DIM, ROW_TABLE

SEEDS = 500  # per generator: about 2 s of calls in all on 2 cores (the Replicate generators' long texts take most)
SYNCS = ("asp", "bsp", "every:2", "ssp:1")
_SGD = '{"dampening": 0.0, "lr": 0.5, "momentum": 0.0, "nesterov": false, "weight_decay": 0.0}'
_SGD_MOMENTUM = '{"dampening": 0.0, "lr": 0.5, "momentum": 0.5, "nesterov": false, "weight_decay": 0.0}'
_ADAM = '{"amsgrad": false, "betas": [0.9, 0.999], "eps": 1e-08, "lr": 0.01, "weight_decay": 0.0}'
# prepare_job's tensors: (shape, dtype, optimizer, params_json); "w" is split in four parts of 5 elements.
_TENSORS: dict[str, tuple[tuple[int, ...], int, str, str]] = {
    "w": ((4, 5), ps_pb2.FLOAT32, "sgd", _SGD), "b": ((5,), ps_pb2.FLOAT32, "sgd", _SGD_MOMENTUM),
    "h": ((2, 3), ps_pb2.FLOAT16, "sgd", _SGD), "e": ((7,), ps_pb2.BFLOAT16, "adam", _ADAM),
}
# What each shard holds, by number of shards: {tensor: its parts there} (as Stats reports it).
_LAYOUT: dict[int, tuple[dict[str, tuple[tuple[int, int], ...]], ...]] = {
    1: ({"w": ((0, 5), (5, 10), (10, 15), (15, 20)), "b": ((0, 5),), "h": ((0, 6),), "e": ((0, 7),)},),
    2: ({"w": ((5, 10), (15, 20)), "b": ((0, 5),)}, {"w": ((0, 5), (10, 15)), "h": ((0, 6),), "e": ((0, 7),)}),
}
_ROWS_HELD = {1: (12,), 2: (8, 4)}  # rows of ROW_TABLE on each shard
SHAPES = [(1, False), (2, False), (2, True)]  # (shards, backups)


def _tensor(name: str, parts: tuple[tuple[int, int], ...]) -> TensorInfo:
    shape, dtype, opt, params = _TENSORS[name]
    spec = ps_pb2.TensorSpec(name=name, shape=shape, dtype=dtype, grad_dtype=dtype,  # type: ignore[arg-type]
                             optimizer=ps_pb2.OptimizerSpec(name=opt, params_json=params),
                             parts=[ps_pb2.Part(start=a, stop=b) for a, b in parts])
    return TensorInfo(name, shape, dtype, dtype, parts, spec)


def job_target(num_shards: int, backups: bool, sync: str) -> fuzz.Target:
    """The Target ``Fuzzer.describe`` gives for prepare_job's job (2 workers, 2 steps each) of ``num_shards``."""
    rows = ps_pb2.RowTableSpec(
        name=ROW_TABLE, dim=ROW_DIM, keys="int64", seed=1, init_json='{"kind": "normal", "mean": 0.0, "std": 1.0}',
        optimizer=ps_pb2.OptimizerSpec(name="sparse_adam", params_json='{"betas": [0.9, 0.999], "eps": 1e-08, '
                                                                       '"lr": 0.1}'))
    shards = tuple(
        ShardInfo(i, 2, sync, 2, (0, 1), {0: 1, 1: 1}, {n: _tensor(n, p) for n, p in held.items()}, 0.0,
                  row_tables={ROW_TABLE: RowTableInfo(rows, _ROWS_HELD[num_shards][i])})
        for i, held in enumerate(_LAYOUT[num_shards]))
    return fuzz.Target(shards, backups=tuple(range(num_shards)) if backups else ())


GENERATORS: dict[str, Callable[[fuzz.Source, fuzz.Target, bool], fuzz.Case]] = dict(fuzz.KINDS)


TARGETS = [job_target(n, backups, sync) for n, backups in SHAPES for sync in SYNCS]


@pytest.mark.parametrize("kind", sorted(GENERATORS))
def test_generator_builds_a_case_for_every_seed(kind: str) -> None:
    """``kind``'s generator, over SEEDS seeds (each with the next job shape), returns a Case and raises
    nothing; with known bugs avoided and not, by turns."""
    gen = GENERATORS[kind]
    failures = []
    for seed in range(SEEDS):
        target = TARGETS[seed % len(TARGETS)]
        try:
            case = gen(fuzz.RandomSource(random.Random(seed)), target, bool(seed % 2))
        except Exception as e:  # noqa: BLE001 - any exception is a generator defect
            shape = f"{len(target.shards)} shard(s), backups {bool(target.backups)}, {target.shards[0].sync}"
            failures.append(f"seed {seed} ({shape}): {type(e).__name__}: {e}")
            continue
        assert isinstance(case, fuzz.Case)
        for m in case.messages or ():
            m.SerializeToString()  # every field set fits its type
    assert not failures, f"{len(failures)} generator defect(s) in {kind}:\n" + "\n".join(failures[:20])


def test_a_row_push_built_with_wrong_grads_never_has_grads_that_fit_its_keys() -> None:
    """``short_grads`` and ``long_grads`` drawn together may cancel out (a cut of 4 x dim bytes, then as many
    added): a valid push, applied, that the fuzzer expected refused (seed 3251861101, 2 shards with backups)."""
    gen = GENERATORS["push_rows"]
    seen = 0
    for seed in range(20 * SEEDS):  # the two drawn together, and cancelling, are rare
        case = gen(fuzz.RandomSource(random.Random(seed)), TARGETS[seed % len(TARGETS)], bool(seed % 2))
        if set(case.defects) & {"short_grads", "long_grads"} and set(case.defects) <= {"short_grads", "long_grads"}:
            seen += 1
            assert any(len(m.grads) != len(m.keys) // 8 * m.dim * 4 for m in case.messages or ()), (seed, case)
    assert seen


class _RunsOut(fuzz.RandomSource):
    """A RandomSource whose integer choices fail after ``n`` of them: any generator raises partway through."""

    def __init__(self, seed: int, n: int) -> None:
        super().__init__(random.Random(seed))
        self.left = n

    def integer(self, lo: int, hi: int) -> int:
        self.left -= 1
        if self.left < 0:
            raise ValueError("Value out of range: 4294967296")
        return super().integer(lo, hi)


def test_draw_case_returns_a_generator_exception_as_a_defect() -> None:
    """draw_case gives the exception of a generator, and the generator's line, instead of raising it; the
    same source goes on to draw the next case."""
    target = TARGETS[0]
    src = _RunsOut(0, 3)
    got = [fuzz.draw_case(src, target) for _ in range(3)]
    defects = [g for g in got if isinstance(g, fuzz.GeneratorDefect)]
    assert defects and all(d.error == "ValueError: Value out of range: 4294967296" for d in defects), got
    assert all(d.where.startswith(("gen_", "draws.py", "cases.py")) and " in " in d.where for d in defects), defects
    src.left = 10**9  # choices again: the next case is drawn as usual
    assert isinstance(fuzz.draw_case(src, target), fuzz.Case)
