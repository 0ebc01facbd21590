"""What the forward trace says about the rest of a forward: the order the next forward uses buckets in, and
which buckets released near the forward's end are held for backward ([Note: kept at the turn]).

[Note: kept at the turn]
Backward needs first what forward used last, so releasing the forward's last buckets only to gather (read,
all-gather) them again a moment later moves their bytes twice. Once the trace ([Note: trace] in
prefetch.py) says the buckets of the calls after the current one fit in ``reuse_bytes`` (OffloadConfig;
bytes of gathered buckets), a bucket the current call releases is held instead (the coordinator's ``_turn``,
in release order; only with grad enabled, not in a recomputation): so forward holds at most ``reuse_bytes``
plus one call's buckets more than it would. At the forward's end the most recently released of them that fit
in ``reuse_bytes`` stay held and in the protocol view ([Note: bucket residency] in bucket_residency.py) -- the
same decision on every rank, from the shared trace and layout, so no rank's collectives change -- and the rest
are released. Backward finds them held and gathers nothing for them; its usual rules release them (gradients
complete, end of backward), and at world size 1 hand what they release to the step ([Note: masters at hand]
in stepper.py). A forward that starts before any backward came (evaluation, two forwards then one backward)
and ``gathered()`` release them first, so nothing stale is ever used. The first forward (still recording the
trace) keeps nothing. Memory: at most ``reuse_bytes`` more held between forward and backward, where
backward's prefetch would hold its first buckets anyway; the module order and sizes decide what is kept,
identically on every rank.
"""
from __future__ import annotations

import torch

from ..params.layout import Layout
from .prefetch import Trace


class TurnPlan:
    """Reads the coordinator's trace (`module_gids`: id(module) -> the buckets it uses); the results are
    cached for as long as the trace is the same."""

    def __init__(self, layout: Layout, trace: Trace, module_gids: dict[int, list[int]], reuse_bytes: int):
        self.layout = layout
        self.trace = trace
        self.module_gids = module_gids
        self.reuse_bytes = reuse_bytes
        self._suffix: list[int] = []  # bytes of the buckets the trace's calls from each position on use
        self._suffix_key: tuple | None = None  # the trace those were computed for
        self._order: list[int] = []  # forward_order()'s, for the trace of _order_key
        self._order_key: tuple | None = None

    def _key(self) -> tuple:
        tr = self.trace
        return (id(tr.order), len(tr.order), tr.rebuilds)

    def forward_order(self) -> list[int]:
        """The buckets the next forward uses, in the order it first uses them (empty while recording)."""
        tr = self.trace
        if tr.recording:
            return []
        key = self._key()
        if self._order_key != key:
            seen: dict[int, None] = {}
            for mid in tr.order:
                for g in self.module_gids.get(mid, ()):
                    seen.setdefault(g)
            self._order, self._order_key = list(seen), key
        return self._order

    def near(self, index: int | None) -> bool:
        """Whether a bucket the call at trace position `index` releases is held for backward: the buckets of
        the calls after it fit in reuse_bytes."""
        tr = self.trace
        if self.reuse_bytes <= 0 or index is None or tr.recording or not torch.is_grad_enabled():
            return False
        key = self._key()
        if self._suffix_key != key:  # the trace changed: bytes of the buckets used from each position on
            seen: set[int] = set()
            total = 0
            suffix = [0] * (len(tr.order) + 1)
            for i in range(len(tr.order) - 1, -1, -1):
                for g in self.module_gids.get(tr.order[i], ()):
                    if g not in seen:
                        seen.add(g)
                        b = self.layout.bucket(g)
                        total += b.numel * b.dtype.itemsize
                suffix[i] = total
            self._suffix, self._suffix_key = suffix, key
        return index + 1 < len(self._suffix) and self._suffix[index + 1] <= self.reuse_bytes

    def keep(self, held: dict[int, None], live, backward: bool) -> dict[int, None]:
        """The forward's end: of the buckets `held` near the turn (in release order), those still `live` that
        stay -- the most recently released that fit in reuse_bytes, none when no `backward` will use them."""
        budget = self.reuse_bytes if backward else 0
        keep: dict[int, None] = {}
        for gid in reversed(list(held)):
            b = self.layout.bucket(gid)
            nbytes = b.numel * b.dtype.itemsize
            if gid in live and nbytes <= budget:
                budget -= nbytes
                keep[gid] = None
        return keep
