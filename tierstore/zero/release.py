"""Handing a model back: close its Zero3Optimizer and put the parameters' values back into the model, so it
is a plain model again -- for a new optimizer ([Note: one optimizer per model] in registry.py), or for use
without one.

[Note: releasing a model]
``opt.close()`` leaves the managed parameters empty: their values live in the optimizer's store, and
materialising a whole model on close would need memory a ZeRO-3 run may not have. ``release_model(opt)``
is the explicit way out: it gathers every managed parameter's full value from the fp32 masters (a frozen
sub-group from its parameter shard), bucket by bucket, closes the optimizer, and sets each parameter's
``.data`` to its value in fp32 on the optimizer's device -- the master values, so a following optimizer
starts from exactly what this one stepped to, whatever its compute dtype was. The whole model is then in
that device's memory. At world size N it is a collective (every rank calls it, every rank gets the whole
model). Optimizer states are not carried over (save a checkpoint for that).
"""
from __future__ import annotations

import logging
import shutil

import torch

from ..errors import MisuseError
from . import _dist
from .params import registry
from .params.partitioned import unpartition
from .step import clip

log = logging.getLogger("tierstore.zero")


def release_model(opt) -> torch.nn.Module:
    """Close `opt` (a Zero3Optimizer) and put the full fp32 value of every parameter it manages back into its
    model; returns the model. See [Note: releasing a model]."""
    if getattr(opt, "store", None) is None:
        raise MisuseError("release_model: this optimizer is closed already, and its parameters' values went "
                          "with it; call release_model(opt) instead of opt.close() to keep them")
    opt.module_state.check_idle("release_model")
    opt.synchronize()
    lay = opt.layout
    values = {n: torch.empty(lay.specs[n][0], dtype=torch.float32) for n in opt._params}  # CPU, full
    for gid in range(len(lay.subgroups)):
        b = lay.bucket(gid)
        shard = opt.shards.read_master(gid).to(opt.device)
        full = torch.empty(b.numel, dtype=torch.float32, device=opt.device)
        _dist.all_gather(shard, full, opt.group, quantized=False)  # exact values: never qwZ here
        del shard
        for pc in b.pieces:
            values[pc.name].view(-1)[pc.param_offset:pc.param_offset + pc.numel].copy_(full[pc.offset:pc.end])
        del full
    model = opt.model
    opt.close()
    for name, p in opt._params.items():
        unpartition(p)
        p.data = values.pop(name).to(opt.device)
        if hasattr(p, registry.RELEASED):
            delattr(p, registry.RELEASED)
    return model


def abandon(opt) -> None:
    """Undo a Zero3Optimizer construction that raised; see [Note: a failed construction].

    [Note: a failed construction]
    The constructor opens a store, registers the optimizer and installs hooks on the model before it is
    done; one that raises half-way (a failing disk, an argument only a later part checks) must not leave
    them: the model would keep hooks of an optimizer nobody holds, be refused to the next one ([Note: one
    optimizer per model] in registry.py), and the store would keep its directories locked. So whatever the
    construction made is taken back -- hooks, registration, the model's zero_grad, threads, the store, a
    temporary directory -- each part as far as it got, the first error of the teardown logged, never
    raised over the constructor's own. The parameters keep their values: they are emptied only at the
    constructor's very end."""
    steps = [
        lambda: opt.hpz.remove() if getattr(opt, "hpz", None) is not None else None,
        lambda: clip.unregister(opt),
        lambda: restore_zero_grad(opt),
        lambda: opt.coordinator.remove() if hasattr(opt, "coordinator") else None,
        lambda: opt.module_state.remove() if hasattr(opt, "module_state") else None,
        lambda: opt.overlap.close() if getattr(opt, "overlap", None) is not None else None,
        lambda: opt.activations.close() if getattr(opt, "activations", None) is not None else None,
        lambda: opt._stepper.close() if hasattr(opt, "_stepper") else None,
        lambda: opt.store.close(flush=False) if getattr(opt, "store", None) is not None else None,
    ]
    for step in steps:
        try:
            step()
        except Exception:  # the constructor's error is the one to see
            log.warning("Zero3Optimizer: undoing a failed construction", exc_info=True)
    opt.store = None
    if getattr(opt, "_tmpdir", None):
        shutil.rmtree(opt._tmpdir, ignore_errors=True)


def restore_zero_grad(opt) -> None:
    """Give `opt`'s model its class's own zero_grad back (if `opt` replaced it)."""
    zero_grad = getattr(opt, "_model_zero_grad", None)
    model = getattr(opt, "model", None)
    if zero_grad is not None and model is not None and model.__dict__.get("zero_grad") is zero_grad:
        del model.zero_grad
