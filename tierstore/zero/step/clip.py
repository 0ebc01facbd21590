"""torch's gradient clipping functions on a ZeRO-3 model's parameters, routed to the optimizer that owns them.

[Note: clipping through torch's functions]
A managed parameter's gradient lives in this rank's partition in the store; ``.grad`` is None. torch's
``clip_grad_norm_(model.parameters(), max_norm)`` -- which accelerate's ``Accelerator.clip_grad_norm_`` and
transformers' Trainer (``max_grad_norm``) call -- would find no gradient, return 0 and clip nothing. So while
a Zero3Optimizer is open, ``torch.nn.utils.clip_grad_norm_`` (also ``torch.nn.utils.clip_grad.clip_grad_norm_``,
which the deprecated ``clip_grad_norm`` calls), ``clip_grad_value_`` and ``clip_grads_with_norm_`` are
wrapped: given parameters none of which a Zero3Optimizer manages, they are torch's own functions, unchanged.
Given the parameters of one optimizer -- every trainable parameter it manages (any order, repeats and its
frozen parameters allowed) and nothing else with a gradient -- they become that optimizer's exact global
operation over every rank's partition: ``opt.clip_grad_norm_`` (the L2 norm of all gradients; the returned
norm is the total before clipping, as torch's), ``opt.clip_grad_value_`` (clamps the partitions) and, for
``clip_grads_with_norm_``, the clip coefficient of the given norm. A strict subset of an optimizer's
trainable parameters, a mix with other parameters that have gradients, or parameters of two optimizers
raise TierstoreValueError: the norm of a subset is not what the partitions can give exactly, and a silent 0
is the bug this exists to prevent. Code that imported the function object before the first optimizer was
built (``from torch.nn.utils import clip_grad_norm_`` at module level) holds torch's original: call
``opt.clip_grad_norm_`` there. ``torch.nn.utils.get_total_norm`` takes gradients, not parameters, so it
cannot be routed: a list of the managed parameters' ``.grad`` is a list of None.
The wrappers stay installed while any Zero3Optimizer is open and are removed when the last one closes.
"""
from __future__ import annotations

import threading
import types

import torch

from ...errors import TierstoreValueError
from ..params import registry

_lock = threading.Lock()
_saved: dict[tuple[types.ModuleType, str], object] = {}  # (module, attribute) -> torch's function


def register(opt) -> None:
    """`opt` is open: install the wrappers if they are not."""
    with _lock:
        registry.add(opt)
        if not _saved:
            _install()


def unregister(opt) -> None:
    """`opt` closed: remove the wrappers with the last one."""
    with _lock:
        if registry.discard(opt) == 0 and _saved:
            for (mod, attr), fn in _saved.items():
                setattr(mod, attr, fn)
            _saved.clear()


def _install() -> None:
    import torch.nn.utils as U
    import torch.nn.utils.clip_grad as C
    orig_norm, orig_value, orig_with_norm = C.clip_grad_norm_, C.clip_grad_value_, U.clip_grads_with_norm_

    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        opt = _owner(params, "clip_grad_norm_") if params else None
        if opt is None:
            return orig_norm(params if params else parameters, max_norm, norm_type, error_if_nonfinite, foreach)
        return opt.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)

    def clip_grad_value_(parameters, clip_value, foreach=None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        opt = _owner(params, "clip_grad_value_") if params else None
        if opt is None:
            return orig_value(params, clip_value, foreach)
        return opt.clip_grad_value_(clip_value)

    def clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        opt = _owner(params, "clip_grads_with_norm_") if params else None
        if opt is None:
            return orig_with_norm(params, max_norm, total_norm, foreach)
        return opt.clip_grads_with_norm_(max_norm, total_norm)

    for fn, orig in ((clip_grad_norm_, orig_norm), (clip_grad_value_, orig_value),
                     (clip_grads_with_norm_, orig_with_norm)):
        fn.__doc__ = ("tierstore: routed to the Zero3Optimizer that manages the parameters (see tierstore/zero/"
                      f"clip.py); otherwise torch's.\n\n{orig.__doc__ or ''}")
        setattr(fn, "__wrapped__", orig)  # noqa: B010  # inspect.signature shows torch's
    for mod, attr, fn in ((C, "clip_grad_norm_", clip_grad_norm_), (U, "clip_grad_norm_", clip_grad_norm_),
                          (C, "clip_grad_value_", clip_grad_value_), (U, "clip_grad_value_", clip_grad_value_),
                          (U, "clip_grads_with_norm_", clip_grads_with_norm_)):
        _saved[(mod, attr)] = getattr(mod, attr)
        setattr(mod, attr, fn)


def _owner(params: list, what: str):
    """The open Zero3Optimizer whose parameters `params` are, None when no optimizer manages any of them;
    raises where the answer could not be exact ([Note: clipping through torch's functions])."""
    ids = {id(p) for p in params}
    owners = registry.owners(ids)
    if not owners:
        return None
    if len(owners) > 1:
        raise TierstoreValueError(f"torch.nn.utils.{what} was given parameters of {len(owners)} Zero3Optimizers; "
                                  f"call it once per optimizer (opt.{what} on each)")
    opt = owners[0]
    managed = opt.managed_param_ids()
    others = [p for p in params if id(p) not in managed and getattr(p, "grad", None) is not None]
    if others:
        raise TierstoreValueError(
            f"torch.nn.utils.{what} was given parameters managed by a Zero3Optimizer (their gradients live in "
            f"its partitions) mixed with {len(others)} other parameter(s) that have a .grad; no exact global norm "
            f"covers both. Clip each set on its own: opt.{what}(...) for the ZeRO-3 model, torch for the rest")
    missing = opt.trainable_param_ids() - ids
    if missing:
        raise TierstoreValueError(
            f"torch.nn.utils.{what} was given {len(ids & managed)} of the {len(opt.trainable_param_ids())} trainable "
            f"parameters a Zero3Optimizer manages; it can only clip all of them (their gradients are partitioned "
            f"together). Pass model.parameters(), or call opt.{what}(...)")
    return opt
