"""Helpers of the Zero3Optimizer tests: a small-bucket config and the comparison with a torch run."""
from __future__ import annotations

import torch

from tierstore.zero import OffloadConfig

from .models import batches, loss_fn, make_pair


def cfg(tmp_path, params="device", states="host", grads="host", **kw) -> OffloadConfig:
    """Tiers by position; buckets small enough that even Net has several sub-groups."""
    kw.setdefault("min_io_bytes", 1024)  # bytes
    kw.setdefault("sub_group_bytes", 8192)  # bytes
    return OffloadConfig(params=params, optimizer_states=states, gradients=grads,
                         nvme_paths=[str(tmp_path / "nvme")], **kw)


def max_rel(full: dict, ref_model: torch.nn.Module) -> float:
    """The largest difference between `full` (a full_state_dict) and `ref_model`'s parameters, relative to
    each parameter's largest magnitude."""
    worst = 0.0
    for n, p in ref_model.named_parameters():
        d = (full[n].float() - p.detach()).abs().max().item()
        worst = max(worst, d / max(p.detach().abs().max().item(), 1e-12))
    return worst


_REFERENCE: dict = {}


def reference(opt_cls, kwargs: dict, steps: int) -> torch.nn.Module:
    """make_pair()'s Net trained `steps` steps of batches() by the plain torch optimizer; computed once per
    (optimizer, kwargs, steps) in a process."""
    key = (opt_cls, repr(sorted(kwargs.items())), steps)
    if key not in _REFERENCE:
        ref_m, _ = make_pair()
        ref = opt_cls(ref_m.parameters(), **kwargs)
        for x, y in batches(steps):
            loss_fn(ref_m, x, y).backward()
            ref.step()
            ref.zero_grad()
        _REFERENCE[key] = ref_m
    return _REFERENCE[key]


def flip_byte(path: str, offset: int) -> None:
    """Damage a file in place: flip one bit of the byte at `offset` (a checksum must catch it)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))
