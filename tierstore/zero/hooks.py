"""Module hooks of ZeRO-3: gather a module's parameters before it runs, release them after; reduce-scatter
gradients into each rank's partition during and at the end of backward.

[Note: gather and release]
Outside of use every managed parameter's ``.data`` is an empty tensor; the values live as this rank's shard
of each bucket in the store. A module's forward pre-hook gathers the buckets holding its own (non-recursive)
parameters -- each rank reads its shard from its tier and they all-gather it (qwZ int8 when enabled) -- and
points each parameter's ``.data`` at its run of the gathered bucket (a view; a parameter split over buckets
is assembled). The forward post-hook releases buckets no running module needs (a count per bucket, so a
parent and a child sharing a bucket, or a module called twice, stay correct). Autograd saves the parameter
itself for backward ([Note: linear keeps its parameters] makes that true for nn.Linear), so the released
bucket's memory is free between forward and backward and the buckets are gathered again before the
module's backward (see [Note: backward gathers]); a bucket is released again once every trainable
parameter in it has accumulated its gradient (post-accumulate-grad hooks), or at the end of backward for
buckets holding unused or frozen parameters.

[Note: linear keeps its parameters]
nn.Linear's forward (F.linear -> addmm / matmul on ``weight.t()``) makes autograd save a transposed *view*
of the weight for backward: a view of the gathered bucket, which keeps the bucket's storage alive until
backward however early the hooks release it. On a stack of Linear layers that is the whole model held at
the end of forward (measured: 60 of 64 MiB), which is what ZeRO-3 exists to avoid. So the coordinator
points the forward of every hooked module whose class uses nn.Linear's own forward (nn.Linear, TiledLinear's
tiles, subclasses that do not override forward) at ``_LinearKeepingParams``: F.linear inside an autograd
Function that saves the input and the Parameter objects themselves -- not their data -- and computes the
three gradients from them in backward, after the backward gather put the values back. Same products as
torch's Linear backward (grad @ W, grad^T @ x, sum of grad); under torch.autocast the products run in the
autocast dtype, as nn.Linear's do. ``remove()`` restores the class's forward.

[Note: releasing frozen buckets in backward]
A bucket of trainable parameters is released in backward once all of them received their gradient; a bucket
of frozen parameters (a frozen base model under adapters) has no such signal, and used to stay until the end
of backward -- the whole frozen model gathered by then. So a hooked forward call that holds a frozen bucket
puts one multi-grad hook (torch.autograd.graph.register_multi_grad_hook) on its tensor inputs that require
grad: it runs when their gradients are complete, that is after every node that consumed them -- the call's
own backward among them -- ran, and it tells the coordinator that the call's backward is over. (An identity
autograd Function on the inputs did the same, but broke modules that modify an input in place.) Each frozen bucket
counts the entries still to finish; at zero, and with no forward running that uses it, it is released
(locally: the protocol view of [Note: backward gathers] is unchanged, so no rank's collectives change).
A call none of whose inputs requires grad (the first layer) gives no signal: its frozen buckets go at the
end of backward, as before.

[Note: activation recomputation]
torch.utils.checkpoint runs a module's forward again inside backward (non-reentrant: when a backward node
unpacks a tensor the first forward did not keep; reentrant: a nested backward over the recomputed graph).
That forward's pre-hooks gather what the module's buckets miss (a bucket released since -- all its gradients
in -- is gathered again), and its post-hooks release nothing: the nodes that asked for the recomputation,
or the recomputed graph's own, read the parameters right after it, and the usual backward rules (gradients
complete, frozen calls finished, end of backward) release them. A gather there is a collective at world size
N, in recomputation order: the same on every rank when every rank's backward graph is the same (the same
model and checkpointed regions on every rank, the usual case); a rank-dependent graph with recomputation
is not covered.

[Note: backward gathers]
Which module backwards run, and when, is a local matter: with a rank-dependent loss (rank 0 reads head 0,
rank 1 head 1) the ranks' autograd graphs differ, and a bucket's release on completion differs with them
(rank 1 may have completed a bucket that rank 0, lacking a gradient for one of its parameters, never
completes). Gathering "whatever the module about to run is missing" therefore posts different collectives
on different ranks (a silent exchange of the wrong shards, or a hang). So backward gathers follow a
sequence every rank shares instead: the *entries*, one per hooked forward call whose output requires grad,
in the order the forward post-hooks ran (identical on every rank, since forward order must be). Backward
walks the entries from the last one down with a cursor; the hook on a module's outputs (run before its
backward) pulls the cursor down to that module's entry, *visiting* every entry on the way: a visit gathers
the entry's buckets that have not been gathered since the backward began (the "protocol" view, kept apart
from which buckets this rank still holds). The end-of-backward callback walks the cursor to the bottom, so
every rank makes the same visits in the same order whatever its graph; a visit during that final walk
drops what it gathered at once. A hook whose entry the cursor already passed gathers nothing: its buckets
were gathered by that visit and are either still held or were released because every trainable parameter
in them already had its gradient -- and then no backward node left needs their values.
Not covered: hooks of an older graph (several forwards before one backward, retain_graph, activation
recomputation inside backward) gather what they miss on demand, deterministic only when every rank's
backward graph is the same.

[Note: gradient reduce-scatter]
Every trainable bucket is reduce-scattered once per backward (mean over ranks; qgZ int4 when enabled) into
this rank's fp32 gradient partition, added to what earlier micro-batches left there (gradient
accumulation), including buckets whose parameters got no gradient (zeros): the collectives of a backward
are then the same on every rank whatever parameters each used.
World size 1 (no collective): a bucket goes to its partition as soon as its last parameter's gradient
lands, and the full ``.grad`` tensors are dropped then.
World size N: reducing "as soon as a bucket is complete" would post collectives in each rank's completion
order (deadlock against the backward all-gathers). Instead the ranks follow an agreed *schedule* counted
in visits ([Note: backward gathers]), which every rank makes in the same order:
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

[Note: no gradient]
torch skips a parameter whose .grad is None; ZeRO-3 reduce-scatters every bucket, so the partition cannot
tell "no gradient" from "zero gradient". The coordinator therefore records which trainable parameters
received a gradient (post-accumulate-grad hook) and, at world size N, agrees the set in the same end-of-
backward all_reduce (per-parameter flags, MAX = any rank): ``grad_names`` holds the parameters that got a
gradient on some rank since the optimizer's last zero_grad(). The optimizer's step skips the others (see
[Note: skipped parameters] in optimizer.py).
"""
from __future__ import annotations

