"""Child processes die with the process that started them, even when it is SIGKILLed.

The parent keeps the write end of a pipe and hands each child the read end
(``Lifeline.spawn_kwargs()``). Nothing is ever written: when the parent exits,
however it exits, the kernel closes the write end and the child's read
returns EOF. The child (``watch_parent()``, called by the ``shardps``
command) then stops as on SIGTERM: a server checkpoints and exits, a worker
exits. If it is still alive ``grace`` seconds later it exits hard.

A pipe rather than Linux's ``PR_SET_PDEATHSIG``: that fires when the
*thread* that forked the child ends, and needs ``preexec_fn``, which is not
safe in a process with threads.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

log = logging.getLogger("shardps")

#: Set by the parent for its children only: the fd of the pipe's read end.
LIFELINE_FD = "SHARDPS_LIFELINE_FD"
DEFAULT_GRACE_S = 30.0


class Lifeline:
    """The parent's side: open while the parent lives; ``close()`` releases every child at once."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()  # both close-on-exec; the read end is passed explicitly

    def spawn_kwargs(self, env: dict[str, str] | None = None) -> dict[str, Any]:
        """Keyword arguments for ``subprocess.Popen`` that tie the child to this process."""
        if self._read < 0:
            raise RuntimeError("this lifeline is closed")
        child_env = dict(os.environ if env is None else env)
        child_env[LIFELINE_FD] = str(self._read)
        return {"pass_fds": (self._read,), "env": child_env}

    @property
    def read_fd(self) -> int:
        """The read end a child watches (``spawn(lifeline_fd=)``)."""
        if self._read < 0:
            raise RuntimeError("this lifeline is closed")
        return self._read

    def close(self) -> None:
        """Children watching this lifeline stop (call after stopping them, or to make them stop)."""
        for fd in (self._read, self._write):
            if fd >= 0:
                os.close(fd)
        self._read = self._write = -1


def watch_parent(grace: float = DEFAULT_GRACE_S) -> bool:
    """In a child: stop when the parent's lifeline breaks. False when this process has none."""
    value = os.environ.pop(LIFELINE_FD, None)
    if value is None:
        return False
    try:
        fd = int(value)
        os.fstat(fd)
    except (ValueError, OSError):
        log.warning("%s=%r is not an open file descriptor: not watching the parent", LIFELINE_FD, value)
        return False

    def watch() -> None:
        try:
            while os.read(fd, 4096):  # nothing is ever written: this returns only at EOF
                pass
        except OSError:
            pass
        log.warning("the process that started this one (pid %d) is gone: stopping", os.getppid())
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace)  # a deadline for the graceful stop, not a wait for an event
        os._exit(1)

    threading.Thread(target=watch, name="shardps-lifeline", daemon=True).start()
    return True
