"""Checkpoints without the frozen parameters: ``save_checkpoint(..., exclude_frozen=True)``.

[Note: frozen parameters left out of a checkpoint]
The frozen parameters (``requires_grad=False``: a pretrained base under LoRA adapters) never change in
training, yet a checkpoint writes them with every save -- all of a 7B base for a few MB of adapters. With
``exclude_frozen=True`` their records are not written (as DeepSpeed's ``exclude_frozen_parameters``): the
base is reloaded from its pretrained weights, and a load keeps the values the model holds. In their place
meta.json holds a fingerprint of them, the fp64 sum and sum of squares of every frozen element (padding is
zero and adds nothing, so it is the same at any world size), which costs one read of this rank's frozen
shards per save and no write. A load checks the model's frozen values against it and refuses a model whose
base differs (another initialisation, another pretrained checkpoint) instead of resuming it silently wrong;
the tolerance is relative 1e-6, or 1e-2 when the two runs' compute dtypes differ (the values were rounded to
each). ``consolidate`` of such a checkpoint returns the trainable parameters and the buffers only.
"""
from __future__ import annotations

import math

import torch

from ...errors import CorruptionError, TierstoreValueError
from .. import _dist, keys


def fingerprint(opt) -> list[float]:
    """[sum, sum of squares] in fp64 of every frozen parameter element of the model (a collective)."""
    acc = torch.zeros(2, dtype=torch.float64)
    for gl in opt.layout.groups:
        if gl.trainable:
            continue
        for gid in gl.gids:
            shard = opt.store.get(keys.param(gid), device="cpu").reshape(-1).to(torch.float64)
            acc += torch.stack([shard.sum(), shard.square().sum()])
    return [float(v) for v in _dist.all_reduce_sum(acc, opt.group)]


def check(opt, saved: object, saved_dtype: str, path: str) -> None:
    """Refuse to resume over frozen parameters whose values are not the ones the checkpoint was saved with."""
    if not (isinstance(saved, list) and len(saved) == 2
            and all(isinstance(v, float) and math.isfinite(v) for v in saved)):
        raise CorruptionError(f"checkpoint file field frozen: {saved!r} is not two finite numbers; the file is "
                              f"damaged: load an older checkpoint", path)
    have = fingerprint(opt)
    same_dtype = str(opt.config.compute_dtype).removeprefix("torch.") == saved_dtype
    tol = 1e-6 if same_dtype else 1e-2
    for what, a, b in zip(("sum", "sum of squares"), have, saved):
        if abs(a - b) > tol * max(abs(a), abs(b), 1.0):
            raise TierstoreValueError(
                f"{path} was saved without the frozen parameters (exclude_frozen=True), and this model's frozen "
                f"parameters are not the ones it was saved with ({what} {a!r} here, {b!r} then): load the same "
                f"base weights (from_pretrained of the same model) before load_checkpoint")


__all__ = ["check", "fingerprint"]
