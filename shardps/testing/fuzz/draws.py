"""The names, values and optimizer params the generators draw (some steer clear of open bugs)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from shardps.protos.optim import spec_from_proto
from shardps.protos.shardps.v1 import ps_pb2
from shardps.protos.syncspec import SyncSpec
from shardps.testing.fuzz.bugs import avoiding
from shardps.testing.fuzz.cases import ITEMSIZE, Source

# -- names, values, optimizer params -------------------------------------------


def _text(src: Source, avoid: bool, long_ok: bool = True) -> str:
    if not avoiding(avoid, "oversized-error-details") and long_ok and src.integer(0, 15) == 0:
        return src.text(40000)  # error details echo it: over gRPC's metadata limit (oversized-error-details)
    return src.text(24)


def unknown_name(src: Source, existing: Sequence[str] | Mapping[str, Any], avoid: bool) -> str:
    name = src.choice(["", "w ", "W", "w\x00", "b.", "\u00e9", "\U0001f600", "x" * 200, "<text>"])
    if name == "<text>":
        name = _text(src, avoid)
    while name in existing:
        name += "?"
    return name


def values(src: Source, n: int, dtype: int) -> bytes:
    size = ITEMSIZE.get(dtype, 4)  # type: ignore[call-overload]  # a wire dtype: an int of the enum, or any
    return src.binary(n * size, n * size)


VALID_OPTIMIZERS = (("sgd", ""), ("sgd", '{"lr": 0.5, "momentum": 0.9}'),
                    ("adam", '{"lr": 0.001, "betas": [0.9, 0.99]}'),
                    ("adamw", "{}"), ("adafactor", "{}"), ("sm3", '{"lr": 0.1}'))


def _refused_by_optimizer_parse(name: str, params_json: str) -> bool:
    try:
        spec_from_proto(ps_pb2.OptimizerSpec(name=name, params_json=params_json))
    except Exception:  # noqa: BLE001 - any failure: the server refuses it too (or hits a known bug)
        return True
    return False


def bad_params_json(src: Source, opt: str, avoid: bool) -> str:
    """params_json that ``opt`` refuses: not JSON, not an object, unknown keys or bad values."""
    modes = [0, 1, 2, 3, 4]
    if not avoiding(avoid, "json-int-overflow"):
        modes.append(5)
    if not avoiding(avoid, "json-recursion"):
        modes.append(6)
    mode = src.choice(modes)
    if mode == 0:
        text = src.text(40)
    elif mode == 1:
        text = src.choice(["[]", "1", '"x"', "null", "true", "{", "{'lr': 1}", "{lr: 1}", '{"lr": }', "\x00",
                           '{"lr": 1,}', "[" * 40, "{" * 40])
    elif mode == 2:
        text = json.dumps({src.text(12) or "?": src.choice([1, 0.5, None, "x", [1]])})
    elif mode in (3, 4):
        key = src.choice(["lr", "momentum", "betas", "eps", "weight_decay", "nesterov", "amsgrad", "beta1",
                          "decay_rate", "clip_threshold", "relative_step"])
        value = src.choice(["-1", "-1e-300", "NaN", "Infinity", "-Infinity", '"fast"', "[1, 2, 3]", "{}", "null",
                            "[0.9]", "[0.9, 2.0]", "2", "1e400", '"NaN"'])
        text = f'{{"{key}": {value}}}'
    elif mode == 5:  # json-int-overflow: an integer too large for a float
        text = '{"lr": 1' + "0" * src.integer(309, 400) + "}"
    else:  # json-recursion: nesting deeper than Python's recursion limit
        text = "[" * src.integer(2000, 100000)
    if not text or not _refused_by_optimizer_parse(opt, text):
        text = '{"no_such_hyperparameter": 1}'
    return text


def bad_sync_string(src: Source, avoid: bool) -> str:
    s = src.choice(["", "BSP!", "every:0", "every:-1", "every:", "every:x", "ssp:-1", "ssp:", "ssp:1.5", "async",
                    "every:" + "9" * 5000, "<text>"])
    if s == "<text>":
        s = _text(src, avoid)
    try:
        SyncSpec.parse(s)
    except ValueError:
        return s
    return s + "!"  # every valid form ends in a letter or digit: this one no longer parses
