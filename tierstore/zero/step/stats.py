"""OptimizerStats: what Zero3Optimizer.step() did, as Zero3Optimizer.stats() reads it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimizerStats:
    """What Zero3Optimizer.step() did, as of one call to Zero3Optimizer.stats(). The hooks' own counters
    (gathers, prefetch, reductions) are in ``opt.coordinator.stats()``; the store's bytes moved per tier in
    ``opt.store.stats()``."""

    steps: int  # steps taken (a step skipped for an fp16 overflow is not one); a loaded checkpoint sets it
    overflow_skips: int  # fp16 steps skipped because a gradient overflowed (the scale halved each time); checkpointed
    loss_scale: float  # the current fp16 loss scale (1.0 without fp16 loss scaling)
    quantized_states: int  # optimizer states (one per sub-group and state, e.g. exp_avg) held in 8 bits now
    fused_steps: int  # sub-group steps done by the fused 8-bit AdamW kernel ([Note: fused 8-bit step in ZeRO-3])
    # sub-group steps on this rank that left some of its elements alone, their parameters having had no gradient
    # ([Note: skipped parameters])
    partly_skipped: int
    # bytes read from / written to the nvme tier since construction, by kind ("params", "grads", "master",
    # "states"; 8-bit states as stored) -- [Note: disk bytes by kind] in disk_bytes.py
    disk_read: dict[str, int]
    disk_written: dict[str, int]
    overlapped: int  # sub-group steps done during backward ([Note: overlapped step])
    # sub-group steps that took the master backward had read from nvme instead of reading it again ([Note: masters
    # at hand] in stepper.py)
    masters_at_hand: int
    # masters the forward took from the step that wrote them instead of reading them ([Note: stepped masters kept
    # for the forward] in stepper.py)
    masters_kept: int
    # path name -> sub-group steps on this rank that took it ([Note: step paths] in stepper.py)
    step_paths: dict[str, int]
