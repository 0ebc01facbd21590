"""The accelerator tier: tensors in the memory of any torch accelerator (CUDA, ROCm, XPU, MPS ...).

[Note: the CPU stands in for the accelerator]
There is no GPU on the development machines, so the tier is written against torch's device-generic API
(`torch.accelerator`, `Tensor.copy_(non_blocking=True)`, streams via `torch.accelerator`) and, where no
accelerator is present, runs with `device=cpu` through exactly the same code: a device copy is then a
separate CPU tensor. Only the synchronisation after a non-blocking copy is skipped on the CPU, where
copies are synchronous anyway.
"""
from __future__ import annotations

import torch

from .base import Budget, TierStats, profile_range


def default_device() -> torch.device:
    """The current accelerator when there is one, else the CPU (standing in for it)."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        dev = acc.current_accelerator()
        if dev is not None:
            return torch.device(dev.type, acc.current_device_index())
    return torch.device("cpu")


def to_dlpack_tensor(obj) -> torch.Tensor:
    """Accept torch tensors, numpy arrays and any DLPack producer (cupy, jax ...) at the edges; refuse tensors
    whose bytes alone are not the value (sparse, nested, quantized) or that have no bytes (meta)."""
    from ..errors import TierstoreValueError

    if isinstance(obj, torch.Tensor):
        t = obj
    else:
        import numpy as np

        if isinstance(obj, np.ndarray):
            t = torch.from_numpy(obj)
        elif hasattr(obj, "__dlpack__"):
            t = torch.from_dlpack(obj)
        else:
            raise TierstoreValueError(f"cannot store a {type(obj).__name__}: pass a torch.Tensor, a numpy array "
                                      "or an object with __dlpack__ (cupy, jax)")
    if t.is_quantized:
        raise TierstoreValueError(
            f"cannot store a quantized {t.dtype} tensor: its bytes alone lose the scale and zero point. Store "
            "t.dequantize(), or t.int_repr() together with t.q_scale()/t.q_zero_point() (per-channel: "
            "t.q_per_channel_scales()/zero_points()) under names of their own; for compact storage pass a "
            "quantized codec (tierstore.quant.codecs) with a float tensor")
    if t.is_nested:
        raise TierstoreValueError("cannot store a nested tensor: store each of t.unbind() under a name of its own")
    if t.layout != torch.strided:
        raise TierstoreValueError(
            f"cannot store a tensor of layout {t.layout}: only dense tensors are stored. Store t.to_dense(), or "
            "its parts (t.indices() and t.values() for COO; crow_indices/col_indices/values for CSR) under names "
            "of their own")
    if t.device.type == "meta":
        raise TierstoreValueError("cannot store a meta tensor: it has a shape but no data. Materialise it first "
                                  "(torch.empty_like(t, device='cpu') and fill it, or module.to_empty(device=...))")
    return t


def resolve_device(device) -> torch.device:
    """The device a `device=` argument names: None is default_device(); otherwise 'cpu' or this machine's
    accelerator (with an index it has). Anything else is a TierstoreValueError saying what to pass."""
    from ..errors import TierstoreValueError

    if device is None:
        return default_device()
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    offer = (f"'cpu', {acc.type!r} (or {acc.type}:0 .. {acc.type}:{torch.accelerator.device_count() - 1})"
             if acc is not None else "'cpu' (this machine has no accelerator)")
    if isinstance(device, bool) or not isinstance(device, (str, torch.device)):
        raise TierstoreValueError(f"device={device!r} must be a str or torch.device: pass {offer}, or None for "
                                  "the current accelerator")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise TierstoreValueError(f"device={device!r} is not a device torch knows: pass {offer}, or None for "
                                  "the current accelerator") from None
    if dev.type == "cpu":
        return dev
    if acc is None or dev.type != acc.type:
        raise TierstoreValueError(f"device={device!r}: there is no {dev.type} device here: pass {offer}, or None "
                                  "for the current accelerator")
    if dev.index is not None and dev.index >= torch.accelerator.device_count():
        raise TierstoreValueError(f"device={device!r}: this machine has {torch.accelerator.device_count()} "
                                  f"{dev.type} device(s): pass {offer}")
    return dev


def device_memory(device: torch.device) -> int | None:
    """Bytes of memory `device` has (the machine's for the CPU), None where it is not known."""
    if device.type == "cpu":
        from ..io.pool import physical_memory

        return physical_memory()
    try:
        return int(torch.accelerator.get_memory_info(device)[1])
    except (RuntimeError, AttributeError, TypeError, ValueError):
        return None


class DeviceTier:
    """Accelerator memory under a byte budget. `device=None` picks `default_device()`; anything but 'cpu' or
    this machine's accelerator is refused (resolve_device), and so is a budget above the device's memory."""

    name = "device"

    def __init__(self, budget_bytes: int | None, device: torch.device | str | None = None):
        from .._units import fmt_bytes
        from ..errors import TierstoreValueError

        self.device = resolve_device(device)
        memory = device_memory(self.device) if budget_bytes else None
        if memory is not None and budget_bytes is not None and budget_bytes > memory:
            raise TierstoreValueError(
                f"budgets['device']={budget_bytes} is more than the {fmt_bytes(memory)} of memory {self.device} has "
                f"({'the CPU stands in for the accelerator here' if self.device.type == 'cpu' else 'all of it'}): "
                f"pass at most {memory} bytes, or None for no limit")
        self.budget = Budget("device", budget_bytes)
        self.stats = TierStats("device")

    def synchronize(self) -> None:
        """Wait for this device's queued copies (a no-op on the CPU stand-in)."""
        if self.device.type != "cpu":  # accelerator-only branch: copies are queued on its current stream
            torch.accelerator.current_stream(self.device).synchronize()

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """Uninitialised device memory for a tensor of `shape` and `dtype`."""
        return torch.empty(shape, dtype=dtype, device=self.device)

    def copy_in(self, src: torch.Tensor) -> torch.Tensor:
        """A new device tensor holding `src` (any device, any layout); returns when the copy is done."""
        nbytes = src.numel() * src.element_size()
        with profile_range("tierstore::to_device"), self.stats.timing("in", nbytes):
            dst = self.empty(src.shape, src.dtype)
            dst.copy_(src, non_blocking=True)
            self.synchronize()
        return dst

    def copy_out(self, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """Copy the device tensor `src` into the host tensor `dst`; returns `dst` when done."""
        nbytes = src.numel() * src.element_size()
        with profile_range("tierstore::from_device"), self.stats.timing("out", nbytes):
            dst.copy_(src, non_blocking=True)
            self.synchronize()
        return dst

    def __repr__(self) -> str:
        return f"DeviceTier({self.device}, {self.budget})"
