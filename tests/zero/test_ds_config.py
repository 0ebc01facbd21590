"""tierstore.zero.from_deepspeed on the configs users copy (tests/fixtures/deepspeed: HF transformers' ZeRO-3
template with its "auto" values, DeepSpeed's ZeRO-Infinity nvme layout) and on malformed ones: "auto"
resolved or refused by name, the optimizer / scheduler built with DeepSpeed's semantics, gradient_clipping
applied at step, batch keys checked, every ignored key named in one warning."""
from __future__ import annotations

import json
import math
import os
import warnings

import pytest
import torch

from tests.support import batches, loss_fn, make_pair, max_rel
from tierstore.errors import TierstoreValueError
from tierstore.zero import DeepSpeedSetup, OffloadConfig, Zero3Optimizer, from_deepspeed
from tierstore.zero.ds_config import DeepSpeedLR

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FIX = os.path.join(os.path.dirname(__file__), "..", "fixtures", "deepspeed")
HF_ZERO3 = os.path.join(FIX, "hf_zero3.json")
INFINITY = os.path.join(FIX, "zero_infinity_nvme.json")
# what HF Trainer passes for its TrainingArguments (fp32, no --bf16/--fp16)
TRAINER_ARGS = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, micro_batch_size=4,
                    gradient_accumulation_steps=2, gradient_clipping=0.05, warmup_steps=3, compute_dtype=torch.float32)


def load(path) -> dict:
    with open(path) as f:
        return json.load(f)


def test_hf_zero3_template_needs_its_auto_values_and_says_which():
    with pytest.raises(TierstoreValueError) as e:
        from_deepspeed(HF_ZERO3)
    assert '"auto"' in str(e.value) and "compute_dtype=" in str(e.value) and "fp16.enabled" in str(e.value)
    for missing, key in (("lr", "optimizer.params.lr"), ("warmup_steps", "scheduler.params.warmup_num_steps"),
                         ("gradient_clipping", "gradient_clipping"), ("micro_batch_size",
                                                                      "train_micro_batch_size_per_gpu")):
        args = {k: v for k, v in TRAINER_ARGS.items() if k != missing}
        with pytest.raises(TierstoreValueError, match=f"{missing}=") as e:
            from_deepspeed(HF_ZERO3, world_size=1, **args)
        assert key in str(e.value) and "invalid literal" not in str(e.value)
    with pytest.raises(TierstoreValueError, match="gradient_clipping="):  # the OffloadConfig-only path too
        OffloadConfig.from_deepspeed(HF_ZERO3, compute_dtype=torch.float32)


def test_hf_zero3_template_resolved_from_trainer_arguments():
    with pytest.warns(UserWarning) as rec:
        s = from_deepspeed(HF_ZERO3, world_size=2, **TRAINER_ARGS)
    assert len(rec) == 1  # ONE warning, naming every key not used
    msg = str(rec[0].message)
    for k in ("zero_optimization.overlap_comm", "zero_optimization.reduce_bucket_size",
              "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.stage3_max_live_parameters",
              "zero_optimization.stage3_gather_16bit_weights_on_model_save", "steps_per_print",
              "wall_clock_breakdown"):
        assert k in msg, k
    assert "optimizer" not in msg and "scheduler" not in msg and "train_batch_size" not in msg
    assert isinstance(s, DeepSpeedSetup)
    c = s.config
    assert (c.params, c.optimizer_states, c.gradients, c.compute_dtype) == ("host", "host", "host", torch.float32)
    assert c.sub_group_bytes == 4_000_000_000 and c.prefetch_depth == 2 and c.gradient_clipping == 0.05
    assert s.optimizer_class is torch.optim.AdamW
    assert s.optimizer_kwargs == dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, fused=True)
    assert (s.scheduler_type, s.scheduler_params) == ("WarmupLR", dict(warmup_min_lr=0.0, warmup_max_lr=1e-2,
                                                                      warmup_num_steps=3))
    b = s.batch
    assert (b.train_batch_size, b.micro_batch_size, b.gradient_accumulation_steps, b.world_size) == (16, 4, 2, 2)
    with pytest.warns(UserWarning):
        bf = from_deepspeed(HF_ZERO3, world_size=1, **{**TRAINER_ARGS, "compute_dtype": torch.bfloat16})
    assert bf.config.compute_dtype == torch.bfloat16


