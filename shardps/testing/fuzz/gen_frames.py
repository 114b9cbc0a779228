"""Damaged frames for a server process's data port (protos/dataconn.py), each enough to be refused.

A case (``FrameCase``) is the bytes one connection sends after a valid hello:
raw bytes, frames torn at any point, extents reordered, past their buffer
or short of their part, lengths that disagree with what follows, unknown
kinds and routes, another worker's requests, streams that end early or go
on after their end, control that does not parse; a Push frame that carries
its Pull (``PUSH_PULL``) in half the cases that are answered, and carried
Pulls that are wrong themselves (another segment, slices, a buffer out of
range, another worker's, garbage, none of a Push beside). Every case carries at
least one defect that must keep the shard's state as it was: a torn or
protocol-breaking frame ends the connection unapplied; a frame that keeps
the protocol is answered with a refusal (a ``PUSH_PULL``'s twice: its
Push refused, its Pull ``NOT_MADE``). ``send_case`` sends one on a
connection of its own and ends its writing side, so the server reads
everything there is and then end-of-stream: what it does never depends on
timing. The judge (``judge_answers``): every answer is a refusal with a
status from ``REFUSALS`` and a message, never OK.
"""

from __future__ import annotations

import random
import socket
from dataclasses import dataclass, field

from shardps.protos import dataconn as wire
from shardps.protos.shardps.v1 import ps_pb2

DEFECTS = ("random_bytes", "bad_magic", "bad_kind", "torn_header", "torn_control", "torn_extent",
           "control_longer", "control_shorter", "extent_past_buffer", "reordered_extents_unknown_tensor",
           "part_missing", "part_short", "unknown_route", "other_worker", "stream_cut", "after_end",
           "over_limits", "control_garbage", "pull_with_extents", "closed_mid_frame", "whole_unknown_tensor",
           "carried_pull_bad")
REFUSALS = {3: "INVALID_ARGUMENT", 5: "NOT_FOUND", 7: "PERMISSION_DENIED", 9: "FAILED_PRECONDITION",
            14: "UNAVAILABLE", 4: "DEADLINE_EXCEEDED", 10: "ABORTED", wire.NOT_MADE: "NOT_MADE"}


@dataclass
class Shard:
    """What a case is built against: the shard's route, a tensor it holds and its flat size."""

    route: int
    tensor: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return 4 * n


@dataclass
class FrameCase:
    defect: str
    data: bytes
    calls: int = 0  # how many answers at most a well-behaved server sends
    notes: list[str] = field(default_factory=list)


def _message(worker_id: int, sh: Shard, *, name: str | None = None, offset: int = 0, nbytes: int | None = None,
             step: int = 0, last: bool = True, ends_with_last: bool = False, chunk_offset: int = 0) -> bytes:
    return ps_pb2.PushRequest(
        worker_id=worker_id, step=step, shm=wire.FRAME_SEGMENT, last=last, ends_with_last=ends_with_last,
        chunk=ps_pb2.Chunk(name=sh.tensor if name is None else name, offset=chunk_offset, dtype=ps_pb2.FLOAT32,
                           shape=list(sh.shape), shm_offset=offset,
                           shm_bytes=sh.nbytes if nbytes is None else nbytes)).SerializeToString()


def frame(kind: int, call: int, route: int, messages: list[bytes], extents: list[tuple[int, bytes]],
          buffer_bytes: int, *, magic: bytes = wire.REQUEST_MAGIC, nctl: int | None = None,
          next_: int | None = None) -> bytes:
    ctl = b"".join(wire.joined(messages))
    head = wire.REQUEST.pack(magic, kind, call, route, 5000, len(ctl) if nctl is None else nctl,
                             len(extents) if next_ is None else next_, buffer_bytes)
    return head + ctl + b"".join(wire.EXTENT.pack(o, len(b)) for o, b in extents) + b"".join(b for _, b in extents)


def _pull(worker_id: int, sh: Shard, **kw: object) -> bytes:
    """A Pull as a ``PUSH_PULL`` frame carries it (``kw``: fields to change)."""
    fields: dict[str, object] = dict(worker_id=worker_id, names=[sh.tensor], shm=wire.FRAME_SEGMENT,
                                     frame_bytes=sh.nbytes)
    fields.update(kw)
    return ps_pb2.PullRequest(**fields).SerializeToString()  # type: ignore[arg-type]


