"""tierstore.integrations.accelerate.prepare against accelerate's plain path on a tiny GPT-2 built from a config:
gradient accumulation, clipping, a scheduler, save_state / load_state and get_state_dict. docs/integrations.md."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate", reason="pip install 'tierstore[test]' (accelerate==1.15.0)")
pytest.importorskip("transformers", reason="pip install 'tierstore[test]' (transformers==5.23.0)")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from tierstore.errors import TierstoreValueError  # noqa: E402
from tierstore.integrations.accelerate import OPTIMIZER_DIR, prepare  # noqa: E402
from tierstore.zero import OffloadConfig, Zero3Optimizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = dict(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
              attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
GA = 2  # micro-batches per step
MAX_NORM = 0.5  # under the gradient norm: the clip acts


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**CONFIG))


def batches(n=8):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": x, "labels": x} for x in torch.randint(0, CONFIG["vocab_size"], (n, 4, 16), generator=g)]


def run(kind: str, tmp_path, lo: int, hi: int, save_at: int | None = None, load: str | None = None,
        mixed_precision: str = "no", compute_dtype: torch.dtype = torch.float32):
    """Micro-batches [lo, hi) of batches() under accelerate; returns (losses, logged norms, get_state_dict)."""
    # accelerate's own resets (private there, its tests use them): each run its own mixed_precision and
    # accumulation, whatever ran in this process before
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, gradient_accumulation_steps=GA, mixed_precision=mixed_precision)
    model = gpt2()
    sched_fn = lambda s: 1.0 - s / 10  # noqa: E731
    if kind == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, sched_fn)
        model, opt, sched = acc.prepare(model, opt, sched)
    else:
        cfg = OffloadConfig(params="host", optimizer_states="nvme", gradients="host",
                            nvme_paths=[str(tmp_path / f"nv-{lo}-{hi}-{mixed_precision}-{compute_dtype}")],
                            compute_dtype=compute_dtype)
        zopt = Zero3Optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.01, config=cfg)
        sched = torch.optim.lr_scheduler.LambdaLR(zopt, sched_fn)
        model, opt, sched = prepare(acc, model, zopt, sched)
    if load:
        acc.load_state(load)
    losses, norms = [], []
    for i, b in enumerate(batches()[lo:hi], start=lo):
        with acc.accumulate(model):
            loss = model(**b).loss
            acc.backward(loss)
            losses.append(loss.item())
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), MAX_NORM)))
            opt.step()
            sched.step()
            opt.zero_grad()
        if save_at is not None and i + 1 == save_at:
            acc.save_state(str(tmp_path / f"{kind}-state"))
    return losses, norms, acc.get_state_dict(model)


def test_prepare_trains_saves_and_resumes_like_torch(tmp_path):
    t_loss, t_norm, t_sd = run("torch", tmp_path, 0, 8)
    z_loss, z_norm, z_sd = run("zero", tmp_path, 0, 8, save_at=4)
    assert len(t_norm) == 4 and min(t_norm) > MAX_NORM  # every step clipped
    assert z_loss == pytest.approx(t_loss, rel=1e-5)
    assert z_norm == pytest.approx(t_norm, rel=1e-5)
    assert (tmp_path / "zero-state" / OPTIMIZER_DIR).is_dir()
    for k, v in t_sd.items():
        assert z_sd[k].shape == v.shape and torch.allclose(z_sd[k], v, rtol=0, atol=1e-5), k
    # a fresh model, optimizer and accelerator load the state saved after micro-batch 4 and continue exactly
    r_loss, r_norm, r_sd = run("zero", tmp_path, 4, 8, load=str(tmp_path / "zero-state"))
    assert r_loss == z_loss[4:] and r_norm == z_norm[2:]
    assert all(torch.equal(r_sd[k], z_sd[k]) for k in z_sd)


def test_prepare_maps_mixed_precision_onto_the_compute_dtype(tmp_path):
    """Accelerator(mixed_precision=...): "bf16" over a bfloat16 optimizer stays as close to plain accelerate's
    bf16 run as bf16 rounding puts that run from fp32's; "bf16" over a float32 optimizer autocasts as accelerate
    does (its first step's losses equal the plain bf16 run's); "fp16" over a float16 optimizer applies its loss scale in
    accelerator.backward (the clipped norms are fp32's, not 2**16 times smaller)."""
    t32, n32, _ = run("torch", tmp_path, 0, 8)
    tb, nb, _ = run("torch", tmp_path, 0, 8, mixed_precision="bf16")
    noise = max(abs(a - b) for a, b in zip(tb, t32))
    assert 0 < noise < 1e-2
    zb, _n, zb_sd = run("zero", tmp_path, 0, 8, mixed_precision="bf16", compute_dtype=torch.bfloat16)
    assert max(abs(a - b) for a, b in zip(zb, tb)) <= 3 * noise
    assert {v.dtype for v in zb_sd.values()} == {torch.bfloat16}
    za, na, _ = run("zero", tmp_path, 0, 8, mixed_precision="bf16")
    assert za[:GA] == pytest.approx(tb[:GA], rel=1e-6) and tb[0] != t32[0]  # autocast, from the same weights
    assert max(abs(a - b) for a, b in zip(za, tb)) <= noise and na == pytest.approx(nb, rel=1e-3)
    zf, nf, _ = run("zero", tmp_path, 0, 8, mixed_precision="fp16", compute_dtype=torch.float16)
    assert zf == pytest.approx(t32, abs=1e-3) and nf == pytest.approx(n32, rel=1e-2)


def test_prepare_refuses_what_it_cannot_do_right(tmp_path):
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = Accelerator(cpu=True, mixed_precision="fp16")
    model = gpt2()
    opt = Zero3Optimizer(model, torch.optim.AdamW, lr=1e-3)
    try:  # fp16 needs an optimizer computing in float16 (its loss scale)
        with pytest.raises(TierstoreValueError, match="compute_dtype=torch.float16"):
            prepare(acc, model, opt)
    finally:
        opt.close()
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = Accelerator(cpu=True)
    model = gpt2()
    with pytest.raises(TierstoreValueError, match="Zero3Optimizer"):
        prepare(acc, model, torch.optim.AdamW(model.parameters()))
    opt = Zero3Optimizer(model, torch.optim.AdamW, lr=1e-3)
    try:
        with pytest.raises(TierstoreValueError, match="another module"):
            prepare(acc, gpt2(), opt)
        _m, _o = prepare(acc, model, opt)
        (tmp_path / "empty").mkdir()
        with pytest.raises(TierstoreValueError, match=OPTIMIZER_DIR):
            acc.load_state(str(tmp_path / "empty"))
    finally:
        opt.close()
