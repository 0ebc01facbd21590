"""hpZ of ZeRO++ (Wang et al. 2023, sec. 3.2): a secondary copy of the parameters partitioned within each
node, so that backward's all-gathers stay inside the node.

[Note: hpZ]
ZeRO-3 gathers every bucket twice per step: before a module's forward and again before its backward, both
times from the primary partition (1/world of each bucket per rank) through the whole data-parallel group --
across nodes. hpZ keeps a second copy partitioned over the ``k`` ranks of a node (``hpz_partition_size``;
rank r's node is ranks [r // k * k, r // k * k + k) of the group, which is how torchrun numbers ranks): each
rank holds 1/k of every bucket the forward gathered. Backward's all-gathers (a recomputation under
torch.utils.checkpoint included) then run in a group of the node's ranks (one ``dist.new_group`` per node,
made when the optimizer is built) and send nothing to another node; the forward's all-gathers still use
the data-parallel group.
- Filling: ``Hpz`` subscribes to the coordinator's events ([Note: hook events] in events.py) and adds no
  state to it. When a hooked module's forward ends (``module_exit``, before its buckets are released), every
  gathered bucket not yet copied in this forward gives the secondary partition this rank's run of it:
  elements [l * numel / k, (l + 1) * numel / k) for the rank's index l in its node. So the secondary holds the
  values the primary all-gather produced in this forward, the same on every rank of the node. Only a model
  forward started with gradients enabled fills (all of it: a region of it under no_grad, such as reentrant
  checkpointing's first pass, is gathered again in backward); a forward recomputed inside backward does not.
- Serving: ``forward_begin`` and ``backward_end`` make every run stale; between ``backward_begin`` and
  ``backward_end`` a gather of a bucket filled in this forward comes from the secondary through the node
  group (``Prefetcher.secondary``, the one seam in the gather path: on demand in ParamCoordinator.gather,
  posted ahead in Prefetcher). Which buckets are filled follows the forward's gathers, which are the same on
  every rank, so every rank makes the same choice and posts the same collectives. A bucket the forward did
  not gather (a stale hook of an earlier graph) comes from the primary partition as before.
- Exactness: without qwZ the secondary holds the gathered bytes themselves and the node all-gather puts
  them back in order: backward sees the bit-identical bucket. With qwZ (quantized_weights) the secondary
  holds int8 codes and per-block scales (quant.collectives.pack_pieces, 1 byte per element plus 4 bytes per
  block): each run of the node slice that was one rank's primary shard is quantized with the blocks the
  primary all-gather used, so requantizing the values that all-gather dequantized reproduces its codes and
  the scales to within a few float32 ulps.
- Memory and tier: ``numel / k`` elements per bucket (the compute dtype without qwZ; the packed int8 with
  it), kept from step to step -- ``HpzStats.secondary_bytes``. It lives on the
  compute device when the parameters' tier is 'device' (what a backward gather reads without a copy, as in
  ZeRO++), else in host memory; the qwZ payload always lives in host memory (the quantizers run on the CPU).
  It is rewritten every forward, so the nvme tier is not offered for it: a write and a read per step would
  cost more than the inter-node bytes it saves.
- ``hpz_partition_size`` 1 (the default) or equal to the world size is no hpZ: no secondary, no groups.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...errors import TierstoreValueError
from ...quant import collectives as qc
from .. import _dist
from .coordinator import ParamCoordinator
from .events import HookEvents


@dataclass(frozen=True)
class HpzStats:
    """What hpZ holds and did, as of one call to Hpz.stats() (``opt.hpz.stats()``)."""

    partition_size: int  # ranks per secondary partition (k)
    tier: str  # where the secondary partition lives: 'device' or 'host'
    secondary_bytes: int  # bytes of the secondary partition on this rank now (kept from step to step)
    buckets_ready: int  # buckets whose secondary run holds this forward's values now
    fills: int  # runs copied from a forward's gathered bucket into the secondary partition
    node_gathers: int  # of CoordinatorStats.gathers, those through the node group (on demand and posted ahead)
    node_gather_bytes: int  # bytes this rank sent in them: its run's bytes x (k - 1)


def partition_size(setting: int | str, group=None) -> int:
    """The ranks per secondary partition that `setting` (OffloadConfig.hpz_partition_size) names in the
    data-parallel `group`: an integer, or 'node' (LOCAL_WORLD_SIZE as torchrun sets it on every rank, else
    the ranks sharing a host name, which must be consecutive). A collective for 'node'."""
    world, _rank = _dist.world_and_rank(group)
    if setting == "node":
        k = _node_size(group, world)
    else:
        k = int(setting)
    if k < 1 or world % k:
        raise TierstoreValueError(
            f"hpz_partition_size={setting!r} gives {k} ranks per secondary partition, which does not divide the "
            f"data-parallel world size {world}; use 1 (hpZ off), the ranks per node, or another divisor of {world}")
    return k


def _node_size(group, world: int) -> int:
    facts = _dist.all_gather_object((socket.gethostname(), os.environ.get("LOCAL_WORLD_SIZE")), group)
    sizes = {s for _h, s in facts}
    if None not in sizes:
        if len(sizes) != 1:
            raise TierstoreValueError(f"hpz_partition_size='node': the ranks' LOCAL_WORLD_SIZE differ "
                                      f"({sorted(sizes)}); set hpz_partition_size to the ranks per node explicitly")
        return int(sizes.pop())
    hosts = [h for h, _s in facts]
    runs: list[int] = []
    for i, h in enumerate(hosts):
        if i and h == hosts[i - 1]:
            runs[-1] += 1
        else:
            runs.append(1)
    if len(runs) != len(set(hosts)) or len(set(runs)) != 1:
        raise TierstoreValueError(
            f"hpz_partition_size='node': the {world} ranks' hosts do not form equal runs of consecutive ranks "
            f"({hosts}); launch node-major (as torchrun does), set LOCAL_WORLD_SIZE, or set hpz_partition_size "
            f"explicitly")
    return runs[0]


def node_group(group, k: int):
    """This rank's group of its node's k ranks (every rank of `group` creates every node's group, in order,
    as torch.distributed requires)."""
    world, rank = _dist.world_and_rank(group)
    ranks = [dist.get_global_rank(group, i) for i in range(world)] if group is not None else list(range(world))
    mine = None
    for node in range(world // k):
        g = dist.new_group(ranks[node * k:(node + 1) * k])
        if rank // k == node:
            mine = g
    return mine


class Hpz(HookEvents):
    """The secondary partition of one coordinator. See [Note: hpZ]."""

    def __init__(self, coordinator: ParamCoordinator, k: int, node, *, params_tier: str):
        self.coord = coordinator
        self.layout = coordinator.layout
        self.k = k
        self.node = node  # process group of this rank's node
        self.local = _dist.world_and_rank(coordinator.group)[1] % k  # index of this rank in its node
        self.world = _dist.world_and_rank(coordinator.group)[0]
        self.qwz = coordinator.qwz
        self.device = coordinator.device
        self.tier = "device" if params_tier == "device" and not self.qwz else "host"
        self._where = self.device if self.tier == "device" else torch.device("cpu")
        self._runs: dict[int, torch.Tensor] = {}  # gid -> this rank's run (or its packed int8 payload)
        self._ready: set[int] = set()  # gids whose run holds this forward's values
        self._serving = False  # between backward_begin and backward_end
        self._filling = False  # this forward fills the secondary (it runs with gradients enabled)
        self.fills = 0
        self.node_gathers = 0
        self.node_gather_bytes = 0
        self._subscription = coordinator.subscribe(self)
        coordinator.prefetcher.secondary = self

    @classmethod
    def attach(cls, coordinator: ParamCoordinator, setting: int | str, *, params_tier: str) -> Hpz | None:
        """hpZ on `coordinator` as `setting` (OffloadConfig.hpz_partition_size) says, or None where it is off
        (1, a world of 1, or one partition over the whole world). A collective: every rank calls it."""
        world, _ = _dist.world_and_rank(coordinator.group)
        if world == 1 or setting == 1:
            return None
        k = partition_size(setting, coordinator.group)
        if k in (1, world):
            return None
        return cls(coordinator, k, node_group(coordinator.group, k), params_tier=params_tier)

    def remove(self) -> None:
        self._subscription.remove()
        if self.coord.prefetcher.secondary is self:
            self.coord.prefetcher.secondary = None
        self._runs.clear()
        self._ready.clear()

    def stats(self) -> HpzStats:
        nbytes = sum(t.numel() * t.element_size() for t in self._runs.values())
        return HpzStats(partition_size=self.k, tier=self.tier, secondary_bytes=nbytes, buckets_ready=len(self._ready),
                        fills=self.fills, node_gathers=self.node_gathers, node_gather_bytes=self.node_gather_bytes)

    # -- events ([Note: hook events]) ---------------------------------------------------------------------
    def forward_begin(self) -> None:
        self._ready.clear()
        self._serving = False
        # the model's forward under torch.no_grad has no backward to come; a region inside a forward with
        # gradients may run under no_grad and still be gathered in backward (reentrant checkpointing)
        self._filling = torch.is_grad_enabled()

    def module_exit(self, module: torch.nn.Module, index: int | None, entry: int | None) -> None:
        if index is None or not self._filling:  # recomputed inside backward, or no backward to come
            return
        for gid, full in self.coord.residency.live.items():
            if gid not in self._ready:
                self._fill(gid, full)

    def backward_begin(self, entries: int) -> None:
        self._serving = True

    def backward_end(self, aborted: bool) -> None:
        self._serving = False
        self._ready.clear()

    # -- the secondary partition --------------------------------------------------------------------------
    def _fill(self, gid: int, full: torch.Tensor) -> None:
        per = full.numel() // self.k
        run = full.view(-1)[self.local * per:(self.local + 1) * per]
        if self.qwz:  # the primary shards this run spans, each packed as the primary all-gather packs it
            self._runs[gid] = qc.pack_pieces(run.cpu(), self.world // self.k)
        else:
            buf = self._runs.get(gid)
            if buf is None:
                buf = self._runs[gid] = torch.empty(per, dtype=full.dtype, device=self._where)
            buf.copy_(run)
        self._ready.add(gid)
        self.fills += 1

    def covers(self, gid: int) -> bool:
        return self._serving and gid in self._ready

    def _post(self, gid: int, async_op: bool):
        b = self.layout.bucket(gid)
        full = torch.empty(b.numel, dtype=b.dtype, device=self.device)
        run = self._runs[gid]
        self.node_gathers += 1
        self.node_gather_bytes += run.numel() * run.element_size() * (self.k - 1)
        if self.qwz:
            piece = self.layout.shard_numel(gid)  # one primary shard
            with torch.profiler.record_function("tierstore::hpz_all_gather"):
                out = full if full.device.type == "cpu" else torch.empty(b.numel, dtype=b.dtype)
                pending = qc.all_gather_packed(run, self.node, piece_numel=piece, out=out, async_op=True)
            if out is full:
                return _dist.Gathering(full, pending)
            # accelerator only -- never run here (the quantizers run on the CPU, as qwZ's all-gather does)
            return _dist.Gathering(full, pending, finish=lambda: full.copy_(out))
        src = run.to(self.device)
        with torch.profiler.record_function("tierstore::hpz_all_gather"):
            if async_op:
                return _dist.all_gather_async(src, full, self.node)
            return _dist.Gathering(_dist.all_gather(src, full, self.node))

    def gather(self, gid: int) -> torch.Tensor | None:
        """Bucket `gid` gathered inside the node, if the secondary covers it now; else None."""
        if not self.covers(gid):
            return None
        return self._post(gid, async_op=False).wait()

    def gather_async(self, gid: int) -> _dist.Gathering | None:
        """The node all-gather of `gid` posted now, if the secondary covers it now; else None."""
        if not self.covers(gid):
            return None
        return self._post(gid, async_op=True)
