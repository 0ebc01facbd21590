"""Parameters that got no gradient since zero_grad(): which sub-groups the step leaves out, which elements
of a stepped sub-group it puts back, and what a state created by the step holds there.

[Note: skipped parameters]
Like torch, a trainable parameter that got no gradient on any rank since zero_grad() is not stepped
(coordinator.grad_names, [Note: no gradient] in hooks/coordinator.py); a sub-group none of whose parameters got one is
left out of the step. A sub-group mixing both is stepped whole (zero gradient on the skipped elements), then
the skipped elements of the master and of every per-element state that existed before the step are put
back: the update is elementwise, so the rest is exactly what stepping only them gives. A per-element state
created by this very step gets, on the skipped elements, what one zero-gradient step makes of a fresh state
on a zero parameter (SkippedParams.fresh_state: 0 for Adam's moments and SGD's momentum, lr for Rprop's
step size; not what weight decay folded into their zero gradient would make) -- the values torch creates at
the parameter's first real step, except that SGD then starts that momentum at (1 - dampening) x grad where
torch starts it at grad. Scalar states (`step`, NAdam's mu_product, ASGD's eta and mu) stay per sub-group:
a parameter skipped while the rest of its sub-group stepped takes its bias corrections from the sub-group's
count, not its own as in torch (exact when it has a sub-group to itself, e.g. min_io_bytes=0). With 8-bit
states such a sub-group takes the unfused path, and requantizing moves the skipped elements' states by the
codec's rounding.
"""
from __future__ import annotations

import torch


class SkippedParams:
    """[Note: skipped parameters] for one Zero3Optimizer: ``plan`` (once per step) says which sub-groups to
    step and records this rank's runs of skipped elements in each; ``keep`` / ``restore`` put those elements
    back around the inner step. `param_groups`: the inner optimizer's (live: an LR scheduler's changes count);
    `templates`: each group's eager initial state (Zero3Optimizer._state_template)."""

    def __init__(self, layout, rank: int, optimizer_class, optimizer_kwargs: dict, param_groups: list[dict],
                 templates: list[dict], device: torch.device):
        self.layout = layout
        self.rank = rank
        self.optimizer_class = optimizer_class
        self.optimizer_kwargs = optimizer_kwargs
        self.param_groups = param_groups
        self.templates = templates
        self.device = device
        self.runs: dict[int, list[tuple[int, int]]] = {}  # gid -> this rank's skipped (start, stop), this step
        self._fresh: dict[int, dict[str, float]] = {}  # group -> fresh_state
        self.partly_skipped = 0  # sub-group steps that left some of their elements alone (OptimizerStats)

    def plan(self, got: set[str]) -> list[int]:
        """The sub-groups to step given `got` (the parameters that got a gradient, coordinator.grad_names), and
        this rank's runs of skipped elements in each (``runs``); the same sub-groups on every rank (grad_names
        is agreed)."""
        self.runs = {}
        gids = []
        for gid in self.layout.trainable_gids():
            b = self.layout.bucket(gid)
            names = {pc.name for pc in b.pieces}
            if not names & got:
                continue
            gids.append(gid)
            if names <= got:
                continue
            lo, hi = b.shard_slice(self.rank).start, b.shard_slice(self.rank).stop
            runs: list[tuple[int, int]] = []
            for pc, start, stop in b.overlapping(lo, hi):
                if pc.name in got:
                    continue
                if runs and runs[-1][1] == start - lo:
                    runs[-1] = (runs[-1][0], stop - lo)
                else:
                    runs.append((start - lo, stop - lo))
            if runs:
                self.runs[gid] = runs
        self.partly_skipped += len(self.runs)
        return gids

    def fresh_state(self, gi: int) -> dict[str, float]:
        """Per-element state keys the inner optimizer creates lazily, and what one step with a zero gradient
        makes of them (learnt once per group on a zero 1-element probe): Adam's moments 0, SGD's momentum 0,
        Rprop's step size lr. A skipped element of a state created by this step gets that value."""
        if gi not in self._fresh:
            probe = torch.zeros(1, device=self.device)
            opts = {k: v for k, v in self.param_groups[gi].items() if k != "params"}
            tmp = self.optimizer_class([{"params": [probe], **opts}], **self.optimizer_kwargs)
            probe.grad = torch.zeros(1, device=self.device)
            tmp.step()
            self._fresh[gi] = {k: float(v.reshape(-1)[0]) for k, v in tmp.state[probe].items()
                               if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == 1}
        return self._fresh[gi]

    def initial_state_values(self, gi: int) -> dict[str, float]:
        """Per-element state keys of group `gi` and the value an element has before its first real step: the
        eager initial state (Adagrad's sum) where the optimizer makes one, else fresh_state's."""
        vals = dict(self.fresh_state(gi))
        for k, v in self.templates[gi].items():
            if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == 1:
                vals[k] = float(v[0])
        return vals

    def keep(self, gid: int, gi: int, master: torch.Tensor, state: dict) -> list | None:
        """Before the inner step of sub-group `gid` (group `gi`): the skipped elements' values of the master
        and of every per-element state in `state`, and the fresh values of the states this step will create
        -- [(state key or None for the master, start, stop, values or fill)]; None when nothing is skipped."""
        runs = self.runs.get(gid)
        if not runs:
            return None
        n = master.numel()
        per_element = [(None, master)] + [(k, v) for k, v in state.items() if isinstance(v, torch.Tensor)
                                          and v.dim() == 1 and v.numel() == n]
        kept: list = [(k, a, e, v[a:e].clone()) for k, v in per_element for a, e in runs]
        kept += [(k, a, e, fill) for k, fill in self.fresh_state(gi).items() if k not in state for a, e in runs]
        return kept

    @staticmethod
    def restore(kept: list, master: torch.Tensor, new_state: dict) -> None:
        """After the inner step: put back what `keep` took."""
        for k, a, e, values in kept:
            if isinstance(values, float):  # a state created by this step: its fresh value
                dst = master if k is None else new_state.get(k)
                if isinstance(dst, torch.Tensor) and dst.dim() == 1 and dst.numel() == master.numel():
                    dst[a:e].fill_(values)
            else:  # a per-element state the step had (or the master)
                (master if k is None else new_state[k])[a:e].copy_(values)
