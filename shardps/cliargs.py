"""The types of the ``shardps`` command's flags, shared by its subcommands' modules (shardps/cli.py,
shardps/cli_ray.py): each parses one flag's text or says what it expected."""

from __future__ import annotations

import argparse

from shardps.protos.optim import SPECS

# Choices come from the registries that accept them. (Ray's placement strategies, --strategy, are
# spelt out in shardps/cli_ray.py: their registry, shardps.deploy.ray.placement, imports Ray.)
OPTIMIZERS = tuple(SPECS)  # the optimizer specs the servers know (shardps.protos.optim)


def addresses(text: str) -> list[str]:
    out = [a.strip() for a in text.split(",") if a.strip()]
    if not out:
        raise argparse.ArgumentTypeError("expected comma-separated HOST:PORT addresses")
    return out


def positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return n


def sync_mode(text: str) -> str:
    from shardps.protos.syncspec import SyncSpec

    try:
        return str(SyncSpec.parse(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def rate(text: str) -> str:
    from shardps.deploy.netsim import parse_rate

    try:
        parse_rate(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def host_rate(text: str) -> tuple[str, str]:
    host, sep, rate_text = text.partition("=")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"expected HOST=RATE (e.g. h5=100mbit), got {text!r}")
    return host, rate(rate_text)


def compress_spec(text: str) -> str:
    """``--compress``: a spec ``shardps.compress.parse`` accepts, kept as text (``none`` without importing
    torch, so that the parser stays light)."""
    if text == "none":
        return text
    from shardps.worker.compress import parse

    try:
        parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def compress_flags(p: argparse.ArgumentParser) -> None:
    """``--compress SPEC`` (checked by ``parse``, kept as text) and ``--compress-warmup N``: the worker's and
    the demo's flags."""
    p.add_argument("--compress", type=compress_spec, default="none", metavar="SPEC",
                   help="compress gradients: none, topk:RATIO (e.g. topk:0.01) or powersgd:RANK, with error "
                        "feedback (docs/compression.md)")
    p.add_argument("--compress-warmup", type=int, default=0, metavar="N",
                   help="with --compress: the first N pushes go dense (default 0)")
