"""Trainer's and accelerate's mixed-precision flags over Zero3Optimizer's own mixed precision.

[Note: mixed precision through Trainer and accelerate]
Zero3Optimizer has its own mixed precision: ``OffloadConfig(compute_dtype=...)`` is the dtype the parameters
are gathered in and the model computes with, while the masters the optimizer steps stay fp32; with
``torch.float16`` it keeps a dynamic loss scale (halved and the step skipped on an overflow, doubled after
``loss_scale_window`` good steps) that must multiply the loss before backward. The frameworks' flags map onto
it:
- ``TrainingArguments(bf16=True)`` / ``(fp16=True)``: TierstoreTrainer builds the optimizer, so it sets
  ``compute_dtype`` to bfloat16 / float16 (``resolve_config``); a ``compute_dtype`` that contradicts the
  flag is refused. Trainer's accelerator still autocasts the forward (as for a plain model), which changes
  nothing for the ops already in the compute dtype and keeps the loss in fp32.
- ``Accelerator(mixed_precision=...)`` with ``integrations.accelerate.prepare``: the optimizer exists
  already, so its ``compute_dtype`` must match the flag ("fp16" needs float16; "bf16" takes bfloat16, or
  float32 masters-and-compute with the forward autocast to bf16 as accelerate does for a plain model).
- fp16's loss scale reaches ``accelerator.backward`` (Trainer's backward too) through ``Zero3LossScaler``,
  installed as ``accelerator.scaler`` in the place of torch's GradScaler: ``scale(loss)`` is the optimizer's
  ``scale_loss``; unscaling is the optimizer's own (its clip and step divide by the scale), so ``unscale_``
  does nothing; ``step`` runs the optimizer's step, and ``update`` tells accelerate's AcceleratedOptimizer
  when that step was skipped for an overflow (its ``_accelerate_step_called`` flag, which accelerate reads
  right after ``update``), so ``accelerator.optimizer_step_was_skipped`` is true and Trainer does not step the
  learning-rate schedule on it, as with GradScaler. The scale is saved in tierstore's checkpoint; the
  scaler's own ``state_dict`` (Trainer's ``scaler.pt``) is informational and loading it changes nothing.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from ..errors import TierstoreValueError
from ..zero import OffloadConfig, Zero3Optimizer

FLAG_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # the frameworks' flag -> compute_dtype


def resolve_config(config: OffloadConfig, flag: str, where: str) -> OffloadConfig:
    """`config` with the compute dtype the mixed-precision `flag` ("no", "bf16", "fp16") asks for; a float32
    compute_dtype (the default) takes the flag's, any other must equal it."""
    want = FLAG_DTYPES.get(flag)
    if want is None or config.compute_dtype == want:
        return config
    if config.compute_dtype != torch.float32:
        raise TierstoreValueError(f"{where}: the {flag} flag asks for compute_dtype={want} but the OffloadConfig "
                                  f"has compute_dtype={config.compute_dtype}; drop one of the two")
    return config.replace(compute_dtype=want)


def check_optimizer(opt: Zero3Optimizer, flag: str, where: str) -> None:
    """A Zero3Optimizer built before the flag was seen must compute in the flag's dtype (bf16 also takes
    float32 compute, which the caller autocasts)."""
    want = FLAG_DTYPES.get(flag)
    have = opt.config.compute_dtype
    if want is None or have == want or (flag == "bf16" and have == torch.float32):
        return
    raise TierstoreValueError(f"{where}: mixed precision {flag!r} with a Zero3Optimizer computing in {have}: "
                              f"build the optimizer with OffloadConfig(compute_dtype={want})")


class Zero3LossScaler:
    """GradScaler's part in accelerate, played by a Zero3Optimizer's fp16 loss scale. See [Note: mixed
    precision through Trainer and accelerate]."""

    def __init__(self, accelerator, optimizer: Zero3Optimizer):
        self.accelerator = accelerator
        self.optimizer = optimizer
        self._overflowed = False
        self.wrappers: list = []  # AcceleratedOptimizers over `optimizer` that accelerate does not register

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.optimizer.scale_loss(loss)

    def unscale_(self, optimizer: Any) -> None:
        """Nothing: the optimizer's clip and step divide by the scale themselves."""

    def step(self, optimizer: Any, closure=None):
        before = self.optimizer.stats().overflow_skips
        out = optimizer.step(closure) if closure is not None else optimizer.step()
        self._overflowed = self.optimizer.stats().overflow_skips != before
        return out

    def update(self, new_scale=None) -> None:
        if self._overflowed:  # accelerate reads this flag right after update() to set step_was_skipped
            for acc_opt in [*getattr(self.accelerator, "_optimizers", []), *self.wrappers]:
                inner = acc_opt
                while inner is not None and inner is not self.optimizer:
                    inner = getattr(inner, "optimizer", None)
                if inner is self.optimizer:
                    acc_opt._accelerate_step_called = False
        self._overflowed = False

    def get_scale(self) -> float:
        return self.optimizer.loss_scale

    def is_enabled(self) -> bool:
        return True

    def state_dict(self) -> dict:
        return dict(self.optimizer.scaler_state())

    def load_state_dict(self, state: dict) -> None:
        """Nothing: the scale is restored with the optimizer's own checkpoint."""


def autocast_forward(accelerator, model: torch.nn.Module) -> None:
    """Run `model`'s forward under the accelerator's autocast with its outputs cast back to fp32, as
    ``accelerator.prepare`` does for a plain model (integrations.accelerate.prepare does not hand the model
    to it)."""
    from accelerate.utils import convert_outputs_to_fp32

    forward = model.forward

    @functools.wraps(forward)
    def autocast_forward(*args: Any, **kwargs: Any):
        with accelerator.autocast():
            return forward(*args, **kwargs)

    model.forward = convert_outputs_to_fp32(autocast_forward)


def install_scaler(accelerator, optimizer: Zero3Optimizer) -> Zero3LossScaler | None:
    """With fp16 compute, make `accelerator.backward` scale the loss by the optimizer's loss scale (and return
    the scaler); otherwise leave accelerate's scaler alone and return None."""
    if optimizer.config.compute_dtype != torch.float16:
        return None
    scaler = accelerator.scaler
    if not isinstance(scaler, Zero3LossScaler) or scaler.optimizer is not optimizer:
        scaler = Zero3LossScaler(accelerator, optimizer)
        accelerator.scaler = scaler
    return scaler


__all__ = ["Zero3LossScaler", "autocast_forward", "check_optimizer", "install_scaler", "resolve_config"]
