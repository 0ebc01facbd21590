"""accelerate over Zero3Optimizer: ``prepare(accelerator, model, optimizer, *objects)``.

    accelerator = Accelerator(gradient_accumulation_steps=2)
    opt = Zero3Optimizer(model, torch.optim.AdamW, lr=3e-4, config=OffloadConfig(...))
    model, opt, loader, sched = prepare(accelerator, model, opt, loader, sched)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step(); sched.step(); opt.zero_grad()
    accelerator.save_state("ckpt")        # ckpt/tierstore_optimizer/: every rank's masters and states
    accelerator.load_state("ckpt")        # ... read back, resharded if the world size changed

[Note: what prepare changes in accelerate]
``accelerator.prepare(model, optimizer)`` would, at world size > 1, wrap the model in DistributedDataParallel
(whose all-reduce fights ZeRO-3's own reduce-scatter), round-trip the optimizer's state dict to "place" it,
and let ``save_state`` write rank 0's ``optimizer.state_dict()`` alone -- one shard of a partitioned state.
``prepare`` therefore leaves the model to ZeRO-3's hooks (not wrapped, not registered), wraps the optimizer
in accelerate's AcceleratedOptimizer without registering it (so ``step``/``zero_grad`` are skipped on the
micro-batches of ``accelerator.accumulate`` as usual), prepares the other objects (data loaders, schedulers)
with ``accelerator.prepare``, and registers save/load pre-hooks that write and read tierstore's checkpoint
(``tierstore_optimizer/`` in the state directory; every rank takes part) -- the weights are in it (the fp32
masters; ``tierstore.zero.consolidate`` turns it into a plain state dict). ``accelerator.backward`` needs
nothing; ``accelerator.clip_grad_norm_(model.parameters(), ...)`` and ``accelerator.get_state_dict(model)``
go through torch's ``clip_grad_norm_`` and ``model.state_dict()``, which Zero3Optimizer makes right for its
model. Refused: ``mixed_precision`` other than "no" (autocast and GradScaler act on a prepared model and its
``.grad``; use ``OffloadConfig(compute_dtype=torch.bfloat16)``), ``compute_dtype=torch.float16``.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from ..errors import TierstoreValueError
from ..zero import Zero3Optimizer
from ._require import missing
from .mixed_precision import FLAG_DTYPES, autocast_forward, check_optimizer, install_scaler

try:
    from accelerate.optimizer import AcceleratedOptimizer
except ImportError as e:
    raise ImportError(missing("accelerate", "accelerate", "1.15.0")) from e

OPTIMIZER_DIR = "tierstore_optimizer"  # in the directory of accelerator.save_state


def prepare(accelerator, model: torch.nn.Module, optimizer: Zero3Optimizer, *objects: Any) -> tuple:
    """(model, wrapped optimizer, *prepared objects). See [Note: what prepare changes in accelerate]."""
    if not isinstance(optimizer, Zero3Optimizer):
        raise TierstoreValueError(f"prepare(accelerator, model, optimizer, ...): optimizer must be a Zero3Optimizer "
                                  f"over `model`; got {type(optimizer).__name__}")
    if optimizer.model is not model:
        raise TierstoreValueError("prepare(accelerator, model, optimizer, ...): this Zero3Optimizer was built over "
                                  "another module; pass the model it partitions")
    flag = str(accelerator.mixed_precision)
    if flag not in ("no", *FLAG_DTYPES):
        raise TierstoreValueError(f"Accelerator(mixed_precision={flag!r}): prepare supports 'no', 'bf16' and "
                                  f"'fp16' (through the optimizer's compute_dtype); use one of those")
    check_optimizer(optimizer, flag, "prepare(accelerator, model, optimizer, ...)")
    if optimizer.world_size != accelerator.num_processes:
        raise TierstoreValueError(f"the Zero3Optimizer's group has {optimizer.world_size} ranks but accelerate runs "
                                  f"{accelerator.num_processes} processes: build the optimizer after the Accelerator "
                                  f"(which initialises torch.distributed), over the default group")
    if flag == "bf16" and optimizer.config.compute_dtype == torch.float32:
        autocast_forward(accelerator, model)  # fp32 parameters, bf16 autocast: what accelerate does for a plain model
    scaler = install_scaler(accelerator, optimizer)  # fp16 compute: the loss scale reaches accelerator.backward
    wrapped = AcceleratedOptimizer(optimizer, device_placement=False, scaler=scaler)
    if scaler is not None:
        scaler.wrappers.append(wrapped)  # not in accelerator._optimizers: told of overflows directly
    prepared = accelerator.prepare(*objects) if objects else ()
    if len(objects) == 1:
        prepared = (prepared,)

    def save_hook(models, weights, output_dir):
        optimizer.save_checkpoint(os.path.join(output_dir, OPTIMIZER_DIR), keep=0)

    def load_hook(models, input_dir):
        path = os.path.join(input_dir, OPTIMIZER_DIR)
        if not os.path.isdir(path):
            raise TierstoreValueError(f"accelerator.load_state({input_dir!r}): no {OPTIMIZER_DIR}/ there; it was "
                                      f"not saved through tierstore.integrations.accelerate.prepare")
        optimizer.load_checkpoint(path)

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
    return (model, wrapped, *prepared)


__all__ = ["OPTIMIZER_DIR", "prepare"]
