"""What every benchmark shares: interleaved A B A B timing, samples and ratios, a progress bar, disk passes;
sizes, tables and JSON come from tierstore/_report.py (re-exported here).

[Note: ratios, not lone numbers]
The machines are shared and the disk is a shared virtual disk whose throughput moves 2x between runs.
A benchmark therefore measures its references (fio, DeepSpeed, torch, memcpy) in the same run,
alternating A B A B, and reports each case as a ratio to its reference from the same rounds.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from .._report import fmt_bytes, gib_s, parse_size, print_table, size_arg, write_json  # noqa: F401  (re-exported)
from ..gpt import proc_status  # noqa: F401  (re-exported: the benches and the tests' memory helper)


@dataclass
class Samples:
    """Timings (seconds) of one case, in the order they were taken."""

    name: str
    seconds: list[float] = field(default_factory=list)
    info: dict = field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds) if self.seconds else float("nan")

    @property
    def best(self) -> float:
        return min(self.seconds) if self.seconds else float("nan")


def interleave(cases: dict[str, Callable[[], float | None]], rounds: int,
               progress: Progress | None = None) -> dict[str, Samples]:
    """Run every case once per round, in the same order each round (A B A B ...).

    A case returns its own elapsed seconds (to exclude set-up) or None to be timed whole."""
    out = {name: Samples(name) for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            r = fn()
            out[name].seconds.append(time.perf_counter() - t0 if r is None else float(r))
            if progress is not None:
                progress.advance()
    return out


class Progress:
    """A rich progress bar on stderr (silent when stderr is not a terminal, e.g. under CI)."""

    def __init__(self, total: int, description: str):
        self._bar = None
        if sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), transient=True)
            self._task = self._bar.add_task(description, total=total)

    def __enter__(self) -> Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def describe(self, text: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=text)

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)


def ratio(a: float | None, b: float | None) -> str:
    """'1.23x' for a/b (both throughputs, or both 1/time), '-' when either is missing."""
    if a is None or b is None or b != b or a != a or b == 0:
        return "-"
    return f"{a / b:.2f}x"


@contextmanager
def timed() -> Iterator[list[float]]:
    """with timed() as t: ...; t[0] is the elapsed seconds."""
    box: list[float] = []
    t0 = time.perf_counter()
    try:
        yield box
    finally:
        box.append(time.perf_counter() - t0)


def drop_page_cache(paths) -> None:
    """Flush `paths` and drop their pages from the page cache, so the next read comes from the disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def engine_pass(eng, path: str, mode: str, pieces) -> float:
    """Seconds for the raw engine to write (mode "w", then fsync) or read (mode "r", from the disk: the page
    cache dropped first) `pieces` [(tensor, byte offset)] of one file, all in flight at once -- the raw-disk
    reference of the store and optim benchmarks."""
    if mode == "r":
        drop_page_cache([path])
    f = eng.open(path, mode)
    op = eng.write if mode == "w" else eng.read
    t0 = time.perf_counter()
    for t, off in pieces:
        op(f, t, off)
    eng.wait_all()
    if mode == "w":
        eng.fsync(f)
    dt = time.perf_counter() - t0
    eng.close_file(f)
    return dt


