"""Module hooks of ZeRO-3: gather a module's parameters before it runs, release them after; reduce-scatter
gradients into each rank's partition during and at the end of backward.

``ParamCoordinator`` is the hooks layer: it installs the hooks and, in each, asks the state objects what to
do and does it -- the phase (phase.py), the backward schedule (backward_schedule.py, a pure state machine),
the gradient reducer (gradient_reducer.py), bucket residency (bucket_residency.py), what the trace says of
the forward's end (turn.py) and the agreement on final buckets (finals.py) -- and tells the subscribers of
events.py where the step is. It does the gathers itself; the prefetch around them is prefetch.py's
``Prefetcher``, which it tells what comes next (the trace forward, the entries below the backward cursor)
and takes read-ahead shards and posted all-gathers from. nn.Linear's forward is replaced by linear.py's.

[Note: gather and release]
Outside of use every managed parameter's ``.data`` is an empty tensor; the values live as this rank's shard
of each bucket in the store. A module's forward pre-hook gathers the buckets holding its own (non-recursive)
parameters -- each rank reads its shard from its tier and they all-gather it (qwZ int8 when enabled) -- and
points each parameter's ``.data`` at its run of the gathered bucket (a view; a parameter split over buckets
is assembled). The forward post-hook releases buckets no running module needs (a count per bucket, so a
parent and a child sharing a bucket, or a module called twice, stay correct; [Note: bucket residency] in
bucket_residency.py). Autograd saves the parameter itself for backward ([Note: linear keeps its
parameters] in linear.py makes that true for nn.Linear), so the released bucket's memory is free between
forward and backward and the buckets are gathered again before the module's backward (see [Note: backward
gathers] in backward_schedule.py); a bucket is released again once every trainable parameter in it has
accumulated its gradient (post-accumulate-grad hooks), or at the end of backward for buckets holding unused
or frozen parameters ([Note: releasing frozen buckets in backward] in bucket_residency.py).

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

[Note: no gradient]
torch skips a parameter whose .grad is None; ZeRO-3 reduce-scatters every bucket, so the partition cannot
tell "no gradient" from "zero gradient". The coordinator therefore records which trainable parameters
received a gradient (post-accumulate-grad hook) and, at world size N, agrees the set in the same end-of-
backward all_reduce (per-parameter flags, MAX = any rank; GradientReducer.end_of_backward):
``grad_names`` holds the parameters that got a gradient on some rank since the optimizer's last
zero_grad(). The optimizer's step skips the others (see [Note: skipped parameters] in skipped.py).

[Note: compiled models]
``torch.compile(model)`` traces the module calls, hooks included. Every hook here (the root's and each
module's forward pre- and post-hook) and the Linear forward of [Note: linear keeps its parameters] in linear.py are run
under ``torch.compiler.disable`` (``_eager``), so Dynamo breaks the graph at each of them and runs them
eagerly, and nothing they call (gathers, store reads, I/O engine, collectives) is traced. What Dynamo
compiles is the compute between hooks: a module's own arithmetic outside its Linear products (norms,
activations, attention arithmetic, residual adds), where the parameters are already gathered. The backward
hooks (gradient hooks on module outputs, post-accumulate-grad hooks) are registered and run by the eager
autograd engine, outside any graph. Costs: one graph break per hooked module call (a graph per region
between them, compiled once; the guards see gathered parameters, so no step recompiles), and Linear
products run as eager calls.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import _dist
from ..params.layout import Layout
from ..phase import Phase
from .backward_schedule import BackwardSchedule
from .bucket_residency import BucketResidency
from .events import Subscribers, Subscription
from .finals import FinalAgreement
from .gradient_reducer import GradientReducer, PartitionSink
from .linear import keep_linear_params
from .prefetch import READ_WORKERS, Prefetcher, Trace
from .turn import TurnPlan


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
    # world size N, overlap_step: buckets reduced during backward that some rank could not step then (not all
    # their gradients in yet there); stepped in step() ([Note: overlapped step at world size N] in finals.py)
    finals_deferred: int
    rereductions: int  # buckets that received gradient after their reduction and were reduced again
    # world size 1: parameters' gradients computed straight into their partition, no full .grad allocated
    # ([Note: gradients computed in their partition] in grad_partitions.py)
    grads_in_place: int
    grad_bytes: int  # bytes of full .grad alive now
    peak_grad_bytes: int  # bytes of full .grad alive at once, at most, in the last (or current) backward
    buckets_held: frozenset[int]  # ids (gids) of the buckets whose gathered values this rank holds now
    reads_in_flight: int  # shards read ahead and not yet used or dropped
    gathers_in_flight: int  # all-gathers posted ahead and not yet used or dropped
    in_forward: bool  # a forward of the model is running (a recomputation inside backward included)
    # buckets the end of forward kept for backward, not gathered again ([Note: kept at the turn] in turn.py)
    kept_at_turn: int


class ParamCoordinator:
    """Installs and runs the hooks of one model. See [Note: gather and release]."""

    def __init__(self, model: torch.nn.Module, layout: Layout, params: dict[str, torch.nn.Parameter],
                 fetch_shard: Callable[[int], torch.Tensor], grad_sink: PartitionSink, *,
                 device: torch.device, group=None, quantized_weights: bool = False,
                 quantized_gradients: bool = False, intra_node_size: int | None = None, prefetch_depth: int = 0,
                 prefetch_bytes: int = 0, read_workers: int = READ_WORKERS,
                 reuse_bytes: int = 0,
                 lend_shard: Callable[[int], tuple[torch.Tensor, Callable[[], None]] | None] | None = None,
                 events: Subscribers | None = None):
        self.model = model
        self.layout = layout
        self.params = params  # canonical name -> Parameter
        self.device = device
        self.group = group
        self.qwz = quantized_weights
        self.prefetch_depth = prefetch_depth
        self._turn: dict[int, None] = {}  # gids held past their release near the forward's end, in release order
        self.kept_at_turn = 0
        self.phase = Phase.IDLE  # [Note: phases]
        self._depth = 0  # nesting of the root module's forward
        self._bw_task = -1  # autograd graph task of the backward in progress
        self.schedule = BackwardSchedule()
        self.reducer = GradientReducer(layout, params, grad_sink, device=device, group=group,
                                       quantized=quantized_gradients, intra_node_size=intra_node_size)
        self.residency = BucketResidency(layout, params, device)
        self.events = Subscribers() if events is None else events  # [Note: hook events] in events.py
        self.trace = Trace()
        self._name_of = {id(p): n for n, p in params.items()}
        self._module_gids: dict[int, list[int]] = {}
        self.turn = TurnPlan(layout, self.trace, self._module_gids, reuse_bytes)  # [Note: kept at the turn] in turn.py
        self._calls: list[_Call] = []  # the hooked forward calls running (nested)
        self._world = _dist.world_and_rank(group)[0]
        # [Note: gathering at world size 1]: gid -> whether its shard was lent last time
        self._lend = lend_shard if self._world == 1 and not quantized_weights else None
        self._lent: dict[int, bool] = {}
        self.views = True  # False: gather copies even where a shard could be lent (gathered())
        # world size N: which buckets reduced early are final ([Note: overlapped step at world size N] in finals.py)
        self.finals = FinalAgreement(self.reducer, self.residency, self.events, group)
        self.final_backwards = 0  # backwards that ended with final buckets wanted (some may have been stepped)
        # -- prefetch ([Note: prefetch stages] in prefetch.py)
        # a lent shard is not read ahead: using it costs nothing
        self.prefetcher = Prefetcher(layout, fetch_shard,
                                     lambda gid: gid in self.residency.protocol or self._lent.get(gid, False),
                                     device=device, group=group, quantized=quantized_weights, depth=prefetch_depth,
                                     read_bytes=prefetch_bytes, read_workers=read_workers)
        # -- counters (tests, diagnostics; read them through stats()); the prefetcher keeps its own
        self.gathers_on_demand = 0  # all-gathers issued when a module needed the bucket (not posted ahead)
        self.prefetch_hits_backward = 0
        self.gather_hits_backward = 0
        self.eager_reductions = 0  # world size 1: buckets reduced as soon as complete
        self.early_reductions = 0  # world size N: buckets reduced during backward by the schedule
        self.rereductions = 0  # dirty buckets reduced again at the end of backward
        self._handles: list = []
        self._install()

    # -- read-only views (kept for the tests that read them; see the stats surface) -----------------------
    @property
    def grad_names(self) -> set[str]:
        """Parameters that got a gradient on some rank since clear_grad_flags() ([Note: no gradient])."""
        return self.reducer.grad_names

    @property
    def grad_bytes(self) -> int:  # bytes of full .grad alive now
        return self.reducer.grad_bytes

    @property
    def peak_grad_bytes(self) -> int:  # bytes: the most alive at once during the last (or current) backward
        return self.reducer.peak_grad_bytes

    # -- installation -----------------------------------------------------------------------------------
    def _install(self) -> None:
        root = self.model
        for m in root.modules():  # [Note: modules that read their children's parameters]
            if isinstance(m, _READS_CHILDREN):
                for p in m.parameters():
                    register_external_parameter(m, p)
        self._handles.append(root.register_forward_pre_hook(_eager(self._root_pre), prepend=True))
        self._handles.append(root.register_forward_hook(_eager(self._root_post), always_call=True))
        for m in root.modules():
            own = [p for p in m._parameters.values() if p is not None]
            own += list(m.__dict__.get("_tierstore_external", ()))
            names = list(dict.fromkeys(self._name_of[id(p)] for p in own if id(p) in self._name_of))
            if not names:
                continue
            gids = sorted({g for n in names for g in self.layout.param_gids[n]})
            self._module_gids[id(m)] = gids
            self._handles.append(m.register_forward_pre_hook(_eager(self._pre_forward)))
            self._handles.append(m.register_forward_hook(_eager(self._post_forward), always_call=True))
            # [Note: linear keeps its parameters] in linear.py; [Note: gradients computed in their partition]
            handle = keep_linear_params(m, self._grad_out)
            if handle is not None:
                self._handles.append(handle)
        for _n, p in self.params.items():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_done))

    def stats(self) -> CoordinatorStats:
        """A snapshot of the counters and of what is held now (see CoordinatorStats)."""
        pf = self.prefetcher
        return CoordinatorStats(
            gathers=self.gathers_on_demand + pf.gathers_ahead, gathers_ahead=pf.gathers_ahead,
            gather_hits=pf.gather_hits, gather_hits_backward=self.gather_hits_backward,
            gathers_dropped=pf.gathers_dropped, most_ahead=pf.most_ahead, prefetch_hits=pf.prefetch_hits,
            prefetch_hits_backward=self.prefetch_hits_backward, staged=pf.stage.staged,
            staged_copies=pf.stage.copies, trace_rebuilds=self.trace.rebuilds,
            eager_reductions=self.eager_reductions, early_reductions=self.early_reductions,
            rereductions=self.rereductions, finals_deferred=self.finals.deferred,
            grads_in_place=self.reducer.grads_in_place, grad_bytes=self.grad_bytes,
            peak_grad_bytes=self.peak_grad_bytes,
            buckets_held=frozenset(self.residency.live), reads_in_flight=pf.reads_in_flight,
            gathers_in_flight=pf.gathers_in_flight, in_forward=self._depth > 0, kept_at_turn=self.kept_at_turn)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.prefetcher.close()

    def subscribe(self, subscriber) -> Subscription:
        """Tell `subscriber` (a HookEvents) where each step is; ``.remove()`` on the result stops it. See
        [Note: hook events] in events.py."""
        return self.events.add(subscriber)

    # -- gather / release -------------------------------------------------------------------------------
    def empty(self, dtype: torch.dtype) -> torch.Tensor:
        return self.residency.empty(dtype)

    def gather(self, gids) -> None:
        """Make `gids` held on this rank: one all-gather per bucket neither held nor posted ahead (a
        collective: every rank must ask for the same buckets in the same order)."""
        res = self.residency
        new = []
        for gid in gids:
            if gid in res.live:
                continue
            full = self.prefetcher.take_gathered(gid)
            done = None
            if full is None and self.prefetcher.secondary is not None:  # hpZ: [Note: hpZ] in hpz.py
                full = self.prefetcher.secondary.gather(gid)  # None where the primary partition serves it
                self.gathers_on_demand += int(full is not None)
            if full is None:
                b = self.layout.bucket(gid)
                if self._world == 1 and not self.qwz:
                    full, done = self._local_bucket(gid, b)
                else:
                    shard = self.prefetcher.shard(gid)
                    full = torch.empty(b.numel, dtype=b.dtype, device=self.device)
                    with torch.profiler.record_function("tierstore::all_gather"):
                        _dist.all_gather(shard, full, self.group, quantized=self.qwz)
                self.gathers_on_demand += 1
            res.add(gid, full, done)
            new.append(gid)
        for gid in new:
            res.materialize(gid)

    # [Note: gathering at world size 1]
    # With one rank the "gathered" bucket is the shard itself, so no all-gather copy is made: a shard on a
    # memory tier on the compute device, in the compute dtype, is lent by the store (``lend_shard``: its own
    # copy, entered with resident() until the bucket is released, so it is neither spilled nor replaced
    # meanwhile) and the parameters are views of it -- no byte moves -- and such a shard is not read ahead;
    # a shard read from nvme (or copied to the device) is a tensor of its own, used as the bucket. Autograd
    # keeps saved views of the bucket under version counting as usual: the step changes a shared master in
    # place only after backward, and an in-place change under a saved view raises, as in torch.
    # ``gathered()`` asks for copies (``views = False``), so what is changed inside it stays there, as its
    # docstring says.

    def _local_bucket(self, gid: int, b) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """World size 1: bucket `gid`'s values and what to call when it is released."""
        if self.views and self._lend is not None:
            lent = self._lend(gid)
            self._lent[gid] = lent is not None
            if lent is not None:
                return lent
        shard = self.prefetcher.shard(gid)
        if shard.dtype == b.dtype and shard.numel() == b.numel and shard.is_contiguous() and \
                shard.device == torch.device(self.device):
            return shard, None  # read for us alone: the bucket itself
        full = torch.empty(b.numel, dtype=b.dtype, device=self.device)
        with torch.profiler.record_function("tierstore::all_gather"):
            _dist.all_gather(shard, full, self.group)
        return full, None

    def release(self, gid: int, *, local_only: bool = False) -> None:
        """Drop bucket `gid`'s gathered values ([Note: bucket residency] in bucket_residency.py)."""
        self._turn.pop(gid, None)
        self.residency.release(gid, local_only=local_only)

    def release_all(self) -> None:
        self.prefetcher.drop()
        self._turn.clear()
        self.residency.release_all()

    def release_kept(self) -> None:
        """Release the buckets the last forward kept for a backward that has not come
        ([Note: kept at the turn] in turn.py)."""
        for gid in list(self._turn):
            if not self.residency.in_use(gid):
                self.release(gid)
        self._turn.clear()

    def forward_order(self) -> list[int]:
        """The buckets the next forward uses, in the order it first uses them, as the trace predicts (empty
        while it is being recorded)."""
        return self.turn.forward_order()

    def _keep_for_backward(self) -> None:
        """The forward's end: of the buckets held near the turn, the most recently released that fit in
        reuse_bytes stay; the others go ([Note: kept at the turn] in turn.py)."""
        keep = self.turn.keep(self._turn, self.residency.live, bool(self.schedule.entries))
        for gid in reversed(list(self._turn)):
            if gid not in keep and not self.residency.in_use(gid):
                self.release(gid)
        self._turn = keep
        self.kept_at_turn += len(keep)

    # -- forward --------------------------------------------------------------------------------------
    def _root_pre(self, module, args) -> None:
        if self._depth == 0 and self.phase is Phase.BACKWARD and torch._C._current_graph_task_id() != self._bw_task:
            # the previous backward raised: the engine does not run its end callback
            self.reducer.backward_raised()
            self.reducer.drop_grads()
            self._reset_backward(aborted=True)
        if self._depth == 0 and self.phase is Phase.IDLE:
            if self._turn:  # kept for a backward that did not come ([Note: kept at the turn] in turn.py)
                self.release_kept()
            self.phase = Phase.FORWARD
            self._calls.clear()
            self.trace.begin()
            self.residency.new_forward()
            self.schedule.new_forward()  # hooks of the previous graph become stale ([Note: backward gathers])
            if self.events:
                self.events.emit("forward_begin")
        self._depth += 1

    def _root_post(self, module, args, output) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.trace.end()
            self.prefetcher.drop()
            if self.phase is Phase.FORWARD:  # buckets kept for a module predicted next (see _post_forward)
                self._keep_for_backward()  # [Note: kept at the turn] in turn.py
                for gid in list(self.residency.live):
                    if gid not in self._turn and not self.residency.in_use(gid):
                        self.release(gid)
                self.phase = Phase.IDLE
                if self.events:
                    self.events.emit("forward_end")

    def _pre_forward(self, module, args) -> None:
        call = _Call()
        self._calls.append(call)  # popped by the post-hook, which runs even when this raises
        gids = self._module_gids[id(module)]
        recompute = self.phase is Phase.BACKWARD  # not part of the forward's order
        if not recompute:
            self.trace.observe(id(module))
            call.index = self.trace.pos - 1
        self.residency.enter(gids)
        # a forward inside backward (activation recomputation) gathers what it misses on demand: see
        # [Note: activation recomputation]
        self.gather(gids)
        if self.events:
            self.events.emit("module_enter", module, call.index)
        if not recompute:
            self._prefetch_ahead()
        if recompute or not torch.is_grad_enabled() or all(self.reducer.trains(g) for g in gids):
            return None
        # frozen buckets: learn when this call's backward is over ([Note: releasing frozen buckets in backward])
        token = call.token = _AfterBackward(self, self.schedule.serial)
        inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        if inputs:
            torch.autograd.graph.register_multi_grad_hook(inputs, lambda grads, t=token: self._after_backward(t))
        return None

    def _post_forward(self, module, args, output) -> None:
        gids = self._module_gids[id(module)]
        call = self._calls.pop() if self._calls else _Call()
        recompute = self.phase is Phase.BACKWARD
        entry = None
        if torch.is_grad_enabled():
            tensors = [t for t in _tensors(output) if t.requires_grad]
            if tensors:
                # the backward pre-hook: a hook on each output's gradient runs before the module's backward
                hook = _BackwardGather(self, self.schedule.serial, len(self.schedule.entries), gids, late=recompute)
                if not recompute:
                    entry = self.schedule.record(id(module), gids)
                    if call.token is not None:  # a call without an entry leaves its token's index None
                        call.token.index = entry
                for t in tensors:
                    t.register_hook(hook)
        if self.events:
            self.events.emit("module_exit", module, call.index, entry)
        # a bucket the trace says the next modules use stays (e.g. packed small parameters of neighbours):
        # the same prediction on every rank, so the same all-gathers are skipped everywhere
        keep = () if recompute or not self.prefetcher.enabled else {
            g for mid in self.trace.upcoming(self.prefetch_depth) for g in self._module_gids.get(mid, ())}
        turn = not recompute and self.turn.near(call.index)  # [Note: kept at the turn] in turn.py
        for g in gids:
            if self.residency.leave(g) and g not in keep and not recompute:
                if turn:
                    self._turn.pop(g, None)
                    self._turn[g] = None  # released last (so far)
                else:
                    self.release(g)
            # inside backward the recomputed graph's nodes read these parameters next: the buckets stay until
            # the backward releases them ([Note: activation recomputation])

    def _prefetch_ahead(self) -> None:
        """Forward: stages ahead of the trace ([Note: prefetch stages])."""
        if self.prefetcher.enabled:
            self.prefetcher.ahead([self._module_gids.get(mid, ()) for mid in self.trace.upcoming(self.prefetcher.span)])

    # -- backward -------------------------------------------------------------------------------------
    def _begin_backward(self) -> None:
        if self.phase is Phase.BACKWARD:
            return
        self.phase = Phase.BACKWARD
        self._bw_task = torch._C._current_graph_task_id()
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
        self.schedule.begin()
        self._turn.clear()  # the buckets kept for backward are its own now ([Note: kept at the turn] in turn.py)
        self.residency.begin_backward((e.gids for e in self.schedule.entries), self.reducer.trains)
        self.reducer.begin()
        if self.events:
            self.events.emit("backward_begin", len(self.schedule.entries))

    def _pre_backward(self, hook: _BackwardGather) -> None:
        self._begin_backward()
        if hook.serial == self.schedule.serial and not hook.late:
            self._advance_to(hook.index)
        else:  # stale: see the Note's "not covered"
            self.gather(hook.gids)

    def _advance_to(self, index: int, *, final: bool = False) -> None:
        """Visit entries down to `index` ([Note: backward gathers])."""
        res, red = self.residency, self.reducer
        while (visit := self.schedule.step_to(index)) is not None:
            self.finals.resolve(wait=False)
            due = [g for g in visit.due if g not in red.reduced]  # [Note: gradient reduce-scatter]
            overlap = self.events.wants_final()  # [Note: hook events] in events.py
            for gid in due:
                red.reduce(gid, hand_over=overlap)
                self.early_reductions += 1
            if overlap and due:
                self.finals.post(due)
            need = [g for g in visit.gids if g not in res.protocol]
            pf = self.prefetcher
            hits, ghits = pf.prefetch_hits, pf.gather_hits
            self.gather(need)
            self.prefetch_hits_backward += pf.prefetch_hits - hits
            self.gather_hits_backward += pf.gather_hits - ghits
            for g in need:
                if final or (red.complete(g) and not res.in_use(g)):
                    res.release(g, local_only=True)  # nobody here needs it (any more)
            if not final:
                if self.events:
                    self.events.emit("backward_visit", visit.entry)
                self._prefetch_backward()

    def _prefetch_backward(self) -> None:
        """Backward: stages ahead of the cursor, over the entries below it ([Note: prefetch stages]). Every
        rank makes the same visits in the same order, so it posts the same all-gathers."""
        if self.prefetcher.enabled:
            self.prefetcher.ahead(self.schedule.below(self.prefetcher.span))

    def _grad_done(self, p: torch.Tensor) -> None:
        self._begin_backward()
        name = self._name_of[id(p)]
        self.schedule.arrived(self.layout.param_gids[name])
        for gid in self.reducer.arrived(name):  # complete now
            if not self.residency.in_use(gid):
                lent = self._lent.get(gid, False) or self._world > 1  # not this rank's own copy
                full = None if lent or not self.events.listens("bucket_released") else self.residency.live.get(gid)
                self.release(gid, local_only=True)
                if full is not None:
                    self.events.emit("bucket_released", gid, full)
                del full
            if self._world == 1 and gid not in self.reducer.reduced:  # no collective: reduce right away
                # final: stepped now, unless its bucket is still held (a forward running needs its values)
                final = gid not in self.residency.live and self.events.wants_final()
                self.reducer.reduce(gid, hand_over=final)
                self.eager_reductions += 1
                if final:
                    self.events.emit("bucket_final", gid)

    def _grad_out(self, p: torch.Tensor) -> torch.Tensor | None:
        """Where parameter `p`'s gradient may be computed in this backward, or None: see [Note: gradients
        computed in their partition] in grad_partitions.py."""
        name = self._name_of.get(id(p))
        return None if name is None else self.reducer.grad_out(name)

    def _after_backward(self, token: _AfterBackward) -> None:
        """A hooked forward call's backward is over (the gradients of its inputs are complete). See
        [Note: releasing frozen buckets in backward]."""
        index = token.index  # None until the post-hook filled it in
        if index is not None and self.schedule.current(token.serial, index):
            self.residency.call_backward_done(self.schedule.entries[index].gids)

    def _backward_end(self) -> None:
        try:
            if self._world > 1:
                self._advance_to(0, final=True)
            self.finals.resolve(wait=True)
            self.final_backwards += self.events.wants_final()
            self.reduce_gradients()
        finally:
            self._reset_backward()

    def _reset_backward(self, *, aborted: bool = False) -> None:
        self.finals.drop()
        self.phase = Phase.FORWARD if self._depth > 0 else Phase.IDLE
        self.reducer.end()
        self.schedule.end()
        self.residency.end_backward()
        self.prefetcher.drop()
        if self.events:
            self.events.emit("backward_end", aborted)

    def stop_lending(self) -> None:
        """Gather copies from now on, never the store's own shard ([Note: the overlapped step by default])."""
        self._lend = None

    def clear_grad_flags(self) -> None:
        """Forget which parameters received a gradient (zero_grad)."""
        self.reducer.grad_names.clear()

    def reduce_gradients(self) -> None:
        """End of backward: the reducer agrees with the other ranks and reduces what is left
        ([Note: gradient reduce-scatter], [Note: no gradient]); while final buckets are wanted, each bucket
        final then is sent as ``bucket_final`` as soon as it is reduced ([Note: overlapped step] in overlap.py)."""
        # a bucket still held once backward is over (a parameter of it got no gradient here) is a copy nobody
        # reads again, unless a forward running uses it (a backward inside a forward)
        res = self.residency
        on_final = functools.partial(self.events.emit, "bucket_final") if self.events.wants_final() else None
        self.rereductions += self.reducer.end_of_backward(self.schedule, on_final, lambda g: not res.in_use(g))

    def prefetch_forward(self) -> None:
        """Between steps (after the optimizer's step): start the stages of [Note: prefetch stages] for the
        first modules of the next forward, as its first module would -- the same on every rank (the trace is),
        so a collective posted here is too. See [Note: prefetch after the step] in prefetch.py."""
        if self.prefetcher.enabled and self.phase is Phase.IDLE and self._depth == 0:
            self.prefetcher.ahead([self._module_gids.get(mid, ()) for mid in self.trace.upcoming(self.prefetcher.span)])


class _Call:
    """One hooked forward call running: its trace index and, if it holds frozen buckets, its token."""

    __slots__ = ("index", "token")

    def __init__(self):
        self.index: int | None = None
        self.token: _AfterBackward | None = None


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


def _eager(fn):
    """`fn` run outside any torch.compile graph ([Note: compiled models])."""
    return torch.compiler.disable(fn, recursive=True)


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
