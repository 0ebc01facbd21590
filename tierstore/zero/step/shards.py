"""The model's shards on this rank: the parameters taken from the model, each bucket's shard cut into the
store at construction, and the access to it that the hooks and the model's state dict use (read, write,
fetch for a gather, lend at world size 1); and the two ways the step's masters and the hooks' buckets are
handed between them ([Note: masters at hand], [Note: stepped masters kept for the forward] in stepper.py).

[Note: shared master]
With fp32 compute and parameters on the same tier as the optimizer states, the parameter shard would be a
byte-for-byte copy of the master: the master is gathered instead, and the step writes one tensor, not two.
"""
from __future__ import annotations

import torch

from ...errors import TierstoreValueError
from ...tiers import tier_info
from .. import _dist, keys
from ..hooks.events import HookEvents
from ..params.layout import Layout
from . import split_master as sm
from .disk_bytes import DiskBytes
from .stepper import SubgroupStepper


def model_params(model: torch.nn.Module
                 ) -> tuple[dict[str, torch.nn.Parameter], dict[str, str], dict[int, str], torch.device]:
    """(canonical name -> parameter, tied once; every name in model.named_parameters(remove_duplicate=False)
    -> its canonical name; id(parameter) -> canonical name; the device they are on)."""
    params: dict[str, torch.nn.Parameter] = {}
    aliases: dict[str, str] = {}
    by_id: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in by_id:
            aliases[name] = by_id[id(p)]
            continue
        by_id[id(p)] = name
        aliases[name] = name
        params[name] = p
    if not params:
        raise TierstoreValueError("the model has no parameters to optimize")
    devices = {p.device for p in params.values() if p.device.type != "meta"}
    return params, aliases, by_id, next(iter(devices)) if devices else torch.device("cpu")


def param_shapes(params: dict[str, torch.nn.Parameter]) -> dict[str, tuple[int, ...]]:
    """Each parameter's full shape, its zero.Init handle unwrapped (a plain Parameter again: the optimizer
    takes it, [Note: when a module is offloaded] in init.py); refuses parameters that are not floating-point."""
    shapes = {}
    for name, p in params.items():
        handle = getattr(p, "_tierstore_init", None)
        if handle is not None:
            handle.unwrap(p)
        shape = tuple(handle.shape) if handle is not None else tuple(p.shape)
        if not (p.dtype.is_floating_point or handle is not None):
            raise TierstoreValueError(f"parameter {name!r} has dtype {p.dtype}; ZeRO-3 manages floating-point "
                                      f"parameters only")
        shapes[name] = shape
    return shapes