import logging
import types
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from . import _dist
from ._layout import Layout
from .prefetch import DeviceStage, Trace

log = logging.getLogger("tierstore.zero")


@dataclass(frozen=True)
class CoordinatorStats:
    """What the ZeRO-3 hooks did, as of one call to ParamCoordinator.stats() (``opt.coordinator.stats()``).
    Counts run from the optimizer's construction unless a field says otherwise."""

    gathers: int  # all-gathers issued, posted ahead or not (world size 1: copies of the shard)
    gathers_ahead: int  # ... posted ahead of the module that uses them ([Note: prefetch stages], world size N)
    gather_hits: int  # all-gathers posted ahead that a module then waited for
    gather_hits_backward: int  # ... of which in backward
    gathers_dropped: int  # all-gathers posted ahead that no module used (the order changed): waited for, dropped
    most_ahead: int  # the most buckets gathered ahead and not yet used, at once
    prefetch_hits: int  # shards read ahead ([Note: prefetch stages]) that a gather then used
    prefetch_hits_backward: int  # ... of which in backward
    staged: int  # shards read ahead that went through the host -> device stage
    staged_copies: int  # ... of which copied on a side stream (0 with the CPU as compute device)
    trace_rebuilds: int  # times the module order changed and the prefetch trace was re-recorded ([Note: trace])
    eager_reductions: int  # world size 1: buckets reduced as soon as their gradients were complete
    early_reductions: int  # world size N: buckets reduced during backward by the agreed schedule
    rereductions: int  # buckets that received gradient after their reduction and were reduced again
    grad_bytes: int  # bytes of full .grad alive now
    peak_grad_bytes: int  # bytes of full .grad alive at once, at most, in the last (or current) backward
    buckets_held: frozenset[int]  # ids (gids) of the buckets whose gathered values this rank holds now
    reads_in_flight: int  # shards read ahead and not yet used or dropped
    gathers_in_flight: int  # all-gathers posted ahead and not yet used or dropped
    in_forward: bool  # a forward of the model is running (a recomputation inside backward included)


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
        self._trainable = layout.trainable_gids()
        self._trainable_param_names = [n for gl in layout.groups if gl.trainable for n in gl.names]
        self._live: dict[int, torch.Tensor] = {}  # gid -> gathered bucket this rank holds
        self._plive: set[int] = set()  # gids every rank counts as gathered ([Note: backward gathers])
        self._users: dict[int, int] = {}  # gid -> running modules needing it
        self._module_gids: dict[int, list[int]] = {}
        self._prefetched: dict[int, Future] = {}  # gid -> read (and staged) shard, [Note: prefetch stages]
        self._pending: dict[int, _dist.Gathering] = {}  # gid -> all-gather posted ahead
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tierstore-prefetch") if prefetch_depth else None
        self.stage = DeviceStage(device)
        self._empty: dict[torch.dtype, torch.Tensor] = {}
        self._trainable_in: dict[int, int] = {}
        for gid in self._trainable:
            self._trainable_in[gid] = len(set(p.name for p in layout.bucket(gid).pieces))
        self._world = _dist.world_and_rank(group)[0]
        self._gather_ahead = self._world > 1 and prefetch_depth > 0  # stage 3 of [Note: prefetch stages]
        # -- backward state ([Note: backward gathers], [Note: gradient reduce-scatter])
        self._entries: list[tuple[int, list[int]]] = []  # (module id, gids) per hooked forward call
        self._serial = 0  # bumped when the entries are reset: hooks carrying an older serial are stale
        self._in_backward = False
        self._bw_task = -1  # autograd graph task of the backward in progress
        self._cursor = 0  # entries[cursor:] were visited in this backward
        self._visits = 0
        self._done: dict[int, int] = {}
        self._seen: set[str] = set()
        self._reduced: set[int] = set()  # buckets reduced in this backward
        self._dirty: set[int] = set()  # reduced, then received more gradient
        self._arrival: dict[int, int] = {}  # gid -> visits made when its last gradient arrived
        self._schedule: list[tuple[int, int]] | None = None  # (position, gid), sorted
        self._schedule_key: tuple | None = None  # the entries the schedule was learnt on
        self._due: list[tuple[int, int]] = []  # this backward's schedule
        self._due_at = 0
        self._cb_queued = False
        self._in_forward = 0
        self._grad_counted: dict[str, int] = {}  # name -> bytes of its full .grad counted as alive
        self._calls: list[_AfterBackward] = []  # tokens of the hooked forward calls running (nested)
        self._frozen_left: dict[int, int] = {}  # frozen gid -> entries whose backward has not finished
        self._got_grad: set[str] = set()  # parameters that received a gradient on this rank in this backward
        self.grad_names: set[str] = set()  # ... on any rank since clear_grad_flags() ([Note: no gradient])
        # -- counters (tests, diagnostics; read them through stats())
        self.gathers = 0  # all-gathers issued (ahead or not)
        self.prefetch_hits = 0  # shards read ahead that were used
        self.prefetch_hits_backward = 0
        self.gathers_ahead = 0  # all-gathers posted ahead
        self.gather_hits = 0  # ... that a module then waited for
        self.gather_hits_backward = 0
        self.gathers_dropped = 0  # ... that no module used (waited for and dropped)
        self.most_ahead = 0  # the most buckets gathered ahead and not yet used, at once
        self.eager_reductions = 0  # world size 1: buckets reduced as soon as complete
        self.early_reductions = 0  # world size N: buckets reduced during backward by the schedule
        self.rereductions = 0  # dirty buckets reduced again at the end of backward
        self.grad_bytes = 0  # bytes of full .grad alive now
        self.peak_grad_bytes = 0  # the most alive at once during the last (or current) backward
        self._handles: list = []
        self._install()

    # -- installation -----------------------------------------------------------------------------------
    def _install(self) -> None:
        root = self.model
        for m in root.modules():  # [Note: modules that read their children's parameters]
            if isinstance(m, _READS_CHILDREN):
                for p in m.parameters():
                    register_external_parameter(m, p)
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
            if type(m).forward is torch.nn.Linear.forward and "forward" not in m.__dict__:
                m.forward = types.MethodType(_linear_keeping_params, m)  # [Note: linear keeps its parameters]
                self._handles.append(_InstanceForward(m))
        for n, p in self.params.items():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_done))

    def stats(self) -> CoordinatorStats:
        """A snapshot of the counters and of what is held now (see CoordinatorStats)."""
        return CoordinatorStats(
            gathers=self.gathers, gathers_ahead=self.gathers_ahead, gather_hits=self.gather_hits,
            gather_hits_backward=self.gather_hits_backward, gathers_dropped=self.gathers_dropped,
            most_ahead=self.most_ahead, prefetch_hits=self.prefetch_hits,
            prefetch_hits_backward=self.prefetch_hits_backward, staged=self.stage.staged,
            staged_copies=self.stage.copies, trace_rebuilds=self.trace.rebuilds,
            eager_reductions=self.eager_reductions, early_reductions=self.early_reductions,
            rereductions=self.rereductions, grad_bytes=self.grad_bytes, peak_grad_bytes=self.peak_grad_bytes,
            buckets_held=frozenset(self._live), reads_in_flight=len(self._prefetched),
            gathers_in_flight=len(self._pending), in_forward=self._in_forward > 0)

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
        """Make `gids` held on this rank: one all-gather per bucket neither held nor posted ahead (a
        collective: every rank must ask for the same buckets in the same order)."""
        new = []
        for gid in gids:
            if gid in self._live:
                continue
            pending = self._pending.pop(gid, None)
            if pending is not None:
                with torch.profiler.record_function("tierstore::all_gather_wait"):
                    full = pending.wait()
                self.gather_hits += 1
            else:
                b = self.layout.bucket(gid)
                shard = self._shard(gid)
                full = torch.empty(b.numel, dtype=b.dtype, device=self.device)
                with torch.profiler.record_function("tierstore::all_gather"):
                    _dist.all_gather(shard, full, self.group, quantized=self.qwz)
                self.gathers += 1
            self._live[gid] = full
            self._plive.add(gid)
            new.append(gid)
        for gid in new:
            self._materialize(gid)

    def _shard(self, gid: int) -> torch.Tensor:
        """This rank's shard of `gid` on the compute device: read ahead, or read now."""
        fut = self._prefetched.pop(gid, None)
        if fut is not None:
            staged = fut.result()
            self.prefetch_hits += 1
            return self.stage.ready(staged)
        return self.fetch_shard(gid).to(self.device)

    def _read_and_stage(self, gid: int):
        """Worker thread: stages 1 and 2 of [Note: prefetch stages]."""
        return self.stage.to_device(self.fetch_shard(gid))

    def _gather_ahead_of(self, gids) -> None:
        """Post the all-gathers of `gids` now, waited when a module needs them (stage 3). Only from the main
        thread, at points every rank reaches in the same order."""
        for gid in gids:
            if gid in self._plive or gid in self._pending:
                continue
            b = self.layout.bucket(gid)
            shard = self._shard(gid)
            full = torch.empty(b.numel, dtype=b.dtype, device=self.device)
            with torch.profiler.record_function("tierstore::all_gather_post"):
                self._pending[gid] = _dist.all_gather_async(shard, full, self.group, quantized=self.qwz)
            self.gathers += 1
            self.gathers_ahead += 1
            self.most_ahead = max(self.most_ahead, len(self._pending))

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

    def release(self, gid: int, *, local_only: bool = False) -> None:
        """Drop bucket `gid`'s gathered values. `local_only`: this rank no longer needs them, but every rank
        still counts the bucket as gathered in this backward ([Note: backward gathers])."""
        if not local_only:
            self._plive.discard(gid)
        if self._live.pop(gid, None) is None:
            return
        b = self.layout.bucket(gid)
        for piece in b.pieces:
            self.params[piece.name].data = self.empty(b.dtype)

    def release_all(self) -> None:
        self._drop_prefetched()
        for gid in list(self._live):
            self.release(gid)
        self._plive.clear()

    def _drop_prefetched(self) -> None:
        """Drop what was fetched ahead and not used; an all-gather posted ahead is waited for first (every
        rank posted it, so it completes)."""
        for gid in sorted(self._pending):
            self._pending[gid].wait()
            self.gathers_dropped += 1
        self._pending.clear()
        for fut in self._prefetched.values():
            try:
                fut.result()
            except Exception:  # a failed read nobody needs: the next real fetch raises it
                pass
        self._prefetched.clear()

    # -- forward --------------------------------------------------------------------------------------
    def _root_pre(self, module, args) -> None:
        if self._in_forward == 0 and self._in_backward and torch._C._current_graph_task_id() != self._bw_task:
            # the previous backward raised: the engine does not run its end callback
            self._cb_queued = False
            if self._world == 1:  # no collective: what it accumulated goes to the partitions, as torch keeps it
                for gid in self.layout.trainable_gids():
                    if gid not in self._reduced and any(self.params[pc.name].grad is not None
                                                        for pc in self.layout.bucket(gid).pieces):
                        self._reduce_bucket(gid)
                self.grad_names |= self._got_grad
                log.warning("a backward ended without reaching its end (it raised); the gradients it accumulated "
                            "are kept, as torch keeps them: call zero_grad() to drop them")
            else:  # finishing its reductions would need the other ranks, which are elsewhere
                log.warning("a backward ended without reaching its end (it raised): the gradients of buckets it "
                            "had already reduced stay in the gradient partitions, the rest are dropped; call "
                            "zero_grad() to start the accumulation afresh")
                self.grad_names |= {pc.name for gid in self._reduced for pc in self.layout.bucket(gid).pieces
                                    if pc.name in self._got_grad}  # in the partitions: stepped, not skipped
            self._reset_backward()
            for n in self._trainable_param_names:
                self._drop_grad(n)
        if self._in_forward == 0 and not self._in_backward:
            self._calls.clear()
            self.trace.begin()
            self._users.clear()
            self._entries = []  # hooks of the previous graph become stale ([Note: backward gathers])
            self._serial += 1
        self._in_forward += 1

    def _root_post(self, module, args, output) -> None:
        self._in_forward -= 1
        if self._in_forward == 0:
            self.trace.end()
            self._drop_prefetched()
            if not self._in_backward:  # buckets kept for a module predicted next (see _post_forward)
                for gid in list(self._live):
                    if self._users.get(gid, 0) <= 0:
                        self.release(gid)

    def _pre_forward(self, module, args) -> None:
        self._calls.append(None)  # popped by the post-hook, which runs even when this raises
        gids = self._module_gids[id(module)]
        if not self._in_backward:  # a recomputation inside backward is not part of the forward's order
            self.trace.observe(id(module))
        for g in gids:
            self._users[g] = self._users.get(g, 0) + 1
        # a forward inside backward (activation recomputation) gathers what it misses on demand: see
        # [Note: activation recomputation]
        self.gather(gids)
        if not self._in_backward:
            self._prefetch_ahead()
        if self._in_backward or not torch.is_grad_enabled() or all(g in self._trainable_in for g in gids):
            return None
        # frozen buckets: learn when this call's backward is over ([Note: releasing frozen buckets in backward])
        token = self._calls[-1] = _AfterBackward(self, self._serial)
        inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        if inputs:
            torch.autograd.graph.register_multi_grad_hook(inputs, lambda grads, t=token: self._after_backward(t))
        return None

    def _post_forward(self, module, args, output) -> None:
        gids = self._module_gids[id(module)]
        token = self._calls.pop() if self._calls else None
        if torch.is_grad_enabled():
            tensors = [t for t in _tensors(output) if t.requires_grad]
            if tensors:
                # the backward pre-hook: a hook on each output's gradient runs before the module's backward
                hook = _BackwardGather(self, self._serial, len(self._entries), gids,
                                       late=self._in_backward)
                if not self._in_backward:
                    if token is not None:  # a call without an entry leaves its token's index None
                        token.index = len(self._entries)
                    self._entries.append((id(module), gids))
                for t in tensors:
                    t.register_hook(hook)
        # a bucket the trace says the next modules use stays (e.g. packed small parameters of neighbours):
        # the same prediction on every rank, so the same all-gathers are skipped everywhere
        keep = () if self._in_backward or self._executor is None else {
            g for mid in self.trace.upcoming(self.prefetch_depth) for g in self._module_gids.get(mid, ())}
        for g in gids:
            n = self._users.get(g, 0) - 1
            self._users[g] = n
            if n <= 0 and g not in keep and not self._in_backward:
                self.release(g)
            # inside backward the recomputed graph's nodes read these parameters next: the buckets stay until
            # the backward releases them ([Note: activation recomputation])

    def _prefetch_ahead(self) -> None:
        """Forward: stages ahead of the trace ([Note: prefetch stages])."""
        if self._executor is None:
            return
        d = self.prefetch_depth
        upcoming = self.trace.upcoming(2 * d if self._gather_ahead else d)
        for mid in upcoming[d:] if self._gather_ahead else upcoming:
            self._read_ahead(self._module_gids.get(mid, ()))
        if self._gather_ahead:
            for mid in upcoming[:d]:
                self._gather_ahead_of(self._module_gids.get(mid, ()))

    def _read_ahead(self, gids) -> None:
        for gid in gids:
            if gid not in self._plive and gid not in self._pending and gid not in self._prefetched:
                self._prefetched[gid] = self._executor.submit(self._read_and_stage, gid)

    # -- backward -------------------------------------------------------------------------------------
    def _begin_backward(self) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        self._bw_task = torch._C._current_graph_task_id()
        if not self._cb_queued:
            self._cb_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
        self._cursor = len(self._entries)
        self._visits = 0
        self._frozen_left = {}
        for _mid, gids in self._entries:
            for g in gids:
                if g not in self._trainable_in:
                    self._frozen_left[g] = self._frozen_left.get(g, 0) + 1
        self.peak_grad_bytes = self.grad_bytes
        key = self._entries_key()
        self._due = self._schedule if self._schedule is not None and key == self._schedule_key else []
        self._due_at = 0

    def _entries_key(self) -> tuple:
        return tuple((mid, tuple(gids)) for mid, gids in self._entries)

    def _pre_backward(self, hook: "_BackwardGather") -> None:
        self._begin_backward()
        if hook.serial == self._serial and not hook.late:
            self._advance_to(hook.index)
        else:  # stale: see the Note's "not covered"
            self.gather(hook.gids)

    def _advance_to(self, index: int, *, final: bool = False) -> None:
        """Visit entries down to `index` ([Note: backward gathers])."""
        while self._cursor > index:
            self._cursor -= 1
            self._reduce_due(self._visits)
            gids = self._entries[self._cursor][1]
            need = [g for g in gids if g not in self._plive]
            hits, ghits = self.prefetch_hits, self.gather_hits
            self.gather(need)
            self.prefetch_hits_backward += self.prefetch_hits - hits
            self.gather_hits_backward += self.gather_hits - ghits
            for g in need:
                if final or (self._done.get(g, 0) >= self._trainable_in.get(g, 1 << 62) and self._users.get(g, 0) <= 0):
                    self.release(g, local_only=True)  # nobody here needs it (any more)
            self._visits += 1
            if not final:
                self._prefetch_backward()

    def _prefetch_backward(self) -> None:
        """Backward: stages ahead of the cursor, over the entries below it ([Note: prefetch stages]). Every
        rank makes the same visits in the same order, so it posts the same all-gathers."""
        if self._executor is None:
            return
        d, c = self.prefetch_depth, self._cursor
        below = [self._entries[j][1] for j in range(c - 1, max(c - 1 - (2 * d if self._gather_ahead else d), -1), -1)]
        for gids in below[d:] if self._gather_ahead else below:
            self._read_ahead(gids)
        if self._gather_ahead:
            for gids in below[:d]:
                self._gather_ahead_of(gids)

    def _grad_done(self, p: torch.Tensor) -> None:
        self._begin_backward()
        name = self._name_of[id(p)]
        self._got_grad.add(name)
        gids = self.layout.param_gids[name]
        for gid in gids:
            self._arrival[gid] = self._visits
            if gid in self._reduced:
                self._dirty.add(gid)
        if name not in self._grad_counted and p.grad is not None:
            nbytes = p.grad.numel() * p.grad.element_size()
            self._grad_counted[name] = nbytes
            self.grad_bytes += nbytes
            self.peak_grad_bytes = max(self.peak_grad_bytes, self.grad_bytes)
        if name in self._seen:
            return
        self._seen.add(name)
        for gid in gids:
            self._done[gid] = self._done.get(gid, 0) + 1
            if self._done[gid] >= self._trainable_in.get(gid, 1 << 62):
                if self._users.get(gid, 0) <= 0:
                    self.release(gid, local_only=True)
                if self._world == 1 and gid not in self._reduced:  # no collective: reduce right away
                    self._reduce_bucket(gid)
                    self.eager_reductions += 1

    def _after_backward(self, token: "_AfterBackward") -> None:
        """A hooked forward call's backward is over (the gradients of its inputs are complete): a frozen
        bucket no entry still to run needs is released. See [Note: releasing frozen buckets in backward]."""
        if token.serial != self._serial or token.index is None or token.index >= len(self._entries):
            return
        for g in self._entries[token.index][1]:
            n = self._frozen_left.get(g)
            if n is None:
                continue
            self._frozen_left[g] = n - 1
            if n - 1 <= 0 and self._users.get(g, 0) <= 0:
                self.release(g, local_only=True)

    def _reduce_due(self, k: int) -> None:
        """World size N: reduce-scatter the buckets the schedule puts at or before visit k."""
        due = self._due
        while self._due_at < len(due) and due[self._due_at][0] <= k:
            gid = due[self._due_at][1]
            self._due_at += 1
            if gid not in self._reduced:
                self._reduce_bucket(gid)
                self.early_reductions += 1

    def _backward_end(self) -> None:
        self._cb_queued = False
        try:
            if self._world > 1:
                self._advance_to(0, final=True)
            self.reduce_gradients()
        finally:
            self._reset_backward()

    def _reset_backward(self) -> None:
        self._in_backward = False
        self._reduced.clear()
        self._dirty.clear()
        self._arrival.clear()
        self._got_grad.clear()
        self._seen.clear()
        self._done.clear()
        self._due = []
        for gid in list(self._live):
            if self._users.get(gid, 0) <= 0:
                self.release(gid)
        self._plive = set(self._live)
        self._drop_prefetched()

    def clear_grad_flags(self) -> None:
        """Forget which parameters received a gradient (zero_grad)."""
        self.grad_names.clear()

    def reduce_gradients(self) -> None:
        """End of backward: agree on positions, dirty buckets and which parameters got a gradient (one
        all_reduce MAX), then reduce-scatter every trainable bucket not reduced yet and every dirty one, in
        bucket order. See [Note: gradient reduce-scatter], [Note: no gradient]."""
        dirty = set(self._dirty)
        got = self._got_grad
        if self._world > 1:
            n = len(self._entries)
            names = self._trainable_param_names
            flags = torch.tensor([self._arrival.get(g, -1) for g in self._trainable]
                                 + [1 if g in dirty else 0 for g in self._trainable]
                                 + [1 if name in got else 0 for name in names], dtype=torch.int64)
            _dist.all_reduce_max(flags, self.group)
            t = len(self._trainable)
            flags = flags.tolist()
            dirty = {g for g, d in zip(self._trainable, flags[t:2 * t]) if d}
            got = {name for name, f in zip(names, flags[2 * t:]) if f}
            self._schedule = sorted((p if p >= 0 else n, g) for g, p in zip(self._trainable, flags[:t]))
            self._schedule_key = self._entries_key()
        self.grad_names |= got
        for gid in self._trainable:
            if gid in dirty:
                self.rereductions += 1
                self._reduce_bucket(gid)
            elif gid not in self._reduced:
                self._reduce_bucket(gid)
        for n in self._trainable_param_names:
            self._drop_grad(n)

    def _drop_grad(self, name: str) -> None:
        self.params[name].grad = None
        self.grad_bytes -= self._grad_counted.pop(name, 0)

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
        self._reduced.add(gid)
        # what went to the partition leaves .grad: a later arrival is then exactly the part still to reduce
        for piece in b.pieces:
            p = self.params[piece.name]
            if p.grad is None:
                continue
            if all(g in self._reduced for g in self.layout.param_gids[piece.name]):
                self._drop_grad(piece.name)
            else:
                if not p.grad.is_contiguous():
                    p.grad = p.grad.contiguous()
                p.grad.view(-1)[piece.param_offset:piece.param_offset + piece.numel].zero_()


