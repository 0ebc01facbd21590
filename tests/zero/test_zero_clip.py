"""Gradient clipping through torch's own functions on a ZeRO-3 model: torch.nn.utils.clip_grad_norm_ /
clip_grad_value_ / clip_grads_with_norm_ over model.parameters() (and accelerate's clip_grad_norm_, which calls
torch's) are the optimizer's exact global operations, or raise -- never a silent 0. See [Note: clipping
through torch's functions] in tierstore/zero/step/clip.py."""
from __future__ import annotations

import gc
import pathlib

import pytest
import torch
import torch.nn as nn

from tests.support import batches, cfg, loss_fn, make_pair, max_rel, run_ranks
from tierstore.errors import MisuseError, TierstoreValueError
from tierstore.zero import Zero3Optimizer
from tierstore.zero.params import registry

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _clipped_run(m, o, data, clip, accum=3):
    """Steps of `accum` micro-batches, clipped by `clip(model)` after the last backward; the returned norms."""
    norms = []
    for i in range(0, len(data), accum):
        for x, y in data[i:i + accum]:
            (loss_fn(m, x, y) / accum).backward()
        norms.append(clip(m))
        o.step()
        o.zero_grad()
    return norms


@pytest.mark.parametrize("tiers", [("host", "host", "host"), ("nvme", "nvme", "nvme")])
def test_torch_clip_grad_norm_on_model_parameters_matches_torch(tmp_path, tiers):
    ref_m, z_m = make_pair()
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2)
    opt = Zero3Optimizer(z_m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path, *tiers))
    try:
        data = batches(12)

        def clip(m):
            return float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05))
        want = _clipped_run(ref_m, ref, data, clip)
        got = _clipped_run(z_m, opt, data, clip)
        assert all(w > 0.05 for w in want)  # clipping was active on every step
        assert got == pytest.approx(want, rel=1e-6)
        assert max_rel(opt.full_state_dict(), ref_m) <= 1e-6
    finally:
        opt.close()


def test_clip_grad_value_and_clip_grads_with_norm_match_torch(tmp_path):
    ref_m, z_m = make_pair()
    ref = torch.optim.SGD(ref_m.parameters(), lr=0.5)
    opt = Zero3Optimizer(z_m, torch.optim.SGD, lr=0.5, config=cfg(tmp_path, "host", "host", "host"))
    try:
        data = batches(6)

        def clip(m):
            torch.nn.utils.clip_grad_value_(m.parameters(), 0.01)
            total = torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9)  # the norm after the value clip
            torch.nn.utils.clip_grads_with_norm_(m.parameters(), 0.5 * float(total), total)
            return float(total)
        want = _clipped_run(ref_m, ref, data, clip, accum=2)
        got = _clipped_run(z_m, opt, data, clip, accum=2)
        assert got == pytest.approx(want, rel=1e-6)
        assert max_rel(opt.full_state_dict(), ref_m) <= 1e-6
    finally:
        opt.close()


def test_accelerate_clip_grad_norm_routes_to_the_optimizer(tmp_path):
    import accelerate
    ref_m, z_m = make_pair()
    opt = Zero3Optimizer(z_m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path, "host", "host", "host"))
    try:
        acc = accelerate.Accelerator(cpu=True)
        x, y = batches(1)[0]
        loss_fn(ref_m, x, y).backward()
        loss_fn(z_m, x, y).backward()
        want = float(torch.nn.utils.clip_grad_norm_(ref_m.parameters(), 1e-3))
        got = float(acc.clip_grad_norm_(z_m.parameters(), 1e-3))
        assert got == pytest.approx(want, rel=1e-6) and got > 0
    finally:
        opt.close()


