"""Which gathered buckets this rank holds, who needs them, and their release: the parameters' ``.data``
point into a held bucket, or at an empty tensor once it is released.

[Note: bucket residency]
Three views of a bucket, kept apart on purpose:
- *held* (``live``): this rank has the gathered values, and its parameters' ``.data`` point into them;
- *protocol* (``protocol``): every rank counts the bucket as gathered in this backward, whether or not this
  rank still holds it ([Note: backward gathers] in backward_schedule.py). A local release
  (``local_only``) leaves it there, so no rank's collectives change; the end of backward resets it to what
  is held;
- *in use* (``users``): hooked forward calls running now that need it (a count, so a parent and a child
  sharing a bucket, or a module called twice, stay correct). A bucket in use is never released.
A parameter split over several buckets is assembled into a tensor of its own once all of them are held.

[Note: releasing frozen buckets in backward]
A bucket of trainable parameters is released in backward once all of them received their gradient; a bucket
of frozen parameters (a frozen base model under adapters) has no such signal and would stay until the end of
backward -- the whole frozen model gathered by then. So a hooked forward call that holds a frozen bucket
puts one multi-grad hook (torch.autograd.graph.register_multi_grad_hook) on its tensor inputs that require
grad: it runs when their gradients are complete, after every node that consumed them -- the call's own
backward among them -- and tells the coordinator that the call's backward is over. (Not an identity autograd
Function on the inputs: that breaks modules that modify an input in place.) Each frozen bucket counts the
entries still to finish; at zero, and with no forward running that uses it, it is released locally (the
protocol view of [Note: backward gathers] is unchanged, so no rank's collectives change). A call none of
whose inputs requires grad (the first layer) gives no signal: its frozen buckets go at the end of backward.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ..params.layout import Layout
from ..params.partitioned import partition, unpartition


class BucketResidency:
    """Held buckets, the protocol view, use counts and frozen buckets' countdowns. See
    [Note: bucket residency]."""

    def __init__(self, layout: Layout, params: dict[str, torch.nn.Parameter], device: torch.device):
        self.layout = layout
        self.params = params  # canonical name -> Parameter
        self.device = device
        self._group_of = {n: gl for gl in layout.groups for n in gl.names}
        self.live: dict[int, torch.Tensor] = {}  # gid -> gathered bucket this rank holds
        self._on_release: dict[int, Callable[[], None]] = {}  # gid -> give a lent shard back (hooks/coordinator.py)
        self.protocol: set[int] = set()  # gids every rank counts as gathered ([Note: backward gathers])
        self.users: dict[int, int] = {}  # gid -> running hooked calls needing it
        self.frozen_left: dict[int, int] = {}  # frozen gid -> entries whose backward has not finished
        self._empty: dict[torch.dtype, torch.Tensor] = {}

    def empty(self, dtype: torch.dtype) -> torch.Tensor:
        """The empty tensor a released parameter's ``.data`` points at."""
        e = self._empty.get(dtype)
        if e is None:
            e = self._empty[dtype] = torch.empty(0, dtype=dtype, device=self.device)
        return e

    def empty_param(self, name: str, dtype: torch.dtype | None = None) -> None:
        """Empty parameter `name` ([Note: partitioned parameters read true] in partitioned.py)."""
        gl = self._group_of[name]
        dtype = dtype if dtype is not None else self.layout.bucket(self.layout.param_gids[name][0]).dtype
        partition(self.params[name], self.empty(dtype), gl.plan.params[name].shape)

    # -- held -------------------------------------------------------------------------------------------
    def add(self, gid: int, full: torch.Tensor, on_release: Callable[[], None] | None = None) -> None:
        """`full` is bucket `gid` gathered (call `materialize` once every bucket of the batch is added);
        `on_release` is called when it is released (a shard lent by the store goes back)."""
        self.live[gid] = full
        self.protocol.add(gid)
        if on_release is not None:
            self._on_release[gid] = on_release

    def materialize(self, gid: int) -> None:
        """Point the parameters with a run in `gid` at their values (those whose buckets are all held)."""
        for piece in self.layout.bucket(gid).pieces:
            name = piece.name
            owners = self.layout.param_gids[name]
            if not all(g in self.live for g in owners):
                continue
            p = self.params[name]
            gl = self._group_of[name]
            shape = gl.plan.params[name].shape
            unpartition(p)  # [Note: partitioned parameters read true]
            if len(owners) == 1:
                p.data = self.live[gid][piece.offset:piece.end].view(shape)
            else:
                t = torch.empty(shape, dtype=gl.plan.params[name].dtype, device=self.device)
                flat = t.view(-1)
                for pc in gl.plan.pieces(name):
                    src = self.live[gl.gids[pc.bucket]]
                    flat[pc.param_offset:pc.param_offset + pc.numel].copy_(src[pc.offset:pc.end])
                p.data = t

    def release(self, gid: int, *, local_only: bool = False) -> None:
        """Drop bucket `gid`'s gathered values. `local_only`: this rank no longer needs them, but every rank
        still counts the bucket as gathered in this backward ([Note: backward gathers])."""
        if not local_only:
            self.protocol.discard(gid)
        if self.live.pop(gid, None) is None:
            return
        b = self.layout.bucket(gid)
        for piece in b.pieces:
            self.empty_param(piece.name, b.dtype)
        done = self._on_release.pop(gid, None)
        if done is not None:
            done()

    def release_unused(self) -> None:
        """Release every held bucket no running call needs."""
        for gid in list(self.live):
            if not self.in_use(gid):
                self.release(gid)

    def release_all(self) -> None:
        for gid in list(self.live):
            self.release(gid)
        self.protocol.clear()

    # -- in use -----------------------------------------------------------------------------------------
    def in_use(self, gid: int) -> bool:
        return self.users.get(gid, 0) > 0

    def enter(self, gids: Iterable[int]) -> None:
        for g in gids:
            self.users[g] = self.users.get(g, 0) + 1

    def leave(self, gid: int) -> bool:
        """A call using `gid` ended: whether none still running needs it."""
        n = self.users.get(gid, 0) - 1
        self.users[gid] = n
        return n <= 0

    def new_forward(self) -> None:
        self.users.clear()

    # -- backward ---------------------------------------------------------------------------------------
    def begin_backward(self, entry_gids: Iterable[Iterable[int]], trainable: Callable[[int], bool]) -> None:
        """Count, per frozen bucket, the entries whose backward is still to finish."""
        self.frozen_left = {}
        for gids in entry_gids:
            for g in gids:
                if not trainable(g):
                    self.frozen_left[g] = self.frozen_left.get(g, 0) + 1

    def call_backward_done(self, gids: Iterable[int]) -> None:
        """The backward of an entry holding `gids` is over: a frozen bucket no entry still to run needs, and
        no running call uses, is released locally ([Note: releasing frozen buckets in backward])."""
        for g in gids:
            n = self.frozen_left.get(g)
            if n is None:
                continue
            self.frozen_left[g] = n - 1
            if n - 1 <= 0 and not self.in_use(g):
                self.release(g, local_only=True)

    def end_backward(self) -> None:
        """Release what no running call needs; the protocol view becomes what is still held."""
        self.release_unused()
        self.protocol = set(self.live)
