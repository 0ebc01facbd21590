"""The arguments of save_checkpoint, load_checkpoint and consolidate, checked before anything is read or
written: a wrong one is a TierstoreValueError naming it and what to pass instead."""
from __future__ import annotations

import os

import torch

from ...errors import MisuseError, TierstoreValueError


def directory(value, fn: str) -> str:
    """`value` as an absolute str path, or TierstoreValueError naming `fn`'s `directory` argument."""
    path = os.fspath(value) if isinstance(value, os.PathLike) else value
    if isinstance(path, bytes):
        raise TierstoreValueError(f"{fn}: directory must be a str path; got bytes {path[:60]!r}: pass it decoded "
                                  "(os.fsdecode(path))")
    if not isinstance(path, str):
        raise TierstoreValueError(f"{fn}: directory must be a path (a str or pathlib.Path) of the checkpoint "
                                  f"directory; got {type(value).__name__} {str(value)[:60]!r}")
    if not path or "\0" in path:
        raise TierstoreValueError(f"{fn}: directory {path[:60]!r} is not a path: pass the checkpoint directory "
                                  "(\".\" for the current one)")
    return os.path.abspath(path)


_INTERFACE = ("export_subgroup", "import_subgroup", "initial_state_values", "hyperparams", "set_hyperparams",
              "scaler_state", "load_scaler_state", "check_usable")


def optimizer(opt, fn: str, *, usable: bool = True) -> None:
    """TierstoreValueError unless `opt` is a Zero3Optimizer; MisuseError when it is closed, or (usable) unusable
    after a failed load ([Note: a failed load changes nothing] in verify.py)."""
    # the checkpoint knows the optimizer only through its checkpoint interface ([Note: checkpoint interface]
    # in optimizer.py), so it asks for that, not for the class (which sits above the checkpoint's modules)
    if not all(callable(getattr(opt, m, None)) for m in _INTERFACE):
        raise TierstoreValueError(f"{fn}: opt must be the Zero3Optimizer to checkpoint; got "
                                  f"{type(opt).__name__}. Call opt.{fn}(directory) on it")
    if opt.store is None:
        raise MisuseError(f"{fn}: this Zero3Optimizer is closed; build a new one")
    if usable:
        opt.check_usable(fn)


def save_args(opt, value) -> None:
    """save_checkpoint's `opt` and `directory`, checked before anything is written."""
    optimizer(opt, "save_checkpoint")
    directory(value, "save_checkpoint")


def dtype(value) -> torch.dtype | None:
    """consolidate's `dtype`: None or a floating torch.dtype."""
    if value is None or isinstance(value, torch.dtype) and value.is_floating_point:
        return value
    raise TierstoreValueError(f"consolidate: dtype must be a floating torch.dtype (torch.float32, torch.bfloat16, "
                              f"torch.float16) or None for the saving run's compute dtype; got {value!r}")
