"""The overlapped step: sub-groups stepped during backward, as soon as their gradient is final
(OffloadConfig(overlap_step=True), or "auto", the default: [Note: the overlapped step by default]).

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

[Note: the overlapped step by default]
overlap_step="auto" (the default) gives the overlapped step to every training loop whose result it does not
change, and the plain schedule to the others, without the user saying which theirs is. What decides:
- the configuration: never with float16 (the loss scaler), nor with gradient_clipping in clip_mode "exact"
  (the global norm is needed before any sub-group is stepped); and only where overlapping saves something --
  some state on a persistent tier (the gradients then never touch the disk, [Note: persistent gradient
  partitions] in grad_partitions.py), or the optimizer states off the compute device (their step on the CPU
  runs while the accelerator computes backward). With everything in the compute device's memory the plain
  step keeps its lent shards and its cores ([Note: gathering at world size 1] in hooks/coordinator.py);
- the loop: the first step() runs plain and watches. If the backwards before it were one, outside
  ``accumulating()``, with no clip of any kind between it and the step, and step() took no closure, every
  later backward steps its final buckets (at world size N the ranks agree first: one all_reduce, once). A
  loop that clips after backward (transformers' Trainer does, max_grad_norm), accumulates micro-batches
  without ``accumulating()`` or steps through a closure stays plain for good.
A loop that changes after the choice (a clip, or a second backward without ``accumulating()``, after a
backward that already stepped) gets the MisuseError overlap_step=True gives it, naming overlap_step=False:
never a silently different result. ``OptimizerStats.overlapped`` counts the sub-groups stepped during backward.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch

from ...tiers import tier_info
from .. import _dist
from ..hooks.coordinator import ParamCoordinator
from ..hooks.events import HookEvents
from ..params.layout import Layout
from .grad_partitions import GradPartitions
from .pipeline import StepStream
from .stepper import SubgroupStepper


def overlap_mode(config, device: torch.device) -> str:
    """"on", "off" or "auto" (decided by the loop): [Note: the overlapped step by default]."""
    if isinstance(config.overlap_step, bool):
        return "on" if config.overlap_step else "off"
    if config.compute_dtype == torch.float16 or (config.gradient_clipping and config.clip_mode == "exact"):
        return "off"
    states = tier_info(config.optimizer_states)
    off_device = states.memory and torch.device(device).type != "cpu" and config.optimizer_states != "device"
    return "auto" if config.uses_nvme or off_device else "off"


class OverlappedStep(HookEvents):
    """Steps the final buckets of one coordinator on a StepStream. `coef()`: what the step multiplies the
    gradients by; `check_usable(what)`: raises where the optimizer may not step. `mode`: "on", or "auto" (off
    until ``observe`` turns it on: [Note: the overlapped step by default])."""

    def __init__(self, config, stepper: SubgroupStepper, grads: GradPartitions, layout: Layout,
                 coordinator: ParamCoordinator, coef: Callable[[], float], check_usable: Callable[[str], None],
                 mode: str = "on", group=None):
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
        self.active = mode == "on"
        self.deciding = mode == "auto"  # the loop not yet watched ([Note: the overlapped step by default])
        self.group = group
        self._backwards = 0  # backwards outside accumulating() since the last step()
        self._subscription = coordinator.subscribe(self)

    def wants_final(self) -> bool:
        return self.active and self._accumulating == 0

    def backward_end(self, aborted: bool) -> None:
        if not aborted and self._accumulating == 0:
            self._backwards += 1

    def observe(self, *, clipped: bool, closure: bool) -> None:
        """A plain step() is about to step: while deciding, turn the overlapped step on for the backwards after
        it if this step's loop lets it ([Note: the overlapped step by default]). Collective while deciding."""
        backwards, self._backwards = self._backwards, 0
        if not self.deciding:
            return
        self.deciding = False
        unfit = torch.tensor([float(backwards != 1 or clipped or closure)])
        if _dist.all_reduce_max(unfit, self.group).item() == 0.0:  # every rank's loop fits, or none overlaps
            self.active = True
            self.coordinator.stop_lending()  # the step changes values autograd may still hold

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
