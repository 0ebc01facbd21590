"""Traced prefetch: learn the order in which modules use their parameters, then fetch ahead of it.

[Note: trace]
The first forward records the sequence of modules whose forward pre-hook fires (a module called twice
appears twice). Later forwards walk the same sequence; at position i the coordinator asks for the modules
that come next and runs the stages of [Note: prefetch stages] ahead of them, overlapped with the compute of
module i. The trace is the same on every rank (it follows the module order, which must be), so every
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
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch

log = logging.getLogger("tierstore.zero")


class Staged(NamedTuple):
    tensor: torch.Tensor  # the shard on the compute device (once `event` completed)
    event: object = None  # torch.Event recorded after the copy on the side stream; None: nothing to wait for
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
        # accelerator only -- never run here (no GPU on the development machine)
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
        # accelerator only -- never run here
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
