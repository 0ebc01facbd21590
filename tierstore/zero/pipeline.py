"""The step as a pipeline over sub-groups: read i+1 while stepping i while writing i-1.

[Note: step pipeline]
ZeRO-Infinity (Rajbhandari et al., SC'21, sec. 6.2 "overlap-centric design") overlaps the NVMe reads of the
next sub-group's optimizer states and the writes of the previous one with the step of the current one.
Here a reader thread runs ``load(i + 1 .. i + ahead)``, the caller's thread runs ``compute(i)`` (the inner
optimizer's step, which wants the cores), and a writer thread runs ``save(i - 1 ..)``. At most
``ahead`` loaded and ``behind`` unsaved sub-groups exist at any time besides the one being stepped, so the
memory the step holds is bounded by (ahead + 1 + behind) sub-groups, whatever the model size; the store's
pinned budget bounds the staging on top. An error in any stage stops the pipeline, waits for the writes
already submitted (so nothing is half-written when the call returns) and is raised.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch


class StepPipeline:
    """Reusable reader/writer threads for `run`."""

    def __init__(self, depth: int = 3):
        self.depth = depth  # sub-groups in flight: ahead + current + behind
        self.ahead = max(1, (depth - 1) // 2) if depth > 1 else 0
        self.behind = max(1, depth - 1 - self.ahead) if depth > 1 else 0
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="tierstore-step-read") if depth > 1 else None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tierstore-step-write") if depth > 1 else None
        self.peak_in_flight = 0  # the most sub-groups held at once in the last run (for tests)

    def run(self, items: Sequence[Any], load: Callable[[Any], Any], compute: Callable[[Any, Any], Any],
            save: Callable[[Any, Any], None]) -> None:
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
        self.peak_in_flight = 0
        try:
            for i, it in enumerate(items):
                while nxt < len(items) and nxt <= i + self.ahead:
                    reads.append(reader.submit(_profiled, "tierstore::step_read", load, items[nxt]))
                    nxt += 1
                loaded = reads.popleft().result()
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
    optimizer.py): ``submit(item)`` loads it on a reader thread, steps it on a compute thread and saves it on a
    writer thread, in the order submitted, while the caller goes on (backward). At most `depth` sub-groups are
    in flight: ``submit`` waits for one to be saved beyond that (back-pressure on the caller, so the memory
    held stays bounded). ``wait`` returns the items done since the last wait, or raises the first error
    after every item submitted has finished (nothing is left half-written)."""

    def __init__(self, depth: int, load: Callable[[Any], Any], compute: Callable[[Any, Any], Any],
                 save: Callable[[Any, Any], None]):
        import threading
        self.load, self.compute, self.save = load, compute, save
        self._slots = threading.Semaphore(max(1, depth))
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="tierstore-overlap-read")
        self._stepper = ThreadPoolExecutor(1, thread_name_prefix="tierstore-overlap-step")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tierstore-overlap-write")
        self._futures: list[tuple[Any, Future]] = []

    def submit(self, item: Any) -> None:
        self._slots.acquire()
        try:
            loaded = self._reader.submit(_profiled, "tierstore::step_read", self.load, item)
            stepped = self._stepper.submit(self._compute, item, loaded)
            saved = self._writer.submit(self._save, item, stepped)
        except BaseException:
            self._slots.release()
            raise
        saved.add_done_callback(lambda _f: self._slots.release())
        self._futures.append((item, saved))

    def _compute(self, item: Any, loaded: Future) -> Any:
        t = loaded.result()
        with torch.profiler.record_function("tierstore::step_compute"):
            return self.compute(item, t)

    def _save(self, item: Any, stepped: Future) -> None:
        t = stepped.result()
        with torch.profiler.record_function("tierstore::step_write"):
            self.save(item, t)

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
