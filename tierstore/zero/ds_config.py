"""A whole DeepSpeed config: the OffloadConfig, the optimizer, the LR scheduler and the batch sizes.

``tierstore.zero.from_deepspeed(ds_config, lr=..., micro_batch_size=..., ...)`` returns a ``DeepSpeedSetup``:

- ``config``: the OffloadConfig (ds_mapping.py's ``map_deepspeed``; ``gradient_clipping`` becomes the field the
  optimizer's step applies);
- ``build_optimizer(model)``: a Zero3Optimizer over the config's ``optimizer`` (Adam / AdamW -> torch.optim.AdamW
  or Adam as DeepSpeed's ``adam_w_mode`` says, SGD, Adagrad);
- ``build_scheduler(optimizer)``: the config's ``scheduler`` (WarmupLR, WarmupDecayLR, WarmupCosineLR) as a
  torch LRScheduler with DeepSpeed's exact values per step (``DeepSpeedLR``);
- ``batch``: train_batch_size = micro x accumulation x world, checked, the missing one derived;
- ``ignored``: every key not used, also named in the one warning from_deepspeed gives.

"auto" values ([Note: DeepSpeed "auto"] in ds_mapping.py) are resolved from the arguments, the way HF Trainer fills
them from TrainingArguments, or refused with the key and the argument to pass.
"""
from __future__ import annotations

import inspect
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import TierstoreValueError
from . import _dist
from .config import OffloadConfig
from .ds_mapping import convert, map_deepspeed, section

# DeepSpeed optimizer "type" (lower case) -> the torch class (None: decided by adam_w_mode)
OPTIMIZERS: dict[str, type | None] = {
    "adam": None, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad,
}
# optimizer.params.<key> "auto" -> the from_deepspeed argument that fills it (as HF Trainer does)
OPTIMIZER_AUTO = {"lr": "lr", "betas": "betas", "eps": "eps", "weight_decay": "weight_decay"}
# scheduler "type" -> {param: (default, what "auto" is filled from)}; defaults are DeepSpeed's
SCHEDULERS: dict[str, dict[str, tuple[Any, str | None]]] = {
    "WarmupLR": {"warmup_min_lr": (0.0, "warmup_min_lr"), "warmup_max_lr": (None, "lr"),
                 "warmup_num_steps": (1000, "warmup_steps"), "warmup_type": ("log", None)},
    "WarmupDecayLR": {"total_num_steps": (None, "total_steps"), "warmup_min_lr": (0.0, "warmup_min_lr"),
                      "warmup_max_lr": (0.001, "lr"), "warmup_num_steps": (1000, "warmup_steps"),
                      "warmup_type": ("log", None)},
    "WarmupCosineLR": {"total_num_steps": (None, "total_steps"), "warmup_min_ratio": (0.0, None),
                       "warmup_num_steps": (1000, "warmup_steps"), "cos_min_ratio": (0.0001, None),
                       "warmup_type": ("log", None)},
}


