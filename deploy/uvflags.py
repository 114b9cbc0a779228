"""pip's settings as uv's flags: ``python deploy/uvflags.py`` prints them for ``uv pip install``.

``make venv`` installs with uv where it can (the same resolution as pip, a few times faster), and uv does
not read pip's configuration (pip.conf, ``PIP_*`` variables). This hands over the settings that change what
is installed: the index and extra indexes, find-links and constraints. Run with the venv's Python before
anything of the project is installed: it imports nothing but the standard library.
"""

from __future__ import annotations

import shlex
import subprocess
import sys

# pip's key (after "global."/"install."/":env:.") -> uv's flag
FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}


def flags(config_list: str) -> list[str]:
    """uv's flags for the lines of ``pip config list`` (``section.key='value'``; a list's items separated by
    whitespace). A key set in several places (a file, the environment) is given once per value."""
    out: list[str] = []
    seen: set[tuple[str, str]] = set()
    for line in config_list.splitlines():
        key, sep, raw = line.partition("=")
        if not sep:
            continue
        flag = FLAGS.get(key.rsplit(".", 1)[-1])
        if flag is None:
            continue
        for value in shlex.split(raw)[0].split() if raw.strip() else []:
            if (flag, value) not in seen:
                seen.add((flag, value))
                out += [flag, value]
    return out


def main() -> None:
    got = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                         timeout=60, check=False)
    print(" ".join(shlex.quote(f) for f in flags(got.stdout if got.returncode == 0 else "")))


if __name__ == "__main__":
    main()
