"""A ZeRO-3 model behaves like a model: model.state_dict() yields full tensors (never shape [0]),
load_state_dict() writes into the shards and the masters, at world size 1 and 2, on host and nvme tiers;
safetensors and transformers' save_pretrained / from_pretrained round-trip. See [Note: a partitioned model's
state dict] in tierstore/zero/params/module_state.py."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from tests.support import Odd, batches, cfg, loss_fn, make_pair, max_rel, run_ranks
from tierstore.errors import MisuseError
from tierstore.zero import Zero3Optimizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _train(m, o, data):
    for x, y in data:
        loss_fn(m, x, y).backward()
        o.step()
        o.zero_grad()


def _equal(a: dict, b: dict, ordered: bool = True) -> bool:
    same_keys = list(a) == list(b) if ordered else set(a) == set(b)
    return same_keys and all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype and torch.equal(a[k], b[k])
                             for k in a)


@pytest.mark.parametrize("tiers", [("host", "host", "host"), ("nvme", "nvme", "nvme"), ("device", "host", "host")])
def test_state_dict_is_full_and_equal_to_torch(tmp_path, tiers):
    ref_m, z_m = make_pair()
    opt = Zero3Optimizer(z_m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path, *tiers))
    try:
        assert all(p.data.numel() == 0 for p in z_m.parameters())  # partitioned: torch's state_dict would be empty
        sd = z_m.state_dict()
        assert _equal(sd, ref_m.state_dict())  # keys, order, shapes, dtypes and every bit
        assert not opt.coordinator.stats().buckets_held  # nothing left gathered
        assert _equal(z_m.fc2.state_dict(), ref_m.fc2.state_dict())  # a submodule's, too
        assert _equal(z_m.state_dict(prefix="m."), ref_m.state_dict(prefix="m."))
        ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2)
        data = batches(4)
        _train(ref_m, ref, data)
        _train(z_m, opt, data)
        sd = z_m.state_dict()
        assert _equal(sd, opt.full_state_dict())
        assert max_rel(sd, ref_m) <= 1e-6  # the tolerance of the parity tests in test_zero.py
    finally:
        opt.close()


def test_tied_parameters_appear_under_each_name_like_torch(tmp_path):
    torch.manual_seed(0)
    ref_m = Odd()
    z_m = copy.deepcopy(ref_m)
    opt = Zero3Optimizer(z_m, torch.optim.Adam, lr=1e-2, config=cfg(tmp_path, "host", "host", "host"))
    try:
        sd, ref_sd = z_m.state_dict(), ref_m.state_dict()
        assert _equal(sd, ref_sd)
        assert sd["out.weight"] is sd["emb.weight"]  # one tensor under both names, as torch's share storage
        assert ref_sd["out.weight"].data_ptr() == ref_sd["emb.weight"].data_ptr()
    finally:
        opt.close()


@pytest.mark.parametrize("tiers", [("host", "host", "host"), ("nvme", "nvme", "nvme")])
def test_load_state_dict_writes_shards_and_masters(tmp_path, tiers):
    src, _ = make_pair(seed=7)
    ref_m, z_m = make_pair(seed=0)
    opt = Zero3Optimizer(z_m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path, *tiers))
    try:
        out = z_m.load_state_dict(src.state_dict())
        assert out.missing_keys == [] and out.unexpected_keys == []
        assert _equal(z_m.state_dict(), src.state_dict())
        # training continues from the loaded values: the masters the optimizer steps from were written too
        ref_m.load_state_dict(src.state_dict())
        ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2)
        data = batches(4)
        _train(ref_m, ref, data)
        _train(z_m, opt, data)
        assert max_rel(opt.full_state_dict(), ref_m) <= 1e-6
    finally:
        opt.close()


def test_load_state_dict_reports_keys_and_shapes_as_torch_does(tmp_path):
    ref_m, z_m = make_pair()
    opt = Zero3Optimizer(z_m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path, "host", "host", "host"))
    try:
        good = make_pair(seed=3)[0].state_dict()
        partial = {k: v for k, v in good.items() if k != "fc2.bias"}
        partial["extra.weight"] = torch.zeros(2)
        for strict in (True, False):
            outcomes = []
            for m in (ref_m, z_m):
                try:
                    outcomes.append(("ok", tuple(m.load_state_dict(partial, strict=strict))))
                except RuntimeError as e:
                    outcomes.append(("raised", str(e)))
            assert outcomes[0] == outcomes[1]
        assert _equal(z_m.state_dict(), ref_m.state_dict())  # what was there was written, like torch
        bad = dict(good)
        bad["fc1.weight"] = torch.zeros(3, 3)
        bad["norm.bias"] = "not a tensor"
        msgs = []
        for m in (ref_m, z_m):
            with pytest.raises(RuntimeError) as e:
                m.load_state_dict(bad)
            msgs.append(str(e.value))
        assert msgs[0] == msgs[1] and "size mismatch for fc1.weight" in msgs[0]
    finally:
        opt.close()


def test_safetensors_round_trip(tmp_path):
    from safetensors.torch import load_file, save_file
    _, z_m = make_pair(seed=0)
    opt = Zero3Optimizer(z_m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path / "a", "nvme", "nvme", "nvme"))
    _train(z_m, opt, batches(3))
    save_file(z_m.state_dict(), str(tmp_path / "m.safetensors"))
    want = opt.full_state_dict()
    opt.close()
    loaded = load_file(str(tmp_path / "m.safetensors"))
    assert _equal(loaded, want, ordered=False)  # safetensors sorts the keys
    _, z2 = make_pair(seed=9)
    opt2 = Zero3Optimizer(z2, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path / "b", "host", "host", "host"))
    try:
        z2.load_state_dict(loaded)
        assert _equal(z2.state_dict(), want)
    finally:
        opt2.close()


class _SavesInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        self.state_dict()
        return self.fc(x)


def test_state_dict_inside_forward_raises_and_keep_vars_needs_gathered(tmp_path):
    m = _SavesInForward()
    opt = Zero3Optimizer(m, torch.optim.SGD, lr=0.1, config=cfg(tmp_path, "host", "host", "host"))
    try:
        with pytest.raises(MisuseError, match="inside its forward or backward"):
            m(torch.randn(2, 4))
        with pytest.raises(MisuseError, match="keep_vars=True"):
            m.state_dict(keep_vars=True)
        with opt.gathered():
            kv = m.state_dict(keep_vars=True)
            assert kv["fc.weight"] is m.fc.weight and kv["fc.weight"].shape == (4, 4)
        assert m.state_dict()["fc.weight"].shape == (4, 4)  # a failed call leaves nothing behind
    finally:
        opt.close()


def test_load_inside_gathered_updates_the_held_values(tmp_path):
    src, _ = make_pair(seed=4)
    _, z_m = make_pair()
    opt = Zero3Optimizer(z_m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path, "host", "host", "host"))
    try:
        with opt.gathered():
            z_m.load_state_dict(src.state_dict())
            assert all(torch.equal(p, src.state_dict()[n]) for n, p in z_m.named_parameters())
        assert _equal(z_m.state_dict(), src.state_dict())
    finally:
        opt.close()


def _rank_state_dict(rank, world, root, tiers):
    import pathlib
    torch.manual_seed(0)
    _, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(pathlib.Path(root) / f"r{rank}", *tiers))
    first = m.state_dict()
    data = batches(4, seed=1)
    for x, y in data[rank::world]:
        loss_fn(m, x, y).backward()
        opt.step()
        opt.zero_grad()
    trained = m.state_dict()
    src = make_pair(seed=11)[0].state_dict()
    m.load_state_dict(src)
    loaded = m.state_dict()
    full = opt.full_state_dict()
    opt.close()
    return {"first": first, "trained": trained, "loaded": loaded, "full": full}


@pytest.mark.parametrize("tiers", [("host", "host", "host"), ("nvme", "nvme", "nvme")])
def test_state_dict_at_world_2_is_the_same_full_dict_on_every_rank(tmp_path, tiers):
    out = run_ranks(_rank_state_dict, 2, str(tmp_path), tiers)
    ref_m, _ = make_pair()
    src = make_pair(seed=11)[0].state_dict()
    for r in out:
        assert _equal(r["first"], ref_m.state_dict())
        assert _equal(r["trained"], out[0]["trained"])  # every rank the same full dict
        assert all(v.shape == ref_m.state_dict()[k].shape for k, v in r["trained"].items())
        assert _equal(r["loaded"], src) and _equal(r["full"], src)  # each rank wrote its own shards


def test_gpt2_save_pretrained_from_pretrained(tmp_path):
    import transformers
    conf = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    z_m = transformers.GPT2LMHeadModel(conf)
    opt = Zero3Optimizer(z_m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path / "z", "host", "host", "host"))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        z_m(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    z_m.save_pretrained(str(tmp_path / "out"))
    want = z_m.state_dict()
    opt.close()
    back = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "out"))
    got = back.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(v.numel() > 0 for v in got.values())


def test_state_dict_holds_one_gathered_bucket_at_a_time(tmp_path, monkeypatch):
    import weakref

    from tierstore.zero.params import module_state
    _, z_m = make_pair()
    opt = Zero3Optimizer(z_m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path, "host", "host", "host"))
    alive_at_call = []
    refs: list = []
    # private: a failing collective injected into the module's own process-group helper
    real = module_state._dist.all_gather

    def spy(shard, out, group=None, **kw):
        alive_at_call.append(sum(r() is not None for r in refs))  # earlier gathered buckets still alive
        refs.append(weakref.ref(out))
        return real(shard, out, group, **kw)
    monkeypatch.setattr(module_state._dist, "all_gather", spy)  # observing the gathers, not changing them
    try:
        sd = z_m.state_dict()
        assert len(refs) == len(opt.layout.subgroups) > 2  # every bucket gathered once
        assert alive_at_call == [0] * len(refs)  # none of the earlier buckets alive at the next gather
        assert all(r() is None for r in refs) and all(v.numel() > 0 for v in sd.values())
    finally:
        opt.close()
