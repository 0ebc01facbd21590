"""The optimizer step of Zero3Optimizer, one sub-group at a time: load its tensors from the store, step
them with the inner optimizer (or the fused 8-bit kernel), save them back. See [Note: thin wrapper over an
elementwise optimizer] in optimizer.py.

[Note: in place on memory tiers]
A sub-group whose tensors live on a memory tier (device/host) is stepped on the tier's own copies:
the load enters ``resident(tier, writeback=True)`` for each (no copy, pinned against eviction), the
inner optimizer updates master and states in place, and the save leaves the blocks (on the writer
thread). Only tensors on the nvme tier are read into buffers -- recycled between sub-groups, so the
step allocates (and page-faults) nothing in steady state -- and written back with put().

[Note: masters at hand]
With fp32 compute at world size 1 and the parameters on the states' tier, the bucket backward gathers *is* the
master shard read from the store ([Note: shared master] in shards.py); with bf16 compute it is the upper half
of a split master, and the step reads only the remainder ([Note: split master] in split_master.py). When
backward releases such a bucket read from nvme and nothing else refers to its memory (no view saved by
autograd: the storage's use count says so), the model's shards hear it (``bucket_released``, [Note: hook
events] in events.py) and offer it here (``offer``): the last ones offered are kept, at most ``reuse_bytes``
(OffloadConfig) of them, and the step's ``load`` takes one instead of reading the master again -- the same
bytes, so the step is unchanged; the overlapped step ([Note: overlapped step] in overlap.py) takes its
sub-group's when the stream loads it, so there the budget also covers the stream's queue ([Note: the stream's
queue is in bytes] in pipeline.py): a master dropped while its sub-group waited would be read again. Anything
that writes a master drops them first (``drop_at_hand``: zero_grad, the end of step, gathered(), loading a
state).

[Note: stepped masters kept for the forward]
The same masters, the other way round: with the parameters sharing the master ([Note: shared master] in
shards.py) on a tier that is not memory, the next forward's first reads are the masters this step just
wrote, read back at once while the forward waits for its prefetch. So ``save`` keeps the master buffers of
the sub-groups in ``keep_for_forward`` (set by the model's shards at each forward's end: the ones the forward
trace uses first, as many as fit in ``reuse_bytes`` and in ``prefetch_bytes`` -- the reads ahead right after
the step would hold that much of them anyway, [Note: prefetch after the step] in prefetch.py, and a larger
budget would grow the peak memory with the model), and the parameter fetch takes one (``take_kept``)
instead of reading it. The buffer is lent to the
master's write ([Note: lent tensors] in tiers/nvme/writes.py): it stays counted as lent, is not recycled into
the pool when the write gives it back (``Returns(kept=)``), and ``take_kept`` hands it out only once the
write has finished -- then it is private, as a get() result is -- and only if the write succeeded
(``TieredTensor.wait_written`` raises its error as the skipped read would have, after the same fallback).
One is kept only once its put has returned, so what is kept is always the store's current value: a save of
a sub-group drops the one kept for it first, and whatever writes a master outside the step drops them all
(``drop_kept``: a model or optimizer state loaded, a checkpoint, gathered(modifier_rank=)). Memory: at most
that budget of buffers out of the pool from the step to the forward (at world size 1 the buffer taken goes
on as the forward's bucket, may be kept at the turn and taken by the next step as a master at hand).

[Note: step paths]
Which way a sub-group is stepped is decided by the configuration and the moment, not by the caller; each way
has a name, and ``paths`` counts the sub-group steps that took it (``OptimizerStats.step_paths``). A step
counts once under the way it was driven -- "in-place" ([Note: one inner step for memory tiers]), "inline"
(memory tiers, one sub-group at a time on the caller's thread), "pipelined" ([Note: step pipeline] in
pipeline.py) or "overlapped" (during backward, [Note: overlapped step] in overlap.py) -- and once more under
each of these it took: "first" (no states yet: the inner optimizer's initial ones), "fused8" ([Note: fused
8-bit step in ZeRO-3] in state8.py), "partly-skipped" ([Note: skipped parameters] in skipped.py),
"masters-at-hand" ([Note: masters at hand]), "shared-master" (no parameter shard written: [Note: shared
master] in shards.py), "split-master" ([Note: split master] in split_master.py) and "kept-for-forward"
([Note: stepped masters kept for the forward]).
"""
from __future__ import annotations

