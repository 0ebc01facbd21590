"""consolidate: the full model of a checkpoint as one plain state_dict, read in one process whatever world
size saved it."""
from __future__ import annotations

import os

import torch

from ...errors import CorruptionError
from ..params.layout import fp32_twin
from . import args as ckpt_args
from . import directory as ckpt_dir
from .meta import read_meta, source_layout
from .records import Checkpoint


def consolidate(directory: str | os.PathLike, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The full model of the latest checkpoint in `directory` as a plain state_dict (every parameter name,
    tied aliases included, and the buffers), for torch.save / safetensors. Runs in one process.

    dtype: of the parameters (default: the compute dtype of the run that saved it; float32 gives the
    masters themselves)."""
    dtype = ckpt_args.dtype(dtype)
    directory = ckpt_args.directory(directory, "consolidate")
    for _attempt in range(ckpt_dir.RETRIES):
        sub, body = read_meta(directory)
        try:
            return _consolidate(sub, body, dtype)
        except CorruptionError as e:  # a file gone because a writer pruned the checkpoint is not damage
            # ([Note: readers and a concurrent cleanup] in directory.py)
            if not ckpt_dir.vanished(directory, sub, e.filename):
                raise
    raise ckpt_dir.removed_error(directory, sub)


def _consolidate(sub: str, body: dict, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    ck = Checkpoint(sub, body)
    try:
        world = body["world_size"]
        cdt = getattr(torch, body["compute_dtype"])
        values: dict[str, torch.Tensor] = {}
        for index, plan, gids in source_layout(body):
            # left out of the checkpoint ([Note: frozen parameters left out of a checkpoint] in frozen.py)
            if index < 0 and "frozen" in body:
                continue
            role = "master" if index >= 0 else "param"
            buckets = []
            for b, gid in enumerate(gids):
                n = plan.buckets[b].shard_numel  # elements
                full = torch.cat([ck.record(r, gid, role, n).reshape(-1).to(torch.float32) for r in range(world)])
                buckets.append(full.to(plan.buckets[b].dtype) if index < 0 else full)
            if index >= 0:
                plan = fp32_twin(plan)
            for name, t in plan.unflatten(buckets).items():
                values[name] = t.to(dtype or cdt)
        out = {alias: values[canon] for alias, canon in body["aliases"].items() if canon in values}
        out.update(ck.buffers())
        return out
    finally:
        ck.close()

