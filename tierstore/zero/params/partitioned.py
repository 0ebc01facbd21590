"""What a partitioned parameter says about itself outside a gather: its real size, and an error for a read.

[Note: partitioned parameters read true]
Outside of use a managed parameter's values are its buckets' shards in the store and its ``.data`` is empty
([Note: gather and release] in hooks/coordinator.py). Counting through it -- ``model.num_parameters()``, ``sum(p.numel()
for p in model.parameters())``, the parameter count transformers' Trainer logs -- would see 0, and reading it
(a callback's ``weight.sum()``) would compute on an empty tensor: silently wrong numbers. So a released
parameter is a ``PartitionedParameter`` (the same object, its class switched; a parameter of another class,
with a layout of its own, keeps its class): its ``__torch_function__`` answers questions about its metadata
-- shape, size, dim, numel, nelement, nbytes, dtype, device, requires_grad, hooks -- as the full parameter
would, without reading anything, and any use that needs its values raises MisuseError naming
``GatheredParameters``, the way to read or change it outside the model's forward. When its buckets are
gathered (forward, backward, ``GatheredParameters``, ``opt.gathered()``) it is a plain Parameter again, so
the model's compute never goes through the check. Not checked, and so still the empty tensor: ``.data``
(the optimizer sets and reads it), ``.to()`` (``Module.to`` converts every parameter; the model's guard in
model_guard.py refuses a cast the optimizer cannot follow), ``.half()`` / ``.float()`` / ``.cpu()`` and their
kind to the parameter's own dtype or device (the parameter itself, as torch returns), the gradients
``torch.autograd.grad`` / ``backward`` take with respect to it (its hooks gather it), the storage
(``untyped_storage()``, ``data_ptr()``: memory accounting, not values), and the ``detach()``
of torch's ``Module._save_to_state_dict`` (the state-dict hooks replace what it returns by full values).
"""
from __future__ import annotations

import sys
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from ...errors import MisuseError

_SHAPE = "_tierstore_shape"  # the full shape, kept on the parameter while it is partitioned


