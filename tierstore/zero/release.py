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

import torch

from ..errors import MisuseError
from . import _dist, registry


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
        shard = opt._read_master(gid).to(opt.device)
        full = torch.empty(b.numel, dtype=torch.float32, device=opt.device)
        _dist.all_gather(shard, full, opt.group, quantized=False)  # exact values: never qwZ here
        del shard
        for pc in b.pieces:
            values[pc.name].view(-1)[pc.param_offset:pc.param_offset + pc.numel].copy_(full[pc.offset:pc.end])
        del full
    model = opt.model
    opt.close()
    for name, p in opt._params.items():
        p.data = values.pop(name).to(opt.device)
        if hasattr(p, registry.RELEASED):
            delattr(p, registry.RELEASED)
    return model