def test_clipping_refuses_what_it_cannot_do_exactly(tmp_path):
    _, z_m = make_pair()
    other = nn.Linear(3, 3)
    opt = Zero3Optimizer(z_m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path / "a", "host", "host", "host"))
    _, z2 = make_pair()
    opt2 = Zero3Optimizer(z2, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path / "b", "host", "host", "host"))
    try:
        x, y = batches(1)[0]
        loss_fn(z_m, x, y).backward()
        with pytest.raises(TierstoreValueError, match="of the 8 trainable parameters"):
            torch.nn.utils.clip_grad_norm_(z_m.fc1.parameters(), 1.0)  # a strict subset
        other(torch.randn(2, 3)).sum().backward()
        with pytest.raises(TierstoreValueError, match="mixed with 1 other parameter"):
            torch.nn.utils.clip_grad_norm_(list(z_m.parameters()) + [other.weight], 1.0)
        with pytest.raises(TierstoreValueError, match="2 Zero3Optimizers"):
            torch.nn.utils.clip_grad_value_(list(z_m.parameters()) + list(z2.parameters()), 1.0)
        with pytest.raises(TierstoreValueError, match="only the L2 norm"):
            torch.nn.utils.clip_grad_norm_(z_m.parameters(), 1.0, norm_type="inf")
        # parameters no optimizer manages: torch's own function, unchanged
        want = torch.linalg.vector_norm(torch.cat([other.weight.grad.reshape(-1), other.bias.grad.reshape(-1)]))
        assert float(torch.nn.utils.clip_grad_norm_(other.parameters(), 1e9)) == pytest.approx(float(want))
        # frozen parameters of the model may be in the list; gradients after the clip are refused
        assert float(torch.nn.utils.clip_grad_norm_(z_m.parameters(), 1e-4)) > 1e-4
        with pytest.raises(MisuseError, match="after the gradients were clipped"):
            loss_fn(z_m, x, y).backward()
    finally:
        opt.close()
        opt2.close()
    gc.collect()  # optimizers another test left unclosed and unreferenced leave the open set
    if not registry.open_optimizers():  # torch's own functions once the last optimizer closed
        assert not (torch.nn.utils.clip_grad_norm_.__doc__ or "").startswith("tierstore")
        assert torch.nn.utils.clip_grad.clip_grad_value_ is torch.nn.utils.clip_grad_value_


def _rank_clip(rank, world, root):
    torch.manual_seed(0)
    _, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(pathlib.Path(root) / f"r{rank}", "host", "nvme",
                                                                     "host"))
    norms = []
    for x, y in batches(4, bs=24):
        half = x.shape[0] // world
        sl = slice(rank * half, (rank + 1) * half)
        loss_fn(m, x[sl], y[sl]).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)))
        opt.step()
        opt.zero_grad()
    full = opt.full_state_dict()
    opt.close()
    return norms, full


def test_torch_clip_grad_norm_at_world_2_is_the_global_norm(tmp_path):
    out = run_ranks(_rank_clip, 2, str(tmp_path))
    ref_m, _ = make_pair()
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2)
    want = []
    for x, y in batches(4, bs=24):
        loss_fn(ref_m, x, y).backward()  # the mean over both halves: what the ranks' averaged gradients are
        want.append(float(torch.nn.utils.clip_grad_norm_(ref_m.parameters(), 0.05)))
        ref.step()
        ref.zero_grad()
    for norms, full in out:
        assert norms == pytest.approx(want, rel=1e-5)
        assert max_rel(full, ref_m) <= 1e-5


@pytest.mark.parametrize("tiers", [("host", "host", "host"), ("nvme", "nvme", "nvme")])
def test_model_zero_grad_forgets_the_partitions(tmp_path, tiers):
    """Code that zeroes through the model (transformers' Trainer: model.zero_grad(), never the optimizer's)
    trains as torch does: the step's gradient does not stay in the partitions for the next backward to add to
    ([Note: model.zero_grad() forgets the partitions] in optimizer.py)."""
    ref_m, z_m = make_pair()
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2)
    opt = Zero3Optimizer(z_m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path, *tiers))
    try:
        for x, y in batches(4):
            for m, o in ((ref_m, ref), (z_m, opt)):
                loss_fn(m, x, y).backward()
                o.step()
                m.zero_grad()  # the model's, not the optimizer's
        assert max_rel(z_m.state_dict(), ref_m) == 0
    finally:
        opt.close()
    assert "zero_grad" not in z_m.__dict__  # close() gave the model its own zero_grad back
