"""Gradient reduction of ZeRO-3: each trainable bucket's gradient, reduce-scattered into this rank's
partition once per backward, with the bookkeeping that decides when (complete buckets, dirty buckets, the
end-of-backward agreement) and the bytes of full ``.grad`` alive meanwhile.

[Note: gradient reduce-scatter]
Every trainable bucket is reduce-scattered once per backward (mean over ranks; qgZ int4 when enabled) into
this rank's fp32 gradient partition, added to what earlier micro-batches left there (gradient
accumulation), including buckets whose parameters got no gradient (zeros): the collectives of a backward
are then the same on every rank whatever parameters each used.
World size 1 (no collective): a bucket goes to its partition as soon as its last parameter's gradient
lands, and the full ``.grad`` tensors are dropped then.
World size N: reducing "as soon as a bucket is complete" would post collectives in each rank's completion
order (deadlock against the backward all-gathers). Instead the ranks follow an agreed *schedule* counted
in visits ([Note: backward gathers] in backward_schedule.py), which every rank makes in the same order:
- every backward records, per trainable bucket, the number of visits made when its last gradient arrived;
  at its end one all_reduce MAX agrees the positions (never arrived anywhere -> the end);
- the next backward over the same entries (same modules, same buckets; otherwise no schedule), at the start
  of visit k and before its gathers, reduce-scatters every bucket not yet reduced whose position is <= k,
  in (position, gid) order -- complete on this rank or not. The reduced part of ``.grad`` is removed (set to
  None, or the bucket's slice zeroed for a parameter split over buckets not all reduced yet);
- reduce-scatter is linear, so a gradient that arrives after its bucket was reduced (a rank-dependent
  branch, a prediction that no longer holds) is not lost: the bucket is marked dirty, the same end-of-
  backward all_reduce (MAX of the dirty flags) tells every rank which buckets to reduce once more -- the
  remainder, in bucket order -- and the positions agreed there are the next backward's schedule;
- buckets never reduced early are reduced at the end, in bucket order.
The first backward (and any backward after the entries changed) holds every full gradient until its end;
later ones hold roughly the gradients of the buckets not yet due. One small collective per backward.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Protocol

import torch

from ...partition import Piece
from .. import _dist
from ..params.layout import Layout
from .backward_schedule import BackwardSchedule

log = logging.getLogger("tierstore.zero")


class PartitionSink(Protocol):
    """Where reductions land: see grad_partitions.GradPartitions."""

    def open(self, gid: int) -> tuple[torch.Tensor, bool]: ...

    def close(self, gid: int, part: torch.Tensor, *, hand_over: bool = False) -> None: ...

    def keep(self, gid: int) -> None: ...

    def abort(self, gid: int, part: torch.Tensor | None = None) -> None: ...

    def open_early(self, gid: int) -> torch.Tensor | None: ...

    def close_early(self) -> None: ...


class GradientReducer:
    """Reduce-scatters trainable buckets' gradients into the partitions (`sink`: open / close / abort, as
    grad_partitions.GradPartitions). See
    [Note: gradient reduce-scatter] and [Note: no gradient] in hooks/coordinator.py."""

    def __init__(self, layout: Layout, params: dict[str, torch.nn.Parameter],
                 sink: PartitionSink, *, device: torch.device, group=None,
                 quantized: bool = False, intra_node_size: int | None = None):
        self.layout = layout
        self.params = params  # canonical name -> Parameter
        self.sink = sink
        self.device = device
        self.group = group
        self.quantized = quantized  # qgZ
        self.intra_node_size = intra_node_size
        self.world = _dist.world_and_rank(group)[0]
        self.trainable = layout.trainable_gids()
        self.trainable_names = [n for gl in layout.groups if gl.trainable for n in gl.names]
        # gid -> trainable parameters with a run in it; a bucket is complete once that many got their gradient
        self.params_named: dict[int, set[str]] = {gid: {p.name for p in layout.bucket(gid).pieces}
                                                  for gid in self.trainable}
        self.params_in: dict[int, int] = {gid: len(names) for gid, names in self.params_named.items()}
        self.grad_names: set[str] = set()  # got a gradient on any rank since clear ([Note: no gradient])
        # -- this backward
        self.reduced: set[int] = set()  # buckets reduced in this backward
        self.dirty: set[int] = set()  # reduced, then received more gradient
        self.got_grad: set[str] = set()  # parameters that received a gradient on this rank
        self._seen: set[str] = set()
        self._done: dict[int, int] = {}  # gid -> its parameters that got their gradient
        # -- full .grad alive
        self._counted: dict[str, int] = {}  # name -> bytes of its full .grad counted as alive
        self.grad_bytes = 0  # bytes of full .grad alive now
        self.peak_grad_bytes = 0  # the most alive at once during the last (or current) backward
        self._flats: dict[int, torch.Tensor] = {}  # numel -> collective input ([Note: gradient bytes copied once])
        # world size 1: name -> (gid, its piece) of a parameter wholly in one trainable bucket, whose gradient can
        # be computed in the partition ([Note: gradients computed in their partition] in grad_partitions.py)
        self._whole: dict[str, tuple[int, Piece]] = {}
        if self.world == 1 and not quantized:
            for gid in self.trainable:
                b = layout.bucket(gid)
                if b.dtype != torch.float32:  # the partition is fp32: a gradient of another dtype cannot live there
                    continue
                for pc in b.pieces:
                    if layout.param_gids[pc.name] == [gid] and pc.param_offset == 0 and \
                            pc.numel == math.prod(layout.specs[pc.name][0]):
                        self._whole[pc.name] = (gid, pc)
        self._in_place: dict[str, int] = {}  # name -> data_ptr of the partition run handed out in this backward
        self.grads_in_place = 0  # gradients computed in their partition, in grad_partitions.py's Note of that name

    def trains(self, gid: int) -> bool:
        return gid in self.params_in

    def complete(self, gid: int) -> bool:
        """Every trainable parameter of `gid` got its gradient in this backward (never, for a frozen one)."""
        return self._done.get(gid, 0) >= self.params_in.get(gid, 1 << 62)

    def begin(self) -> None:
        self.peak_grad_bytes = self.grad_bytes

    def grad_out(self, name: str) -> torch.Tensor | None:
        """Where parameter `name`'s gradient may be computed now: its run of its fresh gradient partition (shaped
        as the parameter), or None (world size N, a parameter split over buckets or not in fp32, a gradient
        already there or handed out in this backward, the bucket reduced or its partition not fresh). See
        [Note: gradients computed in their partition] in grad_partitions.py."""
        whole = self._whole.get(name)
        # once per backward: a parameter used twice has its gradients summed by autograd before they land, so
        # a second product into the same run would overwrite the first one's
        if whole is None or name in self._in_place or self.params[name].grad is not None:
            return None
        gid, pc = whole
        if gid in self.reduced:
            return None
        part = self.sink.open_early(gid)
        if part is None:
            return None
        if part.device != self.params[name].device:  # e.g. host partitions, CUDA compute (tests/test_accelerator.py)
            del self._whole[name]
            return None
        out = part[pc.offset:pc.end].view(self.layout.specs[name][0])
        self._in_place[name] = out.data_ptr()
        return out

    def arrived(self, name: str) -> list[int]:
        """Parameter `name` accumulated a gradient: the buckets it completes (each only once)."""
        self.got_grad.add(name)
        gids = self.layout.param_gids[name]
        for gid in gids:
            if gid in self.reduced:
                self.dirty.add(gid)
        g = self.params[name].grad
        if g is not None and self._in_place.get(name) == g.data_ptr():  # its partition's memory, not a .grad's
            if name not in self._counted:
                self._counted[name] = 0
                self.grads_in_place += 1
        elif name not in self._counted and g is not None:
            nbytes = g.numel() * g.element_size()
            self._counted[name] = nbytes
            self.grad_bytes += nbytes
            self.peak_grad_bytes = max(self.peak_grad_bytes, self.grad_bytes)
        if name in self._seen:
            return []
        self._seen.add(name)
        completed = []
        for gid in gids:
            self._done[gid] = self._done.get(gid, 0) + 1
            if self.complete(gid):
                completed.append(gid)
        return completed

    def reduce(self, gid: int, *, hand_over: bool = False) -> None:
        """Reduce-scatter bucket `gid`'s gradient (zeros for parameters without one) into the partition. World
        size 1: the gradients go straight into the partition ([Note: gradient bytes copied once]).
        `hand_over`: the partition is stepped next (sink.close's hand_over)."""
        b = self.layout.bucket(gid)
        sink = self.sink
        part, fresh = sink.open(gid)
        try:
            if self.world == 1:
                self._fill(b, part, add=not fresh)
            else:
                flat = self._flat(b.numel)
                self._fill(b, flat, add=False)
                with torch.profiler.record_function("tierstore::reduce_scatter"):
                    if fresh and not self.quantized:
                        _dist.reduce_scatter_avg(flat, self.group, out=part)
                    else:
                        shard = _dist.reduce_scatter_avg(flat, self.group, quantized=self.quantized,
                                                         intra_node_size=self.intra_node_size)
                        part.copy_(shard) if fresh else part.add_(shard)
        except BaseException:
            sink.abort(gid, part)
            raise
        sink.close(gid, part, hand_over=hand_over)
        self.reduced.add(gid)
        # what went to the partition leaves .grad: a later arrival is then exactly the part still to reduce
        for piece in b.pieces:
            p = self.params[piece.name]
            if p.grad is None:
                continue
            if all(g in self.reduced for g in self.layout.param_gids[piece.name]):
                self.drop_grad(piece.name)
            else:
                if not p.grad.is_contiguous():
                    p.grad = p.grad.contiguous()
                p.grad.view(-1)[piece.param_offset:piece.param_offset + piece.numel].zero_()

    # [Note: gradient bytes copied once]
    # Each gradient element is read once from ``.grad`` and written once on its way to the partition: world
    # size 1 (no collective) copies it -- or adds it, on a later micro-batch -- straight into the partition;
    # world size N copies it into the collective's input (a buffer reused across buckets) and the collective
    # writes this rank's share straight into a fresh partition (a later micro-batch's share is added). The
    # layout's padding (the bucket's tail) is zeroed, not the whole buffer.

    def _fill(self, b, dst: torch.Tensor, *, add: bool) -> None:
        """dst (the bucket's elements, fp32) <- (or +=, when `add`) the gradients of its pieces; zeros for
        pieces without one and for the padding."""
        end = 0
        for piece in b.pieces:
            g = self.params[piece.name].grad
            d = dst[piece.offset:piece.end]
            if g is not None:
                src = g.reshape(-1)[piece.param_offset:piece.param_offset + piece.numel]
                if src.data_ptr() == d.data_ptr():  # computed in place ([Note: gradients computed in their partition])
                    pass
                elif add:
                    d.add_(src)
                else:
                    d.copy_(src)
            elif not add:
                d.zero_()
            end = max(end, piece.end)
        if not add and end < dst.numel():
            dst[end:].zero_()

    def _flat(self, numel: int) -> torch.Tensor:
        """The collective's input buffer (fp32, `numel` elements), reused across buckets of that size."""
        buf = self._flats.get(numel)
        if buf is None:
            self._flats.clear()  # one size kept: buckets are mostly of one size
            buf = self._flats[numel] = torch.empty(numel, dtype=torch.float32, device=self.device)
        return buf

    def end_of_backward(self, schedule: BackwardSchedule, on_final: Callable[[int], None] | None = None,
                        may_step: Callable[[int], bool] | None = None) -> int:
        """Agree on positions, dirty buckets and which parameters got a gradient (one all_reduce MAX), then
        reduce-scatter every trainable bucket not reduced yet and every dirty one, in bucket order; returns how
        many were reduced again. See [Note: gradient reduce-scatter], [Note: no gradient] in hooks/coordinator.py.
        `on_final`: called with each bucket reduced here whose gradient is then final and whole -- every
        trainable parameter in it got a gradient on some rank, none is skipped -- and that `may_step` allows,
        right after its reduction (its partition handed over; [Note: overlapped step] in overlap.py)."""
        dirty = set(self.dirty)
        got = self.got_grad
        if self.world > 1:
            names = self.trainable_names
            t = len(self.trainable)
            flags = torch.tensor(schedule.positions(self.trainable)
                                 + [1 if g in dirty else 0 for g in self.trainable]
                                 + [1 if name in got else 0 for name in names], dtype=torch.int64)
            _dist.all_reduce_max(flags, self.group)
            agreed = flags.tolist()
            dirty = {g for g, d in zip(self.trainable, agreed[t:2 * t]) if d}
            got = {name for name, f in zip(names, agreed[2 * t:]) if f}
            schedule.agree(self.trainable, agreed[:t])
        self.grad_names |= got
        again = 0
        for gid in self.trainable:
            if gid in dirty:
                again += 1
            elif gid in self.reduced:
                continue
            final = on_final is not None and self.params_named[gid] <= self.grad_names and (
                may_step is None or may_step(gid))
            self.reduce(gid, hand_over=final)
            if final and on_final is not None:
                on_final(gid)
        self.drop_grads()
        return again

    def backward_raised(self) -> None:
        """A backward raised (its end never ran): keep what can be kept, as torch keeps accumulated .grad."""
        if self.world == 1:  # no collective: what it accumulated goes to the partitions, as torch keeps it
            for gid in self.trainable:
                if gid not in self.reduced and any(self.params[pc.name].grad is not None
                                                   for pc in self.layout.bucket(gid).pieces):
                    self.reduce(gid)
            self.grad_names |= self.got_grad
            log.warning("a backward ended without reaching its end (it raised); the gradients it accumulated "
                        "are kept, as torch keeps them: call zero_grad() to drop them")
        else:  # finishing its reductions would need the other ranks, which are elsewhere
            log.warning("a backward ended without reaching its end (it raised): the gradients of buckets it "
                        "had already reduced stay in the gradient partitions, the rest are dropped; call "
                        "zero_grad() to start the accumulation afresh")
            self.grad_names |= {pc.name for gid in self.reduced for pc in self.layout.bucket(gid).pieces
                                if pc.name in self.got_grad}  # in the partitions: stepped, not skipped

    def end(self) -> None:
        """Forget this backward's bookkeeping (the full gradients are dropped separately)."""
        self.reduced.clear()
        self.dirty.clear()
        self.got_grad.clear()
        self._seen.clear()
        self._done.clear()
        self._in_place.clear()
        self.sink.close_early()  # opened for a gradient a raising backward never reduced: left as it was

    def drop_grad(self, name: str) -> None:
        self.params[name].grad = None
        self.grad_bytes -= self._counted.pop(name, 0)

    def drop_grads(self) -> None:
        for n in self.trainable_names:
            self.drop_grad(n)
