"""The DeepSpeed config keys OffloadConfig holds, mapped to its fields: ``map_deepspeed`` reads a DeepSpeed
config (a dict or a JSON file's path) -- ``zero_optimization`` with ``offload_param`` / ``offload_optimizer``,
``fp16`` / ``bf16``, ``gradient_clipping``, ``activation_checkpointing`` -- into an OffloadConfig, the keys it
ignores (each with why, where known) and the top-level sections left for ds_config.py to build (optimizer,
scheduler, batch sizes). One mapping, shared by ``OffloadConfig.from_deepspeed`` (config.py) and
``tierstore.zero.from_deepspeed`` (ds_config.py); each mapped key is one row of the tables below.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import TierstoreValueError

# [Note: DeepSpeed "auto"] HF's DeepSpeed templates leave values as "auto" for the Trainer to fill from its
# arguments. Each mapped key says what its "auto" means here: AUTO_DEFAULT keeps tierstore's own default (the
# key only tunes DeepSpeed's buffers), a string names the from_deepspeed argument / OffloadConfig field that
# resolves it; without one the key is refused, named, with that argument in the message -- never parsed as
# a number ("invalid literal for int()").
AUTO_DEFAULT = object()


def _conv(what: str, fn):
    """A converter named by what it expects (the name goes into the error message)."""
    fn.__name__ = what
    return fn


def _to_int(v):
    if isinstance(v, bool) or not isinstance(v, int | float | str) or float(v) != int(float(v)):
        raise ValueError
    return int(float(v))


def _to_float(v):
    if isinstance(v, bool) or not isinstance(v, int | float | str):
        raise ValueError
    return float(v)


def _to_flag(v):
    if not isinstance(v, bool):
        raise ValueError
    return v


_int = _conv("an integer", _to_int)
_float = _conv("a number", _to_float)
_flag = _conv("true or false", _to_flag)

# zero_optimization.<key> -> OffloadConfig field: (key, field, convert, what "auto" means). One row a key; a row
# whose field is a tuple of fields converts to a tuple of their values.
ZERO_KEYS: list[tuple[str, str | tuple[str, ...], Any, Any]] = [
    ("sub_group_size", "sub_group_bytes", _conv("an integer", lambda v: _int(v) * 4), AUTO_DEFAULT),  # fp32 el.
    # elements read ahead -> as many fp32 bytes read ahead beyond the next modules ([Note: reading ahead by bytes]
    # in prefetch.py); 0 turns prefetching off
    ("stage3_prefetch_bucket_size", ("prefetch_depth", "prefetch_bytes"),
     _conv("a number", lambda v: (2, int(_float(v)) * 4) if _float(v) else (0, 0)), AUTO_DEFAULT),
    ("zero_quantized_weights", "quantized_weights", _flag, None),
    ("zero_quantized_gradients", "quantized_gradients", _flag, None),
    ("zero_hpz_partition_size", "hpz_partition_size", _int, None),  # hpZ ([Note: hpZ] in hpz.py)
]
# fp16.<key> -> OffloadConfig field (read when fp16 is enabled)
FP16_KEYS: list[tuple[str, str | tuple[str, ...], Any, Any]] = [
    ("initial_scale_power", "initial_loss_scale", _conv("an integer", lambda v: 2.0 ** _int(v)), None),
    ("loss_scale_window", "loss_scale_window", _int, None),
    ("min_loss_scale", "min_loss_scale", _float, None),
]
# top-level key -> OffloadConfig field
TOP_KEYS: list[tuple[str, str | tuple[str, ...], Any, Any]] = [
    ("gradient_clipping", "gradient_clipping", _float, "gradient_clipping"),
]
# top-level keys tierstore.zero.from_deepspeed reads (ds_config.py); OffloadConfig.from_deepspeed names them
BUILT_ELSEWHERE = ("optimizer", "scheduler", "train_batch_size", "train_micro_batch_size_per_gpu",
                   "gradient_accumulation_steps")
# why a key commonly found in DeepSpeed configs is ignored (shown in the warning)
WHY_IGNORED = {
    "aio": "the store sizes and queues its own requests",
    "zero_optimization.overlap_comm": "tierstore always overlaps",
    "zero_optimization.contiguous_gradients": "gradient partitions are contiguous",
    "zero_optimization.reduce_bucket_size": "reduce-scatters go by bucket, sub_group_bytes",
    "zero_optimization.stage3_param_persistence_threshold": "small parameters are packed, min_io_bytes",
    "zero_optimization.stage3_max_live_parameters": "releases follow the forward trace",
    "zero_optimization.stage3_max_reuse_distance": "releases follow the forward trace; OffloadConfig.reuse_bytes "
                                                   "keeps the forward's last buckets for backward",
}
_OFFLOAD_DEVICES = {"none": None, None: None, "cpu": "host", "nvme": "nvme"}


def load_deepspeed(ds_config) -> dict:
    """The config dict: `ds_config` itself, or the JSON file it names."""
    if isinstance(ds_config, str | os.PathLike):
        try:
            with open(ds_config) as f:
                ds_config = json.load(f)
        except OSError as e:
            raise TierstoreValueError(f"cannot read the DeepSpeed config {os.fspath(ds_config)!r}: {e}") from e
        except RecursionError:
            raise TierstoreValueError(f"the DeepSpeed config {os.fspath(ds_config)!r} is nested too deeply to be "
                                      "a DeepSpeed config (its sections are a few levels deep)") from None
        except json.JSONDecodeError as e:
            raise TierstoreValueError(f"the DeepSpeed config {os.fspath(ds_config)!r} is not valid JSON: {e}") \
                from e
    if not isinstance(ds_config, Mapping):
        raise TierstoreValueError(f"from_deepspeed(ds_config=...) takes the DeepSpeed config dict or its JSON "
                                  f"file's path; got {type(ds_config).__name__}")
    return dict(ds_config)


def section(ds: Mapping, key: str, where: str = "") -> dict:
    v = ds.get(key)
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise TierstoreValueError(f"DeepSpeed config: {where}{key} must be an object ({{...}}); got {v!r}")
    return dict(v)


def convert(path: str, value, conv, auto, resolved: Mapping[str, Any], hint: str = ""):
    """`value` of key `path` through `conv`; "auto" resolved per [Note: DeepSpeed "auto"]. Returns
    AUTO_DEFAULT when "auto" keeps the default."""
    if value == "auto":
        if auto is AUTO_DEFAULT:
            return AUTO_DEFAULT
        if isinstance(auto, str) and resolved.get(auto) is not None:
            return resolved[auto]
        how = f"pass {auto}=... to from_deepspeed" if isinstance(auto, str) else "set a value in the config"
        raise TierstoreValueError(f'DeepSpeed config: {path} is "auto", which only HF Trainer fills in; {how}{hint}')
    try:
        return conv(value)
    except (TypeError, ValueError, OverflowError):
        raise TierstoreValueError(f"DeepSpeed config: {path}={value!r}: expected {conv.__name__}") from None


def _rows(sec: dict, prefix: str, rows, kw: dict, resolved: Mapping[str, Any]) -> None:
    """Pop each row's key from `sec` into kw[field] (or each of its fields)."""
    for key, fld, conv, auto in rows:
        if key in sec:
            v = convert(prefix + key, sec.pop(key), conv, auto, resolved)
            if v is AUTO_DEFAULT:
                continue
            if isinstance(fld, tuple):
                kw.update(zip(fld, v))
            else:
                kw[fld] = v