class DeepSpeedLR(torch.optim.lr_scheduler.LRScheduler):
    """DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR as a torch LRScheduler: after k calls of step()
    every group's lr equals what DeepSpeed's scheduler gives after k calls of its step() (its
    last_batch_iteration = k - 1; at construction, iteration -1: the minimum lr, 0 for WarmupCosineLR).

    During warmup (iteration i < N = max(2, warmup_num_steps)) the fraction is log(i + 1) / log(N) ('log') or
    i / N ('linear'); then 1 (WarmupLR), max(0, (total - i) / max(1, total - N)) (WarmupDecayLR) or
    cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * min(1, (i - N + 1) / max(1, total - N)))) / 2
    (WarmupCosineLR, times each group's initial lr, which warmup scales from warmup_min_ratio)."""

    def __init__(self, optimizer: torch.optim.Optimizer, kind: str, params: Mapping[str, Any],
                 last_epoch: int = -1):
        if kind not in SCHEDULERS:
            raise TierstoreValueError(f"scheduler type {kind!r}: tierstore builds {sorted(SCHEDULERS)}")
        unknown = set(params) - set(SCHEDULERS[kind])
        if unknown:
            raise TierstoreValueError(f"scheduler {kind}: unknown params {sorted(unknown)}; it takes "
                                      f"{sorted(SCHEDULERS[kind])}")
        p = {k: params.get(k, d) for k, (d, _a) in SCHEDULERS[kind].items()}
        n = p["warmup_num_steps"]
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise TierstoreValueError(f"scheduler {kind}: warmup_num_steps={n!r}: a positive integer")
        if p["warmup_type"] not in ("log", "linear"):
            raise TierstoreValueError(f"scheduler {kind}: warmup_type={p['warmup_type']!r}: 'log' or 'linear'")
        if "total_num_steps" in p and (not isinstance(p["total_num_steps"], int) or p["total_num_steps"] <= 0):
            raise TierstoreValueError(f"scheduler {kind}: total_num_steps={p['total_num_steps']!r}: a positive "
                                      f"integer (pass total_steps=... when it is \"auto\")")
        self.kind = kind
        self.warmup_steps = max(2, n)
        self.warmup_type = p["warmup_type"]
        self.total_steps = p.get("total_num_steps")
        groups = optimizer.param_groups
        if kind == "WarmupCosineLR":
            self.min_ratio, self.cos_min_ratio = float(p["warmup_min_ratio"]), float(p["cos_min_ratio"])
            self.lows = [0.0] * len(groups)
            self.highs = [float(g["lr"]) for g in groups]
        else:
            top = p["warmup_max_lr"] if p["warmup_max_lr"] is not None else groups[0]["lr"]
            self.lows = self._per_group(p["warmup_min_lr"], len(groups), "warmup_min_lr")
            self.highs = self._per_group(top, len(groups), "warmup_max_lr")
        super().__init__(optimizer, last_epoch)

    @staticmethod
    def _per_group(v, n: int, name: str) -> list[float]:
        if isinstance(v, list | tuple):
            if len(v) != n:
                raise TierstoreValueError(f"scheduler {name}: {len(v)} values for {n} parameter groups")
            return [float(x) for x in v]
        return [float(v)] * n

    def _fraction(self, i: int) -> float:
        """DeepSpeed's gamma (or ratio) at last_batch_iteration i >= 0."""
        n = self.warmup_steps
        if i < n:
            w = math.log(i + 1) / math.log(n) if self.warmup_type == "log" else i / n
            return self.min_ratio + w * (1.0 - self.min_ratio) if self.kind == "WarmupCosineLR" else w
        if self.kind == "WarmupLR":
            return 1.0
        assert self.total_steps is not None
        if self.kind == "WarmupDecayLR":
            return max(0.0, (self.total_steps - i) / max(1.0, self.total_steps - n))
        progress = min(1.0, (i - n + 1) / max(1, self.total_steps - n))
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)

    def get_lr(self) -> list[float]:  # type: ignore[override]
        i = self.last_epoch - 1  # torch counts the construction as a step; DeepSpeed's counter starts at -1
        if i < 0:
            return list(self.lows)
        f = self._fraction(i)
        if self.kind == "WarmupCosineLR":
            return [h * f for h in self.highs]
        return [lo + (hi - lo) * f for lo, hi in zip(self.lows, self.highs, strict=True)]


@dataclass
class BatchSettings:
    """train_batch_size = micro_batch_size x gradient_accumulation_steps x world_size (checked)."""
    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int


@dataclass
class DeepSpeedSetup:
    """What a DeepSpeed config asks for, as tierstore objects. See the module's docstring."""
    config: OffloadConfig
    optimizer_class: type | None  # None: the config has no optimizer section (pass your own class)
    optimizer_kwargs: dict[str, Any]
    scheduler_type: str | None  # None: no scheduler section
    scheduler_params: dict[str, Any]
    batch: BatchSettings | None  # None: the config names no batch size
    ignored: list[str] = field(default_factory=list)

    @property
    def gradient_clipping(self) -> float | None:
        return self.config.gradient_clipping

    def build_optimizer(self, model: torch.nn.Module, **kwargs):
        """Zero3Optimizer(model, optimizer_class, config=config, **optimizer_kwargs); `kwargs` go to it too
        (param_groups=, process_group=, or optimizer options that win over the config's)."""
        from .optimizer import Zero3Optimizer
        if self.optimizer_class is None:
            raise TierstoreValueError("the DeepSpeed config has no optimizer section (or one tierstore does not "
                                      "build, named in from_deepspeed's warning): build Zero3Optimizer(model, "
                                      "YourOptimizerClass, config=setup.config, ...) yourself")
        return Zero3Optimizer(model, self.optimizer_class, config=self.config,
                              **{**self.optimizer_kwargs, **kwargs})

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> DeepSpeedLR | None:
        """The config's scheduler over `optimizer` (None when it has none); call .step() after each
        optimizer step, as DeepSpeed's engine does."""
        if self.scheduler_type is None:
            return None
        return DeepSpeedLR(optimizer, self.scheduler_type, self.scheduler_params)


