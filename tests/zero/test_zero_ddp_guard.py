"""DistributedDataParallel around a ZeRO-3 model, directly or through accelerate's own ``Accelerator.prepare``
at world size 2: refused when it wraps, naming the supported calls, the model untouched and still training
equal to the unwrapped run ([Note: DistributedDataParallel around a ZeRO-3 model] in model_guard.py)."""
from __future__ import annotations

import os

import pytest
import torch

from tests.support import batches, loss_fn, make_pair, run_ranks
from tierstore.errors import MisuseError
from tierstore.zero import OffloadConfig, Zero3Optimizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _steps(m, opt, data):
    for x, y in data:
        loss_fn(m, x, y).backward()
        opt.step()
        opt.zero_grad()


def _wrapped_both_ways(rank, world):
    """DDP(model) and Accelerator().prepare(model, opt) on a ZeRO-3 model: the error each gives; then the same
    model and optimizer train on, unwrapped; returns (errors, trained state dict, plain run's state dict)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    data = batches(3, seed=7 + rank)  # each rank its own batch, as under DDP
    _ref, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=OffloadConfig(params="host",
                                                                             optimizer_states="host",
                                                                             gradients="host"))
    errors = {}
    try:
        try:
            torch.nn.parallel.DistributedDataParallel(m)
        except MisuseError as e:
            errors["ddp"] = str(e)
        from accelerate import Accelerator
        acc = Accelerator(cpu=True)
        assert acc.num_processes == world
        try:
            acc.prepare(m, opt)
        except MisuseError as e:
            errors["accelerate"] = str(e)
        _steps(m, opt, data)
        trained = m.state_dict()
    finally:
        opt.close()
    _ref, plain = make_pair()
    plain_opt = Zero3Optimizer(plain, torch.optim.AdamW, lr=1e-2, config=OffloadConfig(params="host",
                                                                                       optimizer_states="host",
                                                                                       gradients="host"))
    try:
        _steps(plain, plain_opt, data)
        unwrapped = plain.state_dict()
    finally:
        plain_opt.close()
    return errors, trained, unwrapped


def test_ddp_and_accelerates_prepare_around_a_zero3_model_raise_naming_the_supported_calls():
    pytest.importorskip("accelerate")
    for errors, trained, unwrapped in run_ranks(_wrapped_both_ways, 2):
        assert set(errors) == {"ddp", "accelerate"}
        for msg in errors.values():
            assert "DistributedDataParallel" in msg and "tierstore.integrations.accelerate.prepare" in msg
            assert "TierstoreTrainer" in msg
        assert all(torch.equal(trained[k], v) for k, v in unwrapped.items())  # the refused wraps changed nothing
