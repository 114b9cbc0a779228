"""Errors raised by the store and the request assembly, each naming a gRPC status.

The store carries no gRPC; ``service.py`` maps ``code`` to ``grpc.StatusCode``.
A request that raises one of these has changed nothing.
"""

from __future__ import annotations


class StoreError(Exception):
    code = "INTERNAL"


class InvalidArgument(StoreError):
    code = "INVALID_ARGUMENT"


class NotFound(StoreError):
    code = "NOT_FOUND"


class FailedPrecondition(StoreError):
    code = "FAILED_PRECONDITION"


class ResourceExhausted(StoreError):
    code = "RESOURCE_EXHAUSTED"


class DeadlineExceeded(StoreError):
    code = "DEADLINE_EXCEEDED"


class Unavailable(StoreError):
    code = "UNAVAILABLE"


class OutOfRange(StoreError):
    code = "OUT_OF_RANGE"


class Aborted(StoreError):
    """The job was rolled back (or this shard restarted): resync and redo from the rollback step."""

    code = "ABORTED"
