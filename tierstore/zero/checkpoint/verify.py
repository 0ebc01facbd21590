"""The two passes of load_checkpoint: verify everything, then import; and what a failure in either leaves.

[Note: a failed load changes nothing]
A load imports one destination sub-group at a time (memory: one source and one destination sub-group:
see [Note: streaming save and load] in load.py), so a record found damaged half-way through one pass
would leave the sub-groups before it loaded and the rest, `steps`, the hyperparameters and the buffers as
they were: a model that is neither run's. So a load runs its plan of imports twice. The first pass makes every read the
import will make -- the same records in the same order, each crc32c-checked, the client state, every
buffer -- and drops what it built without touching the optimizer; the ranks then exchange their outcomes,
so a damaged record on any rank fails the load on every rank before any rank changes anything ("the
optimizer is unchanged", in the error). The second pass reads the records again and imports them.
What can still fail in the second pass is what no check beforehand can rule out: the checkpoint's files
changing between the passes, a disk read failing, or the optimizer's own store failing while a record is
written into it (a full disk). The sub-groups imported before the failure cannot be put back (their old
values were overwritten in the store), so the optimizer is marked unusable on every rank: the error says
so, and every later step, save_checkpoint, state_dict, full_state_dict or gathered() raises a MisuseError
naming the failed load, until a load_checkpoint succeeds (or the optimizer is rebuilt). The records are
read twice; a load is rare and the page cache usually holds them the second time.
"""
from __future__ import annotations

import errno
from collections.abc import Callable, Iterable
from typing import Any

from ...errors import CorruptionError, TierstoreError, TierstoreIOError, TierstoreValueError
from .. import _dist

UNCHANGED = "nothing was loaded: the optimizer is unchanged"
UNUSABLE = ("the optimizer was partly loaded and is now unusable (some sub-groups hold the checkpoint's values, "
            "others the values from before): call load_checkpoint again once the cause is fixed, or build a new "
            "Zero3Optimizer")


def _with(e: BaseException, note: str) -> BaseException:
    """An exception like `e` (its class, errno, file, offset, length) whose message ends with `note`."""
    if isinstance(e, CorruptionError):
        return CorruptionError(f"{e.strerror}; {note}", e.filename, e.offset, e.length)
    if isinstance(e, TierstoreIOError):
        return TierstoreIOError(e.errno, f"{e.strerror}; {note}", e.filename, e.offset, e.length)
    if isinstance(e, TierstoreValueError):
        return TierstoreValueError(f"{e}; {note}")
    if isinstance(e, OSError) and e.errno:
        return TierstoreIOError(e.errno, f"{e.strerror}; {note}", e.filename)
    return TierstoreError(f"{type(e).__name__}: {e}; {note}")


def _outcome(rank: int, e: BaseException | None) -> list[tuple[int, int | None, str]]:
    return [] if e is None else [(rank, getattr(e, "errno", None), f"{type(e).__name__}: {e}")]


def _agree(opt, mine: BaseException | None, note: str) -> None:
    """Every rank's outcome of a pass, exchanged; raise on every rank if any rank failed, with `note`."""
    failures = [f for out in _dist.all_gather_object(_outcome(opt.rank, mine), opt.group) for f in out]
    if not failures:
        return
    if mine is not None:
        raise _with(mine, note) from mine
    rank, code, message = failures[0]
    text = f"load_checkpoint failed on rank {rank} ({message}); {note}"
    if code is None:
        raise TierstoreError(text)
    if code == errno.EBADMSG:
        raise CorruptionError(text)
    raise TierstoreIOError(code, text)


def verify_then_import(opt, plan: Callable[[], Iterable[Any]], apply: Callable[[Any], None]) -> None:
    """Run `plan()` once dropping every item it yields (every read checked), agree across ranks, then run it
    again handing each item to `apply`. See [Note: a failed load changes nothing]."""
    failed: BaseException | None = None
    try:
        for item in plan():
            del item  # dropped before the next is built: one destination sub-group in memory at a time
    except Exception as e:
        failed = e
    _agree(opt, failed, UNCHANGED)
    try:
        for item in plan():
            apply(item)
            del item  # as above
    except Exception as e:
        failed = e
    except BaseException:  # KeyboardInterrupt ...: no exchange (the other ranks may not be interrupted)
        opt.unusable = f"the load was interrupted; {UNUSABLE}"
        raise
    try:
        _agree(opt, failed, UNUSABLE)
    except BaseException as e:
        opt.unusable = str(e)
        raise
    opt.unusable = None
