"""raw_ps_native.c built and loaded: ``library()`` compiles it once per source (gcc, -O3) and loads it.

The shared object goes to the temporary directory under a name holding the source's hash, written to a
temporary name first and renamed, so processes that start at once (a benchmark's servers and workers) share
one build and never load half of one. A driver calls ``library()`` before it starts them, so that no timed
step waits on the compiler.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("raw_ps_native.c")
FLAGS = ["-O3", "-shared", "-fPIC", "-pthread"]

_lib: ctypes.CDLL | None = None
STEP = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)  # rps_serve's per-part step in Python (or None: C's)


class NativeUnavailable(RuntimeError):
    """The build failed: the native rows cannot run (a defect of the source or the flags)."""


class NoCompiler(NativeUnavailable):
    """No C compiler on this machine (gcc, cc or $CC): the native rows need one."""


def build() -> Path:
    """The shared object's path, compiled first if this source has not been."""
    text = SOURCE.read_bytes()
    digest = hashlib.sha256(text + " ".join(FLAGS).encode()).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / f"shardps-raw-ps-{digest}.so"
    if out.exists():
        return out
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise NoCompiler("the native raw parameter server needs a C compiler (gcc, cc or $CC): none found")
    partial = out.with_suffix(f".{os.getpid()}.tmp")
    try:
        done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(partial)], capture_output=True, text=True,
                              timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NativeUnavailable(f"building {SOURCE.name} with {cc} failed: {e}") from None
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise NativeUnavailable(f"building {SOURCE.name} with {cc} failed:\n{done.stderr[-2000:]}")
    os.replace(partial, out)
    return out


def library() -> ctypes.CDLL:
    """The loaded library (built if needed), its two calls typed. ctypes releases the interpreter's lock for
    each call."""
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(str(build()))
        p, i, n, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
        lib.rps_serve.argtypes = [i, p, p, p, p, p, i, p, p, n, f, i, STEP]
        lib.rps_serve.restype = i
        lib.rps_step.argtypes = [i, p, p, p, n, i, p, p, p, i, i]
        lib.rps_step.restype = i
        _lib = lib
    return _lib


def error() -> str:
    """The reason the last failed call gave."""
    return (ctypes.c_char * 512).in_dll(library(), "rps_error").value.decode(errors="replace")