def _arg(args: Mapping[str, Any], name: str):
    return args.get(name)


def _optimizer(sec: dict, args: Mapping[str, Any], ignored: list[str]) -> tuple[type | None, dict]:
    kind = sec.pop("type", None)
    params = dict(sec.pop("params", None) or {})
    ignored += [f"optimizer.{k}" for k in sec]
    if not isinstance(kind, str):
        raise TierstoreValueError(f"DeepSpeed config: optimizer.type={kind!r}: name the optimizer, e.g. 'AdamW'")
    if kind.lower() not in OPTIMIZERS:
        ignored.append(f"optimizer (type {kind!r} not built: tierstore builds Adam, AdamW, SGD, Adagrad; pass "
                       f"your class to Zero3Optimizer)")
        return None, {}
    cls = OPTIMIZERS[kind.lower()]
    if cls is None:  # DeepSpeed's "Adam" is AdamW (decoupled decay) unless adam_w_mode is false
        w_mode = params.pop("adam_w_mode", True)
        cls = torch.optim.AdamW if w_mode else torch.optim.Adam
    else:
        params.pop("adam_w_mode", None)
    torch_adam = params.pop("torch_adam", False)  # which implementation DeepSpeed picks; the maths is the same
    if params.pop("bias_correction", True) is not True:
        raise TierstoreValueError("DeepSpeed config: optimizer.params.bias_correction=false has no torch "
                                  "equivalent; remove it (torch's Adam/AdamW always correct the bias)")
    accepted = set(inspect.signature(cls).parameters) - {"self", "params"}
    kwargs: dict[str, Any] = {}
    for k, v in params.items():
        if k not in accepted:
            ignored.append(f"optimizer.params.{k} ({cls.__name__} has no such option)")
            continue
        if v == "auto":
            arg = OPTIMIZER_AUTO.get(k)
            if arg is None or _arg(args, arg) is None:
                how = f"pass {arg}=... to from_deepspeed" if arg else "set a value"
                raise TierstoreValueError(f'DeepSpeed config: optimizer.params.{k} is "auto", which only HF '
                                          f'Trainer fills in; {how}')
            v = _arg(args, arg)
        kwargs[k] = tuple(v) if isinstance(v, list) else v
    if cls in (torch.optim.Adam, torch.optim.AdamW) and not torch_adam and not {"fused", "foreach"} & set(kwargs):
        # DeepSpeed steps Adam with its fused kernels (FusedAdam on the GPU, DeepSpeedCPUAdam where the states
        # are offloaded) unless torch_adam is true: torch's fused kernel is the counterpart ([Note: the inner
        # step's implementation on the CPU] in stepper.py)
        kwargs["fused"] = True
    for k in ("lr", "eps", "weight_decay", "momentum"):
        if k in kwargs and (isinstance(kwargs[k], bool) or not isinstance(kwargs[k], int | float)):
            raise TierstoreValueError(f"DeepSpeed config: optimizer.params.{k}={kwargs[k]!r}: expected a number")
    return cls, kwargs


def _scheduler(sec: dict, args: Mapping[str, Any], ignored: list[str]) -> tuple[str | None, dict]:
    kind = sec.pop("type", None)
    params = dict(sec.pop("params", None) or {})
    ignored += [f"scheduler.{k}" for k in sec]
    if kind not in SCHEDULERS:
        ignored.append(f"scheduler (type {kind!r} not built: tierstore builds {', '.join(SCHEDULERS)}; use a "
                       f"torch LR scheduler)")
        return None, {}
    table = SCHEDULERS[kind]
    out: dict[str, Any] = {}
    for k, v in params.items():
        if k not in table:
            ignored.append(f"scheduler.params.{k}")
            continue
        _default, arg = table[k]
        if v == "auto":
            if arg is None or _arg(args, arg) is None:
                how = f"pass {arg}=... to from_deepspeed" if arg else "set a value"
                raise TierstoreValueError(f'DeepSpeed config: scheduler.params.{k} is "auto", which only HF '
                                          f'Trainer fills in; {how}')
            v = _arg(args, arg)
        if k in ("warmup_num_steps", "total_num_steps") and isinstance(v, float) and v == int(v):
            v = int(v)
        out[k] = v
    return kind, out