def make_case(rng: random.Random, sh: Shard, worker_id: int, defect: str | None = None) -> FrameCase:
    """One case (``defect``: that one, else drawn)."""
    d = defect or rng.choice(DEFECTS)
    call = rng.randrange(1, 2**40)
    n = sh.nbytes
    values = bytes(rng.getrandbits(8) for _ in range(min(n, 64))) + bytes(max(0, n - 64))
    carries = rng.random() < 0.5  # an answered Push case as a PUSH_PULL: its Pull first in the control
    kind, carried, answers = (wire.PUSH_PULL, [_pull(worker_id, sh)], 2) if carries else (wire.PUSH, [], 1)
    whole = frame(kind, call, sh.route, carried + [_message(worker_id, sh, name="no-such-tensor")], [(0, values)], n)
    if d == "random_bytes":
        return FrameCase(d, bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 300))))
    if d == "bad_magic":
        return FrameCase(d, frame(wire.PUSH, call, sh.route, [_message(worker_id, sh)], [(0, values)], n,
                                  magic=bytes(rng.getrandbits(8) for _ in range(4)).replace(b"S", b"X")))
    if d == "bad_kind":
        good = frame(wire.PUSH, call, sh.route, [_message(worker_id, sh)], [(0, values)], n)
        return FrameCase(d, good[:4] + bytes([rng.choice([0, 5, 9, 255])]) + good[5:])
    if d in ("torn_header", "torn_control", "torn_extent", "closed_mid_frame"):
        good = frame(wire.PUSH, call, sh.route, [_message(worker_id, sh)], [(0, values)], n)
        ctl_end = wire.REQUEST.size + len(b"".join(wire.joined([_message(worker_id, sh)])))
        cut = {"torn_header": rng.randrange(1, wire.REQUEST.size),
               "torn_control": rng.randrange(wire.REQUEST.size, ctl_end),
               "torn_extent": rng.randrange(ctl_end, len(good)),
               "closed_mid_frame": rng.randrange(1, len(good))}[d]
        return FrameCase(d, good[:cut])
    if d in ("control_longer", "control_shorter"):
        msg = carried + [_message(worker_id, sh)]
        real = len(b"".join(wire.joined(msg)))
        nctl = real + rng.randrange(1, 64) if d == "control_longer" else rng.randrange(0, real)
        return FrameCase(d, frame(kind, call, sh.route, msg, [(0, values)], n, nctl=nctl), calls=answers)
    if d == "extent_past_buffer":
        return FrameCase(d, frame(wire.PUSH, call, sh.route, [_message(worker_id, sh)],
                                  [(rng.randrange(1, 64), values)], n))
    if d == "reordered_extents_unknown_tensor":
        half = (n // 2) // 64 * 64 or 4
        ext = [(half, values[half:]), (0, values[:half])]
        return FrameCase(d, frame(kind, call, sh.route, carried + [_message(worker_id, sh, name="nope")], ext, n),
                         calls=answers)
    if d == "part_missing":
        return FrameCase(d, frame(kind, call, sh.route, carried + [_message(worker_id, sh)], [], n), calls=answers)
    if d == "part_short":
        k = rng.randrange(0, n)
        return FrameCase(d, frame(kind, call, sh.route, carried + [_message(worker_id, sh)], [(0, values[:k])], n),
                         calls=answers)
    if d == "unknown_route":
        return FrameCase(d, frame(kind, call, sh.route + rng.randrange(1000, 2**31),
                                  carried + [_message(worker_id, sh)], [(0, values)], n), calls=answers)
    if d == "other_worker":
        other = worker_id + rng.randrange(1, 1000)
        msgs = ([_pull(other, sh)] if carries and rng.random() < 0.5 else carried) + [_message(other, sh)]
        return FrameCase(d, frame(kind, call, sh.route, msgs, [(0, values)], n), calls=answers)
    if d == "carried_pull_bad":  # a valid Push (a duplicate of step 0: answered OK alone) whose Pull is wrong
        bad = rng.choice([_pull(worker_id, sh, shm=""), _pull(worker_id, sh, shm="seg-1"),
                          _pull(worker_id, sh, slices=[ps_pb2.TensorSlice(name=sh.tensor, dim=0, parts=2)]),
                          _pull(worker_id, sh, frame_bytes=-1), _pull(worker_id, sh, frame_bytes=wire.MAX_BUFFER + 1),
                          _pull(worker_id + rng.randrange(1, 1000), sh), b"\x07" + bytes(rng.randrange(0, 40)), None])
        msgs = [_message(worker_id, sh)] if bad is None else [bad, _message(worker_id, sh)]
        return FrameCase(d, frame(wire.PUSH_PULL, call, sh.route, msgs, [(0, values)], n), calls=2)
    if d == "stream_cut":  # a stream that ends before its last message: nothing of it applies
        part = frame(wire.PUSH_PART, call, sh.route, [_message(worker_id, sh, last=False, ends_with_last=True)],
                     [(0, values)], n)
        return FrameCase(d, part)
    if d == "after_end":  # a stream refused at its end (a defect), then a frame of it after that end
        end = frame(wire.PUSH_END, call, sh.route, [_message(worker_id, sh, name="nope")], [(0, values)], n)
        more = frame(wire.PUSH_PART, call, sh.route, [_message(worker_id, sh)], [(0, values)], n)
        return FrameCase(d, end + more, calls=2)
    if d == "over_limits":
        which = rng.choice(["ctl", "ext", "buf"])
        head = wire.REQUEST.pack(wire.REQUEST_MAGIC, wire.PUSH, call, sh.route, 5000,
                                 wire.MAX_CTL + 1 if which == "ctl" else 0,
                                 wire.MAX_EXTENTS + 1 if which == "ext" else 0,
                                 wire.MAX_BUFFER + 1 if which == "buf" else 0)
        return FrameCase(d, head + bytes(rng.randrange(0, 64)))
    if d == "control_garbage":
        # Never a valid PushRequest by chance (an empty or lucky one would be worker 0's duplicate of step 0,
        # rightly answered OK): a message whose first tag is field 0 (never valid), or control whose first
        # length runs past its end.
        junk = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 80)))
        if rng.random() < 0.5:
            bad = b"\x07" + junk
            ctl = wire.LEN.pack(len(bad)) + bad
        else:
            ctl = wire.LEN.pack(len(junk) + rng.randrange(1, 1000)) + junk
        head = wire.REQUEST.pack(wire.REQUEST_MAGIC, wire.PUSH, call, sh.route, 5000, len(ctl), 0, 0)
        return FrameCase(d, head + ctl, calls=1)
    if d == "pull_with_extents":
        req = ps_pb2.PullRequest(worker_id=worker_id, names=[sh.tensor], shm=wire.FRAME_SEGMENT).SerializeToString()
        return FrameCase(d, wire.REQUEST.pack(wire.REQUEST_MAGIC, wire.PULL, call, sh.route, 5000, len(req), 1, n)
                         + req + wire.EXTENT.pack(0, len(values)) + values)
    assert d == "whole_unknown_tensor"
    return FrameCase(d, whole, calls=answers)


