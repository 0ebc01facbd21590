"""The worker process of one torch or tierstore case of `bench optim` / `bench train` (see _harness.py and
[Note: one worker process per case] there): `python -m tierstore.bench._case SPEC_JSON`.

Cases: torch-fused / torch-foreach (torch.optim.AdamW in memory, the reference), host (Zero3Optimizer over
AdamW(fused=True), as the reference, with parameters, gradients, master and states on the host tier), nvme (all
of them on the nvme tier, the rest of the config its defaults), nvme8 (nvme with state_codec="dynamic8"),
nvme-plain (nvme with overlap_step=False), nvme-overlap / nvme8-overlap (overlap_step=True from the first
step), nvme-bf16 / nvme8-bf16 (compute_dtype=torch.bfloat16, fp32 / dynamic8 states), nvme-noreuse (nvme with
reuse_bytes=0: what is at hand is read again).
"""
from __future__ import annotations

import json
import os
import sys

TORCH_CASES: dict[str, dict] = {"torch-fused": {"fused": True}, "torch-foreach": {"foreach": True}}
# case -> (tier of everything, OffloadConfig fields other than the defaults; "compute_dtype" by name)
TIERSTORE_CASES: dict[str, tuple[str, dict]] = {
    "host": ("host", {}), "nvme": ("nvme", {}), "nvme8": ("nvme", {"state_codec": "dynamic8"}),
    "nvme-plain": ("nvme", {"overlap_step": False}), "nvme-overlap": ("nvme", {"overlap_step": True}),
    "nvme8-overlap": ("nvme", {"state_codec": "dynamic8", "overlap_step": True}),
    "nvme-bf16": ("nvme", {"compute_dtype": "bfloat16"}),
    "nvme8-bf16": ("nvme", {"compute_dtype": "bfloat16", "state_codec": "dynamic8"}),
    "nvme-noreuse": ("nvme", {"reuse_bytes": 0})}


def offload_config(case: str, spec: dict):
    """The OffloadConfig of a tierstore case."""
    import torch

    from ..zero import OffloadConfig

    tier, fields = TIERSTORE_CASES[case]
    fields = dict(fields)
    if "compute_dtype" in fields:
        fields["compute_dtype"] = getattr(torch, fields["compute_dtype"])
    return OffloadConfig(params=tier, optimizer_states=tier, gradients=tier,
                         nvme_paths=[os.path.join(spec["dir"], case)] if tier == "nvme" else None,
                         sub_group_bytes=spec["sub_group_bytes"], pinned_bytes=spec["pinned_bytes"], **fields)


def tier_bytes(opt) -> dict[str, int]:
    """Bytes moved so far: {tier_read, tier_written} for each tier from store.stats() (read = out of the tier,
    written = into it), and, where the optimizer counts them (OptimizerStats.disk_read / disk_written), the
    disk's bytes by kind: {disk_read_<kind>, disk_written_<kind>} (params, grads, master, states)."""
    s = opt.store.stats()
    out = {}
    for tier in ("host", "nvme"):
        if tier in s:
            out[f"{tier}_read"] = int(s[tier]["bytes_out"])
            out[f"{tier}_written"] = int(s[tier]["bytes_in"])
    st = opt.stats() if hasattr(opt, "stats") else None
    for direction in ("read", "written"):
        for kind, nbytes in (getattr(st, f"disk_{direction}", None) or {}).items():
            out[f"disk_{direction}_{kind}"] = int(nbytes)
    return out


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    from . import _harness

    _harness.setup(spec["threads"])
    import torch
    case = spec["case"]
    make, data, loss_fn, _tokens = _harness.build(spec)
    n = [0]

    def batch():
        x, y = data[n[0] % len(data)]
        n[0] += 1
        return x, y

    if case in TORCH_CASES:
        model = make()
        opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], **TORCH_CASES[case])

        def one_step() -> dict:
            x, y = batch()
            return _harness.timed_step(lambda: loss_fn(model, x, y), lambda loss: loss.backward(),
                                       lambda: (opt.step(), opt.zero_grad(set_to_none=True)))

        return _harness.serve(_harness.with_kernel_bytes(one_step), spec["warmup"])
    if case not in TIERSTORE_CASES:
        raise SystemExit(f"bench worker: unknown case {case!r}; use one of {[*TORCH_CASES, *TIERSTORE_CASES]}")
    from .. import zero

    cfg = offload_config(case, spec)
    with zero.Init(cfg):
        model = make()
    loss_fn = _harness.in_dtype(loss_fn, cfg.compute_dtype)
    zopt = zero.Zero3Optimizer(model, torch.optim.AdamW, config=cfg, lr=spec["lr"], fused=True)  # as torch-fused

    def step_and_zero() -> None:
        zopt.step()
        zopt.zero_grad()
        # [Note: a timed step ends when its I/O does]
        # The parent leaves each worker idle while it times the other cases; reads the step started ahead of
        # the next forward, and its writes still in flight, would finish there unseen -- free I/O no training
        # loop gets. So the timed step waits for them (at worst this hides their overlap with the next
        # forward's start), and their bytes are counted in the step that moved them.
        zopt.synchronize()

    def zero_step() -> dict:
        x, y = batch()
        before = tier_bytes(zopt)
        out = _harness.timed_step(lambda: loss_fn(model, x, y), lambda loss: loss.backward(), step_and_zero)
        after = tier_bytes(zopt)
        out["bytes"] = {k: after[k] - before.get(k, 0) for k in after}
        return out

    try:
        return _harness.serve(_harness.with_kernel_bytes(zero_step), spec["warmup"])
    finally:
        zopt.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
