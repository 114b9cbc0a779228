"""Making a pipeline's ``SocketLink``s: one connection per pair of neighbouring stages, met at a rendezvous store.

Each stage but the last listens (TCP on its host's address and, on Linux, a
Unix socket with a random abstract name) and publishes both under the
pipeline group's name (``{name}/link/{stage}``); each stage but the first
reads its predecessor's, connects (over the Unix socket when both are on one
host and it answers: no TCP/IP stack between them; else TCP, as between two
hosts or two network namespaces of the simulated cluster) and greets it with
the group's name and its stage; then it accepts its successor and checks the
greeting. Every step has the caller's deadline. ``open_link`` chooses: these
connections on CPU, an nccl group (``GroupLink``) on GPUs.
"""

from __future__ import annotations

import os
import secrets
import select
import socket
import struct
import sys
import time
from typing import Any

import torch

from shardps.worker.groups import GroupSpec, open_group
from shardps.worker.pipeline.link import GroupLink
from shardps.worker.pipeline.socketlink import SocketLink

_HELLO = struct.Struct("<QII")  # magic, stage, length of the group's name (the name follows)
_HELLO_MAGIC = 0x4B4E494C53505350  # "PSPSLINK"


def _hello(name: str, stage: int) -> bytes:
    raw = name.encode()
    return _HELLO.pack(_HELLO_MAGIC, stage, len(raw)) + raw


def _read_exactly(sock: socket.socket, n: int, deadline: float, what: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            chunk = sock.recv(n - len(buf))
        except TimeoutError as e:
            raise TimeoutError(f"{what}: no greeting before the deadline") from e
        if not chunk:
            raise ConnectionError(f"{what}: the connection closed before its greeting")
        buf += chunk
    return bytes(buf)


def listen(host: str, backlog: int = 1, what: str = "link") -> list[socket.socket]:
    """A TCP listener on ``host`` and, on Linux, a Unix one (abstract name) that a peer on this host
    (and network namespace) uses instead: cheaper, no TCP/IP stack between the two. ``published``
    gives the address a peer passes to ``connect``."""
    listeners = [socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                      backlog=backlog)]
    if hasattr(socket, "AF_UNIX") and sys.platform.startswith("linux"):
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.bind(f"\0shardps-{what}-{os.getpid()}-{secrets.token_hex(8)}")
        unix.listen(backlog)
        listeners.append(unix)
    return listeners


def published(host: str, listeners: list[socket.socket]) -> str:
    """The address of ``listen``'s listeners that ``connect`` takes: ``host|port|unix name``."""
    unix_name = listeners[1].getsockname()[1:].decode() if len(listeners) > 1 else ""
    return f"{host}|{listeners[0].getsockname()[1]}|{unix_name}"


def connect(addr: str, host: str, deadline: float) -> socket.socket:
    """A connection to the listeners published as ``addr`` (by ``listen``; ``host``: this process's own
    address): the Unix one when the peer is on this host and it answers, else TCP."""
    peer_host, port, unix_name = addr.split("|", 2)
    left = max(0.001, deadline - time.monotonic())
    if unix_name and peer_host == host:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(left)
        try:
            sock.connect("\0" + unix_name)
            return sock
        except OSError:
            sock.close()  # another network namespace (a simulated host): over TCP
    sock = socket.create_connection((peer_host, int(port)), timeout=left)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the buffers are left to the kernel's autotuning
    return sock


def _accept(listeners: list[socket.socket], deadline: float, what: str) -> socket.socket:
    poll = select.poll()
    for listener in listeners:
        poll.register(listener.fileno(), select.POLLIN)
    ready = poll.poll(max(1, int((deadline - time.monotonic()) * 1000)))
    if not ready:
        raise TimeoutError(what)
    listener = next(x for x in listeners if x.fileno() == ready[0][0])
    listener.setblocking(True)
    sock, _ = listener.accept()
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def open_socket_link(store: Any, name: str, stage: int, num_stages: int, host: str, timeout: float) -> SocketLink:
    """Connect stage ``stage`` of ``num_stages`` to its neighbours through ``store`` (a rendezvous store:
    ``worker/groups.py``), under ``name`` (unique per pipeline group and forming); ``host``: the address
    the neighbours reach this process at. Every stage of the group calls this at once; each blocks until
    its connections are made, at most ``timeout`` seconds."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in [0, {num_stages}), got {stage}")
    deadline = time.monotonic() + timeout
    socks: dict[int, socket.socket] = {}
    listeners: list[socket.socket] = []
    try:
        if stage + 1 < num_stages:
            listeners = listen(host)
            store.set(f"{name}/link/{stage}", published(host, listeners))
        if stage > 0:
            addr = store.get(f"{name}/link/{stage - 1}").decode()  # waits for it (the store's deadline)
            sock = connect(addr, host, deadline)
            socks[stage - 1] = sock
            sock.sendall(_hello(name, stage))
        if listeners:
            sock = _accept(listeners, deadline, f"pipeline group {name}: stage {stage + 1} did not connect to "
                                                f"stage {stage} within {timeout:g}s")
            socks[stage + 1] = sock
            what = f"pipeline group {name}: stage {stage}'s connection from stage {stage + 1}"
            magic, peer, length = _HELLO.unpack(_read_exactly(sock, _HELLO.size, deadline, what))
            got = _read_exactly(sock, length, deadline, what).decode(errors="replace") if magic == _HELLO_MAGIC else ""
            if (magic, peer, got) != (_HELLO_MAGIC, stage + 1, name):
                raise ConnectionError(f"{what}: expected stage {stage + 1} of {name!r}, got stage {peer} of {got!r}")
    except BaseException:
        for s in socks.values():
            s.close()
        raise
    finally:
        for listener in listeners:
            listener.close()
    return SocketLink(socks, stage, num_stages)


def open_link(store: Any, name: str, stage: int, num_stages: int, host: str, timeout: float,
              device: torch.device) -> SocketLink | GroupLink:
    """Stage ``stage``'s link to its neighbours: a ``SocketLink`` when it computes on CPU, a ``GroupLink``
    over an nccl group of the pipeline's stages (stage s its rank s) when on a GPU."""
    if device.type == "cuda":
        return GroupLink(open_group(store, GroupSpec(name, stage, num_stages, "nccl", timeout), host), stage,
                         num_stages, device)
    return open_socket_link(store, name, stage, num_stages, host, timeout)