def send_case(host: str, port: int, token: bytes, worker_id: int, case: FrameCase,
              timeout: float = 10.0) -> list[tuple[int, int, str]]:
    """Send ``case`` on a fresh connection (after a valid hello), end the writing side, and read every
    answer until the server closes: (call, status, message) each. ConnectionError when the hello is not
    acknowledged."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        wire.tune(sock, timeout)
        sock.sendall(wire.HELLO.pack(wire.HELLO_MAGIC, token, worker_id, timeout))
        if wire.ACK.unpack(wire.read_exact(sock, wire.ACK.size)) != (wire.ACK_MAGIC, 0):
            raise ConnectionError("the data port did not acknowledge the hello")
        try:
            sock.sendall(case.data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # the server closed it already (a frame it refused whole)
            pass
        out: list[tuple[int, int, str]] = []
        while True:
            try:
                head = wire.read_exact(sock, wire.ANSWER.size)
            except wire.Torn:
                return out
            magic, _, call, status, nctl, nbytes = wire.ANSWER.unpack(head)
            if magic != wire.ANSWER_MAGIC:
                raise AssertionError(f"an answer that is not one: {bytes(head)!r}")
            text = bytes(wire.read_exact(sock, nctl)).decode(errors="replace")
            wire.read_exact(sock, nbytes)
            out.append((call, status, text))


def judge_answers(case: FrameCase, answers: list[tuple[int, int, str]]) -> str:
    """'' when the answers keep the rules (module docstring), else what broke them."""
    if len(answers) > max(case.calls, 1):
        return f"{case.defect}: {len(answers)} answers, at most {max(case.calls, 1)} expected"
    for call, status, text in answers:
        if status == wire.OK:
            return f"{case.defect}: call {call} was answered OK"
        if status not in REFUSALS or not text:
            return f"{case.defect}: call {call} answered status {status} ({text[:200]!r})"
    return ""
