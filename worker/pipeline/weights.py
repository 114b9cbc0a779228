"""A pipeline stage as a parameter-server worker of its own parameters: master weights, the step's push
and pull, weight delay and weight stashing. No Ray: the stage actor (shardps.deploy.ray.pipeline) is a
shell over it, and tests/worker/test_pipeline_weights.py runs it alone with a fake optimizer.

The masters are the tensors the optimizer pushes the gradients of and pulls new values into (in place).
How forwards see them depends on the sync mode (``SyncSpec.barrier``):

- barrier modes (bsp, every:X): the pull is part of ``sync()``; the runtime runs on the masters themselves,
  so the next step's first forward sees the new weights: one process's semantics.
- the others (asp, ssp:S): ``sync()`` pushes and pulls in a background thread, overlapping the next step
  (unless ``overlap`` is False: then as under a barrier mode, the servers applying each push on arrival).
  Its first ``weight_delay`` micro-batches run on the weights installed before; the forward of micro-batch
  ``weight_delay`` (at the latest the step's last) waits for the pull and installs a copy of the masters.
  Each version is its own tensors, so a micro-batch's backward runs on its forward's weights (weight
  stashing, done by ``StageRuntime``); gradients are summed over the versions a step used.

Not thread-safe: one caller (the stage's task loop) at a time; only the pull runs beside it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch

from shardps.protos.syncspec import SyncSpec
from shardps.worker.pipeline.stage import StageRuntime


class Stepper(Protocol):
    """What pushes the masters' ``.grad`` and pulls new values into the masters in place: a
    ``DistributedOptimizer`` over them (or a fake in tests). ``step`` may block and may raise."""

    def step(self) -> None: ...

    def zero_grad(self) -> None: ...


# Builds the stepper of the given masters (name, tensor), in the stage's parameter order.
MakeStepper = Callable[[list[tuple[str, torch.Tensor]]], Stepper]


class StageWeights:
    """The weights side of stage ``runtime`` under ``sync``; with ``make_stepper`` None (no servers) it
    only reports the runtime's version. ``weight_delay``: micro-batches of a step that may run before the
    previous step's pull lands (asp/ssp only; 0 under barrier modes). ``timeout``: the longest a forward
    waits for a background push and pull to land (seconds) before it raises ``TimeoutError``. ``overlap``
    False: under asp/ssp too, the push and pull run in ``sync()`` (a stage with row modules: the rows a step
    pulled must be pushed by it before the next step's forwards pull theirs; worker/pipeline/rowstage.py)."""

    def __init__(self, runtime: StageRuntime, sync: SyncSpec, weight_delay: int = 1,
                 make_stepper: MakeStepper | None = None, timeout: float = 600.0, overlap: bool = True) -> None:
        if weight_delay < 0:
            raise ValueError(f"weight_delay must be >= 0, got {weight_delay}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.timeout = timeout
        self.runtime = runtime
        self.sync_spec = sync
        self.stash = overlap and not sync.barrier  # the pull overlaps the next step: versions stashed for backwards
        self.weight_delay = weight_delay if self.stash else 0
        self.intervals: list[tuple[float, float]] = []  # (start, end) of each push and pull, wall-clock seconds
        self.masters: dict[str, torch.Tensor] = {}
        self.stepper: Stepper | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        if make_stepper is not None:
            self.masters = {n: p.detach().clone().requires_grad_(p.requires_grad)
                            for n, p in runtime.params.items()}
            self.stepper = make_stepper(list(self.masters.items()))
            self._install()

    @property
    def version(self) -> int:
        """The weight version forwards run on now."""
        return self.runtime.version

    def _install(self) -> None:
        if self.stash:
            self.runtime.install({n: t.detach().clone() for n, t in self.masters.items()})
        else:
            self.runtime.install(self.masters)

    def begin_step(self) -> None:
        """A new step starts: its sync intervals are counted afresh."""
        self.intervals = []

    def before_forward(self, mb: int) -> None:
        """Call before the forward of micro-batch ``mb``: from micro-batch ``weight_delay`` on (and always
        for the step's last), the pull still in flight lands first. Raises what the sync raised."""
        if mb >= min(self.weight_delay, self.runtime.chunks - 1):
            self.wait()

    def sync(self) -> int:
        """After the step's last backward: push its gradients and pull the weights (barrier modes: now;
        asp/ssp: in the background). Returns the version forwards run on now. A pull still in flight is
        landed first; a failure is raised here (barrier modes) or by the next wait (asp/ssp)."""
        if self.stepper is None:
            return self.version
        self.wait()
        grads = self.runtime.step_gradients()
        for n, t in self.masters.items():
            g = grads.get(n)
            k = self.runtime.shared.get(n, 1)  # a weight tied across k stages: k times this stage's part
            if k > 1:  # pushed every round, zeros if unused: the servers' mean counts k pushes per replica
                t.grad = torch.zeros_like(t) if g is None else g.to(t.device) * k
            else:
                t.grad = None if g is None else g.to(t.device)
        if self.stash:
            self._thread = threading.Thread(target=self._step, name="stage-sync", daemon=True)
            self._thread.start()
            return self.version
        self._step()
        self._raise()
        self._install()
        return self.version

    def _step(self) -> None:
        t0 = time.time()
        try:
            assert self.stepper is not None
            self.stepper.step()
            self.stepper.zero_grad()
        except BaseException as e:  # noqa: BLE001 - raised again by the caller's next wait (or sync)
            self._error = e
        self.intervals.append((t0, time.time()))

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def wait(self) -> int:
        """Land a pull still in flight (join it, install the new weights); the version forwards run on
        now. Raises what the background sync raised, or ``TimeoutError`` when it has not landed within
        ``timeout`` seconds (the stepper's own deadlines should end it sooner; the thread is left to them)."""
        if self._thread is not None:
            self._thread.join(self.timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"stage {self.runtime.index}: the background push and pull did not land "
                                   f"within {self.timeout:g} s (forwards run on version {self.version})")
            self._thread = None
            self._raise()
            self._install()
        return self.version
