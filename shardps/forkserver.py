"""The fork server's side of deploy/spawn.py: ``python -m shardps.forkserver FD PADDING``.

It imports PRELOAD once, tells its caller (on the socket FD) that it is ready, and then forks on each
request. A child takes the request's stdout, stderr, environment, directory and session and runs ``shardps``'s
main as ``python -m shardps ARGS`` would; the fork server reports each child's exit code to the caller. It
exits when the caller's end of the socket closes. It starts no thread, and it never runs torch's thread
pools: a child starts them afresh.
"""

from __future__ import annotations

import io
import json
import os
import select
import signal
import socket
import sys
from typing import Any

from shardps.deploy.spawn import MAX_MSG

#: What the fork server imports before it forks anything (the modules ``shardps server`` and ``shardps
#: worker`` import before they serve or train).
PRELOAD = ("torch", "shardps.cli", "shardps.server.app", "shardps.server.service", "shardps.worker.client",
           "shardps.worker.optimizer", "shardps.examples.digits", "shardps.deploy.lifeline")


def _serve(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """Fork on each request, report each child's exit; return in a child (its request and fds), or None
    once the caller is gone."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller's Ctrl-C is the caller's to handle

    def send(msg: dict[str, Any], fds: list[int] | None = None) -> None:
        try:
            socket.send_fds(sock, [json.dumps(msg).encode()], fds or [])
        except OSError:
            pass  # the caller is gone: the loop sees EOF next

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            send({"op": "exit", "pid": pid, "code": os.waitstatus_to_exitcode(status)})

    sock.send(json.dumps({"op": "ready", "pid": os.getpid()}).encode())
    sock_fd = sock.fileno()
    while True:
        ready = select.select([sock_fd, wake_r], [], [])[0]
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
            reap()
        if sock_fd not in ready:
            continue
        msg, fds, _, _ = socket.recv_fds(sock, MAX_MSG, 8)
        if not msg:
            return None
        req = json.loads(msg)
        try:
            pid = os.fork()
        except OSError as e:
            send({"op": "failed", "id": req["id"], "error": str(e)})
            pid = -1
        if pid == 0:
            signal.set_wakeup_fd(-1)
            for fd in (wake_r, wake_w):
                os.close(fd)
            sock.close()
            return req, fds
        for fd in fds:
            os.close(fd)
        if pid > 0:
            # A pidfd opened here, by the parent, before the child can be reaped: it names this child and no
            # later process that gets its pid; the caller signals through it.
            pidfd = os.pidfd_open(pid)
            try:
                send({"op": "spawned", "id": req["id"], "pid": pid}, [pidfd])
            finally:
                os.close(pidfd)


def _become(req: dict[str, Any], fds: list[int]) -> None:
    """In a forked child: take the request's stdout, stderr, environment, directory and session, as a fresh
    ``python -m shardps`` started by subprocess.Popen would have them."""
    import random

    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.setsid()
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in fds[:2]:
        if fd > 2:
            os.close(fd)
    env = dict(req["env"])
    if req["lifeline"]:
        from shardps.deploy.lifeline import LIFELINE_FD
        env[LIFELINE_FD] = str(fds[2])
    os.environ.clear()
    os.environ.update(env)
    os.chdir(req["cwd"])
    sys.path[0] = req["cwd"]  # as `python -m` has it
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    out = io.FileIO(1, "w", closefd=False)
    sys.stdout = io.TextIOWrapper(out if unbuffered else io.BufferedWriter(out), encoding="utf-8",
                                  write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  write_through=True)
    random.seed()  # not the fork server's state, which every child would share


def _title(title: str) -> None:
    """The process's command line (``ps``, ``pgrep -f``); its name stays the interpreter's, as when fresh."""
    try:
        from setproctitle import setproctitle, setthreadtitle
    except ImportError:
        return
    setproctitle(title)
    setthreadtitle(os.path.basename(sys.executable)[:15])


def _main() -> int:
    fd = int(sys.argv[1])
    sock = socket.socket(fileno=fd)
    # setproctitle reads SPT_NOENV when it first sets a title: the titles go over argv only (TITLE_ROOM in
    # deploy/spawn.py), so that /proc/PID/environ keeps showing the environment
    os.environ["SPT_NOENV"] = "1"
    _title(f"{sys.executable} -m shardps.forkserver (the fork server of pid {os.getppid()})")
    del os.environ["SPT_NOENV"]
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    from shardps.cli import build_parser

    build_parser()  # the modules its choices come from
    child = _serve(sock)
    if child is None:
        return 0
    return _run_child(*child)


def _run_child(req: dict[str, Any], fds: list[int]) -> int:
    import importlib.util

    _become(req, fds)
    if req.get("host"):  # a simulated host's process (deploy/netsim.py): its network namespace and /dev/shm
        from shardps.deploy.netns import enter_host

        enter_host(*req["host"])
    args = req["args"]
    _title(" ".join([sys.executable, "-m", "shardps", *args]))
    spec = importlib.util.find_spec("shardps.__main__")
    sys.argv = [spec.origin if spec is not None and spec.origin else "shardps", *args]
    from shardps.cli import main

    return main(list(args))


if __name__ == "__main__":
    sys.exit(_main())