# [Note: modules that read their children's parameters]
# The hooks gather a module's parameters around *its* forward. Some torch modules read a child's parameters
# without calling the child: nn.MultiheadAttention passes out_proj.weight / .bias to the attention function,
# and nn.TransformerEncoderLayer / DecoderLayer take a fused fast path in inference that reads every
# descendant's parameters. Those modules get all their descendants' parameters registered as external
# parameters when the optimizer is built, so each is gathered whole (one layer) around its forward and
# backward. Other modules that do the same need register_external_parameter (see its docstring).
_READS_CHILDREN = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer)


def register_external_parameter(module: torch.nn.Module, param: torch.nn.Parameter) -> None:
    """Declare that `module`'s forward uses `param`, a parameter registered on another module (for example a
    head reading the embedding's weight through a reference). Its buckets are then gathered around
    `module`'s forward and backward too. Call before building the Zero3Optimizer. A module that reads its
    children's parameters without calling them is gathered whole by registering each of
    ``module.parameters()`` ([Note: modules that read their children's parameters])."""
    ext = module.__dict__.setdefault("_tierstore_external", [])
    if not any(p is param for p in ext):
        ext.append(param)


class _LinearKeepingParams(torch.autograd.Function):
    """F.linear whose backward reads the parameters themselves. See [Note: linear keeps its parameters].
    Under torch.autocast the product runs in the autocast dtype, as nn.Linear's would, and each gradient
    comes back in its tensor's own dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        dev = x.device.type
        ctx.cast = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        ctx.save_for_backward(x, weight, bias)
        if ctx.cast is None:
            return torch.nn.functional.linear(x, weight, bias)
        c = ctx.cast
        with torch.autocast(dev, enabled=False):
            return torch.nn.functional.linear(x.to(c), weight.to(c), None if bias is None else bias.to(c))

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias = ctx.saved_tensors
        if ctx.cast is not None:
            grad = grad.to(ctx.cast)
        w = weight if ctx.cast is None else weight.to(ctx.cast)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = grad.matmul(w).to(x.dtype)
        g2 = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            gw = g2.t().matmul(x2 if ctx.cast is None else x2.to(ctx.cast)).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            gb = g2.sum(0).to(bias.dtype)
        return gx, gw, gb


def _linear_keeping_params(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _LinearKeepingParams.apply(x, module.weight, module.bias)


class _InstanceForward:
    """Handle that takes back an instance-level forward set by the coordinator."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def remove(self) -> None:
        self.module.__dict__.pop("forward", None)


class _AfterBackward:
    """Token of one hooked forward call that holds frozen buckets: its entry, filled in by the post-hook."""

    __slots__ = ("coord", "serial", "index")

    def __init__(self, coord: ParamCoordinator, serial: int):
        self.coord = coord
        self.serial = serial
        self.index: int | None = None


class _BackwardGather:
    """Gradient hook on a module's outputs: its buckets are gathered before its backward runs."""

    __slots__ = ("coord", "serial", "index", "gids", "late")

    def __init__(self, coord: ParamCoordinator, serial: int, index: int, gids: list[int], late: bool):
        self.coord = coord
        self.serial = serial  # the entries list it belongs to
        self.index = index  # its entry
        self.gids = gids
        self.late = late  # created inside a backward (recomputation): not an entry

    def __call__(self, grad):
        self.coord._pre_backward(self)
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
