"""Regenerate the committed protobuf/gRPC stubs from ``ps.proto`` and ``experts.proto``.

Run ``make proto`` (or ``python -m shardps.codegen``). The stubs are
generated under the import path ``shardps.protos.shardps.v1`` by mapping the
virtual proto root ``shardps/protos`` onto the ``protos/`` folder (the
``shardps.protos`` package), so the generated ``ps_pb2_grpc.py`` imports
``shardps.protos.shardps.v1.ps_pb2`` as installed. ``generate(out_dir)``
writes to another folder, which the stub test compares. A tool of the
developers (``make proto``, tests/test_proto_stubs.py), not of the wire
contract: it lives beside the CLI, not in ``protos/``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from shardps import protos

PROTO_DIR = Path(protos.__file__).resolve().parent  # protos/ (installed as shardps.protos)
PROTO_FILES = ("shardps/v1/ps.proto", "shardps/v1/experts.proto")
GENERATED = ("ps_pb2.py", "ps_pb2.pyi", "ps_pb2_grpc.py", "experts_pb2.py", "experts_pb2.pyi", "experts_pb2_grpc.py")


def generate(out_dir: Path) -> dict[str, str]:
    """Generate the stubs into a scratch folder; return {file name: text}."""
    import grpc_tools
    from grpc_tools import protoc  # dev dependency only

    include = Path(grpc_tools.__file__).resolve().parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-Ishardps/protos={PROTO_DIR}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
        ] + [f"shardps/protos/{p}" for p in PROTO_FILES]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}: {' '.join(args)}")
        gen = Path(tmp) / "shardps" / "protos" / "shardps" / "v1"
        texts = {name: (gen / name).read_text() for name in GENERATED}
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (out_dir / name).write_text(text)
    return texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=PROTO_DIR / "shardps" / "v1")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        texts = generate(Path(tmp))
        for name in texts:
            shutil.copy(Path(tmp) / name, args.out / name)
    print(f"wrote {', '.join(GENERATED)} to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
