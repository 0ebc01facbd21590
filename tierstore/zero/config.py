"""OffloadConfig: where every ZeRO-3 state lives, how it is encoded, and how the step is pipelined.

``OffloadConfig.from_deepspeed(ds_config)`` maps a DeepSpeed config dict (``zero_optimization``,
``offload_param``, ``offload_optimizer``, ``aio``, ``fp16``/``bf16``) so an existing setup migrates; keys it
does not map are listed in one warning.
"""
from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import TierstoreValueError
from ..tiers import TIERS, tier_info

log = logging.getLogger("tierstore.zero")

STATE_CODECS = (None, "dynamic8")
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class OffloadConfig:
    """Where ZeRO-3 keeps things, per rank.

    params: tier of this rank's parameter shards in the compute dtype (gathered before use).
    optimizer_states: tier of the fp32 master shards and the optimizer's states.
    gradients: tier of this rank's fp32 gradient partition (accumulated between steps).
    nvme_paths: directories (one per drive) for the nvme tier; each rank uses ``<path>/rank<r>``. Needed when
        any tier is 'nvme'; otherwise a temporary directory holds the store's (empty) files.
    state_codec: None (fp32 states) or 'dynamic8' (exp_avg / exp_avg_sq in block-wise dynamic 8 bits when
        stored on nvme, per tierstore.quant.states.StatePolicy).
    quantized_weights: qwZ, an int8 all-gather of parameter shards (world > 1).
    quantized_gradients: qgZ, an int4 all-to-all reduce-scatter of gradients (world > 1).
    compute_dtype: dtype of the gathered parameters the model computes with; masters stay fp32.
    prefetch_depth: modules ahead of use whose buckets are prepared (traced prefetch; 0: off): shards read up
        from the store and copied to the device 2 x depth modules ahead, all-gathers posted depth ahead
        (world size > 1).
    sub_group_bytes: bytes of one bucket (a sub-group of the step pipeline), all ranks together.
    min_io_bytes: small parameters are packed until each rank's shard of a bucket reaches this (bytes).
    pinned_bytes: page-locked staging budget the nvme tier streams through (bytes).
    pipeline_depth: sub-groups in flight in the step (read i+1, step i, write i-1 is 3).
    initial_loss_scale, loss_scale_window, min_loss_scale: fp16 dynamic loss scaling.
    io_tuning: path of a `tierstore tune DIR` recommendation for the store's I/O (see tierstore/io/tuning.py).
    """

    params: str = "device"
    optimizer_states: str = "host"
    gradients: str = "host"
    nvme_paths: Sequence[str] | None = None
    state_codec: str | None = None
    quantized_weights: bool = False
    quantized_gradients: bool = False
    compute_dtype: torch.dtype = torch.float32
    prefetch_depth: int = 2
    sub_group_bytes: int = 64 << 20  # bytes
    min_io_bytes: int = 1 << 20  # bytes
    pinned_bytes: int = 64 << 20  # bytes
    pipeline_depth: int = 3  # sub-groups
    initial_loss_scale: float = 2.0 ** 16
    loss_scale_window: int = 1000  # steps without overflow before the scale doubles
    min_loss_scale: float = 1.0
    intra_node_size: int | None = None  # qgZ: ranks per node (default: all)
    io_tuning: str | None = None
    extra: dict = field(default_factory=dict)  # keys from_deepspeed could not map, kept for reference

    def __post_init__(self) -> None:
        for name in ("params", "optimizer_states", "gradients"):
            v = getattr(self, name)
            if v not in TIERS:
                raise TierstoreValueError(f"OffloadConfig({name}={v!r}): use one of {TIERS}")
        if isinstance(self.nvme_paths, str):
            self.nvme_paths = [self.nvme_paths]
        if self.uses_nvme and not self.nvme_paths:
            raise TierstoreValueError("OffloadConfig: a tier is 'nvme' but nvme_paths is empty; pass "
                                      "nvme_paths=['/path/on/nvme'] (one directory per drive)")
        if self.state_codec not in STATE_CODECS:
            raise TierstoreValueError(f"OffloadConfig(state_codec={self.state_codec!r}): use None or 'dynamic8'")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise TierstoreValueError(f"OffloadConfig(compute_dtype={self.compute_dtype}): use torch.float32, "
                                      f"torch.bfloat16 or torch.float16")
        for name, least in (("prefetch_depth", 0), ("sub_group_bytes", 1), ("min_io_bytes", 0),
                            ("pinned_bytes", 1 << 20), ("pipeline_depth", 1), ("loss_scale_window", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < least:
                raise TierstoreValueError(f"OffloadConfig({name}={v!r}): an integer >= {least}")
        if self.io_tuning is not None:
            from ..io import Tuning
            Tuning.coerce(self.io_tuning)  # a bad file is refused here, naming it
        if not self.initial_loss_scale > 0 or not self.min_loss_scale > 0:
            raise TierstoreValueError("OffloadConfig: initial_loss_scale and min_loss_scale must be > 0")

    @property
    def uses_nvme(self) -> bool:
        """Some state lives on a persistent tier (it needs nvme_paths)."""
        return any(tier_info(t).persistent for t in (self.params, self.optimizer_states, self.gradients))

    def replace(self, **changes) -> OffloadConfig:
        """A copy with some fields changed (e.g. other tiers to load a checkpoint into)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["compute_dtype"] = str(self.compute_dtype).removeprefix("torch.")
        d["nvme_paths"] = list(self.nvme_paths) if self.nvme_paths else None
        return d

    @classmethod
    def from_deepspeed(cls, ds_config: Mapping[str, Any], **overrides) -> OffloadConfig:
        """Map a DeepSpeed config dict; `overrides` win. Warns once, naming every key that is ignored.

        Mapped: zero_optimization.stage (must be 3), .offload_param.{device, nvme_path, pin_memory},
        .offload_optimizer.{device, nvme_path}, .sub_group_size (elements -> fp32 bytes),
        .stage3_prefetch_bucket_size (-> prefetch on), .zero_quantized_weights, .zero_quantized_gradients,
        fp16.{enabled, initial_scale_power, loss_scale_window, min_loss_scale}, bf16.enabled,
        aio.{block_size, queue_depth} (noted: the store picks its own request sizes)."""
        if not isinstance(ds_config, Mapping):
            raise TierstoreValueError(f"from_deepspeed(ds_config=...) takes the DeepSpeed config dict; got "
                                      f"{type(ds_config).__name__}")
        ignored: list[str] = []
        kw: dict[str, Any] = {}
        zo = dict(ds_config.get("zero_optimization") or {})
        stage = zo.pop("stage", 3)
        if stage != 3:
            raise TierstoreValueError(f"zero_optimization.stage={stage}: tierstore implements ZeRO stage 3; "
                                      f"set it to 3")
        paths: list[str] = []

        def tier_of(section: str) -> str | None:
            sec = dict(zo.pop(section, None) or {})
            dev = sec.pop("device", "none")
            p = sec.pop("nvme_path", None)
            if dev == "nvme" and p:
                paths.append(str(p))
            if "pin_memory" in sec:
                sec.pop("pin_memory")
            for k in sec:
                ignored.append(f"zero_optimization.{section}.{k}")
            return {"none": None, None: None, "cpu": "host", "nvme": "nvme"}.get(dev, "invalid:" + str(dev))

        for section, key in (("offload_param", "params"), ("offload_optimizer", "optimizer_states")):
            t = tier_of(section)
            if t is not None and t.startswith("invalid:"):
                raise TierstoreValueError(f"zero_optimization.{section}.device={t[8:]!r}: use 'none', 'cpu' or "
                                          f"'nvme'")
            kw[key] = t or ("device" if key == "params" else "device")
        if kw["optimizer_states"] != "device":
            kw["gradients"] = "host"
        else:
            kw["gradients"] = "device"
        if paths:
            kw["nvme_paths"] = list(dict.fromkeys(paths))
        if "sub_group_size" in zo:
            kw["sub_group_bytes"] = int(zo.pop("sub_group_size")) * 4  # elements of fp32 master
        if "stage3_prefetch_bucket_size" in zo:
            kw["prefetch_depth"] = 2 if zo.pop("stage3_prefetch_bucket_size") else 0
        if "zero_quantized_weights" in zo:
            kw["quantized_weights"] = bool(zo.pop("zero_quantized_weights"))
        if "zero_quantized_gradients" in zo:
            kw["quantized_gradients"] = bool(zo.pop("zero_quantized_gradients"))
        for k in zo:
            ignored.append(f"zero_optimization.{k}")
        fp16 = dict(ds_config.get("fp16") or {})
        bf16 = dict(ds_config.get("bf16") or ds_config.get("bfloat16") or {})
        if fp16.pop("enabled", False):
            kw["compute_dtype"] = torch.float16
            if "initial_scale_power" in fp16:
                kw["initial_loss_scale"] = 2.0 ** fp16.pop("initial_scale_power")
            if "loss_scale_window" in fp16:
                kw["loss_scale_window"] = int(fp16.pop("loss_scale_window"))
            if "min_loss_scale" in fp16:
                kw["min_loss_scale"] = float(fp16.pop("min_loss_scale"))
            ignored += [f"fp16.{k}" for k in fp16]
        if bf16.pop("enabled", False):
            kw["compute_dtype"] = torch.bfloat16
        aio = dict(ds_config.get("aio") or {})
        for k in aio:
            ignored.append(f"aio.{k} (the store sizes and queues its own requests)")
        for k in ds_config:
            if k not in ("zero_optimization", "fp16", "bf16", "bfloat16", "aio", "train_batch_size",
                         "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer",
                         "scheduler", "gradient_clipping"):
                ignored.append(k)
        kw.update(overrides)
        if ignored:
            warnings.warn("OffloadConfig.from_deepspeed ignored: " + ", ".join(ignored), stacklevel=2)
        kw["extra"] = {"ignored": ignored}
        return cls(**kw)
