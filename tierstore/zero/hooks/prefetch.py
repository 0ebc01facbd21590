"""Traced prefetch: learn the order in which modules use their parameters, then fetch ahead of it.

[Note: trace]
The first forward records the sequence of modules whose forward pre-hook fires (a module called twice
appears twice). Later forwards walk the same sequence; at position i the coordinator asks for the modules
that come next and the Prefetcher runs the stages of [Note: prefetch stages] ahead of them, overlapped with
the compute of module i. The trace is the same on every rank (it follows the module order, which must be), so every
prediction -- and every collective posted because of one -- is the same on every rank. When the observed
module differs from the prediction, the trace is cut there and re-recorded from that point (a DEBUG log
line on tierstore.zero says where); what was fetched ahead and not used is dropped at the end of the
forward (an all-gather posted ahead is waited for first: every rank posted it). Backward does not use the
trace: it walks the forward's entries with the cursor of [Note: backward gathers] in backward_schedule.py
and fetches the entries below the cursor.

[Note: prefetch stages]
A bucket gathered ahead goes through three stages, each `prefetch_depth` modules (or entries) ahead:
1. read: this rank's shard comes up from its tier (nvme -> memory) on a worker thread;
2. host -> device: on the same worker thread, right after the read, the shard is copied to the compute
   device with ``.to(device, non_blocking=True)`` on a side stream, and an event is recorded there; the
   main thread makes its current stream wait on that event (and the host on the copy, so the store may
   reuse the source) when the shard is used. Written against torch's device-generic API (torch.Stream,
   torch.Event, torch.accelerator). With the CPU as the compute device the shard is already where it is
   used: the stage hands it through (counted in ``DeviceStage.staged``). The accelerator branch has never
   run: the development machine has no GPU;
3. all-gather (world size > 1): posted with ``async_op=True`` from the main thread -- never from a worker,
   so the order of collectives stays the order of the (shared) trace on every rank -- and waited when the
   module runs; qwZ too (quantized now, dequantized at the wait; see _dist.all_gather_async).
Reads run `2 x prefetch_depth` modules ahead when all-gathers are posted ahead (so an all-gather posted
for the module `prefetch_depth` ahead finds its shard already read), `prefetch_depth` otherwise. Memory:
at most `prefetch_depth` modules' full buckets gathered ahead, plus the shards read ahead (1/world of a
bucket each). At world size 1 there is no collective to overlap: the gather is a copy made when the module
runs. With prefetching on, a bucket the trace says one of the next `prefetch_depth` modules uses is kept
when the module using it ends (packed small parameters of neighbouring modules are gathered once, not once
per module); the forward's end releases it.

[Note: reading ahead by bytes]
A depth in modules fits layers of tens of MiB. For small ones (a 1024-wide Linear is 4 MiB) two modules
ahead is two requests in flight, too few to keep a disk busy. So beyond the depth the read stage
goes on to further modules while the shards read ahead and not yet used add up to at most `read_bytes`
(OffloadConfig.prefetch_bytes), looking at most READ_AHEAD_MAX modules past the depth, and the reads run
on READ_WORKERS threads (offloaded inference: ``read_workers``, more), so that several are in flight at once.
Everything read beyond the depth is bounded by `read_bytes` of memory; what the trace predicted wrongly is
dropped at the forward's end as before.

[Note: prefetch after the step]
The first modules of a forward have nothing before them to hide their reads behind: without help the
forward starts cold (read, all-gather, then compute). So when the optimizer's step() has written every
sub-group back, the coordinator starts the stages for the first modules of the trace as the first module
itself would (``ParamCoordinator.prefetch_forward``): their shards are read, and at world size N their
all-gathers posted (step() runs on every rank, and the trace is the same on every rank, so the collectives
are too), while the caller zeroes gradients and loads the next batch. They are used by the next forward
like any read ahead, and dropped at its end if its order changed. A shard written outside the step
(``load_state_dict``, a checkpoint load, ``gathered(modifier_rank=...)``) first drops what was read ahead,
so nothing read before that write is used after it.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple, Protocol

import torch

from .. import _dist

log = logging.getLogger("tierstore.zero")

READ_WORKERS = 4  # threads reading shards ahead when reading ahead by bytes ([Note: reading ahead by bytes])
READ_AHEAD_MAX = 64  # modules (or backward entries) past the depth looked at for it


class Secondary(Protocol):
    """Another source of gathered buckets (hpZ's secondary partition, hpz.py). For a bucket it covers now,
    gather / gather_async return the full bucket / an all-gather posted now (the same decision on every rank);
    None for the others, which come from this rank's shard through the data-parallel group."""

    def covers(self, gid: int) -> bool: ...

    def gather(self, gid: int) -> torch.Tensor | None: ...

    def gather_async(self, gid: int) -> _dist.Gathering | None: ...


class Staged(NamedTuple):
    tensor: torch.Tensor  # the shard on the compute device (once `event` completed)
    event: torch.Event | None = None  # recorded after the copy on the side stream; None: nothing to wait for
    source: torch.Tensor | None = None  # the host shard, alive until the copy finished


class DeviceStage:
    """Stage 2 of [Note: prefetch stages]: host -> device copies of prefetched shards on a side stream."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        # CPU standing in for the accelerator: nothing to copy, no stream (the CPU backend has no events)
        self.side = torch.Stream(device=self.device) if self.device.type != "cpu" else None
        self.staged = 0  # shards that went through the stage
        self.copies = 0  # of which copied on the side stream

    def to_device(self, shard: torch.Tensor) -> Staged:
        """On the worker thread, right after the read."""
        self.staged += 1
        if self.side is None or shard.device == self.device:
            return Staged(shard)
        # accelerator only: run by tests/test_accelerator.py on a GPU, not on the CPU-only machines
        with self.side:
            dev = shard.to(self.device, non_blocking=True)
            event = torch.Event(device=self.device)
            event.record(self.side)
        self.copies += 1
        return Staged(dev, event, shard)

    def ready(self, staged: Staged) -> torch.Tensor:
        """On the main thread, when the shard is used."""
        if staged.event is None:
            return staged.tensor
        # accelerator only: run by tests/test_accelerator.py on a GPU, not on the CPU-only machines
        current = torch.accelerator.current_stream(self.device)
        current.wait_event(staged.event)
        staged.event.synchronize()  # the host copy (the store's buffer) may be reused once this returns
        staged.tensor.record_stream(current)  # allocated on the side stream, used and freed on this one
        return staged.tensor


class Trace:
    """The recorded module order and where the current forward is in it."""

    def __init__(self) -> None:
        self.order: list[int] = []  # module ids (id(module)) in use order
        self.recording = True
        self.pos = 0  # index of the next expected module
        self.rebuilds = 0
        self.forwards = 0

    def begin(self) -> None:
        self.pos = 0

    def observe(self, mid: int) -> None:
        """Module `mid` is about to run."""
        if self.recording:
            self.order.append(mid)
            self.pos = len(self.order)
            return
        if self.pos < len(self.order) and self.order[self.pos] == mid:
            self.pos += 1
            return
        log.debug("prefetch trace: module order changed at position %d of %d (forward %d); re-recording from "
                  "there", self.pos, len(self.order), self.forwards)
        del self.order[self.pos:]
        self.order.append(mid)
        self.pos = len(self.order)
        self.recording = True
        self.rebuilds += 1

    def upcoming(self, depth: int) -> list[int]:
        """The next `depth` modules the trace predicts (none while recording)."""
        if self.recording or depth <= 0:
            return []
        return self.order[self.pos:self.pos + depth]

    def end(self) -> None:
        """The forward finished: a recording becomes the trace; a walk that stopped early shortens it."""
        if self.recording:
            self.recording = False
        elif self.pos != len(self.order):
            log.debug("prefetch trace: forward %d used %d of %d traced modules; re-recording next forward",
                      self.forwards, self.pos, len(self.order))
            self.order = []
            self.recording = True
            self.rebuilds += 1
        self.forwards += 1
        self.pos = 0


class Prefetcher:
    """The shards read ahead, the all-gathers posted ahead and the worker thread of [Note: prefetch stages].
    The coordinator tells it what comes next (``ahead``), takes what it made (``shard``, ``take_gathered``)
    and drops the rest (``drop``); `held(gid)` says whether a bucket is gathered already (the residency's
    protocol view, the same on every rank)."""

    def __init__(self, layout, fetch_shard: Callable[[int], torch.Tensor], held: Callable[[int], bool], *,
                 device: torch.device, group=None, quantized: bool = False, depth: int = 0, read_bytes: int = 0,
                 read_workers: int = READ_WORKERS):
        self.layout = layout
        self.fetch_shard = fetch_shard
        self.held = held
        self.device = device
        self.group = group
        self.qwz = quantized
        self.depth = depth
        self.read_bytes = read_bytes if depth else 0  # [Note: reading ahead by bytes]
        self.stage = DeviceStage(device)
        self._prefetched: dict[int, Future] = {}  # gid -> read (and staged) shard
        self._ahead_bytes = 0  # bytes of the shards in _prefetched
        self._pending: dict[int, _dist.Gathering] = {}  # gid -> all-gather posted ahead
        self._executor = ThreadPoolExecutor(read_workers if self.read_bytes else 1,
                                            thread_name_prefix="tierstore-prefetch") if depth else None
        # where a gather gets its bytes when not from this rank's shard through `group`: hpZ's secondary
        # partition (a Secondary of hpz.py, set by it; [Note: hpZ] there), or None
        self.secondary: Secondary | None = None
        # stage 3 only where there is a collective to overlap
        self.gathers_ahead_on = _dist.world_and_rank(group)[0] > 1 and depth > 0
        # -- counters (read through CoordinatorStats)
        self.prefetch_hits = 0  # shards read ahead that were used
        self.gathers_ahead = 0  # all-gathers posted ahead
        self.gather_hits = 0  # ... that a module then waited for
        self.gathers_dropped = 0  # ... that no module used (waited for and dropped)
        self.most_ahead = 0  # the most buckets gathered ahead and not yet used, at once

    @property
    def enabled(self) -> bool:
        return self._executor is not None

    @property
    def span(self) -> int:
        """How many modules (or backward entries) ahead `ahead` wants to hear about."""
        return (2 * self.depth if self.gathers_ahead_on else self.depth) + (READ_AHEAD_MAX if self.read_bytes else 0)

    @property
    def reads_in_flight(self) -> int:
        return len(self._prefetched)

    @property
    def gathers_in_flight(self) -> int:
        return len(self._pending)

    def ahead(self, upcoming) -> None:
        """`upcoming`: the gids of each of the next `span` modules (or entries), nearest first. Reads the
        shards of the far ones and posts the all-gathers of the near ones (world size N), or reads them all;
        with read_bytes, those past the depth only while they fit ([Note: reading ahead by bytes]).
        Only from the main thread, at points every rank reaches in the same order."""
        executor = self._executor
        if executor is None:
            return
        d = self.depth
        # read whatever their size: all named (by modules only), or the depth's; beyond those, within read_bytes
        near = (2 * d if self.gathers_ahead_on else d) if self.read_bytes else len(upcoming)
        for gids in upcoming[d:near] if self.gathers_ahead_on else upcoming[:near]:
            self._read_ahead(executor, gids)
        for gids in upcoming[near:]:  # [Note: reading ahead by bytes]
            new = [g for g in gids if self._wanted(g)]
            if self._ahead_bytes + sum(self._shard_bytes(g) for g in new) > self.read_bytes:
                break
            self._read_ahead(executor, new)
        if self.gathers_ahead_on:
            for gids in upcoming[:d]:
                self._gather_ahead_of(gids)

    def shard(self, gid: int) -> torch.Tensor:
        """This rank's shard of `gid` on the compute device: read ahead, or read now."""
        fut = self._prefetched.pop(gid, None)
        if fut is not None:
            self._ahead_bytes -= self._shard_bytes(gid)
            staged = fut.result()
            self.prefetch_hits += 1
            return self.stage.ready(staged)
        return self.fetch_shard(gid).to(self.device)

    def take_gathered(self, gid: int) -> torch.Tensor | None:
        """The full bucket `gid` if its all-gather was posted ahead (waited for now), else None."""
        pending = self._pending.pop(gid, None)
        if pending is None:
            return None
        with torch.profiler.record_function("tierstore::all_gather_wait"):
            full = pending.wait()
        self.gather_hits += 1
        return full

    def drop(self) -> None:
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
        self._ahead_bytes = 0

    def settle(self) -> None:
        """Wait for the reads in flight (they stay read ahead; a failed one raises when its shard is used)."""
        for fut in list(self._prefetched.values()):
            fut.exception()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    def _read_and_stage(self, gid: int) -> Staged:
        """Worker thread: stages 1 and 2."""
        return self.stage.to_device(self.fetch_shard(gid))

    def _gather_ahead_of(self, gids) -> None:
        """Stage 3: post the all-gathers of `gids` now, waited when a module needs them."""
        for gid in gids:
            if self.held(gid) or gid in self._pending:
                continue
            # hpZ: inside the node when the secondary partition covers it ([Note: hpZ] in hpz.py)
            pending = self.secondary.gather_async(gid) if self.secondary is not None else None
            if pending is None:
                b = self.layout.bucket(gid)
                shard = self.shard(gid)
                full = torch.empty(b.numel, dtype=b.dtype, device=self.device)
                with torch.profiler.record_function("tierstore::all_gather_post"):
                    pending = _dist.all_gather_async(shard, full, self.group, quantized=self.qwz)
            self._pending[gid] = pending
            self.gathers_ahead += 1
            self.most_ahead = max(self.most_ahead, len(self._pending))

    def _wanted(self, gid: int) -> bool:
        """Whether bucket `gid`'s shard is to be read ahead: not gathered, posted or read ahead already, and
        not gathered from hpZ's secondary partition (no shard to read)."""
        return not ((self.secondary is not None and self.secondary.covers(gid)) or self.held(gid)
                    or gid in self._pending or gid in self._prefetched)

    def _read_ahead(self, executor: ThreadPoolExecutor, gids) -> None:
        for gid in gids:
            if self._wanted(gid):
                self._prefetched[gid] = executor.submit(self._read_and_stage, gid)
                self._ahead_bytes += self._shard_bytes(gid)

    def _shard_bytes(self, gid: int) -> int:
        b = self.layout.bucket(gid)
        return b.shard_numel * b.dtype.itemsize
