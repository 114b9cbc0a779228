"""A stream's messages agree: one check for every client stream a shard reads (Push, Register, Replicate).

A client stream carries its header either in every message (Push) or in
its first alone (Register, each op of Replicate). Either way a message that
says something else than the first is refused whole, INVALID_ARGUMENT
naming the field and the two values, before anything of the stream is used.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

from google.protobuf import text_format
from google.protobuf.message import Message

from shardps.server.errors import InvalidArgument


def _same(a: Any, b: Any) -> bool:
    return bool(a == b) or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def _show(value: Any) -> str:
    text = text_format.MessageToString(value, as_one_line=True) if isinstance(value, Message) else repr(value)
    if not isinstance(value, (Message, str, bytes, int, float, bool)):  # a repeated field
        text = repr([text_format.MessageToString(v, as_one_line=True) if isinstance(v, Message) else v
                     for v in value])
    return text if len(text) <= 80 else text[:77] + "..."


def mixed(rpc: str, index: int, field: str, first: Any, this: Any, why: str = "") -> InvalidArgument:
    """The error for message ``index`` of an ``rpc`` stream whose ``field`` is ``this``, its first's ``first``."""
    return InvalidArgument(f"{rpc} stream mixes headers: message {index} has {field} {_show(this)}, "
                           f"the first message {_show(first)}{why}")


def check_header(rpc: str, index: int, first: Message, msg: Message, fields: Sequence[str]) -> None:
    """INVALID_ARGUMENT unless message ``index`` (1 is the first) of an ``rpc`` stream carries its first
    message's ``fields``: a stream whose messages disagree is refused whole, before anything of it is used."""
    for f in fields:
        a, b = getattr(first, f), getattr(msg, f)
        if not _same(a, b):
            raise mixed(rpc, index, f, a, b)


def check_continuation(rpc: str, index: int, first: Message, msg: Message, own: Collection[str]) -> None:
    """For streams whose first message alone carries the header (Register, an op of Replicate): every field
    that message ``index`` sets, but its ``own`` ones, must be the first's (INVALID_ARGUMENT)."""
    for fd, value in msg.ListFields():
        if fd.name not in own and not _same(value, getattr(first, fd.name)):
            raise mixed(rpc, index, fd.name, getattr(first, fd.name), value)
