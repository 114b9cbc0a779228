"""A fork server: ``shardps server`` and ``shardps worker`` processes forked from one that imported torch once.

A fresh ``python -m shardps server`` spends about 2 CPU-seconds importing torch before it serves anything
(docs/history/performance-log.md, "The test suite's time"). ``LocalCluster(processes=True)`` and ``shardps demo`` start
theirs through ``spawn()`` instead: the first call starts one fork server for this process (``python -m
shardps.forkserver``), which imports torch and shardps's server and worker modules and then waits. Each
``spawn()`` asks it to fork; the child becomes ``python -m shardps ARGS`` (its command line in ``ps`` too,
through ``setproctitle``) and a server is ready at once, not after torch's import (benchmarks/spawn.py).

What a forked child gets, as a ``subprocess.Popen`` child would: the environment and working directory
given, stdout and stderr each a pipe to the caller or the caller's own, a session of its own, and the
caller's lifeline (deploy/lifeline.py). Its stdin is /dev/null. The caller's ``ForkedProcess`` has
``Popen``'s ``pid``, ``stdout``, ``stderr``, ``returncode``, ``poll``, ``wait``, ``communicate``,
``terminate``, ``kill`` and ``send_signal``; exit codes come from the fork server, which is the child's
parent. Signals go through a pidfd, so they never reach a recycled pid. Two differences a user may see:
the child's parent is the fork server, and ``/proc/PID/environ`` shows the environment the fork server
was started with (the child's own is in ``os.environ``). The fork server never initialises CUDA, so a
child may.

It falls back to a plain ``subprocess.Popen`` (the same command line) when ``SHARDPS_FORK=0``, when an
environment variable that a library reads while it is imported (``OMP_*``, ``MKL_*``, ``CUDA_*``, ``LD_*``,
``PYTHON*``, ...) differs from the fork server's, or when the fork server cannot be started. The fork
server ends when this process does (it reads EOF on its socket); its children then stop through their
lifelines, as before.
"""

from __future__ import annotations

import io
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any, Union

from shardps.protos import env as env_names

log = logging.getLogger("shardps")

#: Environment variables that libraries read when they are imported or loaded (so a forked child would
#: not see a new value): a child whose environment differs from the fork server's in one is started fresh.
IMPORT_TIME_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "CUDA_", "NCCL_", "TORCH", "PYTORCH_",
                        "LD_", "PYTHON", "GRPC_", "MALLOC_", "GLIBC_")
#: ... except these, which Python or shardps read at run time. PYTHONBREAKPOINT is read by each breakpoint()
#: call; ``ray.init`` sets it in its driver's environment (and leaves it): had it counted, every process a Ray
#: driver spawned after it would have differed from a fork server started before it, and started fresh.
RUN_TIME = ("PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONBREAKPOINT")
_START_TIMEOUT_S = 120.0
MAX_MSG = 1 << 20
#: The fork server's last argument, spaces: the room for its children's command lines (setproctitle writes
#: over argv only, SPT_NOENV, so that /proc/PID/environ still shows the environment it was started with).
TITLE_ROOM = 4096


def child_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment a process shardps starts gets: ``environ``, with OpenMP's idle threads asleep where it
    says nothing of them (``protos/env.py`` ``openmp_defaults``), as the fork server's own."""
    return {**environ, **env_names.openmp_defaults(environ)}


