"""What the usual whole-model operations do to a ZeRO-3 model: a cast or a move (``model.to``, ``.half()``),
``copy.deepcopy`` and ``resize_token_embeddings``.

[Note: whole-model operations on a ZeRO-3 model]
A managed parameter's value lives in the optimizer's store in the compute dtype, on the optimizer's
device; its ``.data`` is an empty placeholder outside a gather ([Note: gather and release] in hooks/coordinator.py).
Three operations users apply to a model would, left alone, go wrong without a word or with someone else's
error, so the optimizer gives every module of its model instance-level replacements (taken back by
``close()`` and ``release_model``):

- ``_apply`` (what ``to``, ``half``, ``bfloat16``, ``float``, ``double``, ``cuda``, ``cpu``, ``type`` call):
  torch would replace the empty placeholder and the next gather would put the compute dtype back -- the cast
  silently ignored. Before anything is touched, the function is tried on an empty tensor of each managed
  parameter's compute dtype and device; one that keeps both (``model.to(opt.device)``, which Trainer and
  accelerate call, or a cast of the buffers alone) runs as torch's own; one that changes either raises
  MisuseError naming the way that works: ``OffloadConfig(compute_dtype=...)`` when the optimizer is built
  (its fp32 masters are kept either way), moving the model before building it, or
  ``tierstore.zero.release_model(opt)`` first.
- ``__deepcopy__``: torch would copy the optimizer along with the hooks that reach it (and fail on its
  locks). ``copy.deepcopy`` of the model, or of any of its modules, gives an independent plain model in
  memory -- what an EMA copy or a frozen reference model needs: every managed parameter gathered in full
  (as ``state_dict()`` gathers it, one bucket at a time), in the compute dtype, on the optimizer's device,
  with its ``requires_grad``; tied parameters stay tied; buffers and everything else are copied as torch
  copies them; the optimizer's hooks, its ``zero_grad`` and its ``load_state_dict`` are left behind (the
  user's own hooks are copied). The copy is not partitioned: the whole model is in that device's memory,
  once. At world size N it is a collective, like ``state_dict()``: every rank copies the same module.
  Inside the model's forward or backward it raises.
- ``resize_token_embeddings`` (transformers): the partition layout fixed every parameter's shape when the
  optimizer was built, so a resize cannot keep the new rows in the partitions and the optimizer; it raises
  MisuseError naming the order that works: resize, then build the optimizer (or ``release_model(opt)``,
  resize, and build a new one).
- ``_ddp_params_and_buffers_to_ignore``: wrapping the model in DistributedDataParallel raises, naming the
  supported calls ([Note: DistributedDataParallel around a ZeRO-3 model] below).
"""
from __future__ import annotations

import copy
import functools
import threading
import weakref
from typing import Any

import torch

from ...errors import MisuseError


def install(ms) -> list:
    """Give every module of `ms.model` (ms: the optimizer's ModuleState) the replacements of [Note: whole-model
    operations on a ZeRO-3 model]; returns handles whose remove() takes them back."""
    guard = _Guard(ms)
    handles = []
    for m in ms.model.modules():
        values = {"_apply": _bound(guard.apply, m), "__deepcopy__": _bound(guard.deepcopy, m),
                  _DDP_IGNORE: _RefuseDataParallel()}
        if callable(getattr(type(m), "resize_token_embeddings", None)):
            values["resize_token_embeddings"] = _bound(guard.resize, m)
        for name, value in values.items():
            h = _Attr(m, name, value)
            guard.attrs[(id(m), name)] = h
            handles.append(h)
    return handles


def _bound(fn, module: torch.nn.Module):
    """fn(module, *args) with the module held weakly (the module's own attribute must not keep it alive twice)."""
    ref = weakref.ref(module)

    def call(*args, **kwargs):
        return fn(ref(), *args, **kwargs)

    return call


_MISSING = object()


