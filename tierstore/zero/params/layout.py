"""The adapter between the partition plan and the optimizer: parameter groups, global sub-group ids, fp32 twins.

[Note: one plan per parameter group]
A bucket of ``tierstore.partition.plan`` packs consecutive small parameters of a dtype together, so one
bucket could mix parameters of two optimizer groups (say, with and without weight decay). The inner
optimizer steps one flat fp32 tensor per bucket with one group's hyperparameters, so every parameter group
(and the frozen parameters, which are gathered but never stepped) gets its own plan. A sub-group of the step
pipeline is one bucket of one plan, named by a global id ``gid``.

[Note: fp32 twin plans]
The plan's buckets have the parameters' (compute) dtype; masters and optimizer states are fp32 shards of
the same elements. ``fp32_twin`` is the same layout with every dtype float32 (shard offsets in elements are
unchanged and stay aligned because 4 bytes is a multiple of every smaller itemsize), so resharding a
checkpoint's fp32 shards goes through ``partition.reshard_shards`` unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...errors import TierstoreValueError
from ...partition import Plan, plan


@dataclass
class GroupLayout:
    index: int  # position in param_groups; -1 for the frozen parameters
    plan: Plan
    names: list[str]
    options: dict = field(default_factory=dict)  # the group's hyperparameter overrides
    gids: list[int] = field(default_factory=list)  # global sub-group id of each bucket

    @property
    def trainable(self) -> bool:
        return self.index >= 0


@dataclass(frozen=True)
class SubGroup:
    gid: int
    group: int  # index into Layout.groups
    bucket: int  # index into that group's plan.buckets


def fp32_twin(p: Plan) -> Plan:
    """The same layout with every dtype float32. See [Note: fp32 twin plans]."""
    d = p.to_dict()
    d["params"] = [[n, s, "float32"] for n, s, _dt in d["params"]]
    for b in d["buckets"]:
        b["dtype"] = "float32"
    return Plan.from_dict(d)


class Layout:
    """Every parameter of a model, by group, in buckets sharded over ranks."""

    def __init__(self, named: list[tuple[str, tuple[int, ...], torch.dtype, bool]],
                 groups: list[tuple[list[str], dict]], world_size: int, *, min_io_bytes: int, bucket_bytes: int,
                 frozen_groups: list[list[str]] | None = None):
        """named: (name, shape, dtype, requires_grad) in model order, tied parameters once.
        groups: (names, options) per optimizer group; trainable parameters not named go to the first group.
        frozen_groups: the frozen parameters cut into these runs, each laid out in its own plan, so no bucket
        holds parameters of two runs (default: one plan for all of them)."""
        self.world_size = world_size
        self.specs = {n: (tuple(s), dt, rg) for n, s, dt, rg in named}
        assigned: dict[str, int] = {}
        for gi, (names, _opts) in enumerate(groups):
            for n in names:
                if n not in self.specs:
                    raise TierstoreValueError(f"param_groups[{gi}] names {n!r}, which is not a parameter of the model")
                if n in assigned:
                    raise TierstoreValueError(f"parameter {n!r} is in param_groups {assigned[n]} and {gi}; "
                                              f"give each parameter one group")
                assigned[n] = gi
        members: list[list[str]] = [[] for _ in groups]
        frozen: list[str] = []
        for n, (_s, _dt, rg) in self.specs.items():
            if not rg:
                frozen.append(n)
            else:
                members[assigned.get(n, 0)].append(n)
        cap = max(bucket_bytes, world_size * 4096)
        self.groups: list[GroupLayout] = []
        if frozen_groups is not None:
            listed = [n for g in frozen_groups for n in g]
            if sorted(listed) != sorted(frozen):
                raise TierstoreValueError("frozen_groups must name every frozen parameter exactly once")
        runs = [(-1, list(g)) for g in frozen_groups] if frozen_groups is not None else [(-1, frozen)]
        for gi, names in list(enumerate(members)) + runs:
            spec = {n: (self.specs[n][0], self.specs[n][1]) for n in names}
            pl = plan(spec, world_size, min_io_bytes=min_io_bytes, bucket_bytes=cap)
            self.groups.append(GroupLayout(gi, pl, names, dict(groups[gi][1]) if gi >= 0 else {}))
        self.subgroups: list[SubGroup] = []
        for li, g in enumerate(self.groups):
            for bi in range(len(g.plan.buckets)):
                g.gids.append(len(self.subgroups))
                self.subgroups.append(SubGroup(len(self.subgroups), li, bi))
        # name -> gids holding a piece of it
        self.param_gids: dict[str, list[int]] = {n: [] for n in self.specs}
        for sg in self.subgroups:
            for p in self.bucket(sg.gid).pieces:
                if sg.gid not in self.param_gids[p.name]:
                    self.param_gids[p.name].append(sg.gid)

    def group_of(self, gid: int) -> GroupLayout:
        return self.groups[self.subgroups[gid].group]

    def bucket(self, gid: int):
        sg = self.subgroups[gid]
        return self.groups[sg.group].plan.buckets[sg.bucket]

    def trainable_gids(self) -> list[int]:
        return [sg.gid for sg in self.subgroups if self.groups[sg.group].trainable]

    def shard_numel(self, gid: int) -> int:  # elements
        return self.bucket(gid).shard_numel

    def to_dict(self) -> dict:
        return {"groups": [{"index": g.index, "plan": g.plan.to_dict()} for g in self.groups]}
