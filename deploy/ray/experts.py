"""Expert actors: the experts of ``shardps.nn.MoE(placement="send")`` run on Ray actors instead of in the
shards' processes (docs/moe.md, "Expert actors").

``start_expert_actors(servers)`` starts one ``ExpertActor`` per shard. Each
answers the calls of ``service Experts`` (experts.proto) for its shard's
experts, as the shard itself would (server/experts/service.py: the same ``Program``,
``run_forward`` and ``run_backward``): it holds the experts' TorchScript,
pulls the rows of the experts a call names from its shard (``PullRows``)
and, in ``Backward``, pushes their gradients to that shard alone
(``PushRows`` with the worker's id, step and num_workers: the worker's own
push of the step, under the same exactly-once and bsp rules; an empty one
when the call names no expert, so the shard counts the step; with ``hold``
it sends them to the shard to hold, ``PushRows`` with ``hold``, where they
are replicated as the shard's own holds and the step's push applies them:
an actor keeps nothing between calls, so one that Ray restarts goes on). The shard
stays the experts' home (its row optimizer, checkpoints and replication
hold them as any row table); what moves is the compute, to where an actor
can be placed: a node with a GPU, or spare cores.

The layer reaches an actor through ``ExpertActors.endpoint(shard)``: an
object with the gRPC stub's ``RegisterExpert``, ``Forward`` and
``Backward``, whose errors are ``grpc.RpcError``s with the status the shard
would answer (the layer registers the program again where an actor answers
that it has none, as it does for a shard).
"""

from __future__ import annotations

from collections.abc import Iterator
from types import TracebackType
from typing import Any

import grpc
import numpy as np
import ray
import torch

from shardps.protos import codec
from shardps.protos.rows import MAX_PULL_KEYS, rows_per_message
from shardps.protos.security import Security
from shardps.protos.shardps.v1 import experts_pb2, ps_pb2
from shardps.server.errors import StoreError
from shardps.server.experts.service import Program, check_program, decode, run_backward, run_forward
from shardps.server.rpc import details, status_code
from shardps.worker.datapath.reach import StatusError
from shardps.worker.datapath.transport import Transport

__all__ = ["ActorEndpoint", "ExpertActor", "ExpertActors", "start_expert_actors"]