class _Attr:
    """Sets an instance attribute of a module; remove() puts back what was there, if it is still the one set."""

    def __init__(self, module: torch.nn.Module, name: str, value):
        self.module, self.name, self.value = weakref.ref(module), name, value
        self.previous = module.__dict__.get(name, _MISSING)
        module.__dict__[name] = value

    def remove(self) -> None:
        m = self.module()
        if m is None or m.__dict__.get(self.name) is not self.value:
            return
        if self.previous is _MISSING:
            del m.__dict__[self.name]
        else:
            m.__dict__[self.name] = self.previous


# [Note: DistributedDataParallel around a ZeRO-3 model]
# DDP all-reduces every parameter's gradient into a bucket laid out at the parameters' shapes when it wraps
# the model; a managed parameter's shape then is the empty placeholder's, and its gradient arrives full
# ("returned an invalid gradient") -- and ZeRO-3 reduce-scatters the gradients into its partitions itself, so
# a second reduction would be wrong even if the shapes agreed. DDP reads the names it should leave alone
# from the module's ``_ddp_params_and_buffers_to_ignore`` when it is built (accelerate's ``prepare`` and
# Trainer build it the same way); every module of a ZeRO-3 model carries there an object that refuses to
# be read, so the wrap itself raises MisuseError naming the supported call, before DDP touches anything.
_DDP_IGNORE = "_ddp_params_and_buffers_to_ignore"


class _RefuseDataParallel:
    """What a ZeRO-3 model's modules hold under ``_ddp_params_and_buffers_to_ignore``: reading it raises. See
    [Note: DistributedDataParallel around a ZeRO-3 model]."""

    def __iter__(self):
        raise MisuseError(
            "torch.nn.parallel.DistributedDataParallel (or another wrapper that all-reduces gradients) around a "
            "model whose parameters a Zero3Optimizer partitions: ZeRO-3 already reduce-scatters every gradient "
            "into its partitions over the optimizer's process group, so use the model unwrapped -- in a "
            "training loop call it directly (each rank its own batch, as with DDP); with accelerate call "
            "tierstore.integrations.accelerate.prepare(accelerator, model, opt, *loaders_and_schedulers) in "
            "place of accelerator.prepare(model, opt, ...); with transformers' Trainer use "
            "tierstore.integrations.trainer.TierstoreTrainer")

    def __repr__(self) -> str:
        return "<refused: this model is partitioned by a Zero3Optimizer>"


