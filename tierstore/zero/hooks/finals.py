"""World size N: which buckets reduced during backward are final on every rank, agreed by the ranks before
any of them steps one ([Note: overlapped step at world size N]).

[Note: overlapped step at world size N]
At world size N a bucket is reduce-scattered during backward when the agreed schedule says so ([Note: gradient
reduce-scatter] in gradient_reducer.py) -- complete on this rank or not: a rank whose gradient for it is not
all in yet marks it dirty when the rest arrives, and every rank reduces it again at the end. So "reduced here"
is not "final": this rank cannot know alone whether another will add to it. At each visit that reduces buckets
while some subscriber wants final buckets ([Note: hook events] in events.py; the overlapped step of [Note:
overlapped step] in overlap.py), the coordinator posts one small all_reduce MAX of a flag per bucket -- 1 where
this rank cannot step it now (its gradient not complete here, or its values held, or not gathered in this
backward, so a later visit could read the shard) -- and keeps the partitions aside (on nvme in their buffers,
handed over). At the next visit (or the end of backward) it reads the result: a bucket no rank flagged is final
everywhere and sent as ``bucket_final`` (stepped at once on the stream), the others' partitions are stored as
without overlap and step() steps them (CoordinatorStats.finals_deferred). The decision is the same on every
rank; so must be the use of ``accumulating()`` (it decides whether the flags are posted at all), as every
rank's backward calls must match anyway. With gloo the wait costs at most the other ranks' arrival at that
visit, which its all-gathers wait for anyway; with a backend that reduces only on the device (NCCL) the flags
are read only once the collective completed, never syncing the device. At the end of backward, after the
agreement on dirty buckets, every reduction is final: each bucket reduced there with a gradient for every
parameter (on some rank) and not used by a forward running is handed over as soon as it is reduced. The first
backward (no schedule yet) therefore steps its sub-groups during the end-of-backward reductions, later ones
during backward proper.
Clipping: clip_mode="previous_norm" takes the global norm as without overlap (clip_grad_norm_: an all_reduce
of the ranks' sums of squares, taken when each partition was at hand) after backward; with
OffloadConfig.gradient_clipping, step() posts it before it waits for the sub-groups stepping, so it runs
meanwhile. Exact clipping after a backward that ran with overlap is refused on every rank alike (not only on
those that stepped something): one rank raising alone would leave the others in the collective. Which
parameters got no gradient is only agreed at the end of backward; a bucket stepped earlier had a gradient for
every parameter on every rank, so no parameter of it is skipped ([Note: skipped parameters] in skipped.py).
"""
from __future__ import annotations

import torch

from .. import _dist
from .bucket_residency import BucketResidency
from .events import Subscribers
from .gradient_reducer import GradientReducer


class FinalAgreement:
    """The all_reduces posted for buckets reduced during backward, oldest first, and what they decided."""

    def __init__(self, reducer: GradientReducer, residency: BucketResidency, events: Subscribers, group):
        self.reducer = reducer
        self.residency = residency
        self.events = events
        self.group = group
        self._pending: list[tuple[tuple[int, ...], _dist.Reducing]] = []
        self.deferred = 0  # buckets some rank could not step when reduced: step() steps them

    def post(self, gids: list[int]) -> None:
        """Buckets `gids` were just reduced; whether their gradient is final is known once every rank says it
        had all of it (one small all_reduce MAX, waited later)."""
        res, red = self.residency, self.reducer
        flags = torch.tensor([0 if red.complete(g) and g not in res.live and g in res.protocol else 1 for g in gids],
                             dtype=torch.int32)
        self._pending.append((tuple(gids), _dist.all_reduce_max_async(flags, self.group)))

    def resolve(self, *, wait: bool) -> None:
        """Send ``bucket_final`` for the buckets whose all_reduce said every rank can step them (the oldest
        first, as far as those are ready, or all of them with `wait`); the others' partitions are kept for
        step()."""
        while self._pending and (wait or self._pending[0][1].ready()):
            gids, pending = self._pending.pop(0)
            flags = pending.wait().tolist()
            for gid, refused in zip(gids, flags):
                if not refused and self.events.wants_final():
                    self.events.emit("bucket_final", gid)
                else:
                    self.reducer.sink.keep(gid)
                    self.deferred += 1

    def drop(self) -> None:
        """A backward that raised: the partitions still waiting for an answer wait for step()."""
        for gids, _pending in self._pending:
            for gid in gids:
                self.reducer.sink.keep(gid)
        self._pending.clear()
