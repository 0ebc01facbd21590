"""This rank's gradient partitions between backward and step: where the reductions accumulate, and the
sum of squares the clipping and the fp16 overflow check read.

[Note: persistent gradient partitions]
A gradient partition is written once per backward (and added to on later micro-batches of an accumulation),
so it is kept where it lives and reused rather than made afresh:
- on a memory tier (host / device) it is one tensor of the store per sub-group, created by the first
  reduction and never deleted: zero_grad() only forgets that it holds anything, and the next reduction
  writes into it in place (``open`` enters ``resident()``: no allocation, no copy in or out). The step
  reads it in place too ([Note: in place on memory tiers] in stepper.py);
- on nvme the reduction builds it in a recycled buffer (the earlier micro-batches' sum read into it first)
  and writes it with one put.
``open(gid)`` says whether the partition is *fresh* (nothing accumulated since zero_grad()): the writer then
overwrites it (copy) instead of adding (the zero it would add to is never written). The sum of squares of
each partition (clip_grad_norm_, the fp16 overflow check) is computed when a reader asks -- a step that does
not clip reads its gradients once -- until one has asked: from then on (``eager``) it is computed while
the partition is at hand, for nvme ones (where asking later means reading them back from the disk) and
for a partition handed to an overlapped step (which scales it in place).

[Note: gradient dtype on nvme]
On nvme a partition may be stored in the compute dtype (OffloadConfig.gradient_dtype=torch.bfloat16 with
compute_dtype=torch.bfloat16): half the gradient bytes written by backward and read by the step. The
reduction still adds in fp32, in the recycled fp32 buffer; the partition is rounded to the stored dtype when
it is written (``close``) and widened back to fp32 when it is read (a later micro-batch's ``open``, the
step's load, the norm, clamping). At world size 1 without accumulation the partition holds exactly the
compute-dtype gradients autograd produced, so storing them narrow loses nothing (training is bit-equal to
fp32 partitions); with accumulation, or at world size N (the average of the ranks' gradients), the stored
sum is rounded once per write, as DeepSpeed's bf16 gradients are. A partition handed straight to an
overlapped step never leaves fp32.

[Note: gradients computed in their partition]
At world size 1 a fresh partition needs no reduction: a parameter's gradient can be computed straight into
its run of the partition. ``open_early(gid)`` opens partition `gid` during backward, before its bucket is
complete, when it is fresh (and the step may still take gradient into it); the gradient hooks' nn.Linear
backward ([Note: linear keeps its parameters] in linear.py) then writes ``grad^T @ x`` (and the bias's sum)
into the parameter's run with ``out=``, autograd's AccumulateGrad takes that tensor as the parameter's
``.grad`` (a view of the partition: no full-size gradient is allocated, page-faulted, copied or freed), a
second gradient of the same parameter in the same backward (a tied weight) is added to it in place, and the
reduction that follows skips the runs that already hold their value. ``open(gid)`` hands over the partition
opened early; whatever was opened early and not reduced (a backward that raised) is left as it was by
``close_early`` -- a fresh partition's contents are not a gradient until ``close`` records it.
"""
from __future__ import annotations

import math
from contextlib import AbstractContextManager

import torch

from ...errors import MisuseError
from ...tiers import tier_info
from .. import keys
from ..hooks.events import Subscribers
from ..params.layout import Layout
from .disk_bytes import DiskBytes

# who steps during backward, for the errors that refuse what it makes impossible
OVERLAPPED = ("the overlapped step: OffloadConfig(overlap_step=True), or overlap_step='auto' (the default) once the "
              "first step saw a loop it fits, [Note: the overlapped step by default] in overlap.py")

