"""The TCP bulk path (protos/tcpdata.py): a shard's tensor bytes on a TCP connection of their own.

``TcpPath`` is a ``ShardPath`` (worker/paths.py) for a shard on another
machine whose RegisterResponse gave a data port. gRPC carries the same
messages as the same-host path (chunks that say where their bytes lie);
the bytes travel on the data connection:

- a push sends each part's frame straight from the gradient's memory
  (already in its push dtype: this path does not write ahead) and then the
  message naming it, ``tcp-<seq>`` with a new seq per call;
- a pull names ``tcp-<seq>`` (a new seq per call): the shard sends the
  weights in one frame into this worker's pull buffer, filled by a
  ``Receiver`` thread, and ``read`` waits (with the RPC's deadline) for
  each answer's bytes.

Should the data connection end (the shard went, a broken frame), the path
goes off (``on_end``: ``ShardPaths.off``): the shard's next calls, a retry
included, take gRPC. ``close`` ends the connection and joins its thread.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from shardps.protos import codec, env, shm, tcpdata
from shardps.protos.security import Security
from shardps.protos.shardmap import ShardMap
from shardps.protos.shardps.v1 import ps_pb2
from shardps.worker.layout import Layout
from shardps.worker.paths import Frames, GrpcPath, Routing, Staged
from shardps.worker.pushframes import PushFramer

log = logging.getLogger("shardps.worker")


def wanted(security: Security) -> bool:
    """Whether this worker takes the TCP path where a shard offers it: ``SHARDPS_TCP`` (on by default), and
    never with TLS or tokens (the data connection has neither: the bytes then stay in gRPC)."""
    return env.pick_bool(None, env.TCP, True) and not security.tls and not security.any_token


class TcpLink:
    """One shard's data connection: where each part lies in the shard's push buffer, and our pull buffer."""

    def __init__(self, sock: socket.socket, shard: int, smap: ShardMap, layouts: Mapping[str, Layout],
                 on_end: Callable[[str], None]) -> None:
        self.shard, self.sock, self.timeout = shard, sock, sock.gettimeout() or 60.0
        self.offsets: dict[tuple[str, int], int] = {}
        at = pull = 0
        for p in smap.parts_for(shard):  # as ShmLink lays out its segments
            self.offsets[(p.name, p.start)] = at
            at = shm.aligned(at + (p.stop - p.start) * codec.itemsize(layouts[p.name].push_dtype))
            pull = shm.aligned(pull + (p.stop - p.start) * 4)
        self.push_bytes, self.pull_bytes = at, pull
        self.pull_buf = bytearray(max(1, pull))
        self.send_lock = threading.Lock()
        self.receiver = tcpdata.Receiver(sock, memoryview(self.pull_buf)[:pull], f"s{shard}", on_end)

    @staticmethod
    def open(host: str, port: int, token: bytes, shard: int, smap: ShardMap, layouts: Mapping[str, Layout],
             timeout: float, on_end: Callable[[str], None]) -> TcpLink | None:
        """Connect, say hello, wait for the shard's ACK (all within ``timeout``); None (logged) when that
        fails: the shard's bytes then go through gRPC."""
        try:
            sock = socket.create_connection((host.strip("[]"), port), timeout=timeout)
        except OSError as e:
            log.warning("shard %d: no data connection to %s:%d (%s): its bytes go through gRPC", shard, host, port, e)
            return None
        try:
            tcpdata.tune(sock, timeout)
            link = TcpLink(sock, shard, smap, layouts, on_end)
            sock.sendall(tcpdata.HELLO.pack(tcpdata.HELLO_MAGIC, token, link.push_bytes, link.pull_bytes, timeout))
            ack = bytearray(tcpdata.ACK.size)
            tcpdata.fill(sock, memoryview(ack))
            if tcpdata.ACK.unpack(ack) != (tcpdata.ACK_MAGIC, 0):
                raise OSError("the shard did not acknowledge")
        except (OSError, tcpdata.Torn) as e:
            log.warning("shard %d: data connection refused (%s): its bytes go through gRPC", shard, e)
            sock.close()
            return None
        link.receiver.start()
        return link

    def send(self, seq: int, offset: int, values: torch.Tensor) -> None:
        """Send ``values`` (contiguous, on the CPU) as a frame at ``offset`` of the shard's push buffer."""
        tcpdata.send_frame(self.sock, self.send_lock, seq, offset, _bytes(values))

    def close(self) -> None:
        self.receiver.close()