class PartitionedParameter(torch.nn.Parameter):
    """A parameter a Zero3Optimizer partitions, between gathers. See [Note: partitioned parameters read
    true]."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first: Any = args[0] if args else None  # a PartitionedParameter whenever shape is set below
        shape = getattr(first, _SHAPE, None) if isinstance(first, PartitionedParameter) else None
        if shape is not None:
            meta = _META.get(func)
            if meta is not None:
                with torch._C.DisableTorchFunctionSubclass():
                    return meta(first, shape, args, kwargs)
            if func in _PASS or (func is _T.detach and sys._getframe(1).f_code is _SAVE):
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
            same = _SAME.get(func)
            if same is not None and not kwargs and len(args) == 1:
                with torch._C.DisableTorchFunctionSubclass():
                    if same(first):
                        return first
            if func is torch.Tensor.__repr__:
                return (f"PartitionedParameter(shape={tuple(shape)}, dtype={first.dtype}; "
                        "partitioned by a Zero3Optimizer)")
        if func not in _AUTOGRAD:  # a gradient with respect to it reads no values: its hooks gather them
            for t in _partitioned_in((args, kwargs)):
                raise _misuse(t, func)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def func_name(func) -> str:
    """What a ``__torch_function__`` call is, for an error message."""
    owner = getattr(func, "__self__", None)  # a property's __get__ / __set__: name the property
    if owner is not None and hasattr(owner, "__name__"):
        return f"Tensor.{owner.__name__}"
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def _misuse(p: torch.Tensor, func) -> MisuseError:
    what = func_name(func)
    return MisuseError(
        f"{what} on a parameter of shape {tuple(getattr(p, _SHAPE))} that a Zero3Optimizer partitions: outside "
        f"the model's forward and backward its values are shards in the store. Read it inside `with "
        f"tierstore.zero.GatheredParameters([param]):` (add modifier_rank=0 to keep changes), or take "
        f"opt.full_state_dict() / model.state_dict()")


def _size(p, shape, args, kwargs):
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return shape if dim is None else shape[dim]


_T = torch.Tensor
# torch's Module._save_to_state_dict detaches every parameter; the optimizer's state-dict hooks then put the
# full values in ([Note: a partitioned model's state dict] in module_state.py)
_SAVE = torch.nn.Module._save_to_state_dict.__code__
_META = {_T.shape.__get__: lambda p, s, a, k: s, _T.size: _size,  # type: ignore[attr-defined]
         _T.dim: lambda p, s, a, k: len(s), _T.ndimension: lambda p, s, a, k: len(s),
         _T.ndim.__get__: lambda p, s, a, k: len(s),  # type: ignore[attr-defined]
         _T.numel: lambda p, s, a, k: s.numel(), _T.nelement: lambda p, s, a, k: s.numel(),
         _T.nbytes.__get__: lambda p, s, a, k: s.numel() * p.element_size(),  # type: ignore[attr-defined]
         _T.__len__: lambda p, s, a, k: s[0]}
_PASS = {getattr(_T, n).__get__ if isinstance(getattr(_T, n, None), type(_T.device)) else getattr(_T, n)
         for n in ("device", "dtype", "requires_grad", "is_leaf", "grad", "grad_fn", "layout", "is_meta", "is_cuda",
                   "is_sparse", "is_quantized", "is_floating_point", "is_complex", "element_size", "itemsize",
                   "get_device", "__hash__", "register_hook", "register_post_accumulate_grad_hook",
                   "requires_grad_", "data", "to", "untyped_storage", "data_ptr", "_backward_hooks",
                   "_post_accumulate_grad_hooks", "__reduce_ex__")
         if hasattr(_T, n)}
_PASS.update({getattr(_T, n).__set__ for n in ("requires_grad", "grad", "data")})
_PASS.add(torch._has_compatible_shallow_copy_type)
_AUTOGRAD = {torch.autograd.grad, torch.autograd.backward, _T.backward}
# the casts Module.half() / .bfloat16() / .float() / .cpu() make: to the parameter's own dtype or device they
# are the parameter itself (the model's guard lets Module's only to the optimizer's); any other reads values
_SAME = {_T.half: lambda p: p.dtype == torch.float16, _T.bfloat16: lambda p: p.dtype == torch.bfloat16,
         _T.float: lambda p: p.dtype == torch.float32, _T.double: lambda p: p.dtype == torch.float64,
         _T.cpu: lambda p: p.device.type == "cpu", _T.cuda: lambda p: p.device.type == "cuda"}


def _partitioned_in(obj):
    """The partitioned parameters among the leaves of `obj` (nested lists, tuples, dicts)."""
    return [t for t in tree_leaves(obj) if isinstance(t, PartitionedParameter) and hasattr(t, _SHAPE)]


def partition(p: torch.Tensor, empty: torch.Tensor, shape: tuple[int, ...]) -> None:
    """`p`'s values went to the store: ``.data`` becomes `empty` and `p` reads as its full `shape`."""
    p.data = empty
    setattr(p, _SHAPE, torch.Size(shape))
    if type(p) is torch.nn.Parameter:
        p.__class__ = PartitionedParameter


def unpartition(p: torch.Tensor) -> None:
    """`p` is about to hold its values again: a plain Parameter (before ``.data`` is set)."""
    if type(p) is PartitionedParameter:
        p.__class__ = torch.nn.Parameter  # type: ignore[assignment]
    if _SHAPE in p.__dict__:
        delattr(p, _SHAPE)


def is_empty(p: torch.Tensor) -> bool:
    """Whether `p` holds no values (partitioned, or emptied by a closed optimizer)."""
    with torch._C.DisableTorchFunctionSubclass():
        return p.data.numel() == 0
