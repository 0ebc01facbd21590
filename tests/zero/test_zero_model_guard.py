"""Whole-model operations on a ZeRO-3 model ([Note: whole-model operations on a ZeRO-3 model]): a cast that
would be ignored raises naming compute_dtype, a move to the same device works, ``copy.deepcopy`` gives an
independent plain model with the full values, ``resize_token_embeddings`` raises naming the order that works;
``release_model`` takes every replacement back."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.support import batches, cfg, loss_fn, make_pair, run_ranks
from tierstore.errors import MisuseError
from tierstore.zero import OffloadConfig, Zero3Optimizer, release_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _train(m, opt, data):
    for x, y in data:
        loss_fn(m, x, y).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("cast", [lambda m: m.to(torch.bfloat16), lambda m: m.half(),
                                  lambda m: m.to(dtype=torch.float16), lambda m: m.double()])
def test_a_cast_after_wrapping_raises_naming_compute_dtype_and_changes_nothing(tmp_path, cast):
    ref_m, z_m = make_pair()
    opt = Zero3Optimizer(z_m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path, "host", "host", "host"))
    ref_opt = torch.optim.AdamW(ref_m.parameters(), lr=1e-2)
    data = batches(3)
    try:
        with pytest.raises(MisuseError, match=r"OffloadConfig\(compute_dtype=torch\.") as ei:
            cast(z_m)
        assert "release_model" in str(ei.value)
        assert all(b.dtype == torch.float32 for b in z_m.buffers())
        _train(z_m, opt, data)  # still trains as before, in float32
        _train(ref_m, ref_opt, data)
        got = z_m.state_dict()
        assert all(torch.allclose(got[k], v, rtol=1e-5, atol=1e-6) for k, v in ref_m.state_dict().items())
    finally:
        opt.close()


def test_a_cast_to_the_compute_dtype_or_a_move_to_its_device_works(tmp_path):
    _r, z_m = make_pair()
    opt = Zero3Optimizer(z_m, torch.optim.AdamW, lr=1e-2,
                         config=cfg(tmp_path, "host", "host", "host", compute_dtype=torch.bfloat16))
    try:
        assert z_m.to("cpu") is z_m and z_m.bfloat16() is z_m
        with pytest.raises(MisuseError, match=r"compute_dtype=torch\.float32"):
            z_m.float()
        x, y = batches(1)[0]
        assert z_m(x.bfloat16()).dtype == torch.bfloat16
        _train(z_m, opt, [(x.bfloat16(), y.bfloat16())])
    finally:
        opt.close()


@pytest.mark.parametrize("tiers", [("host", "host", "host"), ("nvme", "nvme", "nvme")])
def test_deepcopy_is_an_independent_plain_model_with_the_full_values(tmp_path, tiers):
    ref_m, z_m = make_pair()
    seen = []
    z_m.head.register_forward_hook(lambda mod, a, out: seen.append(1))  # the user's own hook is copied
    opt = Zero3Optimizer(z_m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path, *tiers))
    data = batches(4)
    try:
        _train(z_m, opt, data[:2])
        want = z_m.state_dict()
        ema = copy.deepcopy(z_m)
        assert type(ema) is type(z_m)
        got = dict(ema.named_parameters())
        assert set(got) == {k for k, _ in ref_m.named_parameters()}
        assert all(torch.equal(got[k].detach(), want[k]) for k in got)
        assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad for p in got.values())
        x, _y = data[0]
        seen.clear()
        with torch.no_grad():
            assert torch.equal(ema(x), z_m(x))
        assert len(seen) == 2
        ema_sd = {k: v.clone() for k, v in ema.state_dict().items()}
        _train(z_m, opt, data[2:])  # the original trains on; the copy does not move
        assert all(torch.equal(ema.state_dict()[k], v) for k, v in ema_sd.items())
        ema.zero_grad()  # the copy's own zero_grad: not the optimizer's
        # the copy trains alone, with its own optimizer, as a plain model
        plain = torch.optim.SGD(ema.parameters(), lr=0.1)
        loss_fn(ema, *data[0]).backward()
        plain.step()
        assert not torch.equal(ema.fc1.weight, ema_sd["fc1.weight"])
        assert all(torch.equal(z_m.state_dict()[k], v) for k, v in z_m.state_dict().items())
        sub = copy.deepcopy(z_m.fc2)  # a submodule alone
        assert torch.equal(sub.weight.detach(), z_m.state_dict()["fc2.weight"])
        opt2 = Zero3Optimizer(ema, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path / "copy", "host", "host", "host"))
        opt2.close()  # a new optimizer takes the copy: it is nobody's
    finally:
        opt.close()


def test_deepcopy_keeps_tied_parameters_tied(tmp_path):
    import transformers
    conf = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=8)
    torch.manual_seed(0)
    m = transformers.GPT2LMHeadModel(conf)
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path, "host", "host", "host"))
    try:
        m.eval()  # no dropout: the two forwards compare exactly
        ref = copy.deepcopy(m)
        assert not ref.training and ref.lm_head.weight is ref.transformer.wte.weight
        assert ref.lm_head.weight.shape == (32, 16)
        ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert torch.equal(ref(input_ids=ids).logits, m(input_ids=ids).logits)
    finally:
        opt.close()


def test_resize_token_embeddings_raises_naming_the_order_that_works(tmp_path):
    import transformers
    conf = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=8)
    torch.manual_seed(0)
    m = transformers.GPT2LMHeadModel(conf)
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path, "host", "host", "host"))
    with pytest.raises(MisuseError, match="build the optimizer after") as ei:
        m.resize_token_embeddings(40)
    assert "release_model" in str(ei.value)
    release_model(opt)  # the supported way: hand the model back, resize, build a new optimizer
    m.resize_token_embeddings(40)
    assert m.lm_head.weight.shape == (40, 16)
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path / "b", "host", "host", "host"))
    try:
        ids = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(0))
        m(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        assert m.state_dict()["lm_head.weight"].shape == (40, 16)
    finally:
        opt.close()


def test_release_model_takes_the_replacements_back(tmp_path):
    _r, z_m = make_pair()
    opt = Zero3Optimizer(z_m, torch.optim.AdamW, lr=1e-2, config=OffloadConfig(params="host",
                                                                               optimizer_states="host",
                                                                               gradients="host"))
    model = release_model(opt)
    ours = ("_apply", "__deepcopy__", "_ddp_params_and_buffers_to_ignore")
    assert not any(k in m.__dict__ for m in model.modules() for k in ours)
    assert model.half().fc1.weight.dtype == torch.float16
    assert copy.deepcopy(model).fc1.weight.dtype == torch.float16


def _deepcopy_at_world(rank, world):
    _r, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=OffloadConfig(params="host",
                                                                             optimizer_states="host",
                                                                             gradients="host"))
    try:
        _train(m, opt, batches(2, seed=3 + rank))
        full = m.state_dict()
        twin = copy.deepcopy(m)
    finally:
        opt.close()
    return full, {k: v.detach() for k, v in twin.state_dict().items()}


def test_deepcopy_at_world_size_2_gives_every_rank_the_whole_model():
    out = run_ranks(_deepcopy_at_world, 2)
    for full, twin in out:
        assert set(twin) == set(out[0][0])
        assert all(torch.equal(twin[k], out[0][0][k]) and torch.equal(full[k], out[0][0][k]) for k in twin)
