"""torch.compile over a model the Zero3Optimizer holds: the module hooks and every store call run outside the
graph, so a compiled model trains equal to the eager one, on every tier."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from tests.support import batches, cfg, loss_fn, make_pair
from tierstore.zero import Zero3Optimizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def train(tmp_path, tier: str, *, compile_from: int | None, steps: int = 3):
    """Losses and final weights of `steps` AdamW steps; the compiled model is used from step `compile_from`
    on (None: eager throughout)."""
    _, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path, params=tier, states=tier, grads=tier))
    compiled = torch.compile(m, backend="aot_eager")
    losses = []
    try:
        for i, (x, y) in enumerate(batches(steps)):
            model = compiled if compile_from is not None and i >= compile_from else m
            loss = loss_fn(model, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, opt.full_state_dict()
    finally:
        opt.close()


@pytest.mark.parametrize("tier", ["host", "nvme"])
@pytest.mark.parametrize("compile_from", [0, 1], ids=["compiled", "after-eager-step"])
def test_compiled_model_trains_equal_to_eager(tmp_path, tier, compile_from):
    torch._dynamo.reset()
    counters.clear()
    ref_losses, ref_w = train(tmp_path / "eager", tier, compile_from=None)
    losses, w = train(tmp_path / "compiled", tier, compile_from=compile_from)
    assert counters["stats"]["unique_graphs"] > 0  # the compute between the hooks really was compiled
    assert losses == ref_losses
    for n, v in ref_w.items():
        assert torch.equal(w[n], v), n