def test_zero_infinity_nvme_template():
    with pytest.warns(UserWarning) as rec:
        s = from_deepspeed(INFINITY, world_size=1)
    msg = str(rec[0].message)
    for k in ("aio.block_size", "aio.thread_count", "zero_optimization.offload_param.buffer_size",
              "zero_optimization.offload_param.max_in_cpu", "zero_optimization.offload_optimizer.fast_init"):
        assert k in msg, k
    c = s.config
    assert (c.params, c.optimizer_states, c.nvme_paths, c.compute_dtype) == ("nvme", "nvme", ["/local_nvme"],
                                                                             torch.bfloat16)
    assert c.gradient_clipping == 1.0
    # DeepSpeed's "Adam" is AdamW (decoupled weight decay) unless adam_w_mode is false
    assert s.optimizer_class is torch.optim.AdamW and s.optimizer_kwargs["betas"] == (0.9, 0.95)
    cfg = load(INFINITY)
    cfg["optimizer"]["params"]["adam_w_mode"] = False
    with pytest.warns(UserWarning):
        assert from_deepspeed(cfg, world_size=1).optimizer_class is torch.optim.Adam
    assert s.scheduler_type == "WarmupDecayLR" and s.scheduler_params["total_num_steps"] == 1000
    # DeepSpeed's own fused kernels unless torch_adam: torch's fused kernel, or torch's default
    assert s.optimizer_kwargs["fused"] is True
    for extra, fused in (({"torch_adam": True}, None), ({"foreach": True}, None), ({"fused": False}, False)):
        cfg = load(INFINITY)
        cfg["optimizer"]["params"].update(extra)
        with pytest.warns(UserWarning):
            assert from_deepspeed(cfg, world_size=1).optimizer_kwargs.get("fused") is fused, extra
    assert (s.batch.train_batch_size, s.batch.micro_batch_size, s.batch.gradient_accumulation_steps) == (32, 4, 8)
    with pytest.raises(TierstoreValueError, match="32 != micro_batch_size 4 x gradient_accumulation_steps 8 x "
                                                  "world size 2"):
        from_deepspeed(INFINITY, world_size=2)
    with pytest.raises(TierstoreValueError, match="given micro_batch_size=2"):
        from_deepspeed(INFINITY, world_size=1, micro_batch_size=2)
    # two of three batch keys: the third follows, DeepSpeed's rule
    cfg = load(INFINITY)
    del cfg["gradient_accumulation_steps"]
    with pytest.warns(UserWarning):
        assert from_deepspeed(cfg, world_size=2).batch.gradient_accumulation_steps == 4
    # OffloadConfig.from_deepspeed: the same config, the optimizer / scheduler / batch named as not built here
    with pytest.warns(UserWarning, match="optimizer .not built here") as rec:
        assert OffloadConfig.from_deepspeed(INFINITY).params == "nvme"
    assert "train_batch_size (not built here" in str(rec[0].message)


@pytest.mark.parametrize("change,match", [
    (("zero_optimization", "sub_group_size", "lots"), r"zero_optimization.sub_group_size='lots': expected an int"),
    (("zero_optimization", "stage", 2), "stage=2"),
    (("zero_optimization", "offload_param", {"device": "gpu"}), r"offload_param.device='gpu'"),
    (("zero_optimization", "offload_param", {"device": "nvme"}), "nvme_path is missing"),
    (("zero_optimization", "offload_param", "cpu"), "offload_param must be an object"),
    ((None, "optimizer", ["AdamW"]), "optimizer must be an object"),
    (("optimizer", "params", {"lr": "fast"}), "optimizer.params.lr='fast'"),
    (("optimizer", "params", {"bias_correction": False}), "bias_correction"),
    ((None, "gradient_clipping", "yes"), "gradient_clipping='yes': expected a number"),
    ((None, "train_batch_size", 0), "train_batch_size=0: expected a positive integer"),
    ((None, "fp16", {"enabled": True}), "both true"),
    (("scheduler", "params", {"warmup_num_steps": 0}), "warmup_num_steps=0"),
    (("scheduler", "params", {"total_num_steps": "auto"}), "total_steps="),
])
def test_malformed_configs_are_refused_by_key(change, match):
    cfg = load(INFINITY)
    sec, key, value = change
    (cfg if sec is None else cfg[sec])[key] = value
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(TierstoreValueError, match=match):
            s = from_deepspeed(cfg, world_size=1)
            s.build_scheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))


def test_unbuilt_optimizer_and_scheduler_are_named(tmp_path):
    cfg = load(INFINITY)
    cfg["optimizer"] = {"type": "Lamb", "params": {"lr": 1e-3}}
    cfg["scheduler"] = {"type": "OneCycle", "params": {}}
    with pytest.warns(UserWarning) as rec:
        s = from_deepspeed(cfg, world_size=1)
    msg = str(rec[0].message)
    assert "type 'Lamb' not built" in msg and "type 'OneCycle' not built" in msg
    assert s.optimizer_class is None and s.build_scheduler(None) is None  # type: ignore[arg-type]
    with pytest.raises(TierstoreValueError, match="no optimizer section"):
        s.build_optimizer(torch.nn.Linear(2, 2))
    with pytest.raises(TierstoreValueError, match="not valid JSON"):
        bad = tmp_path / "bad.json"
        bad.write_text("{")
        from_deepspeed(str(bad))


