"""The step as a pipeline over sub-groups: read i+1 while stepping i while writing i-1.

[Note: step pipeline]
ZeRO-Infinity (Rajbhandari et al., SC'21, sec. 6.2 "overlap-centric design") overlaps the NVMe reads of the
next sub-group's optimizer states and the writes of the previous one with the step of the current one.
Here reader threads run ``load(i + 1 .. i + ahead)``, the caller's thread runs ``compute(i)`` (the inner
optimizer's step, which wants the cores), and a writer thread runs ``save(i - 1 ..)``. At most
``ahead`` loaded and ``behind`` unsaved sub-groups exist at any time besides the one being stepped, so the
memory the step holds is bounded by (ahead + 1 + behind) sub-groups, whatever the model size; the store's
pinned budget bounds the staging on top. Given the sub-groups' `sizes` and `unit_bytes` (the optimizer: each
one's fp32 master bytes, and sub_group_bytes), the readers also load further ahead while those loaded ahead
come to at most ``ahead`` x unit_bytes: sub-groups much smaller than sub_group_bytes (a bucket per 4 MiB
layer) would otherwise leave the readers idle while each is stepped, and the disk with them -- the same bound
in bytes as ``ahead`` full sub-groups. Two reader threads load, in the order submitted: a sub-group's reads
drain to nothing at its end, and with one reader the disk would sit idle there; with two, the next
sub-group's reads are queued meanwhile. The bound above holds whatever the number of readers: it counts the
loads submitted, not those running -- so the sizes given must be the real ones (a size of 0 would leave
the reads ahead bounded by nothing but the reader's own speed). An error in any stage stops the pipeline,
waits for the writes already submitted (so nothing is half-written when the call returns) and is raised.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

STEP_READERS = 2  # threads loading sub-groups for StepPipeline ([Note: step pipeline])


class StepPipeline:
    """Reusable reader/writer threads for `run`."""

    def __init__(self, depth: int = 3, unit_bytes: int = 0):
        self.depth = depth  # sub-groups in flight: ahead + current + behind
        self.unit_bytes = unit_bytes  # bytes of a full sub-group (sizes= of run)
        self.ahead = max(1, (depth - 1) // 2) if depth > 1 else 0
        self.behind = max(1, depth - 1 - self.ahead) if depth > 1 else 0
        self._reader = ThreadPoolExecutor(STEP_READERS, thread_name_prefix="tierstore-step-read") if depth > 1 else None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tierstore-step-write") if depth > 1 else None
        self.peak_in_flight = 0  # the most sub-groups held at once in the last run (for tests)

    def run(self, items: Sequence[Any], load: Callable[[Any], Any], compute: Callable[[Any, Any], Any],
            save: Callable[[Any, Any], None], sizes: Sequence[int] | None = None) -> None:
        reader, writer = self._reader, self._writer
        if reader is None or writer is None:
            for it in items:
                save(it, compute(it, load(it)))
            self.peak_in_flight = 1 if items else 0
            return
        items = list(items)
        reads: deque[Future] = deque()
        writes: deque[Future] = deque()
        nxt = 0
        ahead_bytes = 0  # sizes of the items loaded (or loading) ahead of the current one
        budget = self.ahead * self.unit_bytes if sizes is not None else 0
        self.peak_in_flight = 0
        try:
            for i, it in enumerate(items):
                while nxt < len(items) and (nxt <= i + self.ahead
                                            or (sizes is not None and ahead_bytes + sizes[nxt] <= budget)):
                    reads.append(reader.submit(_profiled, "tierstore::step_read", load, items[nxt]))
                    ahead_bytes += sizes[nxt] if sizes is not None else 0
                    nxt += 1
                loaded = reads.popleft().result()
                ahead_bytes -= sizes[i] if sizes is not None else 0
                self.peak_in_flight = max(self.peak_in_flight, len(reads) + 1 + len(writes))
                with torch.profiler.record_function("tierstore::step_compute"):
                    result = compute(it, loaded)
                del loaded
                while len(writes) >= self.behind:
                    writes.popleft().result()
                writes.append(writer.submit(_profiled, "tierstore::step_write", save, it, result))
                del result
            while writes:
                writes.popleft().result()
        finally:
            for f in list(reads) + list(writes):
                try:
                    f.result()
                except BaseException:  # the first error is already propagating
                    pass

    def close(self) -> None:
        for ex in (self._reader, self._writer):
            if ex is not None:
                ex.shutdown(wait=True)


def _profiled(name: str, fn, *args):
    with torch.profiler.record_function(name):
        return fn(*args)


class StepStream:
    """The step pipeline fed one sub-group at a time, as each becomes ready ([Note: overlapped step] in
    overlap.py): ``submit(item, nbytes)`` loads it on a reader thread, steps it on a compute thread and saves it
    on a writer thread, in the order submitted, while the caller goes on (backward). ``wait`` returns the items
    done since the last wait, or raises the first error after every item submitted has finished (nothing is
    left half-written).

    [Note: the stream's queue is in bytes]
    Two bounds keep the memory held finite. At most `depth` sub-groups are loaded and not yet saved (the one
    reader takes a slot before it loads, so slots go in submission order; during backward one reader keeps the
    disk busy, and a second one's reads would queue in front of the parameter reads backward waits for). And
    ``submit`` waits while the sub-groups submitted and not yet saved come to more than `queue_bytes` (their
    `nbytes`, whatever the caller counts: the optimizer counts the bytes of each sub-group's fp32 master on this
    rank, against pipeline_depth x sub_group_bytes) -- back-pressure on the caller; one sub-group is always
    admitted. StepPipeline reads ahead in bytes too ([Note:
    step pipeline]).
    A bound in sub-groups alone would make the caller wait at every small one: with a bucket per small layer,
    a depth of 3 holds backward up whenever the disk is the slower, and leaves the disk idle wherever
    backward's compute is. Queued in bytes, backward runs ahead through the sub-groups the disk is behind on
    and the reader catches up while backward computes."""

    def __init__(self, depth: int, load: Callable[[Any], Any], compute: Callable[[Any, Any], Any],
                 save: Callable[[Any, Any], None], *, queue_bytes: int = 0):
        import threading
        self.load, self.compute, self.save = load, compute, save
        self._slots = threading.Semaphore(max(1, depth))
        self.queue_bytes = queue_bytes
        self._queued = 0  # bytes submitted and not yet saved
        self._room = threading.Condition()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="tierstore-overlap-read")
        self._stepper = ThreadPoolExecutor(1, thread_name_prefix="tierstore-overlap-step")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tierstore-overlap-write")
        self._futures: list[tuple[Any, Future]] = []

    def submit(self, item: Any, nbytes: int = 0) -> None:
        with self._room:
            while self._queued and self._queued + nbytes > self.queue_bytes:
                self._room.wait()
            self._queued += nbytes
        try:
            loaded = self._reader.submit(self._load, item)
            stepped = self._stepper.submit(self._compute, item, loaded)
            saved = self._writer.submit(self._save, item, stepped)
        except BaseException:
            self._done(nbytes)
            raise
        saved.add_done_callback(lambda _f: self._done(nbytes))
        self._futures.append((item, saved))

    def _done(self, nbytes: int) -> None:
        with self._room:
            self._queued -= nbytes
            self._room.notify_all()

    def _load(self, item: Any) -> Any:
        self._slots.acquire()  # given back when this item's save has finished (or failed)
        return _profiled("tierstore::step_read", self.load, item)

    def _compute(self, item: Any, loaded: Future) -> Any:
        t = loaded.result()
        with torch.profiler.record_function("tierstore::step_compute"):
            return self.compute(item, t)

    def _save(self, item: Any, stepped: Future) -> None:
        try:
            t = stepped.result()
            with torch.profiler.record_function("tierstore::step_write"):
                self.save(item, t)
        finally:
            self._slots.release()  # taken by _load, which ran (or failed) before stepped finished

    @property
    def pending(self) -> int:
        return len(self._futures)

    def wait(self) -> list[Any]:
        futures, self._futures = self._futures, []
        error: BaseException | None = None
        done = []
        for item, f in futures:
            try:
                f.result()
                done.append(item)
            except BaseException as e:  # the first is raised once all have finished
                error = error or e
        if error is not None:
            raise error
        return done

    def close(self) -> None:
        for ex in (self._reader, self._stepper, self._writer):
            ex.shutdown(wait=True)