class _Guard:
    def __init__(self, ms):
        self.ms = ms
        self._local = threading.local()  # depth of a running _apply: children's calls are checked once
        self.attrs: dict[tuple[int, str], _Attr] = {}  # (id(module), name) -> the instance attribute set
        self._ours: dict[int, set[int]] | None = None  # see _without_optimizer
        self._forwards: set[int] = set()  # id() of the modules given an instance forward by the coordinator

    # -- to() / half() ---------------------------------------------------------------------------------
    def apply(self, module: torch.nn.Module, fn, recurse: bool = True):
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            self._check_cast(module, fn)
        self._local.depth = depth + 1
        try:
            return type(module)._apply(module, fn, recurse)
        finally:
            self._local.depth = depth

    def _check_cast(self, module: torch.nn.Module, fn) -> None:
        ms = self.ms
        seen: set[tuple[torch.dtype, torch.device]] = set()
        for p in _managed(ms, module):
            dtype = ms.layout.specs[ms._name_of[id(p)]][1]
            if (dtype, ms.device) in seen:
                continue
            seen.add((dtype, ms.device))
            probe = torch.empty(0, dtype=dtype, device=ms.device)
            out = fn(probe)
            if not isinstance(out, torch.Tensor) or (out.dtype, out.device) == (dtype, probe.device):
                continue
            if out.dtype != dtype:
                raise MisuseError(
                    f"this cast (to {out.dtype}) of a model whose parameters a Zero3Optimizer holds in its "
                    f"compute dtype {dtype} would be ignored: the parameters live in the optimizer's store, and "
                    f"every gather gives them back in {dtype}. Choose the dtype when the optimizer is built: "
                    f"OffloadConfig(compute_dtype={_spell(out.dtype)}) (the fp32 masters are kept either way); or "
                    f"hand the model back with tierstore.zero.release_model(opt) first and cast it then")
            raise MisuseError(
                f"this move (to {out.device}) of a model whose parameters a Zero3Optimizer keeps for the device "
                f"{probe.device} would be ignored: the parameters live in the optimizer's store, and every gather "
                f"puts them on {probe.device}. Move the model before building the optimizer; or hand it back with "
                f"tierstore.zero.release_model(opt) first and move it then")

    # -- copy.deepcopy ---------------------------------------------------------------------------------
    def deepcopy(self, module: torch.nn.Module, memo: dict | None = None) -> torch.nn.Module:
        memo = {} if memo is None else memo
        ms = self.ms
        missing = [p for p in _managed(ms, module) if id(p) not in memo]
        if missing:  # the outermost module copied: its whole subtree's values, gathered once
            ms.check_idle("copy.deepcopy")
            values = ms.gather_values([ms._name_of[id(p)] for p in missing])
            for p in missing:
                v = values.pop(ms._name_of[id(p)]).to(ms.device)
                memo[id(p)] = torch.nn.Parameter(v, requires_grad=p.requires_grad)
                memo.setdefault(id(memo), []).append(p)  # keep the original alive while memo is (as copy does)
        rv: Any = module.__reduce_ex__(4)  # (callable, args, state, ...) for a Module
        func, args, state = rv[0], rv[1], rv[2]
        new = func(*copy.deepcopy(args, memo))
        memo[id(module)] = new
        if isinstance(state, dict):
            state = self._without_optimizer(module, state)
        state = copy.deepcopy(state, memo)
        if hasattr(new, "__setstate__"):
            new.__setstate__(state)
        else:
            new.__dict__.update(state)
        return new

    def _without_optimizer(self, module: torch.nn.Module, state: dict) -> dict:
        """`module`'s state without what the optimizer put there: its hooks and instance attributes."""
        if self._ours is None:  # the optimizer's hooks, installed once: id(hooks dict) -> hook ids
            self._ours, self._forwards = {}, set()
            for h in list(self.ms.coordinator._handles) + list(self.ms._handles):
                for ref in (getattr(h, "hooks_dict_ref", None), *getattr(h, "extra_dict_ref", ())):
                    d = ref() if ref is not None else None
                    if d is not None:
                        self._ours.setdefault(id(d), set()).add(h.id)
                if type(h).__name__ == "_InstanceForward":
                    self._forwards.add(id(h.module))
        ours = self._ours
        if id(module) in self._forwards:
            state = {k: v for k, v in state.items() if k != "forward"}
        out = {}
        for k, v in state.items():
            mine = self.attrs.get((id(module), k))
            if mine is not None and v is mine.value:  # ours: the copy gets what the module had before
                if mine.previous is not _MISSING:
                    out[k] = mine.previous
                continue
            if k == "_load_from_state_dict" or (k == "zero_grad" and isinstance(v, functools.partial)):
                continue
            if isinstance(v, dict) and id(v) in ours:
                v = type(v)((i, h) for i, h in v.items() if i not in ours[id(v)])
            out[k] = v
        return out

    # -- resize_token_embeddings -----------------------------------------------------------------------
    def resize(self, module: torch.nn.Module, *args, **kwargs):
        raise MisuseError(
            f"{type(module).__name__}.resize_token_embeddings after a Zero3Optimizer was built over the model: "
            f"the optimizer partitioned every parameter at its shape then, and its shards, masters and states "
            f"cannot take new rows. Resize the embeddings first and build the optimizer after; or hand the model "
            f"back with tierstore.zero.release_model(opt), resize, and build a new optimizer")


def _managed(ms, module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The managed parameters of `module`'s subtree, once each."""
    return [p for p in module.parameters() if id(p) in ms._name_of]


def _spell(dtype: torch.dtype) -> str:
    return str(dtype)  # "torch.bfloat16"