def _ds_reference(kind, i, p, base_lr):
    """DeepSpeed's lr at last_batch_iteration i, written from its documented formulas."""
    n = max(2, p["warmup_num_steps"])
    if i < 0:
        return 0.0 if kind == "WarmupCosineLR" else p.get("warmup_min_lr", 0.0)
    if i < n:
        w = math.log(i + 1) / math.log(n) if p.get("warmup_type", "log") == "log" else i / n
    elif kind == "WarmupLR":
        w = 1.0
    elif kind == "WarmupDecayLR":
        w = max(0.0, (p["total_num_steps"] - i) / max(1.0, p["total_num_steps"] - n))
    if kind == "WarmupCosineLR":
        if i < n:
            return base_lr * (p["warmup_min_ratio"] + w * (1 - p["warmup_min_ratio"]))
        prog = min(1.0, (i - n + 1) / max(1, p["total_num_steps"] - n))
        return base_lr * (p["cos_min_ratio"] + (1 - p["cos_min_ratio"]) * (1 + math.cos(math.pi * prog)) / 2)
    lo, hi = p.get("warmup_min_lr", 0.0), p["warmup_max_lr"]
    return lo + (hi - lo) * w


@pytest.mark.parametrize("kind,params", [
    ("WarmupLR", dict(warmup_min_lr=0.001, warmup_max_lr=0.1, warmup_num_steps=5)),
    ("WarmupLR", dict(warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=4, warmup_type="linear")),
    ("WarmupDecayLR", dict(total_num_steps=12, warmup_max_lr=0.1, warmup_num_steps=4, warmup_type="linear")),
    ("WarmupCosineLR", dict(total_num_steps=12, warmup_min_ratio=0.1, warmup_num_steps=4, cos_min_ratio=0.01)),
])
def test_schedulers_follow_deepspeed_step_by_step_and_resume(kind, params):
    def make():
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.05)
        return opt, DeepSpeedLR(opt, kind, params)
    opt, sched = make()
    seen = [opt.param_groups[0]["lr"]]
    for _ in range(15):
        opt.step()
        sched.step()
        seen.append(opt.param_groups[0]["lr"])
    full = {**dict(warmup_num_steps=1000, warmup_min_ratio=0.0, cos_min_ratio=1e-4), **params}
    want = [_ds_reference(kind, i - 1, full, 0.05) for i in range(16)]
    assert seen == pytest.approx(want, rel=1e-12, abs=1e-15)
    # resume from the state_dict (JSON-able: it goes into a checkpoint's client_state)
    opt, sched = make()
    for _ in range(6):
        opt.step()
        sched.step()
    sd = json.loads(json.dumps(sched.state_dict()))
    opt2, sched2 = make()
    sched2.load_state_dict(sd)
    for _ in range(4):
        opt.step()
        sched.step()
        opt2.step()
        sched2.step()
        assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_setup_trains_like_torch_with_clipping_and_schedule(tmp_path):
    """build_optimizer + build_scheduler from the HF template equal torch AdamW + clip_grad_norm_ + the same
    schedule; without the gradient_clipping the config asks for, the result differs."""
    with pytest.warns(UserWarning):
        s = from_deepspeed(HF_ZERO3, world_size=1, **TRAINER_ARGS, nvme_paths=[str(tmp_path)],
                           sub_group_bytes=8192, min_io_bytes=1024)
    ref_m, z_m = make_pair()
    ref = torch.optim.AdamW(ref_m.parameters(), **s.optimizer_kwargs)
    ref_sched = DeepSpeedLR(ref, s.scheduler_type, s.scheduler_params)
    opt = s.build_optimizer(z_m)
    assert isinstance(opt, Zero3Optimizer)
    sched = s.build_scheduler(opt)
    try:
        norms = []
        for x, y in batches(6):
            loss_fn(ref_m, x, y).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(ref_m.parameters(), s.gradient_clipping)))
            ref.step()
            ref.zero_grad()
            ref_sched.step()
            loss_fn(z_m, x, y).backward()
            opt.step()  # clips by itself: config.gradient_clipping
            opt.zero_grad()
            sched.step()
        assert max(norms) > s.gradient_clipping  # the clipping really changed the steps
        assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"]
        assert max_rel(opt.full_state_dict(), ref_m) <= 1e-6
    finally:
        opt.close()


def test_every_mapped_key_lands_on_an_offload_config_field():
    """The mapping's tables (ds_mapping.py) name only fields OffloadConfig has, and OffloadConfig.from_deepspeed
    gives the same config as tierstore.zero.from_deepspeed."""
    import dataclasses

    from tierstore.zero import ds_mapping
    names = {f.name for f in dataclasses.fields(OffloadConfig)}
    for _key, fld, _conv, auto in ds_mapping.ZERO_KEYS + ds_mapping.FP16_KEYS + ds_mapping.TOP_KEYS:
        assert set(fld if isinstance(fld, tuple) else (fld,)) <= names, fld
        assert auto is None or auto is ds_mapping.AUTO_DEFAULT or auto in names, auto
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = from_deepspeed(INFINITY, world_size=1).config
        alone = OffloadConfig.from_deepspeed(INFINITY)
    assert whole.replace(extra={}) == alone.replace(extra={})