import ctypes
import math
import threading
import warnings
import weakref
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ...tiers import tier_info
from ...tiers.host import ALIGNED_MIN, aligned_mapping
from .. import keys
from . import split_master as sm
from .disk_bytes import DiskBytes
from .pipeline import StepPipeline
from .skipped import SkippedParams
from .state8 import EightBitStates, fused8_capable

if TYPE_CHECKING:
    from ...store import Store
    from ..config import OffloadConfig

# [Note: the inner step's implementation on the CPU]
# The step runs where the master and states it steps are: on the CPU for states on the host tier (nvme
# states are read into buffers on the model's device), and torch's optimizers pick their implementation
# by the tensors' device when the user names none (foreach=None, fused=None): the single-tensor for-loop
# on the CPU. With the model on an accelerator the user's own torch baseline runs foreach kernels there,
# so this would be a slow path tierstore introduced, silently: the for-loop is several times slower than
# the fused CPU kernel over a large model's states. fused=True is not chosen for the user -- its
# results differ from the for-loop's (and from torch's default) in the last bit, and drop-in means
# torch's results for torch's arguments -- so the first step says so, once.


def cpu_path_warning(inner: torch.optim.Optimizer, group: int, step_device: torch.device,
                     model_device: torch.device, tier: str) -> str | None:
    """The warning of [Note: the inner step's implementation on the CPU], or None where it does not apply."""
    g = inner.param_groups[group]
    if (step_device.type != "cpu" or model_device.type == "cpu" or "fused" not in g or g.get("fused") is not None
            or g.get("foreach") is not None):
        return None
    return (f"Zero3Optimizer: the optimizer states are on the CPU ({tier} tier) and {type(inner).__name__} steps "
            f"them with torch's single-tensor for-loop, its default for CPU tensors (several times slower than "
            f"its fused CPU kernel). Pass fused=True to Zero3Optimizer (results then differ from the for-loop's "
            f"in the last bit), or foreach=False to keep the for-loop and silence this warning")


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src. Same-dtype contiguous CPU tensors go through one memmove: the pipeline's reader and writer
    threads then do not start OpenMP teams of their own next to the compute thread's, which would
    oversubscribe the cores."""
    if (dst.device.type == src.device.type == "cpu" and dst.dtype == src.dtype and dst.is_contiguous()
            and src.is_contiguous() and dst.numel() == src.numel()):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
    else:
        dst.copy_(src)


class BufferPool:
    """Buffers for tensors read from nvme and for packing / unpacking 8-bit states, recycled between
    sub-groups: at most `keep` free buffers of each (elements, dtype).

    [Note: lent buffers are bounded]
    A buffer lent to a write ([Note: lent tensors] in tiers/nvme/writes.py) comes back only when the disk has
    its bytes, and ``put`` returns at once: nothing else holds back whoever lends them, so when the reads
    outpace the writes (an NVMe that reads faster than it writes) the step's written buffers could pile up in
    memory as far as the whole step's bytes. So ``lent(tensors)`` counts the buffers about to be lent until
    given back and first waits while those out on loan come to more than `lend_bytes` (one loan always goes
    out); the step's writer and backward's gradient writes wait there for the disk.

    [Note: only the pool's own buffers are recycled]
    A buffer given back is kept for a later take() only if this pool allocated it: states the inner optimizer
    created on its first step (torch's allocator) are 4 KiB-aligned too, and once in the free lists they
    would go round every step after -- memory without huge pages, whose every 4 KiB page an O_DIRECT request
    pins one by one, a large share of the writer thread's time. The pool's own
    buffers are advised for huge pages (host.aligned_mapping); which they are is known by a weak reference to
    each one's mapping, keyed by address: alive, the memory at that address is that mapping.
    """

    def __init__(self, device: torch.device, keep: int, lend_bytes: int | None = None):
        self.device = device
        self.keep = keep
        self.lend_bytes = lend_bytes  # None: no bound
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._lock = threading.Lock()  # the pipeline's reader and writer threads take and give
        self._room = threading.Condition()
        self._loans: dict[int, list[int]] = {}  # address -> bytes of each loan of it not yet given back
        self.lent_bytes = 0
        self._own: dict[int, weakref.ref] = {}  # address -> the mapping of a buffer this pool allocated

    def lent(self, tensors: list[torch.Tensor], *, wait: bool = True) -> None:
        """`tensors` are about to be lent to writes and given back (``give``) when those finish: count them,
        waiting first while the buffers out on loan exceed lend_bytes (``wait``; see [Note: lent buffers
        are bounded])."""
        n = sum(t.numel() * t.element_size() for t in tensors)
        with self._room:
            while wait and self.lend_bytes is not None and self.lent_bytes and self.lent_bytes + n > self.lend_bytes:
                self._room.wait()
            self.lent_bytes += n
            for t in tensors:
                self._loans.setdefault(t.data_ptr(), []).append(t.numel() * t.element_size())

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:  # numel: elements
        with self._lock:
            free = self._free.get((numel, dtype))
            if free:
                return free.pop()
        if self.device.type != "cpu" or numel * dtype.itemsize < ALIGNED_MIN:  # small: torch's memory will do
            return torch.empty(numel, dtype=dtype, device=self.device)
        # 4 KiB-aligned: the nvme tier reads into it and writes out of it directly ([Note: lent tensors])
        t, mm = aligned_mapping(numel * dtype.itemsize)
        addr = t.data_ptr()

        def gone(ref: weakref.ref, addr: int = addr) -> None:  # lock-free: it may run in a collection anywhere
            if self._own.get(addr) is ref:
                self._own.pop(addr, None)
        self._own[addr] = weakref.ref(mm, gone)
        return t.view(dtype)

    def give(self, t: torch.Tensor, *, recycle: bool = True) -> None:
        """`t` is back: end its loan if it was lent, and keep it for a later take() unless `recycle` is
        False (its taker keeps it: [Note: stepped masters kept for the forward])."""
        with self._room:
            loans = self._loans.get(t.data_ptr())
            if loans:
                self.lent_bytes -= loans.pop()
                if not loans:
                    del self._loans[t.data_ptr()]
                self._room.notify_all()
        if not recycle:
            return
        with self._lock:
            if self.device.type == "cpu":  # [Note: only the pool's own buffers are recycled]
                ref = self._own.get(t.data_ptr())
                if ref is None or ref() is None:
                    return
            free = self._free.setdefault((t.numel(), t.dtype), [])
            if len(free) < self.keep:
                free.append(t)


class Returns:
    """Gives `tensors` back to `buffers` once every write they were lent to has finished ([Note: lent
    tensors] in tiers/nvme/writes.py): ``lend()`` is the callback for one more put; ``done()`` says no more
    will be lent. `kept`: one of `tensors` its taker keeps, not recycled into the pool; ``returned`` is set
    once all are back."""

    def __init__(self, buffers: BufferPool, tensors: list[torch.Tensor], kept: torch.Tensor | None = None):
        self.buffers, self.tensors, self.kept = buffers, tensors, kept
        self._left = 1  # lends not yet returned, +1 until done()
        self._lock = threading.Lock()
        self.returned = threading.Event()

    def lend(self):
        with self._lock:
            self._left += 1
        return self._back

    def done(self) -> None:
        self._back()

    def _back(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left:
                return
        for t in self.tensors:
            self.buffers.give(t, recycle=t is not self.kept)
        self.returned.set()


@dataclass
class LoadedSubgroup:
    """One sub-group between load and save. `tensors`: role -> tensor, the roles "master", "grad" and each
    state key (an 8-bit state unpacked to fp32, or still packed when `fused`); `resident`: the roles entered
    in place on a memory tier ([Note: in place on memory tiers]), held open by `stack`; the step fills
    `master_out` and `new_state`."""

    gid: int
    tensors: dict[str, torch.Tensor]
    resident: set[str]
    stack: ExitStack
    state_keys: list[str]  # the states the store held for it when it was loaded
    fused: bool  # stepped by the fused 8-bit kernel ([Note: fused 8-bit step in ZeRO-3] in state8.py)
    master_out: torch.Tensor | None = None
    new_state: dict = field(default_factory=dict)  # state key -> tensor or scalar, after the step
    paths: list[str] = field(default_factory=list)  # the ways it is stepped ([Note: step paths])

    def close(self) -> None:
        self.stack.close()


@dataclass(frozen=True)
class StepContext:
    """What the sub-group stepper works with. `placeholder`: gid -> the inner optimizer's flat placeholder
    (empty outside the step); `gid_group`: gid -> its index in inner.param_groups; `templates`: each group's
    eager initial state; `shard_numel`: gid -> elements of its master on this rank; `shared_master`: [Note:
    shared master] in shards.py; `fused8`: 8-bit AdamW states are stepped by the fused kernel where they can
    be ([Note: fused 8-bit step in ZeRO-3] in state8.py); `disk`: [Note: disk bytes by kind]."""

    store: Store
    config: OffloadConfig
    inner: torch.optim.Optimizer
    placeholder: dict[int, torch.Tensor]
    gid_group: dict[int, int]
    templates: list[dict]
    states8: EightBitStates
    skipped: SkippedParams
    buffers: BufferPool
    shard_numel: Callable[[int], int]
    shared_master: bool
    split: bool  # [Note: split master] in split_master.py
    fused8: bool
    device: torch.device
    disk: DiskBytes

    @classmethod
    def build(cls, store, config, layout, inner: torch.optim.Optimizer, placeholder: dict[int, torch.Tensor],
              gid_group: dict[int, int], templates: list[dict], optimizer_kwargs: dict, rank: int,
              device: torch.device) -> StepContext:
        """The context of `inner` (built over `placeholder`, inner.py) with the parts the configuration asks for."""
        policy = None
        if config.state_codec == "dynamic8":
            from ...quant.states import StatePolicy
            policy = StatePolicy.make()
        buffers = BufferPool(device, 2 * config.pipeline_depth,  # [Note: lent buffers are bounded]
                             lend_bytes=2 * config.pipeline_depth * config.sub_group_bytes)
        # the (de)quantization kernels use their own default threads (all cores) on the pipeline's threads
        states8 = EightBitStates(store, config.optimizer_states, policy, buffers, nthreads=None)
        skipped = SkippedParams(layout, rank, type(inner), optimizer_kwargs, inner.param_groups, templates, device)
        fused8 = policy is not None and tier_info(config.optimizer_states).holds_encoded_bytes and fused8_capable(
            type(inner), inner.param_groups, device)
        shared = config.compute_dtype == torch.float32 and config.params == config.optimizer_states
        return cls(store, config, inner, placeholder, gid_group, templates, states8, skipped, buffers,
                   shard_numel=layout.shard_numel, shared_master=shared, split=sm.applies(config), fused8=fused8,
                   device=device, disk=DiskBytes(store))


class SubgroupStepper:
    """Loads, steps and saves sub-groups, and knows which states the store holds for each (``state_keys``)
    and the non-tensor state the inner optimizer keeps (``aux``)."""

    def __init__(self, ctx: StepContext):
        self.store, self.config, self.inner = ctx.store, ctx.config, ctx.inner
        self.placeholder, self.gid_group, self.templates = ctx.placeholder, ctx.gid_group, ctx.templates
        self.states8, self.skipped, self.buffers = ctx.states8, ctx.skipped, ctx.buffers
        self.shard_numel, self.shared_master, self.fused8 = ctx.shard_numel, ctx.shared_master, ctx.fused8
        self.device, self.disk, self.split = ctx.device, ctx.disk, ctx.split  # disk: [Note: disk bytes by kind]
        config = ctx.config
        self.state_keys: dict[int, list[str]] = {}  # gid -> tensor states in the store (absent: never stepped)
        self.aux: dict[int, dict] = {}  # gid -> non-tensor states (kept here, not in the store)
        self.fused_steps = 0  # sub-group steps done by the fused 8-bit kernel (OptimizerStats)
        self.paths: Counter[str] = Counter()  # [Note: step paths]
        self._pipeline = StepPipeline(config.pipeline_depth, config.sub_group_bytes)  # [Note: step pipeline]
        self._at_hand: dict[int, torch.Tensor] = {}  # gid -> its master's values ([Note: masters at hand])
        self._hand_lock = threading.Lock()  # offered on the main thread, taken on the pipeline's reader
        self.masters_at_hand = 0  # masters a step took from backward instead of reading them (tests)
        # [Note: stepped masters kept for the forward]
        self.keep_for_forward: frozenset[int] = frozenset()  # the gids whose stepped masters save keeps
        self._kept: dict[int, tuple[torch.Tensor, Returns]] = {}  # gid -> its stepped master, the loan's return
        self.masters_kept = 0  # masters the forward took from the step instead of reading them
        self._inline = StepPipeline(1)  # nothing on nvme: the reads and writes are pointer moves, threads only cost
        self._path_checked = False  # [Note: the inner step's implementation on the CPU]

    def close(self) -> None:
        self._pipeline.close()
        self.drop_at_hand()
        self.drop_kept()

    # -- a sub-group's state in and out ([Note: checkpoint interface] in optimizer.py) ----------------------
    def export(self, gid: int) -> dict:
        """Sub-group `gid`'s state on this rank as CPU tensors (Zero3Optimizer.export_subgroup)."""
        names = self.state_keys.get(gid, [])
        head = [keys.param(gid)] * self.split + [keys.master(gid)]  # [Note: split master] in split_master.py
        got = self.store.get_many(head + [keys.state(gid, k) for k in names], device="cpu")
        q8 = self.states8
        state = {}
        for k in names:
            v = got[keys.state(gid, k)]
            state[k] = q8.unpack(gid, k, v, torch.empty(q8.packed[(gid, k)][1])) if q8.is_packed(gid, k) else v
        master = sm.join(got[keys.param(gid)], got[keys.master(gid)]) if self.split else got[keys.master(gid)]
        return {"master": master, "state": state, "aux": dict(self.aux.get(gid, {}))}

    def import_(self, gid: int, master: torch.Tensor, state: dict, aux: dict) -> None:
        """Replace sub-group `gid`'s master (and parameter shard), states and aux state on this rank
        (Zero3Optimizer.import_subgroup)."""
        cfg = self.config
        self.drop_at_hand()
        self.drop_kept()
        master = master.to(self.device, torch.float32)
        if self.split:
            sm.put(self.store, cfg, gid, master)
        else:
            self.store.put(keys.master(gid), master, tier=cfg.optimizer_states)
        if not (self.shared_master or self.split):
            self.store.put(keys.param(gid), master.to(cfg.compute_dtype), tier=cfg.params)
        for k in self.state_keys.get(gid, []):
            if keys.state(gid, k) in self.store:
                self.store.delete(keys.state(gid, k))
            self.states8.forget(gid, k)  # put() below says again which of the new ones are packed
        for k, v in state.items():
            self.states8.put(gid, k, v.to(self.device))
        if state:
            self.state_keys[gid] = list(state)
        else:  # a sub-group no step reached: its states are created by its first step, as in a new run
            self.state_keys.pop(gid, None)
        self.aux[gid] = dict(aux)

    def offer(self, gid: int, master: torch.Tensor, budget: int) -> None:
        """`master` holds sub-group `gid`'s master values, and nothing else refers to it: keep it for the
        step, the most recent first within `budget` bytes ([Note: masters at hand])."""
        with self._hand_lock:
            self._at_hand.pop(gid, None)
            self._at_hand[gid] = master
            total = sum(t.numel() * t.element_size() for t in self._at_hand.values())
            while total > budget and self._at_hand:
                old = self._at_hand.pop(next(iter(self._at_hand)))
                total -= old.numel() * old.element_size()

    def drop_at_hand(self) -> None:
        """Forget the masters at hand (a master is about to change, or the step is over)."""
        with self._hand_lock:
            self._at_hand.clear()

    def _take_at_hand(self, gid: int) -> torch.Tensor | None:
        with self._hand_lock:
            t = self._at_hand.pop(gid, None)
        if t is not None:
            self.masters_at_hand += 1
        return t

    def take_kept(self, gid: int) -> torch.Tensor | None:
        """Sub-group `gid`'s master as the last step wrote it, if kept for the forward: the caller's to use
        ([Note: stepped masters kept for the forward]). Waits for its write; raises the write's error."""
        with self._hand_lock:
            item = self._kept.pop(gid, None)
        if item is None:
            return None
        master, back = item
        back.returned.wait()  # the write lent it is done with it
        self.store.tensor(keys.master(gid)).wait_written()
        self.masters_kept += 1
        return master

    def drop_kept(self) -> None:
        """Forget the masters kept for the forward (a master is about to change outside the step)."""
        with self._hand_lock:
            self._kept.clear()

    # [Note: one inner step for memory tiers]
    # With nothing on nvme there is no I/O to overlap, and stepping sub-group by sub-group costs one inner
    # optimizer call each, and torch's fused CPU AdamW forks an OpenMP team per call.
    # Once every sub-group has its states (after the first step, which creates them one sub-group at a time so
    # their temporaries never exist all at once) and the gradients sit on the states' tier (no copy of the
    # whole gradient partition to another device), the step enters every sub-group's tensors in place
    # (resident, no copies) and calls inner.step() once over all placeholders: the same elementwise
    # arithmetic, one call.

    def step(self, gids: list[int], coef: float) -> None:
        """Step sub-groups `gids`, their gradients multiplied by `coef` first."""
        cfg = self.config
        on_disk = any(tier_info(t).persistent for t in (cfg.optimizer_states, cfg.gradients)) or (
            tier_info(cfg.params).persistent and not self.shared_master)
        if (not on_disk and cfg.gradients == cfg.optimizer_states and not self.split  # split: one at a time
                and all(gid in self.state_keys for gid in gids)):
            self._step_in_place(gids, coef)  # [Note: one inner step for memory tiers]
        else:
            path = "pipelined" if on_disk else "inline"
            (self._pipeline if on_disk else self._inline).run(
                gids, self.load, lambda gid, t: self.step_loaded([t], coef, path)[0], lambda gid, t: self.save(t),
                sizes=[4 * self.shard_numel(gid) for gid in gids])  # fp32 master bytes ([Note: step pipeline])

    def _step_in_place(self, gids: list[int], coef: float) -> None:
        loaded: list[LoadedSubgroup] = []
        try:
            for gid in gids:
                loaded.append(self.load(gid))
            self.step_loaded(loaded, coef, "in-place")
        except BaseException:
            for t in loaded:
                t.close()
            raise
        saved = 0
        try:
            for t in loaded:
                saved += 1
                self.save(t)
        finally:
            for t in loaded[saved:]:
                t.close()

    def _on_memory(self, name: str, tier: str) -> bool:
        return tier_info(tier).memory and tier in self.store.tensor(name).tiers

    def _fused8_for(self, gid: int) -> bool:
        """Whether sub-group `gid` is stepped by the fused 8-bit kernel ([Note: fused 8-bit step in ZeRO-3])."""
        if not self.fused8 or gid in self.skipped.runs:  # skipped elements need the unfused path
            return False
        return "step" in self.state_keys.get(gid, ()) and self.states8.fused_pair(gid)

    def load(self, gid: int, grad: torch.Tensor | None = None) -> LoadedSubgroup:
        """Sub-group `gid`'s tensors; `grad`: its gradient partition, already at hand (a buffer of
        ``buffers``, given back after the save), instead of read from the store."""
        cfg = self.config
        names = self.state_keys.get(gid, [])
        at_hand = self._take_at_hand(gid)  # [Note: masters at hand]
        roles = sm.roles(gid, cfg, at_hand) if self.split else (  # [Note: split master] in split_master.py
            [] if at_hand is not None else [("master", keys.master(gid), cfg.optimizer_states)])
        if grad is None:
            roles.append(("grad", keys.grad(gid), cfg.gradients))
        roles += [(k, keys.state(gid, k), cfg.optimizer_states) for k in names]
        stack = ExitStack()
        got: dict[str, torch.Tensor] = {} if grad is None else {"grad": grad}
        if at_hand is not None:
            got["hi" if self.split else "master"] = at_hand
        resident: set[str] = set()
        disk: list[tuple[str, str]] = []
        fused = False
        try:
            for role, name, tier in roles:
                if self._on_memory(name, tier):
                    got[role] = stack.enter_context(self.store.tensor(name).resident(tier, writeback=True))
                    resident.add(role)
                else:
                    disk.append((role, name))
            if disk:
                outs = []
                for _role, name in disk:
                    t = self.store.tensor(name)
                    outs.append(self.buffers.take(math.prod(t.shape), t.dtype).view(t.shape))
                read = self.store.get_many([n for _r, n in disk], out=outs)
                for _role, name in disk:
                    self.disk.count(name, write=False)
                fused = self._fused8_for(gid)
                for (role, name), o in zip(disk, outs):
                    got[role] = read[name]
                    if role not in ("master", "grad") and self.states8.is_packed(gid, role) and not fused:
                        got[role] = self.states8.unpack(gid, role, o)
                        self.buffers.give(o)
        except BaseException:
            stack.close()
            raise
        return LoadedSubgroup(gid, got, resident, stack, names, fused,
                              paths=["masters-at-hand"] if at_hand is not None else [])

    def step_loaded(self, items: list[LoadedSubgroup], coef: float, path: str) -> list[LoadedSubgroup]:
        """Step the loaded sub-groups `items` with one inner.step() over their placeholders (the fused 8-bit
        ones with the native kernel); each gains `new_state` and `master_out`. `path`: how the step is driven
        ([Note: step paths])."""
        staged: list[tuple[LoadedSubgroup, torch.Tensor]] = []
        kept: dict[int, list] = {}  # id(placeholder) -> SkippedParams.keep's
        stepped = False
        try:
            for t in items:
                gid, got = t.gid, t.tensors
                master = sm.joined(t, self.buffers) if self.split else got["master"]
                grad = got["grad"]
                if grad.device != master.device or grad.dtype != master.dtype:
                    grad = grad.to(master.device, master.dtype)  # [Note: gradient dtype on nvme]
                if coef != 1.0:
                    grad.mul_(coef)
                t.paths[:0] = [path] + (["first"] if not t.state_keys and not self.aux.get(gid) else [])
                if t.fused:
                    self.states8.adamw_step(gid, got, master, grad, self.inner.param_groups[self.gid_group[gid]])
                    t.new_state = {k: got[k] for k in t.state_keys}
                    t.master_out = master
                    self.fused_steps += 1
                    t.paths.append("fused8")
                    continue
                ph = self.placeholder[gid]
                ph.data = master
                ph.grad = grad
                staged.append((t, ph))
                state = {k: got[k] for k in t.state_keys}
                state.update(self.aux.get(gid, {}))
                if not state:
                    n = master.numel()
                    for k, v in self.templates[self.gid_group[gid]].items():
                        if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == 1:
                            state[k] = torch.full((n,), float(v[0]), dtype=v.dtype, device=master.device)
                        elif isinstance(v, torch.Tensor):
                            state[k] = v.clone()
                        else:
                            state[k] = v
                if state:
                    self.inner.state[ph] = state
                keep = self.skipped.keep(gid, self.gid_group[gid], master, state)  # [Note: skipped parameters]
                if keep:
                    kept[id(ph)] = keep
                    t.paths.append("partly-skipped")
            if staged and not self._path_checked:
                self._path_checked = True
                msg = cpu_path_warning(self.inner, self.gid_group[staged[0][0].gid], staged[0][1].device,
                                       self.device, self.config.optimizer_states)
                if msg:
                    warnings.warn(msg, stacklevel=2)
            if staged:
                self._inner_step([ph for _t, ph in staged], [self.gid_group[t.gid] for t, _ph in staged])
            stepped = True
        except BaseException:
            for t in items:
                t.close()
            raise
        finally:
            for t, ph in staged:
                t.new_state = self.inner.state.pop(ph, {})
                t.master_out = ph.data
                if stepped and id(ph) in kept:
                    self.skipped.restore(kept[id(ph)], ph.data, t.new_state)
                ph.data = torch.empty(0, dtype=torch.float32, device=self.device)
                ph.grad = None
        for t in items if self.split else ():  # hi and lo of the stepped master, into their own buffers
            sm.split(t.master_out, t.tensors["hi"], t.tensors["lo"])
        return items

    # [Note: the inner step sees only what it steps]
    # torch's optimizers walk every parameter of every group on each step() (``_init_group``: is there a
    # grad, is the state there), so stepping sub-group by sub-group over groups holding one placeholder per
    # sub-group costs O(sub-groups) per call and O(sub-groups^2) per step. For the call, each group's "params"
    # lists only the placeholders being stepped; the lists are put back after (the hyperparameters are the same
    # dicts).

    def _inner_step(self, phs: list[torch.Tensor], groups: list[int]) -> None:
        pgs = self.inner.param_groups
        saved = [g["params"] for g in pgs]
        mine: list[list[torch.Tensor]] = [[] for _ in pgs]
        for ph, gi in zip(phs, groups):
            mine[gi].append(ph)
        try:
            for g, m in zip(pgs, mine):
                g["params"] = m
            self.inner.step()
        finally:
            for g, ps in zip(pgs, saved):
                g["params"] = ps

    def save(self, t: LoadedSubgroup) -> None:
        cfg = self.config
        gid, got, resident = t.gid, t.tensors, t.resident
        master = t.master_out
        assert master is not None  # step_loaded() fills it before save()
        with self._hand_lock:
            self._kept.pop(gid, None)  # its value changes now ([Note: stepped masters kept for the forward])
        keep = ("master" not in resident and master.data_ptr() == got["master"].data_ptr()
                and gid in self.keep_for_forward)
        back = Returns(self.buffers, [v for role, v in got.items() if role not in resident],
                       kept=got["master"] if keep else None)
        self.buffers.lent(back.tensors)  # [Note: lent buffers are bounded]
        try:
            if self.split:
                sm.save(self.store, self.disk, cfg, t, back)
            elif "master" not in resident or master.data_ptr() != got["master"].data_ptr():
                self.store.put(keys.master(gid), master, tier=cfg.optimizer_states, lend=back.lend())
                self.disk.count(keys.master(gid), write=True)
                if keep:
                    with self._hand_lock:
                        self._kept[gid] = (got["master"], back)
            pname = keys.param(gid)
            if self.shared_master or self.split:
                t.paths.append("shared-master" if self.shared_master else "split-master")
            elif self._on_memory(pname, cfg.params):
                with self.store.tensor(pname).resident(cfg.params, writeback=True) as p:
                    _copy(p, master)
            else:
                self.store.put(pname, master.to(cfg.compute_dtype), tier=cfg.params)
                self.disk.count(pname, write=True)
            names, aux = [], {}
            for k, v in t.new_state.items():
                if isinstance(v, torch.Tensor):
                    same = k in resident and got[k].data_ptr() == v.data_ptr()
                    if t.fused and self.states8.is_packed(gid, k):  # still packed: the fused step updated the codes
                        self.states8.put_packed(gid, k, v, lend=back.lend())
                    elif not same:
                        self.states8.put(gid, k, v, lend=back.lend())
                    if not same or t.fused:
                        self.disk.count(keys.state(gid, k), write=True)
                    names.append(k)
                else:
                    aux[k] = v
            self.state_keys[gid] = names
            self.aux[gid] = aux
            with self._hand_lock:
                self.paths.update(t.paths + ["kept-for-forward"] * keep)  # [Note: step paths]
        finally:
            t.close()
            back.done()  # the buffers go back to the pool once the writes lent them are done
