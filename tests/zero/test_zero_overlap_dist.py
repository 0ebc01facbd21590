"""The overlapped step at world size N (gloo on CPU): OffloadConfig(overlap_step=True) steps each sub-group
whose reduce-scatter is final while backward goes on, and the result is bit for bit that of overlap_step=False
-- on the host and nvme tiers, with gradient accumulation (only the last micro-batch steps) and with
clip_mode="previous_norm" -- and close to one process on the full batch with torch's AdamW. See [Note:
overlapped step at world size N] in tierstore/zero/hooks/finals.py."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

from tests.support import max_rel, run_ranks
from tierstore.zero import OffloadConfig, Zero3Optimizer

STEPS = 6
D = 24  # wide enough that every Linear is a bucket of its own, uneven over 3 ranks


class Deep(nn.Module):
    """Five Linear layers: a backward long enough that sub-groups are final well before it ends."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(4))
        self.head = nn.Linear(D, 4)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


class TwoHeads(Deep):
    """Deep with a second head; rank r's loss reads head r % 2 only, so each head's gradient is complete on
    some ranks only: its bucket is reduced during backward but no rank may step it there (deferred)."""

    def __init__(self):
        super().__init__()
        self.other = nn.Linear(D, 4)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x), self.other(x)


def model(heads: bool = False) -> Deep:
    torch.manual_seed(0)
    return TwoHeads() if heads else Deep()


def data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(12, D, generator=g), torch.randn(12, 4, generator=g)) for _ in range(n)]


def loss_of(m, x, y, rank=0):
    out = m(x)
    if isinstance(out, tuple):
        out = out[rank % 2]
    return ((out - y) ** 2).mean()


CASES = {  # name -> (tier of params, states and gradients, micro-batches per step, clip max_norm or None)
    "host": ("host", 1, None),
    "nvme": ("nvme", 1, None),
    "host_acc": ("host", 2, None),
    "nvme_acc_clip": ("nvme", 2, 0.05),
    "host_clip": ("host", 1, 0.05),
    "nvme_heads": ("nvme", 1, None),  # TwoHeads, a rank-dependent loss
    "host_clip_config": ("host", 1, 0.05),  # OffloadConfig(gradient_clipping=...): step() takes the norm
}


def run_case(rank, world, root, name, overlap):
    """One training run on this rank: STEPS steps of `micro` micro-batches (all but the last inside
    accumulating()), clip_grad_norm_ with clip_mode="previous_norm" when the case clips. Returns the full
    parameters, the norms, the optimizer's and hooks' counters, and per step the sub-group steps the optimizer
    had started when the gradient of the model's input -- the last of the backward -- was computed."""
    tier, micro, clip = CASES[name]
    heads = name.endswith("heads")
    m = model(heads)
    cfg = OffloadConfig(params=tier, optimizer_states=tier, gradients=tier, min_io_bytes=0, sub_group_bytes=4096,
                        nvme_paths=[os.path.join(root, f"{name}-{overlap}")], overlap_step=overlap,
                        clip_mode="previous_norm" if clip else "exact", prefetch_depth=1,
                        gradient_clipping=clip if name.endswith("config") else None)
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, config=cfg)
    seen: list[int] = []
    norms = []
    try:
        batches = data(STEPS * micro)
        for i in range(0, len(batches), micro):
            at_input: list[int] = []
            before = opt.stats().overlapped
            for j, (x, y) in enumerate(batches[i:i + micro]):
                xs = x.chunk(world)[rank].clone().requires_grad_()
                xs.register_hook(lambda g, b=before, out=at_input: out.append(opt.stats().overlapped - b))
                loss = loss_of(m, xs, y.chunk(world)[rank], rank) / micro
                if j == micro - 1:
                    loss.backward()
                else:
                    with opt.accumulating():
                        loss.backward()
            seen.append(at_input[-1])
            if clip and not name.endswith("config"):
                norms.append(float(opt.clip_grad_norm_(clip)))
            opt.step()
            opt.zero_grad()
        st, co = opt.stats(), opt.coordinator.stats()
        return {"full": opt.full_state_dict(), "norms": norms, "seen": seen, "overlapped": st.overlapped,
                "steps": st.steps, "deferred": co.finals_deferred, "early": co.early_reductions,
                "grads_written": st.disk_written["grads"], "buckets": len(opt.layout.trainable_gids())}
    finally:
        opt.close()