class ModelShards:
    """This rank's shard of every bucket, in the store (keys.py's names): the fp32 master of a trainable
    sub-group (or its remainder: [Note: split master] in split_master.py) and, unless it is the shared master,
    the parameter shard in the compute dtype."""

    def __init__(self, store, config, layout: Layout, params: dict[str, torch.nn.Parameter], *,
                 stepper: SubgroupStepper, disk: DiskBytes, device: torch.device, group, world_size: int, rank: int):
        self.store = store
        self.config = config
        self.layout = layout
        self.params = params
        self.stepper = stepper
        self.disk = disk
        self.device = device
        self.group = group
        self.world_size = world_size
        self.rank = rank
        self.shared_master = stepper.shared_master  # [Note: shared master]
        self.at_hand: MastersAtHand | None = None  # [Note: masters at hand] in stepper.py
        self.forward_head: ForwardHead | None = None  # set by listen(): [Note: stepped masters kept for the forward]

    def hand_to(self, coordinator) -> None:
        """The end of construction: every bucket released, every parameter empty ([Note: gather and release]
        in hooks/coordinator.py), the zero.Init handles discarded -- the values live in the store from here on."""
        for gid in range(len(self.layout.subgroups)):
            coordinator.release(gid)
        for name, p in self.params.items():
            # [Note: partitioned parameters read true] in partitioned.py
            coordinator.residency.empty_param(name, self.config.compute_dtype)
            if hasattr(p, "_tierstore_init"):
                p._tierstore_init.discard()
                del p._tierstore_init

    def listen(self, coordinator, queue_bytes: int) -> None:
        """Subscribe what hands masters between the hooks and the step, where the configuration has them;
        `queue_bytes`: what the overlapped step's queue holds (0 without it)."""
        cfg = self.config
        reused = not tier_info(cfg.optimizer_states).memory and cfg.reuse_budget > 0
        handed = self.shared_master and reused
        if reused and (self.shared_master or self.stepper.split) and self.world_size == 1:  # split: hi at hand
            # also kept while their sub-groups wait in the stream's queue ([Note: the stream's queue is in bytes])
            self.at_hand = MastersAtHand(self.layout, self.device, self.stepper, cfg.reuse_budget + queue_bytes,
                                         cfg.compute_dtype if self.stepper.split else torch.float32)
            coordinator.subscribe(self.at_hand)
        budget = min(cfg.reuse_budget, cfg.prefetch_bytes)
        self.forward_head = ForwardHead(self.layout, coordinator, self.stepper, budget)
        if handed:  # else it only says what would be kept
            coordinator.subscribe(self.forward_head)

    def _take_range(self, name: str, a: int, b: int, out: torch.Tensor, *, sliced: bool) -> None:
        """out (fp32, b - a elements) <- flattened elements [a, b) of parameter `name` that this rank supplies:
        what its zero.Init handle holds, else the in-memory value -- all of it, or (sliced=True: the bucket is
        summed over ranks) only this rank's even slice, so that every element comes from exactly one rank."""
        p = self.params[name]
        handle = getattr(p, "_tierstore_init", None)
        if handle is not None:
            handle.take(a, b, out)
            return
        if sliced:
            from ..params.init import even_slice
            lo, hi = even_slice(p.numel(), self.world_size, self.rank)
            a2, b2 = max(a, lo), min(b, hi)
            if a2 < b2:
                out[a2 - a:b2 - a].copy_(p.detach().reshape(-1)[a2:b2])
            return
        out.copy_(p.detach().reshape(-1)[a:b])

    def _sliced_gids(self) -> set[int]:
        """Sub-groups holding a parameter built under zero.Init at world size > 1 (their shards come from a
        reduce-scatter), agreed by every rank; refuses handles of another world size or rank on every rank at
        once (one rank raising alone would leave the others in the collective). See [Note: streaming Init at
        world size N] in init.py."""
        problem = None
        for name, p in self.params.items():
            h = getattr(p, "_tierstore_init", None)
            if h is not None and (h.world, h.rank) != (self.world_size, self.rank):
                problem = (f"parameter {name!r} was built under tierstore.zero.Init at world size {h.world} (rank "
                           f"{h.rank}), but this Zero3Optimizer's group has world size {self.world_size} (rank "
                           f"{self.rank}). Under Init each rank keeps only its slice of every parameter, so only "
                           f"the same group can reassemble it: initialise torch.distributed before entering Init "
                           f"and pass the same process_group to Init and Zero3Optimizer")
                break
        gids = len(self.layout.subgroups)
        mine = torch.zeros(gids, dtype=torch.int32)
        for gid in range(gids):
            if any(getattr(getattr(self.params[pc.name], "_tierstore_init", None), "sliced", False)
                   for pc in self.layout.bucket(gid).pieces):
                mine[gid] = 1
        if self.world_size == 1:
            if problem:
                raise TierstoreValueError(problem)
            return set()
        flags = torch.cat([torch.tensor([int(problem is not None)], dtype=torch.int32), mine, 1 - mine])
        _dist.all_reduce_max(flags, self.group)  # [any rank refused, any rank sliced, any rank not sliced]
        if problem:
            raise TierstoreValueError(problem)
        if flags[0]:
            raise TierstoreValueError("another rank refused a parameter built under tierstore.zero.Init (world "
                                      "size or rank differs from this Zero3Optimizer's group; its error says which)")
        mixed = [gid for gid in range(gids) if flags[1 + gid] and flags[1 + gids + gid]]
        if mixed:
            names = [pc.name for pc in self.layout.bucket(mixed[0]).pieces]
            raise TierstoreValueError(f"some ranks built parameters {names[:3]} under tierstore.zero.Init and "
                                      f"others did not; every rank must build the same model the same way")
        return {gid for gid in range(gids) if flags[1 + gid]}

    def fill(self) -> None:
        """Cut this rank's shards, one bucket at a time, from the parameters' values or their zero.Init
        handles (whose chunks are deleted as they are taken). At world size N a bucket of Init slices is
        filled with what this rank holds and reduce-scattered; see [Note: streaming Init at world size N]."""
        from ..params.init import reduce_scatter_exact
        sliced = self._sliced_gids()
        for gl in self.layout.groups:
            for bi, b in enumerate(gl.plan.buckets):
                gid = gl.gids[bi]
                # sliced: the whole bucket, zero bits where other ranks supply the value; else this shard
                lo, hi = (0, b.numel) if gid in sliced else (b.shard_slice(self.rank).start,
                                                               b.shard_slice(self.rank).stop)
                buf = torch.zeros(hi - lo, dtype=torch.float32, device=self.device)
                for pc, start, stop in b.overlapping(lo, hi):
                    at = pc.param_offset + start - pc.offset
                    self._take_range(pc.name, at, at + stop - start, buf[start - lo:stop - lo],
                                     sliced=gid in sliced)
                master = reduce_scatter_exact(buf, self.group) if gid in sliced else buf
                del buf
                self._put(gid, gl.trainable, master)
                del master

    def lend(self, gid: int):
        """The store's own copy of `gid`'s parameter shard when it is on a memory tier on the compute device,
        held (resident) until the returned function is called; None otherwise ([Note: gathering at world
        size 1] in hooks/coordinator.py)."""
        if self.shared_master and self.layout.group_of(gid).trainable:
            name, tier = keys.master(gid), self.config.optimizer_states
        else:
            name, tier = keys.param(gid), self.config.params
        t = self.store.tensor(name)
        if not tier_info(tier).memory or tier not in t.tiers or t.dtype != self.layout.bucket(gid).dtype:
            return None
        cm = t.resident(tier)
        x = cm.__enter__()
        if x.device != self.device or not x.is_contiguous():
            cm.__exit__(None, None, None)
            return None
        return x, lambda: cm.__exit__(None, None, None)

    def read_master(self, gid: int) -> torch.Tensor:
        """This rank's shard of sub-group `gid` in fp32 (a copy): the master, or a frozen sub-group's shard."""
        if self.layout.group_of(gid).trainable:
            return sm.get(self.store, gid) if self.stepper.split else self.store.get(keys.master(gid))
        return self.store.get(keys.param(gid)).to(torch.float32)

    def write_master(self, gid: int, master: torch.Tensor) -> None:
        """Replace this rank's shard of sub-group `gid` (fp32 values): master and compute-dtype shard."""
        self.stepper.drop_at_hand()
        self.stepper.drop_kept()
        self._put(gid, self.layout.group_of(gid).trainable, master)

    def _put(self, gid: int, trainable: bool, master: torch.Tensor) -> None:
        cfg = self.config
        if trainable and self.stepper.split:  # [Note: split master] in split_master.py
            sm.put(self.store, cfg, gid, master)
            return
        if trainable:
            self.store.put(keys.master(gid), master, tier=cfg.optimizer_states)
        if not (trainable and self.shared_master):
            self.store.put(keys.param(gid), master.to(cfg.compute_dtype), tier=cfg.params)

    def fetch(self, gid: int) -> torch.Tensor:
        if self.shared_master and self.layout.group_of(gid).trainable:
            kept = self.stepper.take_kept(gid)  # [Note: stepped masters kept for the forward] in stepper.py
            if kept is not None:
                return kept
            name = keys.master(gid)
        else:
            name = keys.param(gid)
        shard = self.store.get(name)
        self.disk.count(name, write=False, kind="params")
        return shard


