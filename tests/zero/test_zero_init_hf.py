"""zero.Init right by construction: a model built under Init has the same weights, bit for bit, as one built
plainly with the same seed -- torch modules whose parents re-initialise their children, transformers' GPT-2 and
Llama (post_init / _init_weights) -- and from_pretrained under Init streams the checkpoint into the store;
GatheredParameters / opt.gathered(modifier_rank=...) keep writes. See [Note: initialisation right by
construction] in tierstore/zero/params/init.py and [Note: gathered parameters] in gathered.py."""
from __future__ import annotations

import pathlib

import pytest
import torch
import torch.nn as nn

from tests.support import batches, cfg, loss_fn, make_pair, run_ranks
from tierstore.errors import MisuseError
from tierstore.zero import GatheredParameters, Init, Zero3Optimizer
from tierstore.zero.params.init import OffloadedParameter

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Parent(nn.Module):
    """A parent whose __init__ changes its children after building them, in the ways models do."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.emb = nn.Embedding(10, 8, padding_idx=0)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        nn.init.zeros_(self.fc.bias)  # torch.nn.init on a child's parameter
        self.fc.weight.data.mul_(0.5)  # through .data
        with torch.no_grad():
            self.emb.weight[1].fill_(3.0)  # through a view
        self.apply(self._init)  # nanoGPT style
        for n, p in self.named_parameters():
            if n.endswith("2.weight"):
                nn.init.normal_(p, std=0.02 / (2 * len(self.blocks)) ** 0.5)  # scaled residual init
        self.scale = nn.Parameter(torch.full((self.fc.weight.shape[0],), 2.0))  # reads a child's shape

    def _init(self, m):
        if isinstance(m, nn.Linear) and m.out_features == 16 and m.in_features == 16:
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx):
        h = self.fc(self.emb(idx)) * self.scale
        for b in self.blocks:
            h = h + torch.tanh(b(h))
        return h.sum(-1)


def _plain_and_init(tmp_path, build, seed=0, params="host"):
    torch.manual_seed(seed)
    ref = build()
    torch.manual_seed(seed)
    with Init(cfg(tmp_path / "i", params=params)) as init:
        m = build()
    return ref, m, init


def _equal(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("params", ["host", "nvme"])
def test_torch_parent_reinitialising_children_is_bit_equal(tmp_path, params):
    ref, m, init = _plain_and_init(tmp_path, Parent, params=params)
    assert init.offloaded == len(list(ref.parameters()))
    assert all(isinstance(p, OffloadedParameter) for p in m.parameters())  # offloaded, not held
    assert m.fc.weight.shape == (16, 8) and m.fc.weight.numel() == 128  # metadata reads as the real one
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path / "o", params=params))
    try:
        assert _equal(m.state_dict(), ref.state_dict())
        idx = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(0))
        assert torch.equal(m(idx), ref(idx))
    finally:
        opt.close()


def test_state_dict_and_load_state_dict_of_a_model_built_under_init(tmp_path):
    ref, m, _init = _plain_and_init(tmp_path, Parent)
    assert _equal(m.state_dict(), ref.state_dict())  # before any optimizer took it: full values
    assert all(isinstance(p, OffloadedParameter) for p in m.parameters())  # and offloaded again after
    torch.manual_seed(3)
    src = Parent()
    assert tuple(m.load_state_dict(src.state_dict())) == ([], [])
    assert all(isinstance(p, OffloadedParameter) for p in m.parameters())
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path / "o", params="host"))
    try:
        assert _equal(m.state_dict(), src.state_dict())
    finally:
        opt.close()


def test_use_outside_a_scope_raises_and_gathered_parameters_keeps_writes(tmp_path):
    ref, m, init = _plain_and_init(tmp_path, Parent)
    with pytest.raises(MisuseError, match="GatheredParameters"):
        with torch.no_grad():
            m.fc.weight.zero_()  # no scope: would have been a write into an empty tensor
    with pytest.raises(MisuseError, match="Tensor.data"):
        m.fc.weight.data.zero_()
    # what needs no value works without a scope: metadata, freezing, zero_grad
    assert len(m.fc.weight) == 16 and m.fc.weight.dim() == 2 and m.fc.weight.size(1) == 8
    m.emb.weight.requires_grad_(False)
    m.zero_grad()
    assert not m.emb.weight.requires_grad and isinstance(m.emb.weight, OffloadedParameter)
    m.emb.weight.requires_grad_(True)
    with GatheredParameters(m.fc.weight):  # modifier_rank=None: read, changes dropped
        assert torch.equal(m.fc.weight, ref.fc.weight)
        with torch.no_grad():
            m.fc.weight.zero_()
    assert isinstance(m.fc.weight, OffloadedParameter)
    with GatheredParameters([m.fc.weight, m.fc.bias], modifier_rank=0):
        with torch.no_grad():
            m.fc.weight.add_(1.0)
            m.fc.bias.fill_(0.25)
    with torch.no_grad():
        ref.fc.weight.add_(1.0)
        ref.fc.bias.fill_(0.25)
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path / "o", params="host"))
    try:
        assert _equal(m.state_dict(), ref.state_dict())
    finally:
        opt.close()


@pytest.mark.parametrize("tiers", [("host", "host", "host"), ("nvme", "nvme", "nvme")])
def test_gathered_with_modifier_rank_writes_shards_and_masters(tmp_path, tiers):
    ref_m, z_m = make_pair()
    opt = Zero3Optimizer(z_m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path, *tiers))
    try:
        with GatheredParameters(list(z_m.fc1.parameters())):  # dropped
            with torch.no_grad():
                z_m.fc1.weight.zero_()
        assert _equal(z_m.state_dict(), ref_m.state_dict())
        with GatheredParameters(z_m.fc1.weight, modifier_rank=0), torch.no_grad():
            z_m.fc1.weight.mul_(-2.0)
        with opt.gathered(modifier_rank=0), torch.no_grad():
            z_m.head.bias.fill_(0.5)
        with torch.no_grad():
            ref_m.fc1.weight.mul_(-2.0)
            ref_m.head.bias.fill_(0.5)
        assert _equal(z_m.state_dict(), ref_m.state_dict())
        assert not opt.coordinator.stats().buckets_held
        ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2)
        for x, y in batches(3):  # training continues from the kept values: the masters were written
            for m, o in ((ref_m, ref), (z_m, opt)):
                loss_fn(m, x, y).backward()
                o.step()
                o.zero_grad()
        full = opt.full_state_dict()
        assert all((full[n] - p).abs().max() <= 1e-6 * p.abs().max() for n, p in ref_m.named_parameters())
    finally:
        opt.close()


def _gpt2():
    import transformers
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64,
                                                                 n_positions=16))


def _llama():
    import transformers
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=32))


@pytest.mark.parametrize("build", [_gpt2, _llama])
def test_transformers_model_under_init_is_bit_equal_and_from_pretrained_streams(tmp_path, build):
    ref, m, _init = _plain_and_init(tmp_path, build)
    assert all(isinstance(p, OffloadedParameter) for p in m.parameters())
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-3, config=cfg(tmp_path / "o", params="host"))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    try:
        assert _equal(m.state_dict(), ref.state_dict())  # post_init's std 0.02, GPT-2's scaled c_proj ...
        m.eval(), ref.eval()  # no dropout: the same forward
        assert torch.equal(m(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss)
    finally:
        opt.close()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p))  # values no initialisation would give: they must come from the file
    ref.save_pretrained(str(tmp_path / "saved"))
    plain = type(ref).from_pretrained(str(tmp_path / "saved"))
    with Init(cfg(tmp_path / "i2", params="nvme")) as init:
        m2 = type(ref).from_pretrained(str(tmp_path / "saved"))
        # each loaded tensor went to the store as it was assigned: nothing of the model is held
        assert all(isinstance(p, OffloadedParameter) for p in m2.parameters())
    assert init.offloaded == len(list(plain.parameters()))
    opt = Zero3Optimizer(m2, torch.optim.AdamW, lr=1e-3, config=cfg(tmp_path / "o2", params="host"))
    try:
        assert _equal(m2.state_dict(), plain.state_dict())
    finally:
        opt.close()


def _rank_init(rank, world, root):
    root = pathlib.Path(root)
    torch.manual_seed(0)
    with Init(cfg(root / f"i{rank}", params="host")):
        m = Parent()
        with GatheredParameters(m.fc.bias, modifier_rank=1), torch.no_grad():
            m.fc.bias.fill_(float(rank + 1))  # rank 1's values are kept everywhere
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(root / f"o{rank}", params="host"))
    with opt.gathered([m.scale], modifier_rank=0), torch.no_grad():
        m.scale.add_(float(10 * (rank + 1)))  # rank 0's values are kept everywhere
    sd = m.state_dict()
    opt.close()
    return sd


def test_init_and_gathered_at_world_2(tmp_path):
    out = run_ranks(_rank_init, 2, str(tmp_path))
    torch.manual_seed(0)
    ref = Parent()
    with torch.no_grad():
        ref.fc.bias.fill_(2.0)
        ref.scale.add_(10.0)
    for sd in out:
        assert _equal(sd, ref.state_dict())


def _rank_from_pretrained(rank, world, root):
    root = pathlib.Path(root)
    import transformers
    with Init(cfg(root / f"i{rank}", params="nvme")):
        m = transformers.GPT2LMHeadModel.from_pretrained(str(root / "saved"))
    assert all(isinstance(p, OffloadedParameter) for p in m.parameters())
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-3, config=cfg(root / f"o{rank}", params="nvme"))
    try:
        sd = m.state_dict()
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        m.eval()
        loss = m(input_ids=ids, labels=ids).loss.detach()
    finally:
        opt.close()
    return sd, loss


def test_from_pretrained_under_init_at_world_2(tmp_path):
    """Each of two ranks loads the same checkpoint under Init (its shard of every parameter to its store):
    the full state_dict and the forward's loss are the plain from_pretrained's, on both ranks."""
    pytest.importorskip("transformers")
    ref = _gpt2()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p))  # values no initialisation would give: they must come from the file
    ref.save_pretrained(str(tmp_path / "saved"))
    plain = type(ref).from_pretrained(str(tmp_path / "saved")).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    want = plain(input_ids=ids, labels=ids).loss.detach()
    for sd, loss in run_ranks(_rank_from_pretrained, 2, str(tmp_path)):
        assert _equal(sd, plain.state_dict())
        assert torch.equal(loss, want)


def test_post_init_holds_one_module_at_a_time(tmp_path, monkeypatch):
    """GPT-2's post_init re-initialises every parameter after the model was built (and offloaded): the values
    it brings back are held one module's worth at a time, not the model."""
    import transformers

    from tierstore.zero.params import init as zinit
    held: list[int] = []
    # private: a spy on materialization; nothing public counts it
    real = zinit._materialize

    def spy(p, func):
        real(p, func)
        held.append(sum(q.numel() for s in zinit._scopes for q, _h in s.touched))  # elements held now
    monkeypatch.setattr(zinit, "_materialize", spy)  # observing the materialisations, not changing them
    conf = transformers.GPT2Config(n_layer=4, n_head=2, n_embd=32, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    with Init(cfg(tmp_path, params="host")):
        m = transformers.GPT2LMHeadModel(conf)
    total = sum(p.numel() for p in m.parameters())
    largest = max(sum(p.numel() for p in mod.parameters(recurse=False)) for mod in m.modules())
    assert len(held) >= len(list(m.parameters()))  # post_init touched every parameter
    assert max(held) <= largest + 32 * 3 * 32 < total / 4, (max(held), largest, total)  # + c_proj of a block
