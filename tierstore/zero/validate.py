"""Checks of what a user passes to ZeRO-3 (OffloadConfig's fields, the inner optimizer's arguments), each
refusal a TierstoreValueError naming the argument and what to pass instead -- made before anything is
created, so a refused call leaves nothing behind.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch

from ..errors import TierstoreTypeError, TierstoreValueError
from ..tiers import TIERS

T = TypeVar("T")


def known_fields(cls: type[T]) -> type[T]:
    """Wrap a dataclass's generated __init__ so that an unknown keyword (a typo, a DeepSpeed key) or too many
    positional arguments are a TierstoreTypeError naming it and the closest field, not a bare TypeError.
    Applied above @dataclass; dataclasses.replace goes through it too."""
    generated = cls.__init__
    names = [f.name for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]

    @functools.wraps(generated)
    def __init__(self, *args, **kwargs):
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            k = unknown[0]
            near = difflib.get_close_matches(k, names, n=1)
            hint = f"did you mean {near[0]}=...? " if near else ""
            raise TierstoreTypeError(f"{cls.__name__}({k}=...): no such field; {hint}its fields are "
                                      f"{', '.join(names)}")
        if len(args) > len(names):
            raise TierstoreTypeError(f"{cls.__name__} takes at most {len(names)} positional arguments "
                                      f"({', '.join(names)}); got {len(args)}: pass them by name")
        taken = [n for n in names[:len(args)] if n in kwargs]
        if taken:
            raise TierstoreTypeError(f"{cls.__name__}: {taken[0]} given twice (by position and by name)")
        generated(self, *args, **kwargs)

    setattr(cls, "__init__", __init__)  # noqa: B010 -- assigning the method directly upsets mypy
    return cls


def nvme_paths(v: Any, owner: str = "OffloadConfig") -> list[str] | None:
    """OffloadConfig.nvme_paths as a list of directory paths (str), or None: one path or a sequence of them,
    each a non-empty str or os.PathLike naming a directory, without NUL bytes."""
    if v is None:
        return None
    what = (f"{owner}(nvme_paths=...) takes a directory (str or pathlib.Path) or a list of them, one per drive, "
            f"e.g. nvme_paths=['/mnt/nvme0/tierstore']")
    if isinstance(v, str | os.PathLike):
        v = [v]
    elif isinstance(v, bytes | bytearray) or not isinstance(v, Sequence):
        raise TierstoreTypeError(f"{what}; got {type(v).__name__} {v!r}"
                                  + (" (decode bytes with os.fsdecode)" if isinstance(v, bytes | bytearray) else ""))
    out = []
    for i, p in enumerate(v):
        if not isinstance(p, str | os.PathLike):
            raise TierstoreTypeError(f"{what}; nvme_paths[{i}] is {type(p).__name__} {p!r}"
                                      + (" (decode bytes with os.fsdecode)" if isinstance(p, bytes) else ""))
        s = os.fspath(p)
        if not isinstance(s, str):
            raise TierstoreValueError(f"{what}; nvme_paths[{i}]={p!r} is a bytes path (decode it with "
                                      f"os.fsdecode)")
        if not s:
            raise TierstoreValueError(f"{what}; nvme_paths[{i}] is '' (the current directory, by accident more "
                                      f"often than not): name the directory, '.' if it really is the current one")
        if "\0" in s:
            raise TierstoreValueError(f"{what}; nvme_paths[{i}]={s!r} holds a NUL byte")
        out.append(s)
    if not out:
        return None
    return out


def integer(owner: str, name: str, v: Any, least: int, *, none_ok: bool = False, meaning: str = "") -> None:
    """`v` is an int (not a bool) >= least (or None where allowed)."""
    if v is None and none_ok:
        return
    if not isinstance(v, int) or isinstance(v, bool) or v < least:
        raise TierstoreValueError(f"{owner}({name}={v!r}): an integer >= {least}{' or None' if none_ok else ''}"
                                  f"{meaning}")


def number(owner: str, name: str, v: Any, *, positive: bool = False, none_ok: bool = False,
           meaning: str = "") -> None:
    """`v` is a finite real number (not a bool), > 0 when `positive` else >= 0 (or None where allowed)."""
    if v is None and none_ok:
        return
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and (v > 0 if positive
                                                                                           else v >= 0)
    if not ok:
        raise TierstoreValueError(f"{owner}({name}={v!r}): a finite number {'> 0' if positive else '>= 0'}"
                                  f"{' or None' if none_ok else ''}{meaning}")


def flag(owner: str, name: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise TierstoreValueError(f"{owner}({name}={v!r}): True or False")


# -- OffloadConfig ------------------------------------------------------------------------------------------
STATE_CODECS = (None, "dynamic8")
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CLIP_MODES = ("exact", "previous_norm")


def offload_config(config: Any) -> None:
    """Check an OffloadConfig's fields (its __post_init__), normalizing nvme_paths to a list."""
    for name in ("params", "optimizer_states", "gradients"):
        v = getattr(config, name)
        if v not in TIERS:
            raise TierstoreValueError(f"OffloadConfig({name}={v!r}): use one of {TIERS}")
    config.nvme_paths = nvme_paths(config.nvme_paths)
    if config.uses_nvme and not config.nvme_paths:
        raise TierstoreValueError("OffloadConfig: a tier is 'nvme' but nvme_paths is empty; pass "
                                  "nvme_paths=['/path/on/nvme'] (one directory per drive)")
    if config.state_codec not in STATE_CODECS:
        raise TierstoreValueError(f"OffloadConfig(state_codec={config.state_codec!r}): use None or 'dynamic8'")
    if config.compute_dtype not in COMPUTE_DTYPES:
        raise TierstoreValueError(f"OffloadConfig(compute_dtype={config.compute_dtype}): use torch.float32, "
                                  f"torch.bfloat16 or torch.float16")
    if config.gradient_dtype not in (torch.float32, config.compute_dtype):
        raise TierstoreValueError(f"OffloadConfig(gradient_dtype={config.gradient_dtype}): use torch.float32 or the "
                                  f"compute dtype ({config.compute_dtype})")
    r = config.reuse_bytes
    if r is not None and (not isinstance(r, int) or isinstance(r, bool) or r < 0):
        raise TierstoreValueError(f"OffloadConfig(reuse_bytes={r!r}): an integer >= 0 (0: off), or None "
                                  f"(2 x sub_group_bytes)")
    for name, least in (("prefetch_depth", 0), ("prefetch_bytes", 0), ("sub_group_bytes", 1), ("min_io_bytes", 0),
                        ("pinned_bytes", 1 << 20), ("pipeline_depth", 1), ("loss_scale_window", 1)):
        v = getattr(config, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise TierstoreValueError(f"OffloadConfig({name}={v!r}): an integer >= {least}")
    gc = config.gradient_clipping
    if gc is not None and (isinstance(gc, bool) or not isinstance(gc, int | float) or not gc >= 0):
        raise TierstoreValueError(f"OffloadConfig(gradient_clipping={gc!r}): a number >= 0 (0 or None: off)")
    h = config.hpz_partition_size
    if h != "node" and (not isinstance(h, int) or isinstance(h, bool) or h < 1):
        raise TierstoreValueError(f"OffloadConfig(hpz_partition_size={h!r}): an integer >= 1 (1: hpZ off) that "
                                  f"divides the world size, or 'node'")
    if config.clip_mode not in CLIP_MODES:
        raise TierstoreValueError(f"OffloadConfig(clip_mode={config.clip_mode!r}): use one of {CLIP_MODES}")
    if not isinstance(config.overlap_step, bool) and config.overlap_step != "auto":
        raise TierstoreValueError(f"OffloadConfig(overlap_step={config.overlap_step!r}): True, False or 'auto'")
    if config.overlap_step is True and config.compute_dtype == torch.float16:
        raise TierstoreValueError("OffloadConfig(overlap_step=True) with compute_dtype=torch.float16: the fp16 "
                                  "loss scaler must see every gradient (overflow) before any sub-group is "
                                  "stepped; use bfloat16, or overlap_step=False")
    if config.overlap_step is True and config.gradient_clipping and config.clip_mode == "exact":
        raise TierstoreValueError(f"OffloadConfig(overlap_step=True, gradient_clipping={config.gradient_clipping}): "
                                  f"exact clipping needs the global norm before any sub-group is stepped; add "
                                  f"clip_mode='previous_norm' (clip with the previous step's norm), or "
                                  f"overlap_step=False")
    if config.activation_offload not in (None, "host", "nvme"):
        raise TierstoreValueError(f"OffloadConfig(activation_offload={config.activation_offload!r}): use None, "
                                  "'host' or 'nvme'")
    if config.activation_mode not in ("all", "checkpoint"):
        raise TierstoreValueError(f"OffloadConfig(activation_mode={config.activation_mode!r}): use 'all' or "
                                  "'checkpoint'")
    if config.activation_offload == "nvme" and not config.nvme_paths:
        raise TierstoreValueError("OffloadConfig(activation_offload='nvme') needs nvme_paths=['/path/on/nvme']")
    c = config.activation_compress
    if c is not None:
        if config.activation_offload != "nvme":
            raise TierstoreValueError(f"OffloadConfig(activation_compress={c!r}) applies to "
                                      f"activation_offload='nvme'; leave it None otherwise")
        if c != "bf16":
            from ..quant import schemes
            try:
                schemes.get(c)
            except TierstoreValueError as e:
                raise TierstoreValueError(f"OffloadConfig(activation_compress={c!r}): None, 'bf16' or a "
                                          f"quantization scheme; {e}") from None
    if config.io_tuning is not None:
        from ..io import Tuning
        Tuning.coerce(config.io_tuning)  # a bad file is refused here, naming it
    for name in ("initial_loss_scale", "min_loss_scale"):
        number("OffloadConfig", name, getattr(config, name), positive=True)
    for name in ("quantized_weights", "quantized_gradients"):
        flag("OffloadConfig", name, getattr(config, name))
    if not isinstance(config.split_master, bool) and config.split_master != "auto":
        raise TierstoreValueError(f"OffloadConfig(split_master={config.split_master!r}): True, False or 'auto'")
    integer("OffloadConfig", "intra_node_size", config.intra_node_size, 1, none_ok=True,
                     meaning=" (ranks per node; None: all)")
    integer("OffloadConfig", "activation_budget_bytes", config.activation_budget_bytes, 0, none_ok=True,
                     meaning=" (bytes; None: no limit)")
    if not isinstance(config.extra, dict):
        raise TierstoreValueError(f"OffloadConfig(extra={config.extra!r}): a dict")


# the inner optimizer's arguments checked by name before torch sees them: name -> (check, what to pass)
def _nonneg(v) -> bool:
    if isinstance(v, torch.Tensor):
        return v.numel() == 1 and v.is_floating_point() and bool(v.detach().cpu() >= 0)
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _betas(v) -> bool:
    return isinstance(v, tuple | list) and len(v) == 2 and all(
        isinstance(b, int | float) and not isinstance(b, bool) and 0 <= b < 1 for b in v)


_OPTIMIZER_ARGS = {
    "lr": (_nonneg, "a learning rate: a finite number >= 0 (e.g. lr=3e-4), or a one-element float tensor"),
    "eps": (_nonneg, "a finite number >= 0 (e.g. eps=1e-8)"),
    "weight_decay": (_nonneg, "a finite number >= 0 (e.g. weight_decay=0.01)"),
    "momentum": (_nonneg, "a finite number >= 0 (e.g. momentum=0.9)"),
    "betas": (_betas, "two numbers in [0, 1), e.g. betas=(0.9, 0.999)"),
}


def optimizer_arguments(optimizer_class: type, kwargs: Mapping[str, Any], group_options: Sequence[Mapping],
                        device: torch.device) -> None:
    """Refuse arguments the inner optimizer would refuse (or misread), before the optimizer creates anything:
    the common ones by name (lr, betas, eps, weight_decay, momentum; in `kwargs` and in each param group's
    options), then whatever else the class itself refuses, by building it over one empty tensor per group
    (cheap: no state is made until a step)."""
    cls = optimizer_class.__name__
    for where, opts in [("", kwargs)] + [(f"param_groups[{i}] ", o) for i, o in enumerate(group_options)]:
        for name, (ok, want) in _OPTIMIZER_ARGS.items():
            if name in opts and not ok(opts[name]):
                raise TierstoreValueError(f"Zero3Optimizer({cls}, {where}{name}={opts[name]!r}): {name} must be "
                                          f"{want}")
    groups = [{**o, "params": [torch.zeros(0, device=device)]} for o in group_options] or \
        [{"params": [torch.zeros(0, device=device)]}]
    try:
        optimizer_class(groups, **kwargs)
    except (TypeError, ValueError, KeyError, RuntimeError) as e:
        raise TierstoreValueError(f"{cls} refused the arguments Zero3Optimizer passes it ({', '.join(kwargs)}"
                                  f"{' and the param_groups options' if any(group_options) else ''}): "
                                  f"{type(e).__name__}: {e}. Pass the arguments {cls} takes, with the values "
                                  f"it accepts") from e
