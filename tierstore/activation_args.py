"""The arguments of ActivationOffload, every one checked before anything is created (a directory, a store,
a thread): a wrong one is a TierstoreValueError naming it and what to pass instead."""
from __future__ import annotations

import os
from collections.abc import Sequence

from .errors import TierstoreValueError
from .io.pool import check_pinned_budget

MODES = ("all", "checkpoint")
TIERS = ("host", "nvme")
BF16 = "bf16"


def _bytes(name: str, v, least: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
        raise TierstoreValueError(f"ActivationOffload({name}={v!r}): an int number of bytes >= {least}")


def _paths(paths) -> list[str] | None:
    """`paths` as a list of absolute str paths (None: none given)."""
    if paths is None:
        return None
    given = [paths] if isinstance(paths, (str, os.PathLike)) else paths
    if isinstance(given, (bytes, str)) or not isinstance(given, Sequence) or not given:
        raise TierstoreValueError(f"ActivationOffload(paths={repr(paths)[:60]}): a directory (str or pathlib.Path) "
                                  "or a non-empty list of them, or None for a temporary directory")
    out = []
    for p in given:
        s = os.fspath(p) if isinstance(p, os.PathLike) else p
        if not isinstance(s, str) or not s or "\0" in s:
            raise TierstoreValueError(f"ActivationOffload(paths=...): {repr(p)[:60]} is not a directory path: give "
                                      "each as a non-empty str or pathlib.Path ('.' for the current directory)")
        out.append(os.path.abspath(s))
    return out


def check(tier, paths, store, mode, budget_bytes, min_bytes, prefetch_bytes, write_behind_bytes, compress,
          pinned_bytes, prefix, small_batch_bytes) -> list[str] | None:
    """Check every argument of ActivationOffload; returns `paths` as absolute str paths (None: none given)."""
    if tier not in TIERS:
        raise TierstoreValueError(f"ActivationOffload(tier={tier!r}): use 'host' or 'nvme'")
    if mode not in MODES:
        raise TierstoreValueError(f"ActivationOffload(mode={mode!r}): use 'all' (every saved tensor) or "
                                  "'checkpoint' (only the inputs torch.utils.checkpoint keeps)")
    for name, v, least in (("min_bytes", min_bytes, 0), ("prefetch_bytes", prefetch_bytes, 0),
                           ("write_behind_bytes", write_behind_bytes, 0),
                           ("small_batch_bytes", small_batch_bytes, 0),
                           ("pinned_bytes", pinned_bytes, 1 << 20)):
        _bytes(name, v, least)
    if budget_bytes is not None and (isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int)
                                     or budget_bytes < 0):
        raise TierstoreValueError(f"ActivationOffload(budget_bytes={budget_bytes!r}): an int number of bytes "
                                  ">= 0, or None for no limit")
    if compress is not None:
        if tier != "nvme":
            raise TierstoreValueError(f"ActivationOffload(compress={compress!r}) applies to the nvme tier; "
                                      "with tier='host' leave compress=None")
        if compress != BF16:
            from .quant import schemes
            schemes.get(compress)  # raises naming the registered schemes
    if not isinstance(prefix, str):
        raise TierstoreValueError(f"ActivationOffload(prefix={prefix!r}): a str, the start of the names of its "
                                  "records in the store (default 'act/')")
    if store is not None:
        from .store import Store
        if not isinstance(store, Store):
            raise TierstoreValueError(f"ActivationOffload(store={type(store).__name__}): an open tierstore.Store, "
                                      "or None for a store of its own")
        return None  # paths and pinned_bytes are the given store's own
    check_pinned_budget(pinned_bytes, f"ActivationOffload(pinned_bytes={pinned_bytes})")
    return _paths(paths)
