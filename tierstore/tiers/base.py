"""What every tier shares: the registry of tiers and their capabilities, the contracts a tier class keeps
(MemoryTier, PersistentTier), a byte budget and transfer statistics.

[Note: tiers are known by their capabilities]
The residency layer never asks "is this the nvme tier?": it asks the registry what a tier can do
(`tier_info(name).persistent`, `.holds_encoded_bytes`, the order fastest first), and calls a tier through
the Protocol its capabilities promise. A new tier is one `TierInfo` record here plus a class keeping its
Protocol, checked by the conformance suite in tests/tiers/tier_conformance.py. The public API still names tiers
by their strings ('device', 'host', 'nvme').
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch._C._autograd import _profiler_enabled

from ..errors import TierstoreValueError


@dataclass(frozen=True)
class TierInfo:
    """What a tier can do. `persistent`: its copies survive the process (a manifest names them) and it keeps
    the PersistentTier contract; else it keeps the MemoryTier contract. `holds_encoded_bytes`: a copy is the
    tensor's bytes after its codec (an extent), not a decoded tensor. `order`: 0 is the fastest."""

    name: str
    order: int
    persistent: bool
    holds_encoded_bytes: bool

    @property
    def memory(self) -> bool:
        return not self.persistent


REGISTRY: tuple[TierInfo, ...] = (  # the one list of tiers, fastest first
    TierInfo("device", 0, persistent=False, holds_encoded_bytes=False),
    TierInfo("host", 1, persistent=False, holds_encoded_bytes=False),
    TierInfo("nvme", 2, persistent=True, holds_encoded_bytes=True),
)
TIERS = tuple(i.name for i in REGISTRY)  # fastest first
MEMORY_TIERS = tuple(i.name for i in REGISTRY if i.memory)  # fastest first
PERSISTENT_TIERS = tuple(i.name for i in REGISTRY if i.persistent)
_INFO = {i.name: i for i in REGISTRY}
_NO_RANGE = nullcontext()


def profile_range(name: str):
    """`torch.profiler.record_function(name)` while a torch profiler runs, else a no-op.

    [Note: profiler ranges cost nothing when nobody profiles]
    Entering a record_function dispatches two torch ops, a cost every small put() would pay. The ranges
    still appear in every trace: the check is the profiler's own state."""
    return torch.profiler.record_function(name) if _profiler_enabled() else _NO_RANGE


def tier_info(tier: str) -> TierInfo:
    """The registry's record of `tier`; TierstoreValueError naming the tiers when there is none."""
    try:
        return _INFO[tier]
    except (KeyError, TypeError):
        raise TierstoreValueError(f"tier={tier!r} is not one of {TIERS}") from None


def tier_index(tier: str) -> int:
    return tier_info(tier).order


class Budget:
    """Bytes a tier may hold. `limit=None` means no limit. Not thread-safe by itself: the store locks."""

    def __init__(self, name: str, limit: int | None):
        if limit is not None and limit < 0:
            raise TierstoreValueError(f"budgets[{name!r}]={limit} must be >= 0 bytes (or None for no limit)")
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


# -- contracts ------------------------------------------------------------------------------------------
@runtime_checkable
class Tier(Protocol):
    """What every tier has: its registry name, a byte budget and transfer statistics."""

    name: str
    budget: Budget
    stats: TierStats


@runtime_checkable
class MemoryTier(Tier, Protocol):
    """A tier holding decoded tensors in memory (device, host). Budgets are charged by the residency layer
    (the tier allocates; it does not refuse)."""

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """Uninitialised memory of this tier for a tensor of `shape` and `dtype`."""

    def copy_in(self, src: torch.Tensor) -> torch.Tensor:
        """A new tensor of this tier holding `src` (any device, any layout); the copy is done on return."""

    def copy_out(self, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """Copy `src`, a tensor of this tier, into `dst` (a CPU tensor of its shape); returns `dst`, done."""


@runtime_checkable
class PersistentTier(Tier, Protocol):
    """A tier holding encoded bytes in files that outlive the process (nvme). A copy is an extent: an object
    with `length` (bytes), `written` (the future of its write, None once durable) and `to_json()`.
    Space is copy-on-write: an extent a manifest names is reused only after commit_done() says a newer
    manifest no longer names it."""

    stripe_unit: int  # bytes
    files: list

    def write(self, src: torch.Tensor, what: str = "a tensor", lend: Callable[[], None] | None = None) -> Any:
        """Start writing the bytes of contiguous CPU `src`; returns its extent, readable at once. Raises
        TierstoreIOError with nothing written when no space can be reserved. `lend`: the caller leaves `src`
        unchanged until `lend()` is called, which happens exactly once (also when this raises), as soon as
        the tier no longer needs the memory -- so the tier may write from it instead of copying it first."""

    def wait_writes(self) -> None:
        """Wait for the writes submitted so far (not durable: sync() is)."""

    def wait_written(self, e: Any) -> None:
        """Wait until extent `e`'s write (if one is in flight) has finished; raise its error if it failed."""

    def read(self, e: Any, out: torch.Tensor, what: str) -> None:
        """Read extent `e` into `out` (contiguous uint8 CPU, e.length elements), its checksum checked."""

    def read_many(self, items: list) -> list:
        """Read many (extent, out, what); one error or None per item, in order."""

    def read_ranges(self, e: Any, ranges: list, out: Any, what: str) -> int:
        """Copy (start, nbytes, dst) byte ranges of extent `e` into `out`, reading (and verifying) only what
        covers them; returns the bytes read."""

    def check_readable(self, e: Any, what: str) -> None:
        """Raise the CorruptionError of an extent found damaged at open (before memory is allocated)."""

    def free(self, e: Any) -> None:
        """No copy names `e` any more (its space comes back when no manifest or read needs it)."""

    def unfree(self, e: Any) -> None:
        """Take back a free() of an extent the last manifest names (a revert to it)."""

    def sync(self) -> None:
        """Wait for every write and make it durable (fsync)."""

    def protect(self, extents: list) -> list:
        """Mark `extents` as named by the manifest being written; returns those newly marked."""

    def unprotect(self, extents: list) -> None:
        """Undo protect() after a manifest that was not written."""

    def commit_done(self, live: list) -> None:
        """The manifest naming exactly `live` is durable: reuse the space of every other freed extent."""

    def check_extents(self, extents: list, path: str, field: Callable[[int], str] | None = None) -> None:
        """Validate the extents read from the manifest at `path` against the files; errors name extent i as
        `field(i)` (default: extents[i])."""

    def adopt(self, extents: list) -> None:
        """Take the extents of a manifest read at open as allocated and committed."""

    def close(self) -> None:
        """Wait for the writes in flight and release files and memory."""