class MastersAtHand(HookEvents):
    """Offers the step the masters backward releases ([Note: masters at hand] in stepper.py), or with split
    masters their bfloat16 halves (`dtype`: what a bucket offered holds; [Note: split master])."""

    def __init__(self, layout: Layout, device: torch.device, stepper: SubgroupStepper, budget: int,
                 dtype: torch.dtype = torch.float32):
        self.layout = layout
        self.device = device
        self.stepper = stepper
        self.budget = budget  # bytes
        self.dtype = dtype

    def bucket_released(self, gid: int, full: torch.Tensor) -> None:
        """Hand bucket `gid`'s values to the step when they are exactly the master's and nothing else refers
        to them."""
        if (not self.layout.group_of(gid).trainable or full.dtype != self.dtype or not full.is_contiguous()
                or full.numel() != self.layout.shard_numel(gid) or full.device != self.device):
            return
        # `full`, the untyped storage asked here and `full`'s base (an aligned allocation) if it is a view; a
        # view saved by autograd would be one more
        if torch._C._storage_Use_Count(full.untyped_storage()._cdata) > 2 + (full._base is not None):
            return
        self.stepper.offer(gid, full, self.budget)


class ForwardHead(HookEvents):
    """At each forward's end, names the trainable sub-groups the next forward uses first, as many as fit in
    `budget` bytes of fp32 shards: the step keeps their masters for it ([Note: stepped masters kept for the
    forward] in stepper.py). The trace changes only in a forward, so this is what the step finds."""

    def __init__(self, layout: Layout, coordinator, stepper: SubgroupStepper, budget: int):
        self.layout = layout
        self.coordinator = coordinator
        self.stepper = stepper
        self.budget = budget
        self._head: tuple[list[int] | None, frozenset[int]] = (None, frozenset())  # (forward order, its head)

    @property
    def gids(self) -> frozenset[int]:
        """The sub-groups whose stepped masters are kept for the next forward, as the trace says now."""
        order = self.coordinator.forward_order()
        if self._head[0] is not order:
            budget, head = self.budget, []
            for gid in order:
                if not self.layout.group_of(gid).trainable:
                    continue
                nbytes = 4 * self.layout.shard_numel(gid)
                if nbytes > budget:
                    break
                budget -= nbytes
                head.append(gid)
            self._head = (order, frozenset(head))
        return self._head[1]

    def forward_end(self) -> None:
        self.stepper.keep_for_forward = self.gids
