"""What every tier shares: a byte budget and transfer statistics."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch
from torch._C._autograd import _profiler_enabled

from ..errors import TierstoreValueError

TIERS = ("device", "host", "nvme")  # fastest first
_NO_RANGE = nullcontext()


def profile_range(name: str):
    """`torch.profiler.record_function(name)` while a torch profiler runs, else a no-op.

    [Note: profiler ranges cost nothing when nobody profiles]
    Entering a record_function dispatches two torch ops (~10 us); put() of 10,000 small tensors paid
    that on every call. The ranges still appear in every trace: the check is the profiler's own state."""
    return torch.profiler.record_function(name) if _profiler_enabled() else _NO_RANGE


def tier_index(tier: str) -> int:
    try:
        return TIERS.index(tier)
    except ValueError:
        raise TierstoreValueError(f"tier={tier!r} is not one of {TIERS}") from None


class Budget:
    """Bytes a tier may hold. `limit=None` means no limit. Not thread-safe by itself: the store locks."""

    def __init__(self, name: str, limit: int | None):
        if limit is not None and limit < 0:
            raise TierstoreValueError(f"{name}_budget={limit} must be >= 0 bytes (or None for no limit)")
        self.name = name
        self.limit = limit  # bytes, None = unlimited
        self.used = 0  # bytes

    def room(self) -> float:
        return float("inf") if self.limit is None else self.limit - self.used

    def fits_at_all(self, nbytes: int) -> bool:
        return self.limit is None or (nbytes <= self.limit and self.limit > 0)

    def take(self, nbytes: int) -> None:
        self.used += nbytes

    def give(self, nbytes: int) -> None:
        self.used -= nbytes
        assert self.used >= 0, f"{self.name} budget accounting went negative"

    def __repr__(self) -> str:
        lim = "unlimited" if self.limit is None else f"{self.limit} bytes"
        return f"{self.name}: {self.used} of {lim} used"


class TierStats:
    """Bytes and seconds moved into (written to) and out of (read from) one tier."""

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.Lock()
        self.bytes_in = 0  # bytes
        self.bytes_out = 0  # bytes
        self.seconds_in = 0.0
        self.seconds_out = 0.0
        self.ops_in = 0
        self.ops_out = 0

    @contextmanager
    def timing(self, direction: str, nbytes: int) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(direction, nbytes, time.perf_counter() - t0)

    def add(self, direction: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            if direction == "in":
                self.bytes_in += nbytes
                self.seconds_in += seconds
                self.ops_in += 1
            else:
                self.bytes_out += nbytes
                self.seconds_out += seconds
                self.ops_out += 1

    def as_dict(self) -> dict:
        with self._lock:
            d = {"bytes_in": self.bytes_in, "bytes_out": self.bytes_out, "seconds_in": self.seconds_in,
                 "seconds_out": self.seconds_out, "ops_in": self.ops_in, "ops_out": self.ops_out}
        for k in ("in", "out"):
            s = d[f"seconds_{k}"]
            d[f"gib_s_{k}"] = d[f"bytes_{k}"] / s / (1 << 30) if s > 0 else 0.0
        return d