@dataclass
class MappedDeepSpeed:
    """What map_deepspeed read: the OffloadConfig it describes (built by the caller, so that config.py and this
    mapping do not import each other), the keys ignored, the top-level sections left to build."""
    config: Any
    ignored: list[str]
    rest: dict[str, Any]


def map_deepspeed(ds_config, overrides: Mapping[str, Any], make: Callable[..., Any]) -> MappedDeepSpeed:
    """Map the parts of a DeepSpeed config OffloadConfig holds; `overrides` (fields) win and resolve "auto";
    `make` (OffloadConfig) builds the config from the mapped fields.
    Raises TierstoreValueError naming the key for a wrong value or an unresolved "auto"."""
    ds = load_deepspeed(ds_config)
    ignored: list[str] = []
    kw: dict[str, Any] = {}
    zo = section(ds, "zero_optimization")
    stage = zo.pop("stage", 3)
    if stage != 3:
        raise TierstoreValueError(f"zero_optimization.stage={stage!r}: tierstore implements ZeRO stage 3; "
                                  f"set it to 3")
    paths: list[str] = []
    for sec_name, fld in (("offload_param", "params"), ("offload_optimizer", "optimizer_states")):
        sec = section(zo, sec_name, "zero_optimization.")
        zo.pop(sec_name, None)
        dev = sec.pop("device", "none")
        if dev not in _OFFLOAD_DEVICES:
            raise TierstoreValueError(f"zero_optimization.{sec_name}.device={dev!r}: use 'none', 'cpu' or 'nvme'")
        p = sec.pop("nvme_path", None)
        if dev == "nvme":
            if not p:
                raise TierstoreValueError(f"zero_optimization.{sec_name}.device is 'nvme' but "
                                          f"{sec_name}.nvme_path is missing: set it to a directory on the drive")
            if not isinstance(p, str):
                raise TierstoreValueError(f"zero_optimization.{sec_name}.nvme_path={p!r}: a directory path (a string)")
            paths.append(p)
        sec.pop("pin_memory", None)  # the nvme tier always stages through pinned memory
        ignored += [f"zero_optimization.{sec_name}.{k}" for k in sec]
        kw[fld] = _OFFLOAD_DEVICES[dev] or "device"
    kw["gradients"] = "device" if kw["optimizer_states"] == "device" else "host"
    if paths:
        kw["nvme_paths"] = list(dict.fromkeys(paths))
    resolved = dict(overrides)
    _rows(zo, "zero_optimization.", ZERO_KEYS, kw, resolved)
    ignored += [f"zero_optimization.{k}" for k in zo]
    fp16, bf16 = section(ds, "fp16"), section(ds, "bf16") or section(ds, "bfloat16")
    dtype_hint = (" (torch.float16, torch.bfloat16 or torch.float32: what TrainingArguments' --fp16/--bf16 "
                  "would choose)")
    fp16_on = convert("fp16.enabled", fp16.pop("enabled", False), _flag, "compute_dtype", {}, dtype_hint) \
        if "compute_dtype" not in overrides else overrides["compute_dtype"] == torch.float16
    bf16_on = convert("bf16.enabled", bf16.pop("enabled", False), _flag, "compute_dtype", {}, dtype_hint) \
        if "compute_dtype" not in overrides else overrides["compute_dtype"] == torch.bfloat16
    fp16.pop("enabled", None)
    bf16.pop("enabled", None)
    if fp16_on and bf16_on:
        raise TierstoreValueError("DeepSpeed config: fp16.enabled and bf16.enabled are both true; enable one")
    if fp16_on:
        kw["compute_dtype"] = torch.float16
        _rows(fp16, "fp16.", FP16_KEYS, kw, resolved)
    elif bf16_on:
        kw["compute_dtype"] = torch.bfloat16
    if fp16_on:  # fp16's other keys matter only when it is on
        ignored += [f"fp16.{k}" for k in fp16]
    ignored += [f"bf16.{k}" for k in bf16]
    ignored += [f"aio.{k}" for k in section(ds, "aio")]
    _rows(ds, "", TOP_KEYS, kw, resolved)
    ignored += _map_activation_checkpointing(section(ds, "activation_checkpointing"), kw)
    rest = {k: ds.pop(k) for k in BUILT_ELSEWHERE if k in ds}
    for k in ds:
        if k not in ("zero_optimization", "fp16", "bf16", "bfloat16", "aio", "activation_checkpointing"):
            ignored.append(k)
    ignored = [f"{k} ({WHY_IGNORED.get(k) or WHY_IGNORED[k.split('.')[0]]})"
               if k in WHY_IGNORED or k.split(".")[0] in WHY_IGNORED else k for k in ignored]
    kw.update(overrides)
    kw["extra"] = {"ignored": list(ignored)}
    return MappedDeepSpeed(make(**kw), ignored, rest)


# What stands in for DeepSpeed's activation_checkpointing keys that need no mapping (named in the warning).
_ACTIVATION_NOTES = {
    "partition_activations": "tierstore has no model parallelism to partition over; activation_offload frees "
                             "the memory instead",
    "contiguous_memory_optimization": "each offloaded tensor is one contiguous extent of the store",
    "number_checkpoints": "the store needs no preallocated checkpoint buffers",
    "synchronize_checkpoint_boundary": "nothing to synchronize: reads and writes are waited for where used",
    "profile": "see ActivationOffload.stats()",
}


def _map_activation_checkpointing(section, kw: dict) -> list[str]:
    """DeepSpeed's ``activation_checkpointing`` -> kw; returns the keys it notes as not mapped."""
    sec = dict(section or {})
    if sec.pop("cpu_checkpointing", False):
        kw["activation_offload"] = "host"
        kw["activation_mode"] = "checkpoint"
    noted = []
    for k, v in sec.items():
        note = _ACTIVATION_NOTES.get(k)
        if note is None:
            noted.append(f"activation_checkpointing.{k}")
        elif v:
            noted.append(f"activation_checkpointing.{k} ({note})")
    return noted
