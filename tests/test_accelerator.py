"""What only a real accelerator can check: the device tier's memory, the pool's page-locked registration and
asynchronous copies, ZeRO-3 with the model on the accelerator against torch on the same accelerator, activation
offload from accelerator memory, and the accelerator's RNG in checkpoints.

[Note: the accelerator checks]
Everything else runs with the CPU standing in for the accelerator ([Note: the CPU stands in for the
accelerator] in tiers/device.py). This module is skipped where torch sees no accelerator -- on the CI machines
and the development machines, which have none -- and is run by hand on a machine with one:
``python -m pytest -q tests/test_accelerator.py`` (bench/README.md, "Accelerator checks", gives the machine
it passed on). Written against torch's device-generic API, like the code it checks.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from tests.support import Net, batches, cfg, loss_fn, make_pair, max_rel
from tests.tiers.tier_conformance import MemoryTierTests, cpu_bytes
from tierstore import ActivationOffload, Store
from tierstore.io import BufferPool
from tierstore.quant import SCHEMES, dequantize, quantize
from tierstore.tiers import DeviceTier
from tierstore.tiers.device import default_device
from tierstore.zero import Zero3Optimizer, rng_state, set_rng_state

pytestmark = pytest.mark.skipif(not torch.accelerator.is_available(),
                                reason="no accelerator here ([Note: the accelerator checks])")

DEV = default_device()


class TestDeviceTierOnTheAccelerator(MemoryTierTests):
    tier_name = "device"

    def make(self, budget):
        return DeviceTier(budget)

    def raw(self, tier, copy):
        assert copy.device == DEV != torch.device("cpu")
        return cpu_bytes(copy.cpu().contiguous())


def test_pool_buffers_are_registered_and_copy_asynchronously():
    pool = BufferPool(8 << 20, 4 << 20)  # lock=True: page-locked, and registered with CUDA where it is present
    try:
        assert pool.locked and pool._cuda_registered == (DEV.type == "cuda")
        buf = pool.lease()
        src = torch.randn(1 << 20)
        host = buf.tensor(torch.float32, src.numel())
        host.copy_(src)
        if DEV.type == "cuda":
            assert host.is_pinned()
        dev = host.to(DEV, non_blocking=True)
        torch.accelerator.synchronize()
        host.zero_()
        host.copy_(dev, non_blocking=True)
        torch.accelerator.synchronize()
        assert torch.equal(host, src)
        buf.release()
    finally:
        pool.close()


@pytest.mark.parametrize("tier", ["device", "host", "nvme"])
def test_store_round_trip_of_accelerator_tensors(tmp_path, tier):
    x = torch.randn(3000, 257, device=DEV)
    with Store(tmp_path / "s", budgets={"device": None}, device=DEV) as s:
        s.put("x", x, tier=tier)
        s.flush()
        assert tier in s.tensor("x").tiers  # flush() adds the durable nvme copy
        got = s.get("x", device=DEV)
        assert got.device == DEV and torch.equal(got, x)
        out = torch.empty_like(x)
        assert s.get("x", out=out) is out and torch.equal(out, x)
        assert torch.equal(s.get("x", device="cpu"), x.cpu())


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_quantizers_on_the_accelerator_write_the_bytes_of_the_cpu_kernels(scheme):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100_003, generator=g) * torch.logspace(-3, 3, 100_003)  # blocks of very different scales
    ref = quantize(x, scheme)  # the native kernel where the scheme has one
    q = quantize(x.to(DEV), scheme)
    assert q.codes.device == DEV
    assert torch.equal(q.codes.cpu(), ref.codes) and torch.equal(q.absmax.cpu(), ref.absmax)
    y = dequantize(q)
    assert y.device == DEV and torch.equal(y.cpu(), dequantize(ref))


def _reference(steps: int, step_on: str, lr=1e-2, weight_decay=0.1):
    """Net trained by torch.optim.AdamW with forward and backward on the accelerator; the step on the
    accelerator (step_on='device') or on fp32 CPU copies the gradients are copied to ('cpu'), as tierstore
    steps where the optimizer states are on the host or nvme tier."""
    m, _ = make_pair()
    m.to(DEV)
    if step_on == "device":
        masters = list(m.parameters())
    else:
        masters = [p.detach().cpu().clone().requires_grad_() for p in m.parameters()]
    opt = torch.optim.AdamW(masters, lr=lr, weight_decay=weight_decay)
    for x, y in batches(steps):
        loss_fn(m, x.to(DEV), y.to(DEV)).backward()
        if step_on != "device":
            for p, q in zip(m.parameters(), masters):
                q.grad = p.grad.cpu()
        opt.step()
        opt.zero_grad()
        m.zero_grad()
        if step_on != "device":
            with torch.no_grad():
                for p, q in zip(m.parameters(), masters):
                    p.copy_(q)
    return m.cpu()


@pytest.mark.parametrize("params,states,grads,extra", [
    ("device", "device", "device", {}),
    ("device", "host", "host", {}),
    ("host", "host", "host", {}),
    ("nvme", "nvme", "nvme", {}),
    ("nvme", "nvme", "nvme", {"overlap_step": True}),
    ("host", "nvme", "host", {"overlap_step": True}),
])
def test_zero3_on_the_accelerator_matches_torch(tmp_path, params, states, grads, extra):
    steps = 12
    ref = _reference(steps, "device" if states == "device" else "cpu")
    _, m = make_pair()
    m.to(DEV)
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                         config=cfg(tmp_path, params, states, grads, **extra))
    try:
        assert opt.device == DEV
        for x, y in batches(steps):
            loss = loss_fn(m, x.to(DEV), y.to(DEV))
            assert loss.device == DEV
            loss.backward()
            opt.step()
            opt.zero_grad()
        assert max_rel(opt.full_state_dict(), ref) <= 1e-6
        if (params, states) == ("host", "nvme"):  # its shards are read ahead (on the CPU stand-in: 38 staged,
            # none kept from the step) and reach the device by a copy on the side stream
            assert opt.coordinator.stats().staged_copies > 0
    finally:
        opt.close()


def test_a_cpu_step_for_an_accelerator_model_warns_once_and_fused_steps_silently(tmp_path):
    """[Note: the inner step's implementation on the CPU]: the states on the host tier step on the CPU; torch's
    default there is its for-loop, so the first step says fused=True exists; with it, no warning."""
    steps = 4
    ref = _reference(steps, "cpu")
    for kw in ({}, {"fused": True}):
        _, m = make_pair()
        m.to(DEV)
        opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                             config=cfg(tmp_path / str(len(kw)), "device", "host", "host"), **kw)
        try:
            for i, (x, y) in enumerate(batches(steps)):
                loss_fn(m, x.to(DEV), y.to(DEV)).backward()
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    opt.step()
                said = [w for w in seen if "fused=True" in str(w.message)]
                assert len(said) == (1 if i == 0 and not kw else 0), [str(w.message) for w in seen]
                opt.zero_grad()
            assert max_rel(opt.full_state_dict(), ref) <= (1e-6 if not kw else 1e-5)
        finally:
            opt.close()


def _held_out_loss(tmp_path, steps=25, **cfg_kw) -> float:
    """A student Net fitted to a teacher Net on the accelerator; the loss on a batch it did not see. Without
    cfg_kw: torch.optim.AdamW in fp32, else Zero3Optimizer with cfg(tmp_path, **cfg_kw)."""
    torch.manual_seed(0)
    m, teacher = Net(d=64, h=128).to(DEV), Net(d=64, h=128).to(DEV)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(32, 64, generator=g).to(DEV) for _ in range(steps + 1)]
    opt = (Zero3Optimizer(m, torch.optim.AdamW, lr=3e-3, config=cfg(tmp_path, **cfg_kw)) if cfg_kw
           else torch.optim.AdamW(m.parameters(), lr=3e-3))
    cdt = cfg_kw.get("compute_dtype", torch.float32)
    try:
        for x in xs[:steps]:
            with torch.no_grad():
                y = teacher(x)
            loss_fn(m, x.to(cdt), y.to(cdt)).backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            return float(loss_fn(m, xs[-1].to(cdt), teacher(xs[-1]).to(cdt)).float())
    finally:
        if cfg_kw:
            opt.close()


def test_zero3_bf16_compute_and_8bit_states_train_on_the_accelerator(tmp_path):
    base = _held_out_loss(tmp_path)
    got = _held_out_loss(tmp_path, params="nvme", states="nvme", grads="nvme", compute_dtype=torch.bfloat16,
                         state_codec="dynamic8", overlap_step=True, min_io_bytes=1 << 20, sub_group_bytes=1 << 20)
    assert abs(got / base - 1) <= 0.1, (got, base)  # as tests/zero/test_zero.py's bf16 compute on the CPU


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_activation_offload_from_accelerator_memory_keeps_gradients(tmp_path, tier):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                                      torch.nn.Linear(256, 64)) for _ in range(3)]).to(DEV)
    x = torch.randn(128, 64, device=DEV)

    def grads(act):
        model.zero_grad(set_to_none=True)
        if act is None:
            loss = model(x).square().sum()
        else:
            with act:
                loss = model(x).square().sum()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]
    ref = grads(None)
    act = ActivationOffload(tier, paths=[str(tmp_path / "a")] if tier == "nvme" else None, min_bytes=1024)
    try:
        got = grads(act)
        assert act.stats().offloaded_bytes > 0
    finally:
        act.close()
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_rng_state_restores_the_accelerators_generator():
    torch.randn(1, device=DEV)  # initialise the accelerator's generator
    state = rng_state()
    assert "cuda" in state or DEV.type != "cuda"
    a = torch.randn(8, device=DEV)
    set_rng_state(state)
    assert torch.equal(torch.randn(8, device=DEV), a)