class ExpertActor:
    """Runs shard ``shard``'s experts (of the job at ``addresses``) for ``MoE(placement="send")``. ``call``
    is its one remote method: a ``service Experts`` call by name, as bytes, answered ("OK", the answer's
    bytes) or (the gRPC status's name, its details)."""

    def __init__(self, addresses: list[str], shard: int, security: Security | None, timeout: float) -> None:
        self.transport = Transport(addresses, security=security or Security(), timeout=timeout,
                                   recovery_timeout=timeout)
        self.shard, self.timeout = shard, timeout
        self.programs: dict[str, Program] = {}
        self.calls = {"RegisterExpert": 0, "Forward": 0, "Backward": 0}

    def call(self, method: str, data: bytes) -> tuple[str, bytes]:
        try:
            if method == "RegisterExpert":
                answer: Any = self._register(experts_pb2.RegisterExpertRequest.FromString(data))
            elif method in ("Forward", "Backward"):
                answer = self._run(experts_pb2.ExpertCall.FromString(data), backward=method == "Backward")
            else:
                return grpc.StatusCode.UNIMPLEMENTED.name, f"expert actor: no method {method!r}".encode()
        except StoreError as e:
            return status_code(e).name, details(e).encode()
        except grpc.RpcError as e:  # the shard's answer to the actor's pull or push
            return e.code().name, (e.details() or "").encode()
        self.calls[method] += 1
        return "OK", answer.SerializeToString()

    def stats(self) -> dict[str, int]:
        """Calls answered by method."""
        return dict(self.calls)

    def _register(self, req: experts_pb2.RegisterExpertRequest) -> experts_pb2.RegisterExpertResponse:
        program = Program(req.program)
        held = self.programs.get(req.table)
        if held is None or held.data != req.program:
            self.programs[req.table] = program
        return experts_pb2.RegisterExpertResponse(parameters=program.numel)

    def _run(self, req: experts_pb2.ExpertCall, *, backward: bool) -> experts_pb2.ExpertAnswer:
        program = check_program(req.table, self.programs.get(req.table), req.dim)
        experts, counts, x, dy = decode(req, backward=backward)
        if not backward:  # the pull waits for the rounds and the ssp clock the worker's step must see
            rows, _ = self._pull(req.table, req.dim, experts, min_round=req.min_round, min_clock=req.min_clock)
            if not len(experts):
                return experts_pb2.ExpertAnswer()
            return experts_pb2.ExpertAnswer(out=run_forward(program, rows, x, counts))
        assert dy is not None
        dx, g, versions = b"", torch.zeros(0, req.dim), np.zeros(0, dtype=np.int64)
        if len(experts):
            rows, versions = self._pull(req.table, req.dim, experts)
            dx, g = run_backward(program, rows, x, dy, counts, req.dim)
        try:
            if req.hold:  # held on the shard (and its backup) for the step's push, not here
                if len(experts):
                    self._push(req, experts, g, versions, hold=True)
                return experts_pb2.ExpertAnswer(out=dx)
            done = self._push(req, experts, g, versions)
            return experts_pb2.ExpertAnswer(out=dx, rows=done.rows, ready=done.ready)
        except grpc.RpcError as e:  # from before a rollback (the worker's epoch): the shard took nothing,
            if req.HasField("epoch") and e.code() == grpc.StatusCode.ABORTED:  # as its own Backward answers
                return experts_pb2.ExpertAnswer(out=dx)
            raise

    def _pull(self, table: str, dim: int, keys: np.ndarray, *, min_round: int = 0,
              min_clock: int = 0) -> tuple[torch.Tensor, np.ndarray]:
        """The rows of distinct uint64 ``keys`` (all this actor's shard's) and their versions, once the table
        applied ``min_round`` rounds and every worker has ``min_clock`` (none: a pull that only waits)."""
        rows, versions = torch.empty(len(keys), dim), np.zeros(len(keys), dtype=np.int64)
        for lo in range(0, max(1, len(keys)) if min_round or min_clock else len(keys), MAX_PULL_KEYS):
            req = ps_pb2.PullRowsRequest(table=table, key_dtype="uint64", keys=keys[lo:lo + MAX_PULL_KEYS].tobytes(),
                                         dim=dim, min_round=min_round, min_clock=min_clock)
            for msg in self.transport.rows(self.shard).PullRows(req, timeout=self.timeout):
                n, at = len(msg.rows) // (dim * 4), lo + msg.first
                rows[at:at + n] = torch.frombuffer(bytearray(msg.rows), dtype=torch.float32).view(n, dim)
                versions[at:at + n] = np.frombuffer(msg.versions, dtype="<i8")
        return rows, versions

    def _push(self, req: experts_pb2.ExpertCall, keys: np.ndarray, grads: torch.Tensor, versions: np.ndarray, *,
              hold: bool = False) -> ps_pb2.PushRowsResponse:
        """The experts' gradients to this actor's shard, as the worker's push of ``req.step`` (the shard adds
        what the step held); the shard's answer. ``hold``: for the shard to hold, as ``req.hold_index``."""
        per = rows_per_message(req.dim + 2, codec.DEFAULT_CHUNK_BYTES)  # + the base version

        def messages() -> Iterator[ps_pb2.PushRowsRequest]:
            for lo in range(0, max(1, len(keys)), per):
                yield ps_pb2.PushRowsRequest(table=req.table, key_dtype="uint64", keys=keys[lo:lo + per].tobytes(),
                                             grads=grads[lo:lo + per].numpy().tobytes(), dim=req.dim,
                                             worker_id=req.worker_id, step=req.step, num_workers=req.num_workers,
                                             base_versions=versions[lo:lo + per].tobytes(), hold=hold,
                                             hold_index=req.hold_index, sync=req.sync, min_round=req.min_round,
                                             epoch=req.epoch if req.HasField("epoch") else None)

        answer: ps_pb2.PushRowsResponse = self.transport.rows(self.shard).PushRows(messages(), timeout=self.timeout)
        return answer

    def close(self) -> None:
        self.transport.close()


