"""Traced prefetch: learn the order in which modules use their parameters, then fetch ahead of it.

[Note: trace]
The first forward records the sequence of modules whose forward pre-hook fires (a module called twice
appears twice). Later forwards walk the same sequence; at position i the coordinator asks for the modules
at i+1 .. i+depth and starts reading their shards up from the store (nvme -> memory) on a worker thread,
overlapped with the compute of module i. Only *local* reads are prefetched, never collectives: a rank whose
order diverged (a data-dependent branch, a frozen layer) must not post an all-gather the others do not, so
a wrong prediction costs a wasted read and never a hang. When the observed module differs from the
prediction, the trace is cut there and re-recorded from that point (a DEBUG log line on tierstore.zero
says where); prefetches that were not used are dropped at the end of the forward. Backward walks the same
trace in reverse: when a module's backward gathers, the shards of the `depth` modules before it in the
trace are read up (dropped at the end of backward if unused).
"""
from __future__ import annotations

import logging

log = logging.getLogger("tierstore.zero")


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
