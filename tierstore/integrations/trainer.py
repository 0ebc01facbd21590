"""transformers' Trainer over Zero3Optimizer: ``TierstoreTrainer``, a drop-in for ``Trainer``.

    trainer = TierstoreTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                               offload_config=OffloadConfig(params="host", optimizer_states="nvme", ...))
    trainer.train(); trainer.save_model("out")        # out/model.safetensors holds the real weights

[Note: what TierstoreTrainer changes in Trainer]
Trainer (transformers 5.23) drives a plain optimizer through calls that do not know about ZeRO-3: it clips
with ``accelerator.clip_grad_norm_(model.parameters())`` and logs that norm, zeroes with
``model.zero_grad()``, saves ``model.state_dict()`` and ``optimizer.state_dict()`` with ``torch.save`` from
rank 0, and reloads them. Under ZeRO-3 the model's parameters hold no values between uses and the gradients
live in the store, so each of those calls is replaced where Trainer offers a method to override:
- ``create_optimizer``: a Zero3Optimizer over the model, the optimizer class and hyperparameters Trainer
  would use (AdamW, ``learning_rate``, ``adam_beta1/2``, ``adam_epsilon``, ``weight_decay`` on the parameters
  ``get_decay_parameter_names`` names, 0 on the rest).
- clipping needs nothing: ``torch.nn.utils.clip_grad_norm_`` over a ZeRO-3 model's parameters (which
  ``accelerator.clip_grad_norm_`` calls) is the optimizer's exact global norm (zero/step/clip.py), so
  ``max_grad_norm`` clips and ``grad_norm`` is logged as a plain Trainer logs it.
- zeroing needs nothing: a ZeRO-3 model's ``zero_grad()`` also forgets the optimizer's gradient partitions
  ([Note: model.zero_grad() forgets the partitions] in zero/optimizer.py).
- saving the model needs nothing: ``model.state_dict()`` of a ZeRO-3 model yields the full weights, gathered
  bucket by bucket (zero/params/module_state.py), so ``model.safetensors`` is what a plain Trainer writes.
- ``_save_optimizer_and_scheduler`` / ``_load_optimizer_and_scheduler``: tierstore's own checkpoint
  (``checkpoint-N/tierstore_optimizer/``: every rank's masters and states, atomic, resharded on load) instead
  of ``optimizer.pt``; ``resume_from_checkpoint`` continues exactly. The frozen parameters are left out of
  it (``exclude_frozen=True``), so a LoRA run's checkpoint holds what changes; the resume takes them from the
  model (Trainer reloads its weights first; a PEFT base comes from ``from_pretrained``).
- ``TrainingArguments(bf16=True / fp16=True)``: the optimizer computes in bfloat16 / float16 with fp32
  masters, and fp16's loss scale reaches Trainer's backward ([Note: mixed precision through Trainer and
  accelerate] in mixed_precision.py).
Refused with an error that says what to do: an ``args.optim`` other than AdamW without ``optimizer_class``.

[Note: TierstoreTrainer at N processes]
Under torchrun or ``accelerate launch`` Trainer runs one process per device and would wrap the model in
DistributedDataParallel (``accelerator.prepare(model, optimizer)``), whose all-reduce of ``.grad`` fights the
reduce-scatter ZeRO-3 already does into each rank's partition. ``_wrap_model`` therefore registers the model
with accelerate through ``prepare_model(evaluation_mode=True)`` (no DDP; accelerate then treats it as
prepared), and everything else stays Trainer's: the data loader is accelerate's, so each rank reads its share
of every global batch (``per_device_train_batch_size`` x N, as under DDP); gradients are averaged over the
ranks as DDP averages them, so losses, logged norms and weights equal a DDP run's; eval runs on every rank.
``save_model`` gathers the weights on every rank (a collective) and the main process writes them; the
optimizer checkpoint is written by every rank and resumes at any world size.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from ..errors import MisuseError, TierstoreValueError
from ..zero import OffloadConfig, Zero3Optimizer
from ._require import missing
from .mixed_precision import check_optimizer, install_scaler, resolve_config

try:
    from transformers import Trainer
except ImportError as e:
    raise ImportError(missing("transformers", "transformers", "5.23.0")) from e

OPTIMIZER_DIR = "tierstore_optimizer"  # in checkpoint-N/: tierstore's checkpoint of the optimizer
SCHEDULER_NAME = "scheduler.pt"  # Trainer's own name for the scheduler's state
ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")


def _unwrap(opt) -> Zero3Optimizer | None:
    """The Zero3Optimizer under accelerate's AcceleratedOptimizer (or None)."""
    while opt is not None and not isinstance(opt, Zero3Optimizer):
        opt = getattr(opt, "optimizer", None)
    return opt