def _bytes(values: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy (bf16 too: numpy has no such dtype)."""
    flat = values.reshape(-1)
    if not flat.numel():
        return memoryview(b"")
    raw: Any = flat.view(torch.uint8).numpy()
    return memoryview(raw)


class TcpPath:
    """A shard's bytes on its data connection (``link``), the messages saying where (module docstring)."""

    writes_ahead = False

    def __init__(self, link: TcpLink, grpc: GrpcPath, lost: Callable[[TcpPath], None] = lambda p: None) -> None:
        self.link, self.grpc, self.shard = link, grpc, grpc.shard
        self._lost = lost
        self._push_seq = self._pull_seq = 0

    @staticmethod
    def open(address: str, answer: ps_pb2.RegisterResponse, grpc: GrpcPath, smap: ShardMap,
             layouts: Mapping[str, Layout], timeout: float, lost: Callable[[TcpPath], None]) -> TcpPath | None:
        """The path to the shard at ``address`` (``host:port`` of its gRPC server) through the data port its
        RegisterResponse (``answer``) gave; None (logged) when the connection cannot be made. ``lost(path)``
        runs when the connection ends by itself."""
        holder: list[TcpPath] = []

        def ended(why: str) -> None:
            quiet = why.startswith("connection closed between")  # the shard closed it (a Leave, a stop)
            log.log(logging.INFO if quiet else logging.WARNING,
                    "shard %d: data connection ended (%s): its bytes go through gRPC", grpc.shard, why)
            if holder:
                lost(holder[0])

        host = address.rsplit(":", 1)[0]
        link = TcpLink.open(host, answer.data_port, answer.data_token, grpc.shard, smap, layouts, timeout, ended)
        if link is None:
            return None
        holder.append(TcpPath(link, grpc, lost))
        if link.receiver.error:  # ended before the path was made
            link.close()
            return None
        return holder[0]

    @property
    def push_segment(self) -> str:
        """A new name for each call: the call's frames carry its seq."""
        self._push_seq += 1
        return tcpdata.segment_name(self._push_seq)

    @property
    def pull_segment(self) -> str:
        """A new name for each Pull: its answer's frame carries its seq."""
        self._pull_seq += 1
        return tcpdata.segment_name(self._pull_seq)

    def stage(self, flats: Mapping[str, torch.Tensor], parts: Sequence[tuple[str, int, int]] | None = None
              ) -> Staged | None:
        return None

    def read_values(self, staged: Staged | None, flats: Mapping[str, torch.Tensor], cast: set[str],
                    route: Routing) -> list[torch.Tensor]:
        return self.grpc.read_values(None, flats, cast, route)

    def _part(self, seq: int, name: str, flat: torch.Tensor, start: int, stop: int, route: Routing,
              cast: bool) -> ps_pb2.Chunk:
        """Send one part's frame; the chunk that names it."""
        lay = route.layouts[name]
        values = flat[start:stop]
        if cast:  # meant for shared memory (a fail-over): cast here
            values = values.to(codec.to_torch_dtype(lay.push_dtype))
        off = self.link.offsets[(name, start)]
        if values.numel():  # an empty part has no frame (the shard reads no bytes for it)
            self.link.send(seq, off, values.contiguous())
        return ps_pb2.Chunk(name=name, offset=start, dtype=lay.push_dtype, shape=lay.shape,  # type: ignore[arg-type]
                            shm_offset=off, shm_bytes=values.numel() * values.element_size())

    def push_messages(self, frames: Frames, staged: Staged | None, flats: Mapping[str, torch.Tensor],
                      cast: set[str], route: Routing) -> Iterator[bytes]:
        segment = self.push_segment
        seq = self._push_seq
        framer = frames(segment)
        assert route.shard_map is not None
        parts = route.shard_map.parts_for(self.shard)

        def messages() -> Iterator[bytes]:
            try:
                chunks = [self._part(seq, p.name, flats[p.name], p.start, p.stop, route, p.name in cast)
                          for p in parts if p.name in flats]
            except OSError as e:  # no message named the frames yet: this call's bytes go in its messages
                log.warning("shard %d: data connection failed (%s): its bytes go through gRPC", self.shard, e)
                self._lost(self)
                yield from self.grpc.push_messages(frames, None, flats, cast, route)
                return
            yield from framer.shm_chunks(chunks, last=True)

        return messages()

    def bucket_messages(self, frames: PushFramer, batch: Sequence[tuple[str, torch.Tensor]],
                        written: Mapping[str, Mapping[int, Sequence[ps_pb2.Chunk]]],
                        ranges: Mapping[str, Sequence[tuple[int, int]]], route: Routing) -> Iterator[bytes]:
        seq = self._push_seq  # the call's, named by its framer (push_segment, read as the call started)
        chunks = [self._part(seq, name, flat, start, stop, route, name in written)
                  for name, flat in batch for start, stop in ranges.get(name, ())]
        if chunks:
            yield from frames.shm_chunks(chunks, last=False)

    def pull_messages(self, numel: int, itemsize: int, chunk_bytes: int) -> int:
        return 1  # one per part

    def read(self, chunk: ps_pb2.Chunk) -> torch.Tensor:
        if not chunk.shm_bytes:
            return codec.decode(chunk.data, chunk.dtype)
        try:
            view = self.link.receiver.wait(self._pull_seq, chunk.shm_offset, chunk.shm_bytes, self.link.timeout,
                                           exact=False)
        except tcpdata.DataError as e:
            raise ValueError(f"shard {self.shard}, tensor {chunk.name!r}: {e}") from None
        return codec.decode(view, chunk.dtype)

    def close(self) -> None:
        self.link.close()
