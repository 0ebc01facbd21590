"""The inner torch optimizer of Zero3Optimizer: which optimizer classes it can drive (elementwise ones), the
parameter groups given to it, and the inner optimizer itself, built over one flat placeholder per trainable
sub-group ([Note: thin wrapper over an elementwise optimizer] in optimizer.py).
"""
from __future__ import annotations

import torch

from ...errors import TierstoreValueError
from ..params.layout import Layout

ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "Rprop", "ASGD")


def check_elementwise(cls, elementwise_ok: bool) -> None:
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TierstoreValueError(f"optimizer_class={cls!r} must be a torch.optim.Optimizer subclass, e.g. "
                                  f"torch.optim.AdamW (the class, not an instance)")
    ok = cls.__module__.startswith("torch.optim") and cls.__name__ in ELEMENTWISE
    if not ok and not elementwise_ok:
        raise TierstoreValueError(
            f"{cls.__module__}.{cls.__name__} is not a known elementwise optimizer; Zero3Optimizer steps flat "
            f"shards of many parameters at once, which is only the same optimizer when the update is "
            f"elementwise. Supported: torch.optim.{', torch.optim.'.join(ELEMENTWISE)}. If yours is elementwise "
            f"(no per-tensor norms, factored or matrix states), pass elementwise_ok=True")


def normalise_groups(param_groups, aliases: dict[str, str], by_id: dict[int, str]) -> list[tuple[list[str], dict]]:
    """[(canonical parameter names, options), ...] of the `param_groups` given to Zero3Optimizer."""
    if param_groups is None:
        return [([], {})]
    if not isinstance(param_groups, (list, tuple)) or not param_groups:
        raise TierstoreValueError("param_groups must be a non-empty list of dicts with a 'params' key")
    out = []
    for i, g in enumerate(param_groups):
        if not isinstance(g, dict) or "params" not in g:
            raise TierstoreValueError(f"param_groups[{i}] must be a dict with a 'params' key")
        names = []
        for p in g["params"]:
            if isinstance(p, str):
                names.append(aliases.get(p, p))
            elif isinstance(p, torch.Tensor) and id(p) in by_id:
                names.append(by_id[id(p)])
            else:
                raise TierstoreValueError(f"param_groups[{i}]['params'] holds {type(p).__name__}; give "
                                          f"parameter names or the model's parameters")
        out.append((names, {k: v for k, v in g.items() if k != "params"}))
    return out


def state_template(cls, group: dict, kwargs: dict) -> dict:
    """What the inner optimizer puts in a fresh parameter's state at construction (Adagrad's sum), learnt
    on a 1-element tensor: 1-element tensors become fill values, 0-d tensors and others are copied."""
    probe = torch.zeros(1)
    opts = {k: v for k, v in group.items() if k != "params"}
    tmp = cls([{"params": [probe], **opts}], **kwargs)
    return dict(tmp.state.get(probe, {}))


def build_inner(layout: Layout, cls, kwargs: dict, device: torch.device
                ) -> tuple[torch.optim.Optimizer, dict[int, torch.Tensor], dict[int, int], list[dict]]:
    """(the inner optimizer over one empty fp32 placeholder per trainable sub-group, gid -> its placeholder,
    gid -> its index in inner.param_groups, each group's initial-state template)."""
    placeholder: dict[int, torch.Tensor] = {}
    gid_group: dict[int, int] = {}
    inner_groups = []
    for gl in layout.groups:
        if not gl.trainable:
            continue
        phs = []
        for gid in gl.gids:
            ph = torch.empty(0, dtype=torch.float32, device=device)
            placeholder[gid] = ph
            gid_group[gid] = gl.index
            phs.append(ph)
        inner_groups.append({"params": phs, **gl.options})
    inner = cls(inner_groups, **kwargs)
    inner.state.clear()  # eager states of 0-element placeholders; real ones come from the templates
    return inner, placeholder, gid_group, [state_template(cls, g, kwargs) for g in inner_groups]
