"""What a Store is opened with, checked before anything is created: its directories, its byte budgets (one
mapping, tier name -> bytes) and its size arguments.

[Note: a refused Store leaves the disk as it was]
Every argument of Store() is checked, and every part of a store that lives only in memory (the pinned pool,
the I/O engine, the device and host tiers) is built, before the first directory, lock file or manifest is
created: a bad `backend`, `device`, budget or path raises with the disk untouched.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping

from .errors import TierstoreTypeError, TierstoreValueError
from .tiers import TIERS

_ALIGN = 4096  # bytes: extent files and the pinned pool's buffers are aligned to it
_FIT = "the path of a directory as a str or pathlib.Path (created if missing)"


def store_paths(paths) -> list[str]:
    """The absolute directories `paths` names: a str or os.PathLike, or an iterable of them. bytes, None, an
    empty path or one with a NUL character are refused naming the argument."""
    if isinstance(paths, (str, os.PathLike, bytes)):
        items, single = [paths], True
    elif paths is None or not isinstance(paths, Iterable):
        raise TierstoreValueError(f"paths={paths!r} is not a directory: pass {_FIT}, or a list of them (one per "
                                  "drive)")
    else:
        items, single = list(paths), False
    out = []
    for i, p in enumerate(items):
        name = "paths" if single else f"paths[{i}]"
        raw = os.fspath(p) if isinstance(p, os.PathLike) else p
        if isinstance(raw, bytes):
            raise TierstoreValueError(f"{name}={p!r} is bytes: pass {_FIT} (decode it with os.fsdecode())")
        if not isinstance(raw, str):
            raise TierstoreValueError(f"{name}={p!r} is a {type(p).__name__}: pass {_FIT}")
        if not raw:
            raise TierstoreValueError(f"{name} is an empty path (it would mean the current directory): pass {_FIT}")
        if "\0" in raw:
            raise TierstoreValueError(f"{name}={raw!r} contains a NUL character, which no path can hold: pass {_FIT}")
        out.append(os.path.abspath(raw))
    if not out:
        raise TierstoreValueError("paths is empty: give at least one directory for the nvme tier")
    if len({os.path.realpath(p) for p in out}) != len(out):
        raise TierstoreValueError(f"paths={out} names a directory twice: give each directory once")
    for i, p in enumerate(out):
        if os.path.exists(p) and not os.path.isdir(p):
            raise TierstoreValueError(f"paths[{i}]={p!r} is a file, not a directory: give a directory (it is "
                                      "created if missing) for the extent files")
    return out


# [Note: one budget per tier name]
# Store(budgets={...}) maps a name to the bytes it may hold: each tier of the registry (tiers/base.py), plus
# "pinned", the page-locked staging pool every nvme transfer streams through. A name left out keeps its
# default; None means no limit (not for "pinned": its pool is allocated up front). The tiers look their
# budget up by their own name, so no code branches on a tier name to find one. A budget is a cap, not an
# allocation: "host" and "nvme" may exceed what the machine has today (a disk can grow, other tensors
# leave), but not MAX_BUDGET; "device" is checked against the device's memory (tiers/device.py) and
# "pinned" against this machine's memory (io/pool.py), both when the store is built.
BUDGET_NAMES = (*TIERS[:-1], "pinned", TIERS[-1])  # fastest first: device, host, pinned, nvme
DEFAULT_BUDGETS: dict[str, int | None] = {"device": 0, "host": 256 << 20, "pinned": 64 << 20, "nvme": None}
MAX_BUDGET = 1 << 60  # bytes (1 EiB): more than a file offset reaches or any machine holds
_OLD_KEYWORDS = {f"{name}_budget": name for name in BUDGET_NAMES}  # device_budget= ... -> budgets["device"]


def store_budgets(budgets, old: dict) -> dict[str, int | None]:
    """The byte budget of every name in BUDGET_NAMES: `budgets` (a mapping, names left out keep
    DEFAULT_BUDGETS) merged with the deprecated keywords device_budget= / host_budget= / pinned_budget= /
    nvme_budget= (`old`, translated here and only here, with a DeprecationWarning). Any other keyword in
    `old` is refused as Python would, a wrong name or value naming the valid ones."""
    unknown = sorted(set(old) - set(_OLD_KEYWORDS))
    if unknown:
        raise TierstoreTypeError(f"Store() got an unexpected keyword argument {unknown[0]!r}; its byte budgets "
                                 f"go in budgets={{name: bytes}} with names {BUDGET_NAMES}")
    if budgets is not None and not isinstance(budgets, Mapping):
        raise TierstoreTypeError(f"budgets={budgets!r} must be a mapping tier name -> bytes (or None for no "
                                 f"limit), e.g. budgets={{'host': 1 << 30, 'nvme': None}}; names: {BUDGET_NAMES}")
    given = dict(budgets or {})
    if old:
        translated = {_OLD_KEYWORDS[k]: v for k, v in old.items()}
        words = ", ".join(f"{k}=" for k in old)
        mapping = ", ".join(f"{n!r}: ..." for n in translated)
        warnings.warn(f"Store({words}) is deprecated: pass budgets={{{mapping}}}", DeprecationWarning, stacklevel=3)
        both = sorted(set(translated) & set(given))
        if both:
            raise TierstoreValueError(f"the {both[0]!r} budget is given twice, in budgets= and as "
                                      f"{both[0]}_budget=: pass it once, in budgets=")
        given.update(translated)
    for name, v in given.items():
        if name not in BUDGET_NAMES:
            raise TierstoreValueError(f"budgets has no tier named {name!r}: the names are {BUDGET_NAMES} "
                                      "(device memory, page-locked host copies, the pinned staging pool, nvme "
                                      "extents)")
        where = f"budgets[{name!r}]={v!r}"
        if isinstance(v, bool) or not (v is None or isinstance(v, int)):
            none = "" if name == "pinned" else " or None (no limit)"
            raise TierstoreTypeError(f"{where} must be an int number of bytes (e.g. 1 << 30 for 1 GiB){none}, "
                                     f"not a {type(v).__name__}")
        if v is None and name == "pinned":
            raise TierstoreValueError(f"{where}: the pinned pool is allocated when the store opens, so it needs "
                                      "a size in bytes (64-256 MiB keeps the disk busy)")
        if v is not None and (v < 0 or (v == 0 and name == "pinned")):
            raise TierstoreValueError(f"{where} must be {'>= 1' if name == 'pinned' else '>= 0'} bytes")
        if v is not None and v > MAX_BUDGET:
            none = "" if name == "pinned" else ", or None for no limit"
            raise TierstoreValueError(f"{where} bytes is more than any machine holds: pass at most 1 << 60 "
                                      f"bytes{none}")
    return {name: given.get(name, DEFAULT_BUDGETS.get(name)) for name in BUDGET_NAMES}


def check_sizes(**sizes) -> None:
    """Every size argument is an int, none negative, the counts positive, the layout sizes multiples of
    4 KiB. (The budgets are checked by store_budgets.)"""
    positive = {"buffer_bytes", "queue_depth", "extent_file_bytes", "stripe_unit", "workers"}
    aligned = {"buffer_bytes", "extent_file_bytes", "stripe_unit"}
    for name, v in sizes.items():
        count = name in ("queue_depth", "workers")
        unit = "" if count else " bytes"
        if isinstance(v, bool) or not isinstance(v, int):
            what = "an int" if count else "an int number of bytes (e.g. 1 << 30 for 1 GiB)"
            raise TierstoreValueError(f"{name}={v!r} must be {what}, not a {type(v).__name__}")
        if v < 0 or (v == 0 and name in positive):
            raise TierstoreValueError(f"{name}={v} must be {'>= 1' if name in positive else '>= 0'}{unit}")
        if name in aligned and v % _ALIGN:
            raise TierstoreValueError(f"{name}={v} must be a multiple of {_ALIGN} bytes (e.g. "
                                      f"{max(v // _ALIGN, 1) * _ALIGN})")
        if name in ("extent_file_bytes", "stripe_unit") and v > 1 << 60:
            raise TierstoreValueError(f"{name}={v} is more than a file offset can reach: pass at most 1 << 60 "
                                      "bytes (the defaults: 16 GiB extent files, 1 MiB stripes)")
        if name == "workers" and v > 256:
            raise TierstoreValueError(f"workers={v} must be in 1..256 (threads moving tensors between tiers)")


def check_flag(name: str, v) -> None:
    if not isinstance(v, bool):
        raise TierstoreValueError(f"{name}={v!r} must be True or False")