ActorRpcError = StatusError  # an expert actor's answer that is not OK, as the gRPC error the shard would raise


class ActorEndpoint:
    """An ``ExpertActor`` with the gRPC stub's calls (``timeout`` each call's deadline, as the stub's). A call
    whose actor died is made once more, on the actor Ray restarts (``max_restarts``): every call may be
    (``Forward`` reads; a held ``Backward`` names its ``hold_index``; a ``Backward``'s push is the worker's
    push of its step, applied once), and the restarted actor, which has no program, answers so (the layer
    registers it again)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def _call(self, method: str, req: Any, answer: Any, timeout: float | None) -> Any:
        code, data = self._get(method, req.SerializeToString(), timeout)
        if code != "OK":
            raise ActorRpcError(grpc.StatusCode[code], data.decode())
        return answer.FromString(data)

    def _get(self, method: str, data: bytes, timeout: float | None, again: bool = True) -> tuple[str, bytes]:
        try:
            out: tuple[str, bytes] = ray.get(self.actor.call.remote(method, data), timeout=timeout)
            return out
        except ray.exceptions.GetTimeoutError:
            raise ActorRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, f"expert actor: {method} took over {timeout} s"
                                ) from None
        except ray.exceptions.RayActorError as e:
            if not again:  # an actor that is not restarted fails again at once
                raise ActorRpcError(grpc.StatusCode.UNAVAILABLE, f"expert actor: {type(e).__name__}") from None
        return self._get(method, data, timeout, again=False)

    def RegisterExpert(self, req: experts_pb2.RegisterExpertRequest, timeout: float | None = None  # noqa: N802
                       ) -> experts_pb2.RegisterExpertResponse:
        return self._call("RegisterExpert", req, experts_pb2.RegisterExpertResponse, timeout)

    def Forward(self, req: experts_pb2.ExpertCall, timeout: float | None = None  # noqa: N802
                ) -> experts_pb2.ExpertAnswer:
        return self._call("Forward", req, experts_pb2.ExpertAnswer, timeout)

    def Backward(self, req: experts_pb2.ExpertCall, timeout: float | None = None  # noqa: N802
                 ) -> experts_pb2.ExpertAnswer:
        return self._call("Backward", req, experts_pb2.ExpertAnswer, timeout)


class ExpertActors:
    """One ``ExpertActor`` per shard: ``MoE(expert_hosts=...)``. ``endpoint(shard)``; ``stats()``: each
    actor's calls; ``close()`` (or leave the ``with`` block) ends them."""

    def __init__(self, actors: list[Any]) -> None:
        self.actors = actors

    def endpoint(self, shard: int) -> ActorEndpoint:
        return ActorEndpoint(self.actors[shard])

    def stats(self, timeout: float = 60.0) -> list[dict[str, int]]:
        out: list[dict[str, int]] = ray.get([a.stats.remote() for a in self.actors], timeout=timeout)
        return out

    def close(self) -> None:
        for a in self.actors:
            ray.kill(a)
        self.actors = []

    def __enter__(self) -> ExpertActors:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def start_expert_actors(servers: Any, *, num_cpus: float = 1.0, num_gpus: float = 0.0,
                        resources: dict[str, float] | None = None, security: Security | None = None,
                        timeout: float = 120.0, max_restarts: int = 3) -> ExpertActors:
    """One expert actor per shard of ``servers`` (a ``ServerGroup``, a ``LocalCluster`` or the addresses),
    each with ``num_cpus``, ``num_gpus`` and ``resources``, restarted by Ray up to ``max_restarts`` times if
    it dies (a call it was answering is made again: ``ActorEndpoint``); returns once every one answers."""
    addresses = list(servers.addresses if hasattr(servers, "addresses") else servers)
    if not addresses:
        raise ValueError("start_expert_actors: no servers")
    remote = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, resources=resources or {},
                        max_restarts=max_restarts)(ExpertActor)
    actors = [remote.remote(addresses, i, security, timeout) for i in range(len(addresses))]
    group = ExpertActors(actors)
    try:
        group.stats(timeout)
    except BaseException:
        group.close()
        raise
    return group
