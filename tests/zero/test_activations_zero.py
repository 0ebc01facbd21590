"""Activation offload with Zero3Optimizer (OffloadConfig.activation_offload, attached to the ZeRO-3 hook events):
training with it is bit-equal to training without it, at world 1 and 2 (gloo), with and without
torch.utils.checkpoint; from_deepspeed maps DeepSpeed's activation_checkpointing section."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from tests.support import run_ranks
from tierstore.errors import TierstoreValueError
from tierstore.zero import OffloadConfig, Zero3Optimizer


class Blocks(nn.Module):
    def __init__(self, ckpt: bool | None):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 96), nn.GELU(), nn.Linear(96, 32), nn.LayerNorm(32))
                                    for _ in range(3))
        self.head = nn.Linear(32, 4)
        self.ckpt = ckpt

    def forward(self, x):
        for b in self.blocks:
            x = x + (checkpoint(b, x, use_reentrant=self.ckpt) if self.ckpt is not None else b(x))
        return self.head(x)


def _train(root: str, tier: str | None, ckpt: bool | None, mode: str = "all", rank: int = 0, world: int = 1):
    torch.manual_seed(0)
    model = Blocks(ckpt)
    cfg = OffloadConfig(params="device", optimizer_states="host", gradients="host", nvme_paths=[root],
                        min_io_bytes=1024, sub_group_bytes=16384, activation_offload=tier, activation_mode=mode)
    opt = Zero3Optimizer(model, torch.optim.AdamW, config=cfg, lr=1e-2)
    losses, stats = [], None
    try:
        if opt.activations is not None:
            opt.activations.min_bytes = 1024  # the test's tensors are small: offload them
        g = torch.Generator().manual_seed(1 + rank)
        for _ in range(3):
            x = torch.randn(48, 32, generator=g).requires_grad_()  # reentrant checkpoint: grads of block 0
            y = torch.randn(48, 4, generator=g)
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if opt.activations is not None:
            opt.activations.wait_writes()
            stats = opt.activations.stats()
            assert opt.activations.store.keys() == []
        full = {k: v.clone() for k, v in opt.full_state_dict().items()} if hasattr(opt, "full_state_dict") else \
            {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        opt.close()
    return losses, full, stats


def _ranks(rank, world, root, cases):
    return {c: _train(f"{root}/{rank}-{'-'.join(map(str, c))}", *c, rank=rank, world=world) for c in cases}


@pytest.mark.parametrize("ckpt,mode", [(True, "checkpoint")])  # world 2 below: no / non-reentrant ckpt
def test_world1_bit_equal_to_no_offload(tmp_path, ckpt, mode):
    ref_losses, ref_full, _ = _train(str(tmp_path / "ref"), None, ckpt)
    losses, full, stats = _train(str(tmp_path / "act"), "nvme", ckpt, mode)
    assert stats.offloaded > 0 and stats.unpacked > 0 and stats.held_bytes == 0
    assert losses == ref_losses
    assert all(torch.equal(full[k], ref_full[k]) for k in ref_full)


def test_world2_bit_equal_to_no_offload(tmp_path):
    cases = [(None, False), ("nvme", False), ("host", False, "checkpoint")]
    results = run_ranks(_ranks, 2, str(tmp_path), cases)
    for res in results:
        ref_losses, ref_full, _ = res[(None, False)]
        for c in cases[1:]:
            losses, full, stats = res[c]
            assert stats.offloaded > 0
            assert losses == ref_losses, c
            assert all(torch.equal(full[k], ref_full[k]) for k in ref_full), c


def test_offload_config_checks(tmp_path):
    with pytest.raises(TierstoreValueError, match="activation_offload"):
        OffloadConfig(activation_offload="device")
    with pytest.raises(TierstoreValueError, match="activation_mode"):
        OffloadConfig(activation_offload="host", activation_mode="every")
    with pytest.raises(TierstoreValueError, match="nvme_paths"):
        OffloadConfig(activation_offload="nvme")


def test_from_deepspeed_maps_activation_checkpointing():
    ds = {"zero_optimization": {"stage": 3},
          "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                       "contiguous_memory_optimization": False, "number_checkpoints": 4,
                                       "synchronize_checkpoint_boundary": False, "profile": False}}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cfg = OffloadConfig.from_deepspeed(ds)
    assert cfg.activation_offload == "host" and cfg.activation_mode == "checkpoint"
    text = " ".join(str(x.message) for x in w)
    assert "activation_checkpointing.partition_activations" in text
    assert "activation_checkpointing.number_checkpoints" in text
    assert "cpu_checkpointing" not in text and "activation_checkpointing.profile" not in text
    plain = OffloadConfig.from_deepspeed({"zero_optimization": {"stage": 3},
                                          "activation_checkpointing": {"cpu_checkpointing": False}})
    assert plain.activation_offload is None
