"""load_checkpoint: this rank's shards rebuilt under the loading optimizer's own layout and world size from
the records of the saving run's, one destination sub-group at a time, verified in full before anything is
imported (verify.py).

[Note: streaming save and load]
Save reads one sub-group (master and states, from whatever tier) from the store, appends its records to the
rank file and drops it before reading the next, so its memory is about one sub-group whatever the model
size. Load builds this rank's shards one destination sub-group at a time: ``partition.reshard_copies`` (what
``reshard_shards`` is built on) lists, for this rank only, which runs of which source shards make each
destination shard; the source records are read as needed, keeping only the last source sub-group read (the
copies go through both plans in model order, so a source record is normally read once). Memory: one source
and one destination sub-group.

[Note: resharding on load]
Every shard file holds fp32 shards of buckets of the layout the saving run used. A load rebuilds this rank's
shards under its own layout over fp32 twins of both plans (see [Note: fp32 twin plans] in params/layout.py); states
with one element per parameter element (exp_avg, sum, momentum_buffer ...) move the same way. Sub-groups
do not all step together: one whose parameters never got a gradient has no states yet, and one skipped on
some steps has its own `step` ([Note: skipped parameters] in skipped.py). So the state keys are read per
source sub-group: a destination sub-group takes the per-element states its sources hold (elements from a
source without one get the value before a first step: 0, or the optimizer's eager initial state), its
scalar states from the first of its sources that was stepped -- exact when the layouts match, the usual
resume; merged onto another layout, sources with different counts share that one -- and no states at all
when none of its sources was stepped (its first step creates them, as in a new run). Tiers are whatever
the loading optimizer's config says.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from ...errors import TierstoreValueError
from ...partition import Plan, reshard_copies
from .. import _dist, keys
from ..params.layout import fp32_twin
from . import args as ckpt_args
from . import frozen as frozen_ckpt
from . import verify as ckpt_verify
from .meta import read_meta, source_layout
from .records import Checkpoint, check


def _assemble(ck: Checkpoint, src: Plan, dst: Plan, s_gids: list[int], rank: int, roles: list[str],
              dtype: torch.dtype, device, has: dict[int, list[str]] | None = None, fill=None):
    """Yield (destination bucket, {role: this rank's shard}, [source buckets it draws on, in order]) one bucket
    at a time, each shard built from the source records ``<src gid>.<role>`` of every source rank it overlaps.
    has[source bucket] -> the roles that source has records for (default: all); a role none of the sources
    of the destination bucket (on any rank, so every rank of it agrees) holds is left out of its dict, and
    elements of a role from a source without it are fill[role] (default 0). See [Note: streaming save and
    load]."""
    by_dst: dict[int, list] = {}  # this rank's copies
    srcs_of: dict[int, list[int]] = {}  # source buckets of every rank's shard of the destination bucket
    for c in reshard_copies(src, dst):  # sorted by source: model order
        if c.dst_rank == rank:
            by_dst.setdefault(c.dst_bucket, []).append(c)
        if c.src_bucket not in srcs_of.setdefault(c.dst_bucket, []):
            srcs_of[c.dst_bucket].append(c.src_bucket)
    fill = fill or {}
    for b in dst.buckets:
        copies = by_dst.get(b.index, [])
        srcs = srcs_of.get(b.index, [])
        present = {r for sb in srcs for r in (has[sb] if has is not None else roles)}
        out = {role: torch.full((b.shard_numel,), fill.get(role, 0.0), dtype=dtype, device=device)
               for role in roles if role in present}
        for c in copies:
            for role in (has[c.src_bucket] if has is not None else roles):
                if role in out:
                    s = ck.record(c.src_rank, s_gids[c.src_bucket], role, src.buckets[c.src_bucket].shard_numel)
                    out[role][c.dst_offset:c.dst_offset + c.numel].copy_(
                        s.reshape(-1)[c.src_offset:c.src_offset + c.numel])
        yield b.index, out, srcs
        del out  # before the next bucket's: one destination sub-group at a time


def load_checkpoint(opt, directory: str | os.PathLike) -> Any:
    """Load the latest checkpoint in `directory` into `opt` (every rank calls it), resharding to this world
    size and layout, one sub-group at a time; returns this rank's client_state ([Note: client state] in
    save.py). See [Note: resharding on load]. A load that fails leaves `opt` as it was, or unusable,
    saying so ([Note: a failed load changes nothing] in verify.py)."""
    ckpt_args.optimizer(opt, "load_checkpoint", usable=False)  # a load is what makes an unusable one whole
    directory = ckpt_args.directory(directory, "load_checkpoint")
    got: dict[str, Any] = {}  # read in the first pass: inside it, a rank that cannot read them fails every rank

    def plan():
        if not got:
            sub, body = read_meta(directory)
            got["ck"] = ck = Checkpoint(sub, body)
            got["client"] = ck.rank(opt.rank if opt.rank < body["world_size"] else 0).client_state()
        return _load(opt, got["ck"], got["ck"].body)
    try:
        ckpt_verify.verify_then_import(opt, plan, lambda item: _import(opt, item))
    finally:
        if "ck" in got:
            got["ck"].close()
        if opt.unusable is not None:  # partly loaded: what is gathered may be from before
            opt.coordinator.release_all()
    opt.zero_grad()
    opt.coordinator.release_all()
    _dist.barrier(opt.group)
    return got["client"]


def _import(opt, item: tuple) -> None:
    """Put one item _load yields into the optimizer."""
    kind = item[0]
    if kind == "param":
        _k, gid, shard = item
        opt.store.put(keys.param(gid), shard.to(opt.device, opt.config.compute_dtype), tier=opt.config.params)
    elif kind == "subgroup":
        _k, gid, master, state, aux = item
        opt.import_subgroup(gid, master, state, aux)
    elif kind == "buffer":
        _k, b, value = item
        b.data.copy_(value.to(b.dtype))
    else:  # "meta"
        body = item[1]
        opt.set_hyperparams(body["param_groups"])
        opt.load_scaler_state(body["scaler"])
        opt.steps = body["steps"]


def _load(opt, ck: Checkpoint, body: dict):
    """Yield what loading the checkpoint into `opt` imports, one item at a time, every record read (and
    crc-checked) before the item it belongs to; `opt` is only read: ("param", gid, fp32 shard) of a frozen
    sub-group, ("subgroup", gid, master, states, aux), ("buffer", the model's buffer, value), ("meta", body)
    for the hyperparameters, loss scaler and steps. See [Note: a failed load changes nothing] in
    verify.py."""
    src = source_layout(body)
    if len(src) != len(opt.layout.groups):
        raise TierstoreValueError(f"the checkpoint has {len(src) - 1} parameter groups; this optimizer has "
                                  f"{len(opt.layout.groups) - 1}")
    me = opt.rank
    # checked before anything is yielded: hyperparameters, the buffers' shapes, every sub-group's aux state
    meta = os.path.join(ck.sub, "meta.json")
    _check_hyperparams(opt.param_groups, body["param_groups"], meta)
    if "frozen" in body:  # [Note: frozen parameters left out of a checkpoint] in frozen.py
        frozen_ckpt.check(opt, body["frozen"], body["compute_dtype"], meta)
    bfile = ck.file("buffers.bin")
    for n, b in opt.model.named_buffers():
        shape = bfile.shape(n)  # None: the checkpoint has no such buffer
        if shape is not None and shape != tuple(b.shape):
            raise TierstoreValueError(f"buffer {n!r} has shape {list(shape)} in {bfile.path} and "
                                      f"{list(b.shape)} in the model; build the same model")
    first = ck.rank(0)
    aux = {sg: first.aux_of(sg) for s_index, _p, s_gids in src if s_index >= 0 for sg in s_gids}
    for (s_index, s_plan, _g), gl in zip(src, opt.layout.groups):
        if s_index != gl.index or set(s_plan.params) != set(gl.plan.params):
            raise TierstoreValueError(f"parameter group {gl.index} holds other parameters in the checkpoint "
                                      f"({sorted(set(s_plan.params) ^ set(gl.plan.params))[:3]} differ); build "
                                      f"the same model and param_groups")
    for (_i, s_plan, s_gids), gl in zip(src, opt.layout.groups):
        if not gl.gids:
            continue
        if not gl.trainable and "frozen" in body:  # left out (checked above): the model's own values stay
            continue
        if not gl.trainable:
            # over fp32 twins too, so the compute dtype may differ from the saving run's
            for b, shard, _srcs in _assemble(ck, fp32_twin(s_plan), fp32_twin(gl.plan), s_gids, me, ["param"],
                                             torch.float32, "cpu"):
                yield "param", gl.gids[b], shard["param"]
            continue
        # per source sub-group: which states are per element (resharded) and which scalar; a sub-group no
        # step reached has none, and sub-groups skipped on some steps count their own `step`
        # ([Note: resharding on load])
        per_element: dict[int, list[str]] = {}
        scalars: dict[int, dict] = {}
        for sb, sg in enumerate(s_gids):
            names = [n[len(f"{sg}.state."):] for n in first.records if n.startswith(f"{sg}.state.")]
            per_element[sb] = [k for k in names
                               if first.shape(f"{sg}.state.{k}") == (s_plan.buckets[sb].shard_numel,)]
            scalars[sb] = {k: first.read(f"{sg}.state.{k}") for k in names if k not in per_element[sb]}
        all_keys = list(dict.fromkeys(k for sb in per_element for k in per_element[sb]))
        fresh = opt.initial_state_values(gl.gids[0])
        roles = ["master"] + [f"state.{k}" for k in all_keys]
        for b, shards, srcs in _assemble(
                ck, fp32_twin(s_plan), fp32_twin(gl.plan), s_gids, me, roles, torch.float32, "cpu",
                has={sb: ["master"] + [f"state.{k}" for k in ks] for sb, ks in per_element.items()},
                fill={f"state.{k}": fresh.get(k, 0.0) for k in all_keys}):
            st = {k: shards[f"state.{k}"] for k in all_keys if f"state.{k}" in shards}
            stepped = [sb for sb in srcs if per_element[sb] or scalars[sb] or aux[s_gids[sb]]]
            if stepped:  # scalars of the first source sub-group that was stepped (all of them agree when
                st.update({k: v.clone() for k, v in scalars[stepped[0]].items()})  # the layouts match)
            yield "subgroup", gl.gids[b], shards["master"], st, aux[s_gids[stepped[0]]] if stepped else {}
            del shards, st
    for n, b in opt.model.named_buffers():  # one at a time
        if n in bfile.records:
            yield "buffer", b, bfile.read(n)
    yield "meta", body


def _kind(v) -> str:
    if isinstance(v, torch.Tensor):
        return "number" if v.numel() == 1 else "sequence"
    if isinstance(v, bool) or isinstance(v, str) or isinstance(v, dict):
        return type(v).__name__
    if isinstance(v, (int, float)):
        return "number"
    return "sequence" if isinstance(v, (list, tuple)) else type(v).__name__


def _check_hyperparams(groups: list[dict], saved: list[dict], path: str) -> None:
    """Each saved hyperparameter must be of the kind (number, bool, str, sequence) the optimizer holds."""
    for i, (g, sv) in enumerate(zip(groups, saved)):
        for k, v in sv.items():
            cur = g.get(k)
            check(cur is None or v is None or _kind(cur) == _kind(v), path, f"param_groups[{i}][{k!r}]",
                   f"{str(v)[:40]} is a {_kind(v)}; the optimizer's is a {_kind(cur)}")

