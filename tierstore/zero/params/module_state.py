"""A ZeRO-3 model's own ``state_dict()`` and ``load_state_dict()``: full values out, values into the shards.

[Note: a partitioned model's state dict]
Outside of use a managed parameter's ``.data`` is empty ([Note: gather and release] in hooks/coordinator.py), so torch's
``Module.state_dict`` would hand out shape-[0] tensors and ``load_state_dict`` would refuse every shape.
Code that does not know about ZeRO-3 (``save_pretrained``, safetensors, Trainer's and accelerate's saves)
calls exactly these two, so the optimizer installs hooks that make them mean what they mean for a plain
model:

- ``state_dict()``: a state-dict pre-hook on the module it is called on (every module of the model has one;
  nested calls see that one is running) gathers the buckets holding the managed parameters of that module's
  subtree, **one bucket at a time** -- this rank's shard is read from its tier and all-gathered without
  quantization (qwZ would round), each piece copied into its parameter's full tensor, the bucket dropped --
  so at most one bucket is alive beyond the dict being returned. Each module's post-hook then puts the full
  tensors under its parameters' keys. Values are CPU tensors in the parameter's dtype (the compute dtype):
  the model of a ZeRO-3 run need not fit on the device. A tied parameter appears under every name, one
  tensor, as torch does. At world size N it is a collective: every rank must call it, on the same module,
  and every rank gets the same full dict. Inside the model's forward or backward it raises (its gathers
  would interleave with the hooks' collectives). ``keep_vars=True`` asks for the Parameter objects: they are
  returned as torch does only while they hold their full values (inside ``opt.gathered()`` or
  ``GatheredParameters``), otherwise it raises rather than hand out empty Parameters.
- ``load_state_dict(sd)``: each module with managed parameters gets its own ``_load_from_state_dict``, which
  checks its managed keys as torch does (missing key, size mismatch, non-tensor -- torch's own messages),
  lets torch's method handle everything else (buffers, unmanaged parameters, unexpected keys, hooks) with
  the managed parameters hidden from it, and writes the values into this rank's shards bucket by bucket:
  the fp32 master the optimizer steps from and the compute-dtype shard that is gathered (one write with a
  shared master). No collective: every rank loads the same dict, as with a plain model; each writes its own
  shards. Held buckets (inside a gathered context) are updated too. Like torch, values are written before
  ``strict`` raises about unexpected or missing keys. Optimizer states are untouched (as torch's
  load_state_dict leaves the optimizer alone). ``assign=True`` writes the values the same way: the
  Parameter objects stay, the hooks and the optimizer hold them.
"""
from __future__ import annotations

import types
from collections.abc import Callable

import torch

from ...errors import MisuseError
from .. import _dist
from ..phase import Phase
from . import model_guard
from .layout import Layout


