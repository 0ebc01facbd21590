"""The Zero3Optimizers that are open, weakly held: who manages a given parameter (clip.py, gathered.py)."""
from __future__ import annotations

import threading
import weakref

_lock = threading.Lock()
_open: weakref.WeakSet = weakref.WeakSet()


def add(opt) -> int:
    """Record `opt` as open; returns how many are open now."""
    with _lock:
        _open.add(opt)
        return len(_open)


def discard(opt) -> int:
    """`opt` closed; returns how many are still open."""
    with _lock:
        _open.discard(opt)
        return len(_open)


def open_optimizers() -> list:
    with _lock:
        return list(_open)


def owners(ids: set[int]) -> list:
    """The open optimizers managing any parameter whose id() is in `ids`."""
    return [o for o in open_optimizers() if not ids.isdisjoint(o.managed_param_ids())]
