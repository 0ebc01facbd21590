"""The Zero3Optimizers that are open, weakly held: who manages a given parameter (clip.py, gathered.py), and
the one-optimizer-per-model rule.

[Note: one optimizer per model]
A Zero3Optimizer partitions its model's parameters (their ``.data`` emptied, their values in its store) and
installs its hooks on every module. A second one built on the same model (a notebook cell run twice) would
partition the emptied parameters and add a second set of hooks: both would gather, release and reduce, and
training would silently follow neither. So a model any of whose parameters an open optimizer manages is
refused up front, before anything is touched, with MisuseError naming that optimizer. ``close()`` removes
its hooks and takes it out of this registry, but the parameters stay empty (their values were in its store,
and putting a whole model back in memory is not what closing should do): a model whose parameters a closed
optimizer emptied is refused too. ``release_model(opt)`` closes it and gives the values back ([Note:
releasing a model] in release.py); then a new optimizer takes the model. The registry holds optimizers
weakly; an optimizer dropped without close() stays alive, and the model's owner, as long as the model does
(its hooks hold it), so ``optimizer_of(model)`` finds it to close it. An offload for inference
(inference/offload.py) hooks and empties a model the same way, so the rule covers it too: a model an open
optimizer or an open offload holds is refused by either.
"""
from __future__ import annotations

import threading
import weakref

import torch

from ...errors import MisuseError
from .partitioned import is_empty

_lock = threading.Lock()
_open: weakref.WeakSet = weakref.WeakSet()
_offloads: weakref.WeakSet = weakref.WeakSet()  # open OffloadedModels (inference/offload.py)
RELEASED = "_tierstore_released"  # attribute of a parameter a closed optimizer emptied: that optimizer's repr


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


def add_offload(handle) -> None:
    """Record an open offload for inference (it has ``managed_param_ids()``)."""
    with _lock:
        _offloads.add(handle)


def discard_offload(handle) -> None:
    with _lock:
        _offloads.discard(handle)


def open_optimizers() -> list:
    with _lock:
        return list(_open)


def owners(ids: set[int]) -> list:
    """The open optimizers managing any parameter whose id() is in `ids`."""
    return [o for o in open_optimizers() if not ids.isdisjoint(o.managed_param_ids())]


def optimizer_of(model: torch.nn.Module):
    """The open Zero3Optimizer that partitions `model`'s parameters (any of them), or None."""
    found = owners({id(p) for p in model.parameters()})
    return found[0] if found else None


def mark_released(params, closed_by: str) -> None:
    """An optimizer (repr `closed_by`) is closing: its `params` stay empty, their values gone with its store."""
    for p in params:
        if is_empty(p):
            setattr(p, RELEASED, closed_by)


def check_unowned(model: torch.nn.Module) -> None:
    """Refuse `model` per [Note: one optimizer per model]: another optimizer manages it, or a closed one
    emptied its parameters."""
    ids = {id(p) for p in model.parameters()}
    with _lock:
        offloads = [h for h in _offloads if not ids.isdisjoint(h.managed_param_ids())]
    if offloads:
        raise MisuseError(
            f"this model's weights are held by {offloads[0]!r}, an open offload for inference (its parameters are "
            f"empty and its hooks installed); close it first -- close(restore=True) puts the weights back in "
            f"memory -- then build the optimizer or the new offload")
    first = optimizer_of(model)
    if first is not None:
        raise MisuseError(
            f"this model is already partitioned by {first!r} (object at {id(first):#x}), which is open; one "
            f"Zero3Optimizer per model (two would both hook it, and training would follow neither). Keep using "
            f"that one (its settings can change through its param_groups), or hand the model back with "
            f"tierstore.zero.release_model(first) -- it closes that optimizer and puts the parameters' values "
            f"back into the model (every rank calls it) -- and build the new one then. "
            f"tierstore.zero.optimizer_of(model) returns that optimizer")
    for name, p in model.named_parameters():
        closed_by = getattr(p, RELEASED, None)
        if closed_by is not None and is_empty(p):
            raise MisuseError(
                f"parameter {name!r} of this model is empty: {closed_by} held it and was closed, and its values "
                f"went with it. Build the model again; to keep the values, hand a model back with "
                f"tierstore.zero.release_model(opt) instead of opt.close() (an offload for inference: "
                f"close(restore=True))")