WORLD_CASES = {2: list(CASES), 3: ["host", "nvme_acc_clip"]}
# world 3 (uneven shards): two cases, time budget


def run_all(rank, world, root):
    return {(name, overlap): run_case(rank, world, root, name, overlap)
            for name in WORLD_CASES[world] for overlap in (False, True)}


_RUNS: dict = {}


def results_for(world, tmp_path_factory):
    """Every case of WORLD_CASES[world], overlapped and not, in one launch of `world` ranks."""
    if world not in _RUNS:
        _RUNS[world] = run_ranks(run_all, world, str(tmp_path_factory.mktemp(f"overlap{world}")))
    return _RUNS[world]


def reference(micro: int, clip: float | None, norms: list[float]):
    """torch's AdamW on one process and the full batch; clipping with the previous step's norm as given."""
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    batches = data(STEPS * micro)
    coefs = [1.0] + [min(1.0, clip / (t + 1e-6)) for t in norms[:-1]] if clip else [1.0] * STEPS
    for s, i in enumerate(range(0, len(batches), micro)):
        for x, y in batches[i:i + micro]:
            (loss_of(m, x, y) / micro).backward()
        for p in m.parameters():
            p.grad.mul_(coefs[s])
        opt.step()
        opt.zero_grad()
    return m


@pytest.mark.parametrize("world,name", [(w, n) for w, names in WORLD_CASES.items() for n in names])
def test_overlapped_step_at_world_n_equals_the_step_after_backward(tmp_path_factory, world, name):
    res = results_for(world, tmp_path_factory)
    for r in range(world):
        off, on = res[r][(name, False)], res[r][(name, True)]
        for k, v in off["full"].items():
            assert torch.equal(v, on["full"][k]), (world, r, name, k)
        assert off["norms"] == on["norms"]
        assert off["overlapped"] == 0 and on["steps"] == STEPS
        if r:
            assert all(torch.equal(v, res[0][(name, True)]["full"][k]) for k, v in on["full"].items())
    on = res[0][(name, True)]
    if name.endswith("config"):  # the same clipping as clip_grad_norm_ after backward, bit for bit
        assert all(torch.equal(v, res[0][("host_clip", False)]["full"][k]) for k, v in on["full"].items())
        assert on["overlapped"] == on["buckets"] * STEPS and on["deferred"] == 0, on
        return
    if name.endswith("heads"):
        # the heads' buckets: reduced during backward from the second step on, complete on one rank only, so
        # stepped in step() (their nvme partitions stored meanwhile); every other sub-group overlapped
        assert on["deferred"] > 0 and on["deferred"] % (STEPS - 1) == 0, on
        assert on["overlapped"] + on["deferred"] == on["buckets"] * STEPS, on
        return
    # every sub-group of every step after the first was stepped during backward or at its end, none deferred:
    # the schedule reduces each bucket once all its gradients are in on every rank
    assert on["overlapped"] == on["buckets"] * STEPS and on["deferred"] == 0, on
    tier, micro, clip = CASES[name]
    if tier == "nvme" and micro == 1:  # handed from the reduction to the step: never written
        assert on["grads_written"] == 0 and res[0][(name, False)]["grads_written"] > 0
    if clip:
        assert min(min(1.0, clip / (t + 1e-6)) for t in on["norms"]) < 0.5  # the clipping acts
    # the mean of the ranks' means is the full batch's mean but for rounding, which AdamW's normalisation
    # amplifies over the steps in elements of tiny gradient (as in test_zero_dist.py)
    rel = max_rel(on["full"], reference(micro, clip, on["norms"]))
    assert rel <= 2e-4, rel


@pytest.mark.parametrize("world", list(WORLD_CASES))
def test_sub_groups_are_stepped_before_backward_ends(tmp_path_factory, world):
    """When the gradient of the model's input is computed -- the last node of backward, before its end --
    the optimizer has already started steps of sub-groups (counted by OptimizerStats.overlapped)."""
    res = results_for(world, tmp_path_factory)
    for r in range(world):
        for name in WORLD_CASES[world]:
            seen = res[r][(name, True)]["seen"]
            # one micro-batch: the first backward learns the schedule (and reduces at its end); with two, the
            # first micro-batch learns it and the last one of every step overlaps
            first = 1 if CASES[name][1] == 1 else 0
            assert all(s == 0 for s in seen[:first]) and all(s > 0 for s in seen[first:]), (world, r, name, seen)
            assert res[r][(name, False)]["seen"] == [0] * STEPS
