"""The numbers users read off a model the Zero3Optimizer holds: parameter counts and shapes are the full
model's, and reading a partitioned weight outside a gather raises MisuseError naming GatheredParameters."""
from __future__ import annotations

import logging

import pytest
import torch

from tests.support import batches, cfg, loss_fn, make_pair
from tierstore.errors import MisuseError
from tierstore.zero import GatheredParameters, OffloadConfig, Zero3Optimizer, release_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("tier", ["device", "nvme"])
def test_counts_and_shapes_are_the_full_models(tmp_path, tier):
    ref, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path, tier, tier, tier))
    try:
        for x, y in batches(1):  # after a step too
            loss_fn(m, x, y).backward()
            opt.step()
            opt.zero_grad()
        for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
            assert (p.shape, p.numel(), p.dim(), p.size(0), p.nbytes) == (q.shape, q.numel(), q.dim(), q.size(0),
                                                                         q.nbytes), n
            assert (p.dtype, p.device, p.requires_grad) == (q.dtype, q.device, q.requires_grad)
        assert sum(p.numel() for p in m.parameters()) == sum(p.numel() for p in ref.parameters())
    finally:
        opt.close()


def test_reading_a_weight_outside_a_gather_names_gathered_parameters(tmp_path):
    ref, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path, "host", "host", "host"))
    try:
        w = m.fc1.weight
        for read in (lambda: w.sum(), lambda: w.detach().clone(), lambda: w[0], lambda: w.norm(), lambda: w + 1,
                     lambda: torch.equal(w, ref.fc1.weight)):
            with pytest.raises(MisuseError, match="GatheredParameters"):
                read()
        assert "PartitionedParameter(shape=(32, 16)" in repr(w)
        with GatheredParameters([w]):
            assert torch.equal(w.detach(), ref.fc1.weight.detach())  # the value, inside a gather
        with pytest.raises(MisuseError, match="GatheredParameters"):
            w.sum()  # partitioned again after it
        loss_fn(m, *batches(1)[0]).backward()  # the model's own compute never hits the check
        opt.step()
    finally:
        model = release_model(opt)
    assert model.fc1.weight.sum().item() == pytest.approx(model.fc1.weight.detach().sum().item())  # plain again


def test_hf_num_parameters_and_trainer_logged_count(tmp_path):
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from tierstore.integrations.trainer import TierstoreTrainer

    conf = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    plain = GPT2LMHeadModel(conf)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(conf)
    want, want_trainable = plain.num_parameters(), plain.num_parameters(only_trainable=True)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 64, (8, 16), generator=g)]
    args = TrainingArguments(str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4, report_to=[],
                             use_cpu=True, optim="adamw_torch", disable_tqdm=True, save_strategy="no")
    trainer = TierstoreTrainer(model=model, args=args, train_dataset=data,
                               offload_config=cfg(tmp_path, "host", "host", "host"))
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("transformers.trainer")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        trainer.train()
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    logged = [r.getMessage() for r in records if "Number of trainable parameters" in r.getMessage()]
    assert logged and logged[0].split("=")[-1].strip() == f"{want_trainable:,}"
    assert model.num_parameters() == want and model.num_parameters(only_trainable=True) == want_trainable


def test_casts_to_its_own_dtype_are_the_parameter_and_others_read_values():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    opt = Zero3Optimizer(model, torch.optim.AdamW, lr=1e-3, config=OffloadConfig(params="host",
                         optimizer_states="host", gradients="host"))
    try:
        w = model[0].weight
        assert w.float() is w and w.cpu() is w  # what Module.float() / .cpu() do: nothing to convert
        with pytest.raises(MisuseError, match="GatheredParameters"):
            w.double()  # a real conversion reads the values
        with pytest.raises(MisuseError, match="GatheredParameters"):
            w.float().sum()
    finally:
        opt.close()
