"""What a Store is opened with, checked before anything is created: its directories and its size arguments.

[Note: a refused Store leaves the disk as it was]
Every argument of Store() is checked, and every part of a store that lives only in memory (the pinned pool,
the I/O engine, the device and host tiers) is built, before the first directory, lock file or manifest is
created: a bad `backend`, `device`, budget or path raises with the disk untouched.
"""
from __future__ import annotations

import os
from collections.abc import Iterable

from .errors import TierstoreValueError

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


def check_sizes(**sizes) -> None:
    """Every budget/size argument is an int (budgets may be None), none negative, the counts positive, the
    layout sizes multiples of 4 KiB."""
    may_be_none = {"host_budget", "device_budget", "nvme_budget"}
    positive = {"pinned_budget", "buffer_bytes", "queue_depth", "extent_file_bytes", "stripe_unit", "workers"}
    aligned = {"buffer_bytes", "extent_file_bytes", "stripe_unit"}
    for name, v in sizes.items():
        if v is None and name in may_be_none:
            continue
        count = name in ("queue_depth", "workers")
        unit = "" if count else " bytes"
        if isinstance(v, bool) or not isinstance(v, int):
            what = "an int" if count else "an int number of bytes (e.g. 1 << 30 for 1 GiB)"
            none = " or None (no limit)" if name in may_be_none else ""
            raise TierstoreValueError(f"{name}={v!r} must be {what}{none}, not a {type(v).__name__}")
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
