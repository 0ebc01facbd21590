"""TierstoreTrainer (tierstore.integrations.trainer) against transformers' plain Trainer on a tiny GPT-2 built from
a config: the same losses' gradient norms, clipping, saved weights and resumption. See docs/integrations.md."""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers", reason="pip install 'tierstore[test]' (transformers==5.23.0)")
from safetensors.torch import load_file  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from tierstore.errors import TierstoreValueError  # noqa: E402
from tierstore.integrations.trainer import OPTIMIZER_DIR, TierstoreTrainer  # noqa: E402
from tierstore.zero import OffloadConfig, Zero3Optimizer, optimizer_of  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = dict(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
              attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**CONFIG))


def dataset(n=32, t=16):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": x, "labels": x} for x in torch.randint(0, CONFIG["vocab_size"], (n, t), generator=g)]


def targs(out, **kw) -> TrainingArguments:
    base = dict(max_steps=4, per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1, save_steps=2,
                report_to=[], use_cpu=True, optim="adamw_torch", seed=0, disable_tqdm=True, weight_decay=0.01,
                max_grad_norm=0.0)
    base.update(kw)
    return TrainingArguments(str(out), **base)


def norms(trainer) -> list[float]:
    return [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]


def weights(path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def test_matches_trainer_exactly_and_resumes_exactly(tmp_path):
    """fp32 states on the nvme tier: every step's logged gradient norm and the saved weights (the final ones and
    checkpoint-2's) equal a plain Trainer's; resuming from checkpoint-2 ends bit-equal to the uninterrupted run."""
    ref = Trainer(model=gpt2(), args=targs(tmp_path / "ref"), train_dataset=dataset())
    ref.train()
    ref.save_model(str(tmp_path / "ref" / "final"))
    cfg = OffloadConfig(params="host", optimizer_states="nvme", gradients="nvme", nvme_paths=[str(tmp_path / "nv")])
    ts = TierstoreTrainer(model=gpt2(), args=targs(tmp_path / "ts"), train_dataset=dataset(), offload_config=cfg)
    ts.train()
    assert isinstance(ts.optimizer.optimizer, Zero3Optimizer)
    ts.save_model(str(tmp_path / "ts" / "final"))
    assert len(norms(ts)) == 4 and all(n > 0 for n in norms(ts))
    assert norms(ts) == pytest.approx(norms(ref), rel=1e-6)
    for sub in ("final", "checkpoint-2", "checkpoint-4"):
        a, b = weights(tmp_path / "ref" / sub), weights(tmp_path / "ts" / sub)
        assert sorted(a) == sorted(b)
        for k in a:
            assert a[k].shape == b[k].shape and torch.equal(a[k], b[k]), (sub, k)
    assert (tmp_path / "ts" / "checkpoint-2" / OPTIMIZER_DIR).is_dir()
    # the saved directory is an ordinary transformers checkpoint
    back = GPT2LMHeadModel.from_pretrained(str(tmp_path / "ts" / "final"))
    for k, v in back.state_dict().items():
        assert torch.equal(v, weights(tmp_path / "ref" / "final")[k.replace("lm_head.weight",
                                                                              "transformer.wte.weight")]), k
    # resume: a fresh model and trainer continue from checkpoint-2 exactly
    cfg2 = cfg.replace(nvme_paths=[str(tmp_path / "nv2")])
    re = TierstoreTrainer(model=gpt2(), args=targs(tmp_path / "re"), train_dataset=dataset(), offload_config=cfg2)
    re.train(resume_from_checkpoint=str(tmp_path / "ts" / "checkpoint-2"))
    assert norms(re) == norms(ts)  # steps 1-2 from the checkpoint's trainer_state.json, 3-4 run again
    re.save_model(str(tmp_path / "re" / "final"))
    a, b = weights(tmp_path / "ts" / "final"), weights(tmp_path / "re" / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_max_grad_norm_clips_like_torch(tmp_path):
    """max_grad_norm well under the gradient norm: the logged norm is torch's and the weights follow the clipped
    torch run (a clip that did nothing would leave them ~20x further along)."""
    ref = Trainer(model=gpt2(), args=targs(tmp_path / "ref", max_grad_norm=0.05, max_steps=3, save_steps=10),
                  train_dataset=dataset())
    ref.train()
    ts = TierstoreTrainer(model=gpt2(), args=targs(tmp_path / "ts", max_grad_norm=0.05, max_steps=3, save_steps=10),
                          train_dataset=dataset())
    ts.train()
    assert min(norms(ref)) > 0.5  # the clip is active on every step
    assert norms(ts) == pytest.approx(norms(ref), rel=1e-6)
    ref.save_model(str(tmp_path / "a"))
    ts.save_model(str(tmp_path / "b"))
    a, b = weights(tmp_path / "a"), weights(tmp_path / "b")
    init = gpt2().state_dict()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0, atol=1e-6), k
    moved = max(float((a[k] - init[k]).abs().max()) for k in a)
    assert moved > 1e-4 and math.isfinite(moved)


def test_adamw_torch_fused_steps_with_the_fused_kernel_as_trainer_does(tmp_path):
    """optim='adamw_torch_fused' is AdamW(fused=True) in Trainer; the wrapped optimizer gets it too (its bits
    differ from the for-loop's), so the weights equal a plain Trainer's with the same optim."""
    args = dict(optim="adamw_torch_fused", max_steps=2, save_steps=10)
    ref = Trainer(model=gpt2(), args=targs(tmp_path / "ref", **args), train_dataset=dataset())
    ref.train()
    ts = TierstoreTrainer(model=gpt2(), args=targs(tmp_path / "ts", **args), train_dataset=dataset())
    ts.train()
    assert optimizer_of(ts.model).optimizer_kwargs["fused"] is True
    ref.save_model(str(tmp_path / "a"))
    ts.save_model(str(tmp_path / "b"))
    a, b = weights(tmp_path / "a"), weights(tmp_path / "b")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_refuses_what_it_cannot_do_right(tmp_path):
    with pytest.raises(TierstoreValueError, match="compute_dtype=torch.bfloat16"):
        TierstoreTrainer(model=gpt2(), args=targs(tmp_path / "a", bf16=True), train_dataset=dataset(),
                         offload_config=OffloadConfig(compute_dtype=torch.float16))
    with pytest.raises(TierstoreValueError, match="optim="):
        TierstoreTrainer(model=gpt2(), args=targs(tmp_path / "b", optim="adafactor"), train_dataset=dataset())
    m = gpt2()
    with pytest.raises(TierstoreValueError, match="Zero3Optimizer"):
        TierstoreTrainer(model=m, args=targs(tmp_path / "c"), train_dataset=dataset(),
                         optimizers=(torch.optim.AdamW(m.parameters()), None))
    # a plain Trainer's checkpoint holds no tierstore optimizer state: said, not silently restarted
    Trainer(model=gpt2(), args=targs(tmp_path / "p", max_steps=2), train_dataset=dataset()).train()
    ts = TierstoreTrainer(model=gpt2(), args=targs(tmp_path / "d"), train_dataset=dataset())
    with pytest.raises(TierstoreValueError, match=OPTIMIZER_DIR):
        ts.train(resume_from_checkpoint=str(tmp_path / "p" / "checkpoint-2"))


# -- LoRA: frozen parameters ----------------------------------------------------------------------------------
class LoRAConv(torch.nn.Module):
    """A frozen GPT-2 projection plus a trainable rank-r update, as LoRA adds one (B starts at zero)."""

    def __init__(self, base, r=4):
        super().__init__()
        self.base = base
        self.lora_a = torch.nn.Parameter(torch.randn(base.weight.shape[0], r) * 0.02)
        self.lora_b = torch.nn.Parameter(torch.zeros(r, base.weight.shape[1]))

    def forward(self, x):
        return self.base(x) + x @ self.lora_a @ self.lora_b


def lora_gpt2(base_seed=0):
    """A GPT-2 whose every weight is frozen, with LoRA-like adapters on each attention's input projection."""
    model = gpt2()
    if base_seed:
        torch.manual_seed(base_seed)
        model = GPT2LMHeadModel(GPT2Config(**CONFIG))
    model.requires_grad_(False)
    torch.manual_seed(1)
    for block in model.transformer.h:
        block.attn.c_attn = LoRAConv(block.attn.c_attn)
    return model


def _bytes(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_lora_checkpoints_hold_what_changes_and_resume_exactly(tmp_path):
    """Most parameters frozen: each checkpoint's tierstore_optimizer/ is within 2x of the plain Trainer's
    optimizer.pt for the same run (the frozen base is not rewritten by every save), the run equals the plain
    one, and resuming from checkpoint-2 ends bit-equal to the uninterrupted run."""
    args = dict(max_steps=4, save_steps=2, learning_rate=1e-2)
    ref = Trainer(model=lora_gpt2(), args=targs(tmp_path / "ref", **args), train_dataset=dataset())
    ref.train()
    ts = TierstoreTrainer(model=lora_gpt2(), args=targs(tmp_path / "ts", **args), train_dataset=dataset())
    ts.train()
    assert norms(ts) == pytest.approx(norms(ref), rel=1e-6)
    frozen = sum(p.numel() for p in lora_gpt2().parameters() if not p.requires_grad)
    assert frozen > 20 * sum(p.numel() for p in lora_gpt2().parameters() if p.requires_grad)
    for step in (2, 4):
        plain = (tmp_path / "ref" / f"checkpoint-{step}" / "optimizer.pt").stat().st_size
        ours = _bytes(tmp_path / "ts" / f"checkpoint-{step}" / OPTIMIZER_DIR)
        assert ours <= 2 * plain, (step, ours, plain)
    re = TierstoreTrainer(model=lora_gpt2(), args=targs(tmp_path / "re", **args), train_dataset=dataset())
    re.train(resume_from_checkpoint=str(tmp_path / "ts" / "checkpoint-2"))
    assert norms(re) == norms(ts)
    ts.save_model(str(tmp_path / "ts" / "final"))
    re.save_model(str(tmp_path / "re" / "final"))
    a, b = weights(tmp_path / "ts" / "final"), weights(tmp_path / "re" / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)


def peft_gpt2():
    peft = pytest.importorskip("peft", reason="pip install 'tierstore[test]' (peft==0.21.2)")
    cfg = peft.LoraConfig(r=16, lora_alpha=32, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)
    model = gpt2()
    torch.manual_seed(1)
    return peft.get_peft_model(model, cfg)


def test_peft_lora_checkpoints_hold_the_adapters_and_resume_exactly(tmp_path):
    """peft's own LoRA model: each checkpoint's tierstore_optimizer/ is within 2x of the plain Trainer's
    optimizer.pt, and a resume onto a fresh PEFT model over the same base ends bit-equal."""
    args = dict(max_steps=4, save_steps=2, learning_rate=1e-2)
    ref = Trainer(model=peft_gpt2(), args=targs(tmp_path / "ref", **args), train_dataset=dataset())
    ref.train()
    ts = TierstoreTrainer(model=peft_gpt2(), args=targs(tmp_path / "ts", **args), train_dataset=dataset())
    ts.train()
    assert norms(ts) == pytest.approx(norms(ref), rel=1e-6)
    for step in (2, 4):
        plain = (tmp_path / "ref" / f"checkpoint-{step}" / "optimizer.pt").stat().st_size
        ours = _bytes(tmp_path / "ts" / f"checkpoint-{step}" / OPTIMIZER_DIR)
        assert ours <= 2 * plain, (step, ours, plain)
    re = TierstoreTrainer(model=peft_gpt2(), args=targs(tmp_path / "re", **args), train_dataset=dataset())
    re.train(resume_from_checkpoint=str(tmp_path / "ts" / "checkpoint-2"))
    assert norms(re) == norms(ts)
    a, b = ts.model.state_dict(), re.model.state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_without_the_frozen_base_refuses_another_base(tmp_path):
    """save_checkpoint(exclude_frozen=True) over a model with another frozen base: the load is refused before
    anything is imported; over the same base it resumes; consolidate returns the trainable weights."""
    from tierstore.zero import consolidate
    model = lora_gpt2()
    opt = Zero3Optimizer(model, torch.optim.AdamW, lr=1e-2)
    try:
        batch = torch.stack([d["input_ids"] for d in dataset(4)])
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.save_checkpoint(tmp_path / "ck", exclude_frozen=True)
        trained = {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        opt.close()
    other = lora_gpt2(base_seed=7)
    opt2 = Zero3Optimizer(other, torch.optim.AdamW, lr=1e-2)
    try:
        with pytest.raises(TierstoreValueError, match="frozen parameters are not the ones"):
            opt2.load_checkpoint(tmp_path / "ck")
    finally:
        opt2.close()
    same = lora_gpt2()
    opt3 = Zero3Optimizer(same, torch.optim.AdamW, lr=1e-2)
    try:
        opt3.load_checkpoint(tmp_path / "ck")
        got = same.state_dict()
        assert all(torch.equal(got[k], trained[k]) for k in trained)
    finally:
        opt3.close()
    plain = consolidate(tmp_path / "ck")
    assert sorted(plain) == sorted(k for k in trained if "lora_" in k)
    assert all(torch.equal(plain[k], trained[k]) for k in plain)


def _rank_frozen_save(rank, world, root):
    model = lora_gpt2()
    opt = Zero3Optimizer(model, torch.optim.AdamW, lr=1e-2)
    try:
        batch = torch.stack([d["input_ids"] for d in dataset(4)])[rank::world]
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.save_checkpoint(f"{root}/ck", exclude_frozen=True)
        return model.state_dict()
    finally:
        opt.close()


def test_a_checkpoint_without_the_frozen_base_loads_at_another_world_size(tmp_path):
    """Saved at world 2 without the frozen base, loaded by one process over the same base: the fingerprint
    matches (it does not depend on the partitioning) and the model equals the world-2 one."""
    from tests.support import run_ranks
    saved = run_ranks(_rank_frozen_save, 2, str(tmp_path))[0]
    model = lora_gpt2()
    opt = Zero3Optimizer(model, torch.optim.AdamW, lr=1e-2)
    try:
        opt.load_checkpoint(tmp_path / "ck")
        got = model.state_dict()
        assert sorted(got) == sorted(saved) and all(torch.equal(got[k], saved[k]) for k in saved)
    finally:
        opt.close()


# -- mixed precision -------------------------------------------------------------------------------------------
def _losses(cls, out, steps, **kw):
    t = _recording(cls)(model=gpt2(), args=targs(out, max_steps=steps, save_steps=1000, logging_steps=steps,
                                                 **kw.pop("args", {})), train_dataset=dataset(), **kw)
    t.losses = []
    t.train()
    return t, torch.tensor(t.losses)


def test_bf16_flag_trains_like_trainer_bf16(tmp_path):
    """TrainingArguments(bf16=True): the optimizer computes in bfloat16 with fp32 masters; over 50 steps every
    loss is as close to a plain Trainer(bf16=True)'s as bf16 rounding puts that run from fp32's."""
    _t, fp32 = _losses(Trainer, tmp_path / "fp32", 50)
    _t, ref = _losses(Trainer, tmp_path / "ref", 50, args=dict(bf16=True))
    ts, got = _losses(TierstoreTrainer, tmp_path / "ts", 50, args=dict(bf16=True))
    assert optimizer_of(ts.model).config.compute_dtype == torch.bfloat16
    noise = float((ref - fp32).abs().max())
    assert 0 < noise < 1e-2  # bf16 moved the plain run, a little
    assert len(got) == 50 and float((got - ref).abs().max()) <= 3 * noise
    assert float(got[-1]) < float(got[0]) - 0.1  # it learned
    ts.save_model(str(tmp_path / "ts" / "final"))
    saved = weights(tmp_path / "ts" / "final")
    assert {v.dtype for v in saved.values()} == {torch.bfloat16}  # the compute dtype (docs/integrations.md)


def test_fp16_flag_scales_the_loss_through_trainers_backward(tmp_path):
    """TrainingArguments(fp16=True): float16 compute, and the optimizer's loss scale reaches Trainer's backward:
    at the default scale no step overflows and the losses follow fp32's; from a scale that overflows, the
    overflowing steps are skipped (the scale halves each time) and the learning-rate schedule does not advance
    on them, as with torch's GradScaler."""
    _t, fp32 = _losses(Trainer, tmp_path / "fp32", 8)
    ts, got = _losses(TierstoreTrainer, tmp_path / "ts", 8, args=dict(fp16=True))
    z = optimizer_of(ts.model)
    assert z.config.compute_dtype == torch.float16 and z.loss_scale == 2.0 ** 16
    assert z.stats().overflow_skips == 0 and z.steps == 8
    assert float((got - fp32).abs().max()) < 1e-3
    big = OffloadConfig(initial_loss_scale=2.0 ** 22)
    ts2, _got = _losses(TierstoreTrainer, tmp_path / "ts2", 8, args=dict(fp16=True), offload_config=big)
    z2 = optimizer_of(ts2.model)
    skips = z2.stats().overflow_skips
    assert 0 < skips < 8 and z2.loss_scale == 2.0 ** (22 - skips) and z2.steps == 8 - skips
    assert ts2.lr_scheduler.last_epoch == 8 - skips  # the schedule skipped the skipped steps


# -- several processes -----------------------------------------------------------------------------------------
def _recording(cls):
    """`cls` (Trainer or TierstoreTrainer) recording every micro-batch's loss, unrounded (Trainer logs 4 digits)."""
    class Recording(cls):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if model.training:
                self.losses.append(float(out.detach()))
            return out
    return Recording


def _rank_trainer(rank, world, root, kind, resume=None):
    """One rank of a Trainer run over `world` processes: (micro-batch losses, logged grad norms, eval losses)."""
    import os
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    out = f"{root}/{kind}"
    args = targs(out, per_device_train_batch_size=8 // world, eval_strategy="steps", eval_steps=2,
                 per_device_eval_batch_size=4, load_best_model_at_end=True, metric_for_best_model="eval_loss")
    assert args.world_size == world
    if kind.startswith("plain"):
        t = _recording(Trainer)(model=gpt2(), args=args, train_dataset=dataset(), eval_dataset=dataset(8))
    else:
        cfg = OffloadConfig(params="host", optimizer_states="nvme", gradients="host",
                            nvme_paths=[f"{root}/nv-{kind}-{rank}"])
        t = _recording(TierstoreTrainer)(model=gpt2(), args=args, train_dataset=dataset(), eval_dataset=dataset(8),
                                         offload_config=cfg)
    t.losses = []
    t.train(resume_from_checkpoint=resume)
    t.save_model(f"{out}/final")
    evals = [h["eval_loss"] for h in t.state.log_history if "eval_loss" in h]
    return t.losses, norms(t), evals, t.state.best_model_checkpoint


def test_trainer_at_two_processes_matches_ddp_and_resumes_at_another_world_size(tmp_path):
    """TierstoreTrainer under 2 processes (gloo): every rank's micro-batch losses, the logged gradient norms,
    the eval losses, the best checkpoint (load_best_model_at_end) and the saved weights equal a plain Trainer's
    under DDP at the same global batch; a run
    resumed from its world-2 checkpoint-2 in one process ends where the world-2 run ended."""
    from tests.support import run_ranks
    plain = run_ranks(_rank_trainer, 2, str(tmp_path), "plain")
    ts = run_ranks(_rank_trainer, 2, str(tmp_path), "ts")
    for (pl, pn, pe, pb), (tl, tn, te, tb) in zip(plain, ts):
        best = f"checkpoint-{2 if pe[0] < pe[1] else 4}"  # load_best_model_at_end: the lower eval loss
        assert pb.endswith(best) and tb.endswith(best)
        assert len(tl) == 4 and tl == pytest.approx(pl, rel=0, abs=1e-5)
        assert len(tn) == 4 and tn == pytest.approx(pn, rel=1e-5)
        assert len(te) == 2 and te == pytest.approx(pe, rel=0, abs=1e-5)
    assert plain[0][0] != plain[1][0]  # each rank saw its own half of the global batch
    for sub in ("final", "checkpoint-2", "checkpoint-4"):
        a, b = weights(tmp_path / "plain" / sub), weights(tmp_path / "ts" / sub)
        assert sorted(a) == sorted(b)
        for k in a:
            assert torch.allclose(a[k], b[k], rtol=0, atol=1e-5), (sub, k)
    assert (tmp_path / "ts" / "checkpoint-2" / OPTIMIZER_DIR).is_dir()
    # the world-2 checkpoint resumed by one process at the same global batch (8)
    [(_losses, rn, _e, _b)] = run_ranks(_rank_trainer, 1, str(tmp_path), "ts1", str(tmp_path / "ts" / "checkpoint-2"))
    assert rn == pytest.approx(ts[0][1], rel=1e-5)
    a, b = weights(tmp_path / "ts" / "final"), weights(tmp_path / "ts1" / "final")
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0, atol=1e-5), k