def _batch(rest: dict, args: Mapping[str, Any]) -> BatchSettings | None:
    """DeepSpeed's rule: given two of (train, micro, accumulation) the third follows; all three must agree."""
    world = args.get("world_size") or _dist.world_and_rank(None)[0]
    names = {"train_batch_size": "train_batch_size", "train_micro_batch_size_per_gpu": "micro_batch_size",
             "gradient_accumulation_steps": "gradient_accumulation_steps"}
    got: dict[str, int | None] = {}
    for key, arg in names.items():
        v = rest.pop(key, None)
        a = args.get(arg)
        if v is None or v == "auto":
            got[key] = a  # "auto" or absent: the argument, else derived below
            continue
        v = convert(key, v, _pos_int, None, {})
        if a is not None and a != v:
            raise TierstoreValueError(f"DeepSpeed config: {key}={v} but from_deepspeed was given {arg}={a}; "
                                      f"make them agree (or set the key to \"auto\")")
        got[key] = v
    t, m, g = got["train_batch_size"], got["train_micro_batch_size_per_gpu"], got["gradient_accumulation_steps"]
    if t is None and m is None and g is None:
        return None
    if m is None and g is None:
        g = 1
    if t is None:
        if m is None:
            raise TierstoreValueError('DeepSpeed config: train_micro_batch_size_per_gpu is "auto" (or absent) and '
                                      'train_batch_size cannot give it; pass micro_batch_size=... to from_deepspeed')
        t = m * (g or 1) * world
    if m is None:
        assert g is not None
        m = t // (g * world)
    if g is None:
        g = t // (m * world)
    if m < 1 or g < 1 or t != m * g * world:
        raise TierstoreValueError(f"DeepSpeed config: train_batch_size={t} != micro_batch_size {m} x "
                                  f"gradient_accumulation_steps {g} x world size {world}; fix one of them")
    return BatchSettings(t, m, g, world)


def _check_pos_int(v):
    if isinstance(v, bool) or not isinstance(v, int | float) or v != int(v) or v < 1:
        raise ValueError
    return int(v)


_pos_int = _check_pos_int
_pos_int.__name__ = "a positive integer"


def from_deepspeed(ds_config: Mapping[str, Any] | str | os.PathLike, *, lr: float | None = None,
                   betas: tuple[float, float] | None = None, eps: float | None = None,
                   weight_decay: float | None = None, micro_batch_size: int | None = None,
                   gradient_accumulation_steps: int | None = None, world_size: int | None = None,
                   gradient_clipping: float | None = None, warmup_steps: int | None = None,
                   warmup_min_lr: float | None = 0.0, total_steps: int | None = None,
                   compute_dtype: torch.dtype | None = None, **overrides) -> DeepSpeedSetup:
    """A DeepSpeed config (dict or JSON path) as a DeepSpeedSetup. The keyword arguments fill its "auto"
    values (as HF Trainer does from TrainingArguments: lr <- learning_rate, betas <- (adam_beta1, adam_beta2),
    eps <- adam_epsilon, weight_decay, micro_batch_size <- per_device_train_batch_size,
    gradient_accumulation_steps, gradient_clipping <- max_grad_norm, warmup_steps, total_steps <- max_steps,
    compute_dtype <- --bf16 / --fp16) and must agree with explicit values; `world_size` defaults to
    torch.distributed's; `overrides` are OffloadConfig fields and win. Warns once, naming every key ignored.
    """
    fields = dict(overrides)
    if compute_dtype is not None:
        fields["compute_dtype"] = compute_dtype
    if gradient_clipping is not None:
        fields["gradient_clipping"] = gradient_clipping
    m = map_deepspeed(ds_config, fields, OffloadConfig)
    args = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "world_size": world_size,
            "micro_batch_size": micro_batch_size, "gradient_accumulation_steps": gradient_accumulation_steps,
            "warmup_steps": warmup_steps, "warmup_min_lr": warmup_min_lr, "total_steps": total_steps}
    ignored = list(m.ignored)
    rest = dict(m.rest)
    cls: type | None = None
    kwargs: dict[str, Any] = {}
    if rest.get("optimizer") is not None:
        cls, kwargs = _optimizer(section(rest, "optimizer"), args, ignored)
        del rest["optimizer"]
    sched: str | None = None
    sparams: dict[str, Any] = {}
    if rest.get("scheduler") is not None:
        sched, sparams = _scheduler(section(rest, "scheduler"), args, ignored)
        del rest["scheduler"]
    batch = _batch(rest, args)
    if ignored:
        warnings.warn("tierstore.zero.from_deepspeed ignored: " + ", ".join(ignored), stacklevel=2)
    m.config.extra["ignored"] = list(ignored)
    return DeepSpeedSetup(m.config, cls, kwargs, sched, sparams, batch, ignored)
