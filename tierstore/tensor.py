"""TieredTensor: a handle on one named value of a Store.

The handle holds no state of its own: where the value's copies are, its version and its pins belong to the
residency layer (residency.py), which the handle asks. A handle is bound to one value: once that value is
replaced (a put() of its name) or deleted, the handle refuses with MisuseError. Handles of the same value
compare equal. Memory tiers (device, host) hold the value decoded, in its own shape and dtype; the nvme
tier holds its *encoded* bytes ([Note: codecs] in encoding.py).
"""
from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager

import torch

from .errors import TierstoreValueError
from .residency import Placement, Residency, check_out
from .tiers import tier_index, tier_info
from .tiers.device import to_dlpack_tensor


class TieredTensor:
    """A named tensor held by a Store on one or more tiers. Get handles with `store.tensor(name)`."""

    __slots__ = ("_res", "_p")

    def __init__(self, residency: Residency, placement: Placement):
        self._res = residency
        self._p = placement

    # -- what it is --------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._p.name

    @property
    def shape(self) -> torch.Size:
        return self._p.shape

    @property
    def dtype(self) -> torch.dtype:
        return self._p.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the value, decoded."""
        return self._p.nbytes

    @property
    def codec(self):
        return self._p.codec

    @property
    def tiers(self) -> frozenset[str]:
        """The tiers holding a valid copy."""
        return self._res.tiers_of(self._p)

    @property
    def dirty(self) -> bool:
        """True when the current value is not yet durable (flush() has work to do for it)."""
        return self._res.dirty(self._p)

    @property
    def encoded_nbytes(self) -> int | None:
        """Bytes the nvme copy occupies (None without one)."""
        return self._res.encoded_nbytes(self._p)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TieredTensor) and other._p is self._p

    def __hash__(self) -> int:
        return id(self._p)

    def __repr__(self) -> str:
        return (f"TieredTensor({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"tiers={sorted(self.tiers, key=tier_index)}, dirty={self.dirty})")

    # -- reading ---------------------------------------------------------------------------------------
    def get(self, device: torch.device | str | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of the value as a plain tensor (on `device`, default: where the fastest copy is; nvme -> cpu).

        out: a tensor of this shape and dtype to receive the value (returned). A trainer that reads the same
        tensors every step should pass one: freshly allocated memory costs page faults, which on a VM
        can be slower than the disk. A contiguous CPU `out` is read into directly (O_DIRECT when it is 4 KiB
        aligned, else through pool buffers); `device=`, if given, must be out's device."""
        if out is not None:
            check_out(self._p, out, device)
        return self._res.read([self._p], device, [out], by_name=False)[0]

    def wait_written(self) -> None:
        """Wait until the write of this value to nvme, if one is in flight, has finished, and raise its error
        as a read would if it failed -- for a caller that still holds the bytes it put (lent them) and will
        use its own copy instead of reading them back."""
        self._res.wait_written(self._p)

    def prefetch(self, tier: str = "device") -> Future:
        """Start moving a copy up to `tier` ('device' or 'host'); the future resolves to this TieredTensor."""
        tier_index(tier)
        self._res.check(self._p)
        return self._res.submit(self._prefetch_job, tier)

    def _prefetch_job(self, tier: str) -> TieredTensor:
        self._res.bring_to(self._p, tier)
        return self

    @contextmanager
    def resident(self, device: torch.device | str | None = None, *, writeback: bool = False) -> Iterator[torch.Tensor]:
        """`with t.resident(device) as x:` x is the tier's copy as a plain torch.Tensor, not evicted inside
        the block. `device`: 'device' / 'host' / a torch device (default: the store's device). With
        writeback=True changes made to x are written to every other tier holding a copy on exit; without
        it, treat x as read-only."""
        with self._res.resident(self._p, self._res.tier_for(device), writeback=writeback) as x:
            yield x

    # -- moving and changing -------------------------------------------------------------------------
    def offload(self, tier: str = "nvme", *, keep: bool = False) -> Future:
        """Start writing a copy down to `tier` ('host' or 'nvme'); unless keep=True, the faster copies are
        dropped once it is there. The future resolves to this TieredTensor. An nvme copy is readable at once
        and durable after store.flush()."""
        if tier_index(tier) == 0:
            raise TierstoreValueError("offload moves down to 'host' or 'nvme'; to move up use prefetch('device')")
        self._res.check(self._p)
        self._res.check_writable(f"offload of {self.name!r}")
        return self._res.submit(self._offload_job, tier, keep)

    def _offload_job(self, tier: str, keep: bool) -> TieredTensor:
        self._res.offload(self._p, tier, keep)
        return self

    def drop(self, tier: str) -> None:
        """Free the copy on `tier`, keeping the others. The only copy cannot be dropped."""
        tier_info(tier)
        self._res.drop(self._p, tier)

    def update(self, value) -> None:
        """Replace the value (same shape and dtype): memory copies are overwritten in place, the nvme copy is
        rewritten when it is the only one, else dropped (and rewritten at flush)."""
        self._res.check_writable(f"update of {self.name!r}")
        value = to_dlpack_tensor(value)
        if tuple(value.shape) != tuple(self.shape) or value.dtype != self.dtype:
            raise TierstoreValueError(
                f"update() of {self.name!r} needs shape {tuple(self.shape)} and dtype {self.dtype}; got "
                f"{tuple(value.shape)} {value.dtype}. To change shape or dtype, store.put({self.name!r}, ...) again")
        self._res.update(self._p, value)