class GradPartitions:
    """The gradient partitions of one rank on tier `tier`. See [Note: persistent gradient partitions]."""

    def __init__(self, store, tier: str, layout: Layout, buffers, disk: DiskBytes,
                 dtype: torch.dtype = torch.float32, events: Subscribers | None = None):
        self.store = store
        self.disk = disk  # [Note: disk bytes by kind]
        self.tier = tier
        self.layout = layout
        self.buffers = buffers  # BufferPool of CPU buffers, for the nvme tier
        self.memory = tier_info(tier).memory
        # dtype stored on nvme ([Note: gradient dtype on nvme]); memory tiers keep fp32
        self.dtype = torch.float32 if self.memory else dtype
        # gid -> sum of squares of its partition, None: not computed yet. Insertion order = reduction order.
        self.sq: dict[int, float | None] = {}
        self._open: dict[int, AbstractContextManager] = {}
        self._early: dict[int, torch.Tensor] = {}  # gid -> fresh partition opened during backward ([Note: gradients
        # computed in their partition]), handed over by the next open(gid)
        self.handed: dict[int, torch.Tensor] = {}  # gid -> nvme partition kept for the step, not written
        self.stepped: set[int] = set()  # stepped during this backward ([Note: overlapped step] in overlap.py)
        self.eager = False  # sums of squares taken while the partition is at hand (someone reads them)
        # where ``gradient_open`` is sent, whose subscribers raise where no gradient may arrive now (a clip
        # pending): [Note: hook events] in events.py
        self.events = events if events is not None else Subscribers()

    def __contains__(self, gid: int) -> bool:
        """Whether partition `gid` holds gradient accumulated since clear()."""
        return gid in self.sq

    def __bool__(self) -> bool:
        return bool(self.sq)

    def open(self, gid: int) -> tuple[torch.Tensor, bool]:
        """(partition `gid` to write into, fresh). Fresh: nothing accumulated since clear(); overwrite it
        (its contents are stale), else add to it. Call close(gid, partition) after."""
        if gid in self.stepped:
            raise MisuseError(
                f"sub-group {gid} received more gradient after {OVERLAPPED} had stepped it since the last step(): "
                f"a second backward outside `with opt.accumulating():` (run every micro-batch but the last inside "
                f"it), or a parameter with a second gradient in one backward (e.g. shared by two reentrant "
                f"checkpointed regions); that step cannot be undone. Otherwise train with "
                f"OffloadConfig(overlap_step=False)")
        self.events.emit("gradient_open", gid)
        early = self._early.pop(gid, None)
        if early is not None:  # fresh: nothing can have been accumulated since it was opened
            return early, True
        return self._open_now(gid)

    def open_early(self, gid: int) -> torch.Tensor | None:
        """Fresh partition `gid`, opened now for gradients computed into it before its reduction; None where
        it is not fresh or may not take gradient now (open() then says why). The next open(gid) returns it.
        See [Note: gradients computed in their partition]."""
        part = self._early.get(gid)
        if part is not None:
            return part
        if gid in self.sq or gid in self.stepped:
            return None
        try:
            self.events.emit("gradient_open", gid)
        except MisuseError:
            return None  # the reduction's open() raises it, where it always has
        part = self._early[gid] = self._open_now(gid)[0]
        return part

    def close_early(self) -> None:
        """Leave every partition opened early and not reduced as it was (their contents were never recorded)."""
        for gid in list(self._early):
            self.abort(gid)

    def _open_now(self, gid: int) -> tuple[torch.Tensor, bool]:
        fresh = gid not in self.sq
        name = keys.grad(gid)
        n = self.layout.shard_numel(gid)
        if self.memory:
            if name not in self.store:
                self.store.put(name, torch.empty(n, dtype=torch.float32), tier=self.tier)
            cm = self.store.tensor(name).resident(self.tier, writeback=True)
            part = cm.__enter__()
            self._open[gid] = cm
            return part, fresh
        buf = self.buffers.take(n, torch.float32)
        if not fresh:
            try:
                self._read(name, buf)
            except BaseException:
                self.buffers.give(buf)
                raise
        return buf, fresh

    def _read(self, name: str, out: torch.Tensor) -> None:
        """fp32 `out` <- nvme partition `name` (widened from the stored dtype)."""
        if self.dtype == torch.float32:
            self.store.get(name, out=out)
        else:
            low = self.buffers.take(out.numel(), self.dtype)
            try:
                self.store.get(name, out=low)
                out.copy_(low)
            finally:
                self.buffers.give(low)
        self.disk.count(name, write=False)

    def _write(self, name: str, part: torch.Tensor) -> None:
        """nvme partition `name` <- fp32 `part` (a buffer of ``buffers``), rounded to the stored dtype; `part`
        goes back to the buffers once the disk has it: it is lent to the write ([Note: lent tensors] in
        tiers/nvme/writes.py), or copied to the stored dtype first."""
        src = part
        if self.dtype != torch.float32:
            try:
                src = self.buffers.take(part.numel(), self.dtype)
                src.copy_(part)
            finally:
                self.buffers.give(part)
        self.buffers.lent([src])  # waits while many are on loan ([Note: lent buffers are bounded] in stepper.py)
        self.store.put(name, src, tier=self.tier, lend=lambda: self.buffers.give(src))
        self.disk.count(name, write=True)

    def close(self, gid: int, part: torch.Tensor, *, hand_over: bool = False) -> None:
        """Partition `gid` (from open) now holds the accumulated gradient. `hand_over`: it is about to be
        stepped ([Note: overlapped step] in overlap.py): its sum of squares is taken now (the step scales it
        in place), and on nvme it is kept for ``take`` instead of written."""
        eager = self.eager and (hand_over or not self.memory)
        self.sq[gid] = _sum_squares(part) if eager else None  # else computed when asked for (sum_squares)
        if self.memory:
            self._open.pop(gid).__exit__(None, None, None)
            return
        if hand_over:
            self.handed[gid] = part
            return
        self._write(keys.grad(gid), part)  # gives `part` back

    def keep(self, gid: int) -> None:
        """Partition `gid`, closed with hand_over, is not stepped now after all (world size N: another rank had
        not all its gradient when it was reduced; [Note: overlapped step at world size N] in finals.py):
        stored as close() would have stored it."""
        part = self.handed.pop(gid, None)
        if part is None:  # a memory tier: it is in the store already
            return
        self._write(keys.grad(gid), part)  # in the stored dtype ([Note: gradient dtype on nvme]); gives it back

    def abort(self, gid: int, part: torch.Tensor | None = None) -> None:
        """open() (or open_early()) was not followed by close() (an error): leave it as it was. `part`: what
        open() returned (an nvme buffer goes back to the buffers)."""
        early = self._early.pop(gid, None)
        part = part if part is not None else early
        cm = self._open.pop(gid, None)
        if cm is not None:
            cm.__exit__(None, None, None)
        elif part is not None and not self.memory:
            self.buffers.give(part)

    def take(self, gid: int) -> torch.Tensor | None:
        """The nvme partition kept by close(hand_over=True) (the caller gives it back to the buffers)."""
        return self.handed.pop(gid, None)

    def sum_squares(self) -> tuple[float, int]:
        """(sum over partitions of their squared L2 norm, partitions with a non-finite value)."""
        self.eager = True
        total, bad = 0.0, 0
        for gid, sq in self.sq.items():
            if sq is None and gid in self.stepped:
                raise MisuseError(f"the gradient of sub-group {gid} was stepped during backward before its norm "
                                  f"was taken ({OVERLAPPED}); use clip_mode='previous_norm', or "
                                  f"OffloadConfig(overlap_step=False)")
            if sq is None and self.memory:
                with self.store.tensor(keys.grad(gid)).resident(self.tier) as part:
                    sq = self.sq[gid] = _sum_squares(part)
            elif sq is None:  # read back once; from now on taken while the partition is at hand
                buf = self.buffers.take(self.layout.shard_numel(gid), torch.float32)
                try:
                    self._read(keys.grad(gid), buf)
                    sq = self.sq[gid] = _sum_squares(buf)
                finally:
                    self.buffers.give(buf)
            if math.isfinite(sq):
                total += sq
            else:
                bad += 1
        return total, bad

    def clamp_(self, bound: float) -> None:
        """Clamp every partition holding gradient to [-bound, bound] in place (clip_grad_value_)."""
        for gid in list(self.sq):
            name = keys.grad(gid)
            if self.memory:
                with self.store.tensor(name).resident(self.tier, writeback=True) as part:
                    part.clamp_(-bound, bound)
                    self.sq[gid] = _sum_squares(part) if self.eager else None
                continue
            buf = self.buffers.take(self.layout.shard_numel(gid), torch.float32)
            try:
                self._read(name, buf)
                buf.clamp_(-bound, bound)
                self.sq[gid] = _sum_squares(buf) if self.eager else None
                self._write(name, buf)
            finally:
                self.buffers.give(buf)

    def clear(self) -> None:
        """zero_grad(): forget what the partitions hold (their memory is kept for the next backward)."""
        self.close_early()
        self.sq.clear()
        self.stepped.clear()
        for part in self.handed.values():
            self.buffers.give(part)
        self.handed.clear()


def _sum_squares(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t, dtype=torch.float64) ** 2)