class TierstoreTrainer(Trainer):
    """Trainer whose optimizer is a Zero3Optimizer. See [Note: what TierstoreTrainer changes in Trainer].

    offload_config: where parameters, gradients and optimizer states live (default OffloadConfig()).
    optimizer_class: the elementwise torch optimizer to wrap (default torch.optim.AdamW, from args).
    optimizer_kwargs: extra keyword arguments for it (they override those taken from args).
    Every other argument is Trainer's. ``optimizers=(Zero3Optimizer, scheduler)`` is accepted too.
    """

    def __init__(self, *args: Any, offload_config: OffloadConfig | None = None, optimizer_class=None,
                 optimizer_kwargs: dict | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.offload_config = offload_config if offload_config is not None else OffloadConfig()
        self.zero_optimizer_class = optimizer_class
        self.zero_optimizer_kwargs = dict(optimizer_kwargs or {})
        a = self.args
        flag = "bf16" if a.bf16 else "fp16" if a.fp16 else "no"
        where = f"TierstoreTrainer(TrainingArguments({flag}=True))"
        self.offload_config = resolve_config(self.offload_config, flag, where)
        if self.optimizer is not None and not isinstance(self.optimizer, Zero3Optimizer):
            raise TierstoreValueError(f"TierstoreTrainer(optimizers=({type(self.optimizer).__name__}, ...)): give "
                                      f"a Zero3Optimizer over this model, or none and let offload_config build it")
        if self.optimizer is not None:
            check_optimizer(self.optimizer, flag, where)
        if optimizer_class is None and a.optim not in ADAMW_OPTIMS:
            raise TierstoreValueError(f"TierstoreTrainer: TrainingArguments(optim={a.optim!r}) is not an AdamW "
                                      f"Zero3Optimizer can wrap; use optim='adamw_torch' or pass optimizer_class= "
                                      f"(an elementwise torch.optim class) and optimizer_kwargs=")

    # -- the optimizer ---------------------------------------------------------------------------------------
    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            opt_model = self.model if model is None else model
            if opt_model is None:
                raise MisuseError("TierstoreTrainer: no model to optimize (pass model= to the constructor)")
            decay = set(self.get_decay_parameter_names(opt_model))
            names = [n for n, p in opt_model.named_parameters() if p.requires_grad]
            groups = [{"params": [n for n in names if n in decay], "weight_decay": self.args.weight_decay},
                      {"params": [n for n in names if n not in decay], "weight_decay": 0.0}]
            kwargs: dict[str, Any] = {}
            cls = self.zero_optimizer_class
            if cls is None:
                cls = torch.optim.AdamW
                kwargs = {"lr": self.args.learning_rate, "betas": (self.args.adam_beta1, self.args.adam_beta2),
                          "eps": self.args.adam_epsilon}
                if self.args.optim == "adamw_torch_fused":  # as Trainer's own AdamW(fused=True)
                    kwargs["fused"] = True
            else:
                kwargs = {"lr": self.args.learning_rate}
            kwargs.update(self.zero_optimizer_kwargs)
            self.optimizer = Zero3Optimizer(opt_model, cls, config=self.offload_config,
                                            param_groups=[g for g in groups if g["params"]], **kwargs)
        install_scaler(self.accelerator, self._zero3())  # fp16: the loss scale reaches accelerator.backward
        return self.optimizer

    def _zero3(self) -> Zero3Optimizer:
        opt = _unwrap(self.optimizer)  # accelerate's AcceleratedOptimizer wraps it in train()
        if opt is None:
            raise MisuseError("TierstoreTrainer: no optimizer yet (create_optimizer() or train() builds it)")
        return opt

    # -- several processes ---------------------------------------------------------------------------------
    def _wrap_model(self, model, training: bool = True, dataloader=None):
        """Trainer's wrapping, except DistributedDataParallel: the model is registered with accelerate as
        prepared (autocast and the rest of prepare_model's evaluation path apply, DDP does not), so Trainer's
        ``accelerator.prepare(model, optimizer)`` leaves it to ZeRO-3's hooks. See [Note: TierstoreTrainer at N
        processes]."""
        model = super()._wrap_model(model, training, dataloader)
        if training and model is self.model and not getattr(model, "_is_accelerate_prepared", False):
            model = self.accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
        return model

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Trainer's save_model; at world size N every rank takes part in gathering the weights (a collective),
        and the main process writes them."""
        if self.args.world_size > 1 and self.model is not None:
            state_dict = self.model.state_dict()  # every rank: the gather is a collective
            self._save(output_dir if output_dir is not None else self.args.output_dir, state_dict=state_dict)
        else:
            super().save_model(output_dir, _internal_call)

    # -- saving and resuming -----------------------------------------------------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # the frozen parameters (a LoRA base) are not rewritten by every save: [Note: frozen parameters left out
        # of a checkpoint] in zero/checkpoint/frozen.py; Trainer's resume reloads them with the model's weights
        self._zero3().save_checkpoint(os.path.join(output_dir, OPTIMIZER_DIR), keep=0, exclude_frozen=True)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, OPTIMIZER_DIR)
        if not os.path.isdir(path):
            raise TierstoreValueError(f"resume_from_checkpoint={checkpoint!r} has no {OPTIMIZER_DIR}/: it was not "
                                      f"saved by TierstoreTrainer (a plain Trainer's optimizer.pt holds unpartitioned "
                                      f"states). Resume from a checkpoint TierstoreTrainer wrote, or start fresh")
        self._zero3().load_checkpoint(path)
        sched = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(sched):
            self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))


__all__ = ["OPTIMIZER_DIR", "TierstoreTrainer"]