def import_time_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` that a forked child could not change (IMPORT_TIME_PREFIXES)."""
    return {k: v for k, v in environ.items() if k.startswith(IMPORT_TIME_PREFIXES) and k not in RUN_TIME}


class ForkedProcess:
    """A child of the fork server, with ``subprocess.Popen``'s interface for what shardps uses."""

    def __init__(self, pid: int, pidfd: int, args: list[str], stdout: io.TextIOWrapper | None,
                 stderr: io.TextIOWrapper | None) -> None:
        self.pid = pid
        self.args = args
        self.stdin: io.TextIOWrapper | None = None  # /dev/null, as Popen(stdin=DEVNULL) has it
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self._ended = threading.Event()
        self._readers: list[threading.Thread] | None = None
        self._out: dict[int, str] = {}
        self._pidfd: int | None = pidfd  # opened by the fork server, before the child could be reaped
        self._pidfd_lock = threading.Lock()  # no signal through a pidfd being closed (its number reused)

    def _set_exit(self, code: int) -> None:
        with self._pidfd_lock:
            self.returncode = code
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def communicate(self, input: str | None = None, timeout: float | None = None) -> tuple[str | None, str | None]:
        """The rest of stdout and stderr (where pipes; else None), once the child has ended; TimeoutExpired
        at the deadline (call again to go on waiting, as with Popen). ``input``: none (stdin is /dev/null)."""
        if input:
            raise ValueError("a forked child's stdin is /dev/null: no input")
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._readers is None:
            self._readers = []
            for i, stream in enumerate((self.stdout, self.stderr)):
                if stream is not None:
                    t = threading.Thread(target=self._drain, args=(i, stream), daemon=True,
                                         name=f"shardps-pipe-{self.pid}-{i + 1}")
                    t.start()
                    self._readers.append(t)
        for t in self._readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self._out.get(0), self._out.get(1)

    def _drain(self, i: int, stream: io.TextIOWrapper) -> None:
        self._out[i] = stream.read()
        stream.close()

    def send_signal(self, sig: int) -> None:
        with self._pidfd_lock:
            if self.returncode is not None or self._pidfd is None:
                return
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass  # ended, not yet reported

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


Process = Union["subprocess.Popen[str]", ForkedProcess]


class Spawner:
    """The caller's side of one fork server (``spawner()`` gives this process's)."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self.environ = child_env(os.environ if environ is None else environ)
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # one request at a time: replies come in order
        self._replies: dict[int, dict[str, Any]] = {}
        self._reply_ready = threading.Condition()
        self._children: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}
        self._next_id = 0
        self._closed = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self, timeout: float = _START_TIMEOUT_S) -> Spawner:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            env = dict(self.environ, PYTHONUNBUFFERED="1")
            self._proc = subprocess.Popen([sys.executable, "-m", "shardps.forkserver", str(theirs.fileno()),
                                           " " * TITLE_ROOM],
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env,
                                          pass_fds=(theirs.fileno(),), start_new_session=True)
        finally:
            theirs.close()
        self._sock = ours
        ours.settimeout(timeout)
        try:
            hello = ours.recv(MAX_MSG)
        except TimeoutError:
            self.close()
            raise TimeoutError(f"the fork server (pid {self._proc.pid}) did not start within {timeout:.0f}s") from None
        if not hello:
            code = self._proc.wait(timeout=30)
            self._sock = None
            raise RuntimeError(f"the fork server exited with {code} before it was ready (its stderr is above)")
        ours.settimeout(None)
        threading.Thread(target=self._read, name="shardps-spawner", daemon=True).start()
        return self

    def _read(self) -> None:
        sock = self._sock
        assert sock is not None
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(sock, MAX_MSG, 1)
            except OSError:
                data, fds = b"", []
            if not data:
                break
            msg = json.loads(data)
            if msg.get("op") == "spawned":
                msg["pidfd"] = fds[0]  # the child's, from its parent
            else:
                for fd in fds:
                    os.close(fd)
            if msg.get("op") == "exit":
                with self._reply_ready:
                    child = self._children.pop(msg["pid"], None)
                    if child is None:
                        self._early_exits[msg["pid"]] = msg["code"]
                if child is not None:
                    child._set_exit(msg["code"])
            else:
                with self._reply_ready:
                    self._replies[msg["id"]] = msg
                    self._reply_ready.notify_all()
        # The fork server is gone: its children are no one's to reap; wait for each through its pidfd.
        with self._reply_ready:
            self._closed = True
            orphans = list(self._children.values())
            self._children.clear()
            self._reply_ready.notify_all()
        for child in orphans:
            threading.Thread(target=_await_orphan, args=(child,), daemon=True).start()

    def popen(self, args: Sequence[str], *, env: Mapping[str, str], stdout: int | IO[str] | None = subprocess.PIPE,
              stderr: int | IO[str] | None = None, lifeline_fd: int | None = None, cwd: str | None = None,
              timeout: float = 30.0, host: tuple[str, str] | None = None) -> ForkedProcess:
        """Fork ``python -m shardps ARGS``. ``stdout``, ``stderr``: ``subprocess.PIPE``, None (this process's
        own) or an open file; ``lifeline_fd``: the read end of the Lifeline the child watches; ``host``:
        (network namespace, /dev/shm directory) of a simulated host the child runs in (``netns.enter_host``)."""
        if self._sock is None or self._closed:
            raise RuntimeError("the fork server is not running")
        ours: list[int] = []  # the read ends of the pipes asked for, in order
        theirs: list[int] = []  # what the child gets as fds 1 and 2
        made: list[int] = []  # of those, the write ends made here (closed once sent)
        for own, choice in ((1, stdout), (2, stderr)):
            if choice == subprocess.PIPE:
                r, w = os.pipe()
                ours.append(r)
                theirs.append(w)
                made.append(w)
            elif choice is None:
                theirs.append(own)
            elif hasattr(choice, "fileno"):  # an open file of the caller's (a log): the child writes to it too
                theirs.append(choice.fileno())
            else:
                raise ValueError(f"stdout and stderr must be subprocess.PIPE, None or a file, got {choice!r}")
        fds = theirs + ([lifeline_fd] if lifeline_fd is not None else [])
        req = {"op": "spawn", "args": list(args), "env": dict(env), "cwd": cwd or os.getcwd(),
               "lifeline": lifeline_fd is not None, "host": list(host) if host else None}
        try:
            with self._lock:
                self._next_id += 1
                req["id"] = rid = self._next_id
                socket.send_fds(self._sock, [json.dumps(req).encode()], fds)
                with self._reply_ready:
                    if not self._reply_ready.wait_for(lambda: rid in self._replies or self._closed, timeout):
                        raise TimeoutError(f"the fork server did not answer within {timeout:.0f}s")
                    if rid not in self._replies:
                        raise RuntimeError("the fork server ended")
                    reply = self._replies.pop(rid)
            if "error" in reply:
                raise RuntimeError(f"the fork server could not fork: {reply['error']}")
        except BaseException:
            for fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in made:
                os.close(fd)
        pipes = iter(open(fd, encoding="utf-8") for fd in ours)  # noqa: SIM115 - the caller closes them
        child = ForkedProcess(reply["pid"], reply["pidfd"], [sys.executable, "-m", "shardps", *args],
                              next(pipes) if stdout == subprocess.PIPE else None,
                              next(pipes) if stderr == subprocess.PIPE else None)
        with self._reply_ready:
            code = self._early_exits.pop(child.pid, None)
            if code is None:
                self._children[child.pid] = child
        if code is not None:
            child._set_exit(code)
        return child

    def close(self) -> None:
        """End the fork server (its children go on: they end through their own lifelines)."""
        if self._sock is not None:
            self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        if self._proc is not None:
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=30)


def _await_orphan(child: ForkedProcess) -> None:
    pidfd = child._pidfd
    if pidfd is not None:
        select.select([pidfd], [], [])  # the child's end: a pidfd turns readable when it exits
    log.warning("pid %d ended after its fork server did: its exit code is not known (255)", child.pid)
    child._set_exit(255)


_shared: Spawner | None = None
_shared_pid = 0  # the process that started _shared (a forked copy of this process starts its own)
_shared_lock = threading.Lock()


def spawner() -> Spawner | None:
    """This process's fork server, started on first use; None when SHARDPS_FORK=0 or it cannot start."""
    global _shared, _shared_pid
    if not env_names.pick_bool(None, env_names.FORK, True):
        return None
    with _shared_lock:
        if _shared is not None and not _shared._closed and _shared_pid == os.getpid():
            return _shared
        try:
            _shared, _shared_pid = Spawner().start(), os.getpid()
        except (OSError, RuntimeError, TimeoutError) as e:
            log.warning("no fork server (%s): starting processes fresh", e)
            return None
        return _shared


def spawn(args: Sequence[str], *, env: Mapping[str, str], stdout: int | None = subprocess.PIPE,
          stderr: int | None = None, lifeline_fd: int | None = None) -> Process:
    """Start ``python -m shardps ARGS`` in a session of its own: forked by this process's fork server where it
    can be, else with subprocess.Popen. ``stdout``, ``stderr``: ``subprocess.PIPE`` or None (inherited);
    ``lifeline_fd``: the read end of the Lifeline the child watches (deploy/lifeline.py)."""
    env = child_env(env)
    sp = spawner()
    if sp is not None and import_time_env(env) == import_time_env(sp.environ):
        try:
            return sp.popen(args, env=env, stdout=stdout, stderr=stderr, lifeline_fd=lifeline_fd)
        except RuntimeError as e:
            log.warning("fork server: %s; starting the process fresh", e)
    fresh = dict(env)
    if lifeline_fd is not None:
        from shardps.deploy.lifeline import LIFELINE_FD
        fresh[LIFELINE_FD] = str(lifeline_fd)
    return subprocess.Popen([sys.executable, "-m", "shardps", *args], env=fresh, text=True, stdout=stdout,
                            stderr=stderr, start_new_session=True,
                            pass_fds=() if lifeline_fd is None else (lifeline_fd,))