class ModuleState:
    """Installs the state-dict hooks on every module of a ZeRO-3 model. See [Note: a partitioned model's
    state dict]. read_master(gid) / write_master(gid, fp32): this rank's shard of sub-group gid as fp32
    values (the master, or the parameter shard of frozen sub-groups), and writing it back (master and
    compute-dtype shard); fetch_shard(gid): this rank's compute-dtype shard, as gathered."""

    def __init__(self, model: torch.nn.Module, layout: Layout, params: dict[str, torch.nn.Parameter], coordinator,
                 fetch_shard: Callable[[int], torch.Tensor], read_master: Callable[[int], torch.Tensor],
                 write_master: Callable[[int, torch.Tensor], None], *, device: torch.device, group=None):
        self.model = model
        self.layout = layout
        self.params = params
        self.coordinator = coordinator
        self.fetch_shard = fetch_shard
        self.read_master = read_master
        self.write_master = write_master
        self.device = device
        self.group = group
        self.rank = _dist.world_and_rank(group)[1]
        self._name_of = {id(p): n for n, p in params.items()}
        self._saving: dict[int, torch.Tensor] | None = None  # id(param) -> full value, while a state_dict runs
        self._saving_root: torch.nn.Module | None = None
        self._handles: list = []
        def save_pre(module, prefix, keep_vars):
            self._save_pre(module, prefix, keep_vars)

        def save_post(module, destination, prefix, local_metadata):
            self._save_post(module, destination, prefix, local_metadata)

        for m in model.modules():  # plain functions: torch marks the post-hook with an attribute
            self._handles.append(m.register_state_dict_pre_hook(save_pre))
            self._handles.append(m.register_state_dict_post_hook(save_post))
            if self._own(m):
                m._load_from_state_dict = types.MethodType(_load_hook(self), m)  # type: ignore[method-assign]
                self._handles.append(_InstanceAttr(m, "_load_from_state_dict"))
        self._handles += model_guard.install(self)  # [Note: whole-model operations on a ZeRO-3 model]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _own(self, m: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
        """m's own managed parameters by local name."""
        return {n: p for n, p in m._parameters.items() if p is not None and id(p) in self._name_of}

    def check_idle(self, what: str) -> None:
        c = self.coordinator
        if c.phase is not Phase.IDLE or c.stats().in_forward:
            raise MisuseError(
                f"{what} of a ZeRO-3 model cannot run inside its forward or backward (phase {c.phase.value}): its "
                f"parameters are partitioned, and gathering them there would interleave with the hooks' "
                f"collectives. Call it between steps (after backward, or before the next forward)")

    # -- full values ------------------------------------------------------------------------------------
    def gather_values(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Canonical name -> full value (CPU, compute dtype) of `names`, gathered bucket by bucket (one bucket
        alive at a time). Collective at world size N: every rank asks for the same names."""
        lay = self.layout
        out: dict[str, torch.Tensor] = {}
        gids: set[int] = set()
        for n in names:
            shape, dtype, _rg = lay.specs[n]
            out[n] = torch.empty(shape, dtype=dtype)
            gids.update(lay.param_gids[n])
        wanted = set(names)
        for gid in sorted(gids):
            b = lay.bucket(gid)
            shard = self.fetch_shard(gid).to(self.device)
            full = torch.empty(b.numel, dtype=b.dtype, device=self.device)
            with torch.profiler.record_function("tierstore::state_dict_gather"):
                _dist.all_gather(shard, full, self.group, quantized=False)  # exact values: never qwZ here
            del shard
            for pc in b.pieces:
                if pc.name in wanted:
                    out[pc.name].view(-1)[pc.param_offset:pc.param_offset + pc.numel].copy_(full[pc.offset:pc.end])
            del full
        return out

    # -- state_dict -------------------------------------------------------------------------------------
    def _save_pre(self, module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
        if self._saving is not None and prefix:  # a submodule of the state_dict call in progress
            return
        self._saving = None
        self.check_idle("state_dict()")
        seen: dict[int, torch.nn.Parameter] = {}
        for p in module.parameters():
            if id(p) in self._name_of:
                seen[id(p)] = p
        if keep_vars:
            empty = [self._name_of[i] for i, p in seen.items()
                     if p.data.numel() != _numel(self.layout, self._name_of[i])]
            if empty:
                raise MisuseError(
                    f"state_dict(keep_vars=True) of a ZeRO-3 model asks for the Parameter objects, and {empty[:3]} "
                    f"are partitioned now (empty .data). Use state_dict() (full values, gathered) or call it "
                    f"inside `with opt.gathered():` / tierstore.zero.GatheredParameters(...)")
            vals: dict[int, torch.Tensor] = dict(seen)
        else:
            got = self.gather_values([self._name_of[i] for i in seen])
            vals = {i: got[self._name_of[i]] for i in seen}
        self._saving, self._saving_root = vals, module

    def _save_post(self, module: torch.nn.Module, destination: dict, prefix: str, local_metadata) -> None:
        vals = self._saving
        own = self._own(module)
        try:
            for n, p in own.items():
                key = prefix + n
                if key not in destination:
                    continue
                if vals is None or id(p) not in vals:
                    raise MisuseError(f"state_dict(): the full value of {key!r} was not gathered (an earlier "
                                      f"state_dict call was interrupted?); call state_dict() again on the model")
                destination[key] = vals[id(p)]
        finally:
            if module is self._saving_root:
                self._saving, self._saving_root = None, None

    # -- load_state_dict --------------------------------------------------------------------------------
    def load_into_shards(self, values: dict[str, torch.Tensor]) -> None:
        """Write full values (canonical name -> tensor of the parameter's shape) into this rank's shards of
        every bucket they touch: master and compute-dtype shard; held buckets too. No collective."""
        if not values:
            return
        self.check_idle("load_state_dict()")
        lay = self.layout
        coord = self.coordinator
        coord.prefetcher.drop()  # shards read ahead are the old values
        by_gid: dict[int, list[str]] = {}
        for n in values:
            for gid in lay.param_gids[n]:
                by_gid.setdefault(gid, []).append(n)
        live = coord.residency.live
        for gid in sorted(by_gid):
            b = lay.bucket(gid)
            sl = b.shard_slice(self.rank)
            lo, hi = sl.start, sl.stop
            names = set(by_gid[gid])
            master = None
            for pc, start, stop in b.overlapping(lo, hi):
                if pc.name not in names:
                    continue
                if master is None:
                    master = self.read_master(gid)
                at = pc.param_offset + start - pc.offset
                master[start - lo:stop - lo].copy_(values[pc.name].reshape(-1)[at:at + stop - start])
            if master is not None:
                self.write_master(gid, master)
                del master
            if gid in live:
                full = live[gid]
                for pc in b.pieces:
                    if pc.name in names:
                        v = values[pc.name].reshape(-1)
                        full[pc.offset:pc.end].copy_(v[pc.param_offset:pc.param_offset + pc.numel])
        for gid in sorted(by_gid):
            if gid in live:
                coord.residency.materialize(gid)  # parameters assembled from several buckets: a fresh copy


def _numel(layout: Layout, name: str) -> int:
    n = 1
    for s in layout.specs[name][0]:
        n *= s
    return n


def _load_hook(ms: ModuleState):
    """The `_load_from_state_dict` of a module with managed parameters ([Note: a partitioned model's state
    dict]): torch's checks and messages for the managed keys, torch's own method for the rest."""

    def _load_from_state_dict(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        own = ms._own(module)
        values: dict[str, torch.Tensor] = {}
        for n, p in own.items():
            key = prefix + n
            if key not in state_dict:
                if strict:
                    missing_keys.append(key)
                continue
            v = state_dict[key]
            if not torch.overrides.is_tensor_like(v):
                error_msgs.append(f'While copying the parameter named "{key}", expected torch.Tensor or Tensor-like '
                                  f"object from checkpoint but received {type(v)}")
                continue
            shape = torch.Size(ms.layout.specs[ms._name_of[id(p)]][0])
            if len(shape) == 0 and v.dim() == 1 and v.shape[0] == 1:
                v = v[0]
            if v.shape != shape:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {v.shape} from checkpoint, "
                                  f"the shape in current model is {shape}.")
                continue
            if v.is_meta:
                error_msgs.append(f"{key}: the checkpoint's value is on the meta device (no data); a ZeRO-3 model "
                                  f"can only load real values")
                continue
            values[ms._name_of[id(p)]] = v.detach()
        n_unexpected = len(unexpected_keys)
        full = module.__dict__["_parameters"]
        module.__dict__["_parameters"] = {n: p for n, p in full.items() if n not in own}
        try:  # buffers, unmanaged parameters, unexpected keys and the module's load pre-hooks: torch's method
            type(module)._load_from_state_dict(module, state_dict, prefix, local_metadata, strict, missing_keys,
                                               unexpected_keys, error_msgs)
        finally:
            module.__dict__["_parameters"] = full
        # hidden from torch's method, the managed keys looked unexpected to it
        mine = {prefix + n for n in own}
        unexpected_keys[n_unexpected:] = [k for k in unexpected_keys[n_unexpected:] if k not in mine]
        with torch.no_grad():
            ms.load_into_shards(values)

    return _load_from_state_dict


class _InstanceAttr:
    """Handle that takes back an instance-level attribute set by ModuleState."""

    def __init__(self, module: torch.nn.Module, name: str):
        self.module, self.name = module, name

    def remove(self) -> None:
        self.module.__dict__.pop(self.name, None)
