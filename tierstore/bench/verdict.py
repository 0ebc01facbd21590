"""Whether a benchmark run can decide a target: the order of the cases in each round, the machine's load
sampled between cases, and the one verdict function `bench optim` and `bench train` print ("met", "MISSED",
or "undecided (why)").

[Note: a verdict the load cannot flip]
A ratio of two cases timed on a shared machine moves with whatever else runs there: a neighbour that slows
the reference 4x during its turn makes any case look fast next to it. So a run decides a target only when
(1) every round's ratio -- each round's A over the same round's B, measured one after the other -- lies on
the same side of the target: the spread over the rounds, not the median alone, is what the run measured; the
cases run in another order each round (rotated, and reversed every other round: round_order), so no case
always runs right after the same neighbour or always first; and at least MIN_ROUNDS rounds ran; and
(2) the 1-minute load average, sampled before the run, between cases and after it, stayed at or under
LOAD_PER_CORE x the machine's cores. The bench's own running case is in that figure: up to --threads (every
core by default) runnable threads, and its threads waiting on the disk, which Linux counts in the load too --
a quiet machine reads about 1 per core while a case runs. At 1.5 per core others hold at most about a third
of the machine; above it their share, not the library, decides the ratio, so the run says "undecided (load L
on N cores)" instead of a verdict. Measures that do not depend on time (peak RSS) are decided from their
one value, whatever the load.
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

LOAD_PER_CORE = 1.5  # the most 1-minute load average per core under which a run decides a timed target
MIN_ROUNDS = 2  # fewer rounds have no spread to judge

Target = tuple[str, float]  # ("<=", 1.1) or (">=", 0.95)


def load_average() -> float:
    """The machine's 1-minute load average now (/proc/loadavg; os.getloadavg where there is no /proc)."""
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except OSError:
        return os.getloadavg()[0]


@dataclass
class Load:
    """The 1-minute load average sampled through a run, and the machine's cores."""

    cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    samples: list[float] = field(default_factory=list)

    def sample(self) -> float:
        v = load_average()
        self.samples.append(v)
        return v

    @property
    def start(self) -> float:
        return self.samples[0] if self.samples else float("nan")

    @property
    def end(self) -> float:
        return self.samples[-1] if self.samples else float("nan")

    @property
    def max(self) -> float:
        return max(self.samples) if self.samples else float("nan")

    @property
    def limit(self) -> float:
        return LOAD_PER_CORE * self.cores

    @property
    def quiet(self) -> bool:
        return bool(self.samples) and self.max <= self.limit

    def describe(self) -> str:
        return (f"load average {self.start:.2f} at the start, {self.end:.2f} at the end, {self.max:.2f} at most "
                f"(sampled between cases) on {self.cores} cores; verdicts need at most {self.limit:.1f}")

    def as_dict(self) -> dict:
        return {"start": self.start, "end": self.end, "max": self.max, "cores": self.cores, "limit": self.limit,
                "samples": self.samples}


def round_order(cases: Sequence[str], k: int) -> list[str]:
    """The order of the cases in round k (from 0): rotated by k // 2, and reversed in odd rounds -- A B C,
    C B A, B C A, A C B, ... -- so each case runs in every position and after different neighbours."""
    n = len(cases)
    if n == 0:
        return []
    s = (k // 2) % n
    order = list(cases[s:]) + list(cases[:s])
    return order[::-1] if k % 2 else order


def holds(value: float, target: Target) -> bool:
    op, bound = target
    if op == "<=":
        return value <= bound
    if op == ">=":
        return value >= bound
    raise ValueError(f"target {target!r}: use '<=' or '>='")


def spread_text(values: Sequence[float]) -> str:
    """'0.93–1.10x': the least and the most of the per-round values ('-' with none)."""
    vals = [v for v in values if math.isfinite(v)]
    if not vals:
        return "-"
    return f"{min(vals):.2f}–{max(vals):.2f}x" if len(vals) > 1 else f"{vals[0]:.2f}x"


def verdict(values: Sequence[float], target: Target, load: Load | None, timed: bool = True) -> str:
    """"met" or "MISSED" when the run decides `target` from `values` (one per round: each round's ratio; or
    the one value of an untimed measure, timed=False), else "undecided (why)" -- see
    [Note: a verdict the load cannot flip]."""
    vals = [v for v in values if math.isfinite(v)]
    if not vals:
        return "undecided (no value)"
    sides = {holds(v, target) for v in vals}
    why = []
    if timed:
        if load is not None and not load.quiet:
            why.append(f"load {load.max:.2f} on {load.cores} cores")
        if len(vals) < MIN_ROUNDS:
            why.append(f"{len(vals)} round: no spread")
    if len(sides) > 1:
        why.append(f"spread {min(vals):.2f}–{max(vals):.2f} crosses the target")
    if why:
        return f"undecided ({'; '.join(why)})"
    return "met" if sides == {True} else "MISSED"
