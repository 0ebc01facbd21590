"""overlap_step="auto", the default: the overlapped step wherever it gives the plain step's result, the plain
schedule where it must ([Note: the overlapped step by default] in zero/step/overlap.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support import batches, cfg, loss_fn, make_pair, run_ranks
from tierstore.errors import MisuseError, TierstoreValueError
from tierstore.zero import OffloadConfig, Zero3Optimizer
from tierstore.zero.step.overlap import overlap_mode

NVME = dict(params="nvme", states="nvme", grads="nvme")


def train(tmp_path, steps=4, micro=1, clip=None, use_accumulating=False, **kw):
    """(full_state_dict, stats) after `steps` steps of `micro` backwards each; `clip`: clip_grad_norm_'s max_norm
    after the last backward of each step."""
    _, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, config=cfg(tmp_path, **kw), lr=1e-2)
    try:
        data = iter(batches(steps * micro))
        for _ in range(steps):
            for k in range(micro):
                x, y = next(data)
                if use_accumulating and k < micro - 1:
                    with opt.accumulating():
                        loss_fn(m, x, y).backward()
                else:
                    loss_fn(m, x, y).backward()
            if clip is not None:
                opt.clip_grad_norm_(clip)
            opt.step()
            opt.zero_grad()
        return opt.full_state_dict(), opt.stats()
    finally:
        opt.close()


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_default_is_auto_and_refuses_other_words():
    assert OffloadConfig().overlap_step == "auto"
    with pytest.raises(TierstoreValueError, match="True, False or 'auto'"):
        OffloadConfig(overlap_step="yes")


def test_a_plain_loop_on_nvme_overlaps_from_the_second_step_with_the_plain_result(tmp_path):
    auto, st = train(tmp_path / "a", **NVME)
    plain, st_plain = train(tmp_path / "p", overlap_step=False, **NVME)
    n = st.step_paths["first"]  # sub-groups stepped per step
    assert st.overlapped == 3 * n and st.step_paths["pipelined"] == n  # step 1 plain, then overlapped
    assert st_plain.overlapped == 0
    assert same(auto, plain)  # bit for bit
    # the lever's bytes: from the second step on, no gradient is written to or read from the disk
    assert st.disk_written["grads"] == st_plain.disk_written["grads"] // 4 > 0
    assert st.disk_read["grads"] == st_plain.disk_read["grads"] // 4


@pytest.mark.parametrize("loop", ["clip", "accumulate"])
def test_a_loop_that_clips_or_accumulates_stays_plain_and_exact(tmp_path, loop):
    kw = dict(clip=0.05) if loop == "clip" else dict(micro=2)
    auto, st = train(tmp_path / "a", **kw, **NVME)
    plain, _ = train(tmp_path / "p", overlap_step=False, **kw, **NVME)
    assert st.overlapped == 0 and same(auto, plain)


def test_accumulating_micro_batches_inside_accumulating_still_overlap(tmp_path):
    auto, st = train(tmp_path / "a", micro=2, use_accumulating=True, **NVME)
    plain, _ = train(tmp_path / "p", micro=2, overlap_step=False, **NVME)
    assert st.overlapped > 0 and same(auto, plain)


@pytest.mark.parametrize("kw, mode", [
    (dict(), "off"),  # everything in the compute device's memory (the CPU here): nothing to save
    (NVME, "auto"),
    (dict(states="nvme"), "auto"),
    ({**NVME, "compute_dtype": torch.float16}, "off"),  # the loss scaler sees every gradient first
    ({**NVME, "gradient_clipping": 1.0}, "off"),  # exact clipping at step()
    ({**NVME, "gradient_clipping": 1.0, "clip_mode": "previous_norm"}, "auto"),
    ({**NVME, "overlap_step": True}, "on"),
    ({**NVME, "overlap_step": False}, "off"),
])
def test_the_configuration_decides_where_auto_may_overlap(tmp_path, kw, mode):
    assert overlap_mode(cfg(tmp_path, **kw), torch.device("cpu")) == mode


def test_states_on_the_host_beside_an_accelerator_are_auto(tmp_path):
    """The step on the CPU runs while the accelerator computes backward (the device itself is not needed to
    decide; the tests run on the CPU)."""
    assert overlap_mode(cfg(tmp_path), torch.device("cuda", 0)) == "auto"
    assert overlap_mode(cfg(tmp_path, states="device", grads="device"), torch.device("cuda", 0)) == "off"


@pytest.mark.parametrize("change", ["clip", "second-backward"])
def test_a_loop_that_changes_after_the_choice_gets_a_clear_error(tmp_path, change):
    _, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, config=cfg(tmp_path, **NVME), lr=1e-2)
    try:
        data = batches(4)
        for x, y in data[:2]:
            loss_fn(m, x, y).backward()
            opt.step()
            opt.zero_grad()
        assert opt.stats().overlapped > 0
        x, y = data[2]
        loss_fn(m, x, y).backward()
        with pytest.raises(MisuseError, match="overlap_step=False") as e:
            if change == "clip":
                opt.clip_grad_norm_(1.0)
            else:
                loss_fn(m, *data[3]).backward()
        assert "auto" in str(e.value)
    finally:
        opt.close()


def test_a_closure_step_stays_plain(tmp_path):
    _, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, config=cfg(tmp_path, **NVME), lr=1e-2)
    try:
        for x, y in batches(3):
            def closure(x=x, y=y):
                loss = loss_fn(m, x, y)
                loss.backward()
                return loss
            opt.step(closure)
            opt.zero_grad()
        assert opt.stats().overlapped == 0
    finally:
        opt.close()


def _ranks_decide(rank, world, root, clip_on_rank):
    _, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, config=cfg(Path(root) / f"r{rank}", **NVME), lr=1e-2)
    try:
        for i, (x, y) in enumerate(batches(3)):
            loss_fn(m, x[rank::world], y[rank::world]).backward()
            if i == 0 and rank == clip_on_rank:
                opt.clip_grad_value_(10.0)  # only this rank's loop clips (not a collective)
            opt.step()
            opt.zero_grad()
        return opt.stats().overlapped
    finally:
        opt.close()


@pytest.mark.parametrize("clip_on_rank", [None, 1])
def test_ranks_agree_on_the_choice(tmp_path, clip_on_rank):
    """World size 2: the ranks overlap together or not at all (a rank overlapping alone would wait in the
    agreement on final buckets forever)."""
    overlapped = run_ranks(_ranks_decide, 2, str(tmp_path), clip_on_rank)
    assert (overlapped[0] > 0) == (overlapped[1] > 0) == (clip_on_rank is None)
