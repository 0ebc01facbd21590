"""The model's full parameter values on demand from a Zero3Optimizer's shards: ``opt.gathered()`` (the
parameters hold their full values for a while, changes kept or dropped) and ``opt.full_state_dict()``.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from ...errors import TierstoreValueError


@contextmanager
def gathered(opt, params=None, *, modifier_rank: int | None = None):
    """Zero3Optimizer.gathered (see its docstring and [Note: gathered parameters] in gathered.py)."""
    if params is None:
        names = list(opt._params)
    else:
        by_id = {id(p): n for n, p in opt._params.items()}
        given = [params] if isinstance(params, torch.Tensor) else list(params)
        foreign = [p for p in given if id(p) not in by_id]
        if foreign:
            raise TierstoreValueError(f"gathered(params=...): {len(foreign)} of the parameters given are not "
                                      f"managed by this Zero3Optimizer")
        names = list(dict.fromkeys(by_id[id(p)] for p in given))
    opt.check_usable("gathered")
    opt.module_state.check_idle("gathered()")
    # values it changes must not reach a kept bucket ([Note: kept at the turn] in turn.py)
    opt.coordinator.release_kept()
    opt._stepper.drop_at_hand()
    gids = sorted({g for n in names for g in opt.layout.param_gids[n]})
    before = set(opt.coordinator.residency.live)
    # copies: changes made inside stay there ([Note: gathering at world size 1] in hooks/coordinator.py)
    opt.coordinator.views = False
    try:
        opt.coordinator.gather(gids)
    finally:
        opt.coordinator.views = True
    ok = False
    try:
        yield opt.model
        ok = True
    finally:
        try:
            if ok and modifier_rank is not None:
                values = {}
                for n in names:
                    v = opt._params[n].data
                    if opt.world_size > 1:
                        import torch.distributed as dist
                        src = dist.get_global_rank(opt.group, modifier_rank) if opt.group is not None \
                            else modifier_rank
                        dist.broadcast(v, src=src, group=opt.group)
                    values[n] = v
                with torch.no_grad():
                    opt.module_state.load_into_shards(values)
        finally:
            for gid in gids:
                if gid not in before:
                    opt.coordinator.release(gid)


def full_state_dict(opt) -> dict[str, torch.Tensor]:
    """Zero3Optimizer.full_state_dict."""
    opt.check_usable("full_state_dict")
    vals = opt.module_state.gather_values(list(opt._params))  # one bucket alive at a time; CPU tensors
    out = {alias: vals[canon] for alias, canon in opt._aliases.items()}
    for n, b in opt.model.named_buffers():
        out[n] = b.detach().clone()
    return out
