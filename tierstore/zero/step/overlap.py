"""The overlapped step: sub-groups stepped during backward, as soon as their gradient is final
(OffloadConfig(overlap_step=True)).

[Note: overlapped step]
With OffloadConfig(overlap_step=True), a sub-group whose gradient is final -- world size 1: every trainable
parameter of its bucket has its gradient for this backward and the bucket is reduced; world size N: see [Note:
overlapped step at world size N] in finals.py -- is stepped right away: ``OverlappedStep`` wants final buckets
([Note: hook events] in events.py), the coordinator hands each over (``bucket_final``) and StepStream
(pipeline.py) loads its master and states on a reader thread, steps it on a compute thread and writes it back
on a writer thread while backward goes on; on nvme its gradient partition goes from the reduction straight to
the step, never to the disk ([Note: persistent gradient partitions] in grad_partitions.py). ``step()`` waits for
them and steps what backward left (some parameter of the bucket without a gradient, a bucket still held by a
running forward); a bucket whose gradient becomes final in the end-of-backward reductions is handed over
there, so its step overlaps the reductions after it. Only the backward of the last micro-batch steps: one run
inside ``with opt.accumulating():`` only accumulates (no final buckets are wanted meanwhile).
What it changes: a step needs every clipping or overflow decision before the sub-groups are stepped, so
float16 (the loss scaler) is refused, exact clipping after an overlapped backward raises, and
clip_mode="previous_norm" clips every step with the max_norm and global norm of the clip_grad_norm_ call of the
step before (the first step is not clipped) -- exact when nothing is clipped ([Note: clipping with the loss
scale] in scaling.py). A sub-group that receives gradient after it was stepped (a parameter shared by two
reentrant checkpointed regions) raises instead of being stepped twice. The parameters are gathered as copies in
this mode (no lent shards, [Note: gathering at world size 1] in hooks/coordinator.py), so what autograd saved in forward
keeps the values the forward used. Not covered: a parameter gathered again later in the same backward after
its gradient is final (a use that takes no gradient, on demand) reads the stepped value -- keep overlap_step
off for such a model.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

from ..hooks.coordinator import ParamCoordinator
from ..hooks.events import HookEvents
from ..params.layout import Layout
from .grad_partitions import GradPartitions
from .pipeline import StepStream
from .stepper import SubgroupStepper


class OverlappedStep(HookEvents):
    """Steps the final buckets of one coordinator on a StepStream. `coef()`: what the step multiplies the
    gradients by; `check_usable(what)`: raises where the optimizer may not step."""

    def __init__(self, config, stepper: SubgroupStepper, grads: GradPartitions, layout: Layout,
                 coordinator: ParamCoordinator, coef: Callable[[], float], check_usable: Callable[[str], None]):
        st = stepper
        self.stream = StepStream(config.pipeline_depth, lambda it: st.load(it[0], grads.take(it[0])),
                                 lambda it, t: st.step_loaded([t], it[1], "overlapped")[0], lambda it, t: st.save(t),
                                 queue_bytes=config.pipeline_depth * config.sub_group_bytes)
        self.grads = grads
        self.layout = layout
        self.coordinator = coordinator
        self.coef = coef
        self.check_usable = check_usable
        self._accumulating = 0
        self.overlapped = 0  # sub-group steps done during backward (OptimizerStats)
        self._final_backwards_seen = 0  # coordinator.final_backwards at the last zero_grad()
        self._subscription = coordinator.subscribe(self)

    def wants_final(self) -> bool:
        return self._accumulating == 0

    def bucket_final(self, gid: int) -> None:
        """Step sub-group `gid` now, on the stream."""
        self.check_usable("step")
        self.grads.stepped.add(gid)
        self.overlapped += 1
        nbytes = 4 * self.layout.shard_numel(gid)  # its fp32 master here ([Note: the stream's queue is in bytes])
        self.stream.submit((gid, self.coef()), nbytes)

    @contextmanager
    def accumulating(self):
        """Zero3Optimizer.accumulating."""
        self._accumulating += 1
        try:
            yield
        finally:
            self._accumulating -= 1

    def spent(self) -> bool:
        """A backward since zero_grad() ended wanting final buckets: sub-groups may have been stepped -- the
        same answer on every rank, which the set of sub-groups stepped is not (a collective refused on one rank
        alone would leave the others waiting in it)."""
        return bool(self.grads.stepped) or self.coordinator.final_backwards != self._final_backwards_seen

    def wait(self) -> None:
        """Wait for the sub-groups stepped during backward."""
        self.stream.wait()

    def zero_grad(self) -> None:
        self.stream.wait()  # nothing may still be stepping what is forgotten
        self._final_backwards_seen = self.coordinator.final_backwards

    def close(self) -> None:
        self._subscription.remove()
        self.stream.close()
