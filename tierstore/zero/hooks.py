"""Module hooks of ZeRO-3: gather a module's parameters before it runs, release them after; reduce-scatter
gradients into each rank's partition at the end of backward.

[Note: gather and release]
Outside of use every managed parameter's ``.data`` is an empty tensor; the values live as this rank's shard
of each bucket in the store. A module's forward pre-hook gathers the buckets holding its own (non-recursive)
parameters -- each rank reads its shard from its tier and they all-gather it (qwZ int8 when enabled) -- and
points each parameter's ``.data`` at its run of the gathered bucket (a view; a parameter split over buckets
is assembled). The forward post-hook releases buckets no running module needs (a count per bucket, so a
parent and a child sharing a bucket, or a module called twice, stay correct). Autograd saves the parameter
itself for backward, so a hook on the gradient of each of the module's outputs (run before the
module's backward) gathers again before the module's backward runs; a bucket is
released again once every trainable parameter in it has accumulated its gradient (post-accumulate-grad
hooks), or at the end of backward for buckets holding unused parameters.

[Note: gradient reduce-scatter]
Gradients are reduce-scattered at the end of backward (an autograd engine callback), for every trainable
bucket in bucket order, on every rank -- including buckets whose parameters got no gradient (zeros). The
sequence of collectives is therefore the same on every rank whatever parameters were used, which is what
keeps a data-dependent branch or an unused parameter from hanging the group. The mean over ranks (qgZ int4
when enabled) lands in this rank's fp32 gradient partition, added to what earlier micro-batches left there
(gradient accumulation); the full-size ``.grad`` tensors are then dropped.
Cost of that choice at world size > 1: full gradients of one backward exist at once before the
reduce-scatter. Reducing a bucket as soon as it completes is not safe there: a rank blocked in an early
reduce-scatter can wait on a rank that is itself waiting in a backward all-gather (deadlock) whenever the
ranks' completion orders differ. At world size 1 there is no collective, so each bucket's gradient goes to
the partition (and the full .grad tensors are dropped) as soon as its last parameter's gradient lands.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from . import _dist
from ._layout import Layout
from .prefetch import Trace

log = logging.getLogger("tierstore.zero")



class ParamCoordinator:
    """Installs and runs the hooks of one model. See [Note: gather and release]."""

    def __init__(self, model: torch.nn.Module, layout: Layout, params: dict[str, torch.nn.Parameter],
                 fetch_shard: Callable[[int], torch.Tensor], grad_sink: Callable[[int, torch.Tensor], None], *,
                 device: torch.device, group=None, quantized_weights: bool = False,
                 quantized_gradients: bool = False, intra_node_size: int | None = None, prefetch_depth: int = 0):
        self.model = model
        self.layout = layout
        self.params = params  # canonical name -> Parameter
        self.fetch_shard = fetch_shard
        self.grad_sink = grad_sink
        self.device = device
        self.group = group
        self.qwz = quantized_weights
        self.qgz = quantized_gradients
        self.intra_node_size = intra_node_size
        self.prefetch_depth = prefetch_depth
        self.trace = Trace()
        self._name_of = {id(p): n for n, p in params.items()}
        self._group_of = {n: gl for gl in layout.groups for n in gl.names}
        self._live: dict[int, torch.Tensor] = {}  # gid -> gathered bucket
        self._users: dict[int, int] = {}  # gid -> running modules needing it
        self._module_gids: dict[int, list[int]] = {}
        self._prefetched: dict[int, Future] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tierstore-prefetch") if prefetch_depth else None
        self._empty: dict[torch.dtype, torch.Tensor] = {}
        self._trainable_in: dict[int, int] = {}
        for gid in layout.trainable_gids():
            self._trainable_in[gid] = len(set(p.name for p in layout.bucket(gid).pieces))
        self._done: dict[int, int] = {}
        self._seen: set[str] = set()
        self._reduced: set[int] = set()  # buckets already reduced in this backward (world size 1 only)
        self._world = _dist.world_and_rank(group)[0]
        self.eager_reductions = 0
        self._cb_queued = False
        self._in_forward = 0
        self.gathers = 0  # all-gathers issued (for tests)
        self.prefetch_hits = 0
        self.prefetch_hits_backward = 0
        self._bw_pos: int | None = None  # backward's position in the trace (walked in reverse)
        self._handles: list = []
        self._install()

    # -- installation -----------------------------------------------------------------------------------
    def _install(self) -> None:
        root = self.model
        self._handles.append(root.register_forward_pre_hook(self._root_pre, prepend=True))
        self._handles.append(root.register_forward_hook(self._root_post, always_call=True))
        for m in root.modules():
            own = [p for p in m._parameters.values() if p is not None]
            own += list(m.__dict__.get("_tierstore_external", ()))
            names = list(dict.fromkeys(self._name_of[id(p)] for p in own if id(p) in self._name_of))
            if not names:
                continue
            gids = sorted({g for n in names for g in self.layout.param_gids[n]})
            self._module_gids[id(m)] = gids
            self._handles.append(m.register_forward_pre_hook(self._pre_forward))
            self._handles.append(m.register_forward_hook(self._post_forward, always_call=True))
        for n, p in self.params.items():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_done))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    # -- gather / release -------------------------------------------------------------------------------
    def empty(self, dtype: torch.dtype) -> torch.Tensor:
        e = self._empty.get(dtype)
        if e is None:
            e = self._empty[dtype] = torch.empty(0, dtype=dtype, device=self.device)
        return e

    def gather(self, gids) -> None:
        new = []
        for gid in gids:
            if gid in self._live:
                continue
            b = self.layout.bucket(gid)
            fut = self._prefetched.pop(gid, None)
            if fut is not None:
                shard = fut.result()
                self.prefetch_hits += 1
            else:
                shard = self.fetch_shard(gid)
            full = torch.empty(b.numel, dtype=b.dtype, device=self.device)
            with torch.profiler.record_function("tierstore::all_gather"):
                _dist.all_gather(shard.to(self.device), full, self.group, quantized=self.qwz)
            self._live[gid] = full
            self.gathers += 1
            new.append(gid)
        for gid in new:
            self._materialize(gid)

    def _materialize(self, gid: int) -> None:
        for piece in self.layout.bucket(gid).pieces:
            name = piece.name
            owners = self.layout.param_gids[name]
            if not all(g in self._live for g in owners):
                continue
            p = self.params[name]
            gl = self._group_of[name]
            shape = gl.plan.params[name].shape
            if len(owners) == 1:
                p.data = self._live[gid][piece.offset:piece.end].view(shape)
            else:
                t = torch.empty(shape, dtype=gl.plan.params[name].dtype, device=self.device)
                flat = t.view(-1)
                for pc in gl.plan.pieces(name):
                    src = self._live[gl.gids[pc.bucket]]
                    flat[pc.param_offset:pc.param_offset + pc.numel].copy_(src[pc.offset:pc.end])
                p.data = t

    def release(self, gid: int) -> None:
        if self._live.pop(gid, None) is None:
            return
        b = self.layout.bucket(gid)
        for piece in b.pieces:
            self.params[piece.name].data = self.empty(b.dtype)

    def release_all(self) -> None:
        for gid in list(self._live):
            self.release(gid)
        self._drop_prefetched()

    def _drop_prefetched(self) -> None:
        for fut in self._prefetched.values():
            try:
                fut.result()
            except Exception:  # a failed read nobody needs: the next real fetch raises it
                pass
        self._prefetched.clear()

    # -- forward --------------------------------------------------------------------------------------
    def _root_pre(self, module, args) -> None:
        if self._in_forward == 0:
            self.trace.begin()
            self._users.clear()
            self._bw_pos = None
        self._in_forward += 1

    def _root_post(self, module, args, output) -> None:
        self._in_forward -= 1
        if self._in_forward == 0:
            self.trace.end()
            self._drop_prefetched()

    def _pre_forward(self, module, args) -> None:
        gids = self._module_gids[id(module)]
        self.trace.observe(id(module))
        for g in gids:
            self._users[g] = self._users.get(g, 0) + 1
        self.gather(gids)
        self._prefetch_ahead()

    def _post_forward(self, module, args, output) -> None:
        gids = self._module_gids[id(module)]
        if torch.is_grad_enabled():
            # the backward pre-hook: a hook on each output's gradient runs before the module's backward
            hook = _BackwardGather(self, id(module), gids)
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(hook)
        for g in gids:
            n = self._users.get(g, 0) - 1
            self._users[g] = n
            if n <= 0:
                self.release(g)

    def _prefetch_ahead(self) -> None:
        if self._executor is None:
            return
        for mid in self.trace.upcoming(self.prefetch_depth):
            for gid in self._module_gids.get(mid, ()):
                if gid not in self._live and gid not in self._prefetched:
                    self._prefetched[gid] = self._executor.submit(self.fetch_shard, gid)

    # -- backward -------------------------------------------------------------------------------------
    def _queue_end_callback(self) -> None:
        if not self._cb_queued:
            self._cb_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)

    def _pre_backward(self, mid: int, gids) -> None:
        self._queue_end_callback()
        hits = self.prefetch_hits
        self.gather(gids)
        self.prefetch_hits_backward += self.prefetch_hits - hits
        self._prefetch_backward(mid)

    def _prefetch_backward(self, mid: int) -> None:
        """Backward runs the traced order in reverse: read up the shards of the `prefetch_depth` modules
        before `mid` in the trace (local reads only, as in forward; see [Note: trace] in prefetch.py)."""
        order = self.trace.order
        if self._executor is None or self.trace.recording or not order:
            return
        j = self._bw_pos - 1 if self._bw_pos is not None else len(order) - 1
        while j >= 0 and order[j] != mid:
            j -= 1
        if j < 0:
            return  # not in the trace (an order change): no prediction
        self._bw_pos = j
        for prev in reversed(order[max(0, j - self.prefetch_depth):j]):
            for gid in self._module_gids.get(prev, ()):
                if gid not in self._live and gid not in self._prefetched:
                    self._prefetched[gid] = self._executor.submit(self.fetch_shard, gid)

    def _grad_done(self, p: torch.Tensor) -> None:
        self._queue_end_callback()
        name = self._name_of[id(p)]
        if name in self._seen:
            return
        self._seen.add(name)
        for gid in self.layout.param_gids[name]:
            self._done[gid] = self._done.get(gid, 0) + 1
            if self._done[gid] >= self._trainable_in.get(gid, 1 << 62):
                if self._users.get(gid, 0) <= 0:
                    self.release(gid)
                if self._world == 1:  # no collective: the bucket's gradient can leave memory right away
                    self._reduce_bucket(gid)
                    self._reduced.add(gid)
                    self.eager_reductions += 1

    def _backward_end(self) -> None:
        self._cb_queued = False
        self._bw_pos = None
        try:
            self.reduce_gradients()
        finally:
            self._reduced.clear()
            self._seen.clear()
            self._done.clear()
            for gid in list(self._live):
                if self._users.get(gid, 0) <= 0:
                    self.release(gid)
            self._drop_prefetched()

    def reduce_gradients(self) -> None:
        """Reduce-scatter every trainable bucket's gradient into the sink. See [Note: gradient reduce-scatter]."""
        for gid in self.layout.trainable_gids():
            if gid not in self._reduced:
                self._reduce_bucket(gid)
        for gl in self.layout.groups:
            if gl.trainable:
                for n in gl.names:
                    self.params[n].grad = None

    def _reduce_bucket(self, gid: int) -> None:
        b = self.layout.bucket(gid)
        flat = torch.zeros(b.numel, dtype=torch.float32, device=self.device)
        for piece in b.pieces:
            g = self.params[piece.name].grad
            if g is not None:
                flat[piece.offset:piece.end].copy_(g.reshape(-1)[piece.param_offset:piece.param_offset + piece.numel])
        with torch.profiler.record_function("tierstore::reduce_scatter"):
            shard = _dist.reduce_scatter_avg(flat, self.group, quantized=self.qgz,
                                             intra_node_size=self.intra_node_size)
        del flat
        self.grad_sink(gid, shard)
        if self._world == 1:  # drop the full gradients now (a split parameter: once all its buckets are done)
            for piece in b.pieces:
                if all(g in self._reduced or g == gid for g in self.layout.param_gids[piece.name]):
                    self.params[piece.name].grad = None


def register_external_parameter(module: torch.nn.Module, param: torch.nn.Parameter) -> None:
    """Declare that `module`'s forward uses `param`, a parameter registered on another module (for example a
    head reading the embedding's weight through a reference). Its buckets are then gathered around
    `module`'s forward and backward too. Call before building the Zero3Optimizer."""
    ext = module.__dict__.setdefault("_tierstore_external", [])
    if not any(p is param for p in ext):
        ext.append(param)


class _BackwardGather:
    """Gradient hook on a module's outputs: gathers the module's buckets before its backward runs."""

    __slots__ = ("coord", "mid", "gids")

    def __init__(self, coord: ParamCoordinator, mid: int, gids: list[int]):
        self.coord = coord
        self.mid = mid
        self.gids = gids

    def __call__(self, grad):
        self.coord._pre_backward(self.mid, self.gids)
        return None


def _tensors(obj):
    """Every tensor in a module output (tensor, tuple/list, dict), depth first."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)
