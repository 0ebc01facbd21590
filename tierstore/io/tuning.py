"""The engine's knobs as one recommendation: what `tierstore tune DIR` writes and `Engine.from_tuning(path)`,
`Store(..., io_tuning=path)` and `OffloadConfig(io_tuning=path)` read.

    {"format": "tierstore-io-tuning/1", "backend": "io_uring", "queue_depth": 32, "block_size": 1048576,
     "buffer_bytes": 4194304, "stripe_unit": 1048576, "workers": 2, "measured": {...}}

[Note: a tuning file only fills in defaults]
A knob passed explicitly (a value other than the parameter's default) wins over the file, so a tuning file
never silently overrides what the caller wrote. `stripe_unit` is the on-disk layout of a store's extent
files: it applies to a new store only; an existing store keeps the stripe unit its manifest was written with.
"""
from __future__ import annotations

import inspect
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..errors import TierstoreValueError
from .files import ALIGN

FORMAT = "tierstore-io-tuning/1"
BACKENDS = ("auto", "io_uring", "threads")


@dataclass(frozen=True)
class Tuning:
    """backend / queue_depth / block_size: the Engine's; buffer_bytes (the pool's buffers: the request size
    the nvme tier streams with), stripe_unit and workers: the Store's. `measured` keeps what tune measured
    (informative; nothing reads it)."""

    backend: str = "auto"
    queue_depth: int = 32
    block_size: int = 1 << 20  # bytes
    buffer_bytes: int = 4 << 20  # bytes
    stripe_unit: int = 1 << 20  # bytes
    workers: int = 2
    measured: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        self.check()

    def check(self, where: str = "Tuning") -> None:
        if self.backend not in BACKENDS:
            raise TierstoreValueError(f"{where}: backend={self.backend!r}; choose one of {BACKENDS}")
        for name, lo, hi, align in (("queue_depth", 1, 4096, 1), ("block_size", ALIGN, 1 << 30, ALIGN),
                                    ("buffer_bytes", ALIGN, 1 << 30, ALIGN), ("stripe_unit", ALIGN, 1 << 30, ALIGN),
                                    ("workers", 1, 256, 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi or v % align:
                unit = f", a multiple of {align} bytes" if align > 1 else ""
                raise TierstoreValueError(f"{where}: {name}={v!r} must be an int in {lo}..{hi}{unit}")

    # -- files --------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike) -> Tuning:
        """The tuning written to `path` by `tierstore tune` (or by hand); every field checked."""
        path = os.fspath(path)
        try:
            with open(path) as f:
                d = json.load(f)
        except OSError as e:
            raise TierstoreValueError(f"cannot read the tuning file {path}: {e.strerror}; write one with "
                                      "`tierstore tune DIR --out PATH`") from None
        except json.JSONDecodeError as e:
            raise TierstoreValueError(f"the tuning file {path} is not JSON ({e}); write it again with "
                                      "`tierstore tune DIR --out PATH`") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            got = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise TierstoreValueError(f"the tuning file {path} has format {got!r}, not {FORMAT!r}; write it "
                                      "again with `tierstore tune DIR --out PATH`")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known - {"format"})
        if unknown:
            raise TierstoreValueError(f"the tuning file {path} has unknown keys {unknown}; known: {sorted(known)}")
        try:
            return cls(**{k: v for k, v in d.items() if k in known})
        except TierstoreValueError as e:
            raise TierstoreValueError(f"the tuning file {path}: {str(e).removeprefix('Tuning: ')}") from None

    @classmethod
    def coerce(cls, value: Tuning | str | os.PathLike) -> Tuning:
        """A Tuning from itself or from the path of a tuning file."""
        if isinstance(value, Tuning):
            return value
        if isinstance(value, (str, os.PathLike)):
            return cls.load(value)
        raise TierstoreValueError(f"io_tuning={value!r}: give the path of a tuning file (`tierstore tune DIR`) "
                                  "or a tierstore.io.Tuning")

    def save(self, path: str | os.PathLike) -> None:
        """Write it as JSON (atomically: a temporary file renamed over `path`)."""
        path = os.fspath(path)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"format": FORMAT, **asdict(self)}, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)

    # -- what each layer takes ------------------------------------------------------------------------------
    def engine_kwargs(self) -> dict[str, Any]:
        return {"backend": self.backend, "queue_depth": self.queue_depth, "block_size": self.block_size}

    def fill(self, fn: Callable, given: dict[str, Any], *, layout: bool = True) -> dict[str, Any]:
        """`given` (knob -> value passed to `fn`) with every knob left at `fn`'s default replaced by this
        tuning's value (see [Note: a tuning file only fills in defaults]); stripe_unit only when `layout`."""
        params = inspect.signature(fn).parameters
        out = dict(given)
        for k, v in given.items():
            if k == "stripe_unit" and not layout:
                continue
            if hasattr(self, k) and k in params and v == params[k].default:
                out[k] = getattr(self, k)
        return out
