"""The events of the ZeRO-3 hooks ([Note: hook events] in events.py) and the phase they come in
([Note: phases] in phase.py), recorded by a subscriber over a tiny model's steps."""
from __future__ import annotations

import logging

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from tierstore.zero import OffloadConfig, Zero3Optimizer
from tierstore.zero.hooks.events import HookEvents
from tierstore.zero.phase import Phase


class Recorder(HookEvents):
    def __init__(self, coordinator, names):
        self.co = coordinator
        self.names = names  # id(module) -> name
        self.log = []

    def _add(self, *event):
        self.log.append(event + (self.co.phase,))

    def forward_begin(self):
        self._add("forward_begin")

    def module_enter(self, module, index):
        self._add("enter", self.names[id(module)], index)

    def module_exit(self, module, index, entry):
        self._add("exit", self.names[id(module)], index, entry)

    def forward_end(self):
        self._add("forward_end")

    def backward_begin(self, entries):
        self._add("backward_begin", entries)

    def backward_visit(self, entry):
        self._add("visit", entry)

    def backward_end(self, aborted):
        self._add("backward_end", aborted)


class _Fails(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward failed on purpose")


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 2)
        self.recompute_b = False
        self.fail = False

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.fail:
            h = _Fails.apply(h)
        h = checkpoint(self.b, h, use_reentrant=False) if self.recompute_b else self.b(h)
        return self.c(torch.tanh(h))


def _setup(tmp_path):
    torch.manual_seed(0)
    m = Tiny()
    opt = Zero3Optimizer(m, torch.optim.SGD, lr=0.1, config=OffloadConfig(
        params="host", optimizer_states="host", gradients="host", nvme_paths=[str(tmp_path / "nvme")],
        min_io_bytes=0))
    rec = Recorder(opt.coordinator, {id(mod): n for n, mod in m.named_modules()})
    handle = opt.coordinator.subscribe(rec)
    return m, opt, rec, handle


F, B, I = Phase.FORWARD, Phase.BACKWARD, Phase.IDLE  # noqa: E741 (one letter per phase keeps the tables below aligned)
STEP = [("forward_begin", F),
        ("enter", "a", 0, F), ("exit", "a", 0, 0, F),
        ("enter", "b", 1, F), ("exit", "b", 1, 1, F),
        ("enter", "c", 2, F), ("exit", "c", 2, 2, F),
        ("forward_end", I),
        ("backward_begin", 3, B), ("visit", 2, B), ("visit", 1, B), ("visit", 0, B),
        ("backward_end", False, I)]


def test_a_step_emits_forward_trace_and_backward_visits_in_their_phases(tmp_path):
    m, opt, rec, handle = _setup(tmp_path)
    x = torch.randn(4, 8)
    for _ in range(2):  # the first step records the trace, the second walks it: same indices
        rec.log.clear()
        assert opt.coordinator.phase is I
        m(x).square().mean().backward()
        assert rec.log == STEP
        opt.step()
        opt.zero_grad()
    rec.log.clear()
    with torch.no_grad():  # no gradient: no entries, no backward
        m(x)
    assert [e[:4] for e in rec.log if e[0] == "exit"] == [("exit", "a", 0, None), ("exit", "b", 1, None),
                                                          ("exit", "c", 2, None)]
    handle.remove()
    rec.log.clear()
    m(x).square().mean().backward()
    assert rec.log == []
    opt.close()


def test_recomputation_inside_backward_is_a_module_call_without_index(tmp_path):
    m, opt, rec, _handle = _setup(tmp_path)
    m.recompute_b = True
    m(torch.randn(4, 8)).square().mean().backward()
    # b's forward runs again when its backward (after its visit) needs what the first forward did not keep
    assert rec.log == STEP[:11] + [("enter", "b", None, B), ("exit", "b", None, None, B)] + STEP[11:]
    opt.close()


def test_a_backward_that_raised_ends_aborted_before_the_next_forward(tmp_path, caplog):
    m, opt, rec, _handle = _setup(tmp_path)
    m.fail = True
    x = torch.randn(4, 8)
    try:
        m(x).square().mean().backward()
    except RuntimeError as e:
        assert "on purpose" in str(e)
    else:
        raise AssertionError("the backward did not raise")
    assert rec.log[-1] == ("visit", 1, B) and opt.coordinator.phase is B  # its end never ran
    m.fail = False
    rec.log.clear()
    with caplog.at_level(logging.WARNING, logger="tierstore.zero"):
        m(x).square().mean().backward()
    assert "without reaching its end" in caplog.text
    assert rec.log == [("backward_end", True, I)] + STEP
    opt.close()


class GradientEvents(HookEvents):
    """Records the events of the gradients' way to the step ([Note: hook events] in events.py)."""

    def __init__(self):
        self.log = []

    def gradient_open(self, gid):
        self.log.append(("open", gid))

    def bucket_final(self, gid):
        self.log.append(("final", gid))

    def bucket_released(self, gid, full):
        self.log.append(("released", gid, full.dtype))


def test_the_gradients_way_to_the_step_is_heard_by_subscribers(tmp_path):
    """gradient_open comes for every trainable bucket's partition; bucket_released (world size 1) only where
    the released values are this rank's own copy -- a shard read from nvme, not one the store lent; bucket_final
    only while some subscriber wants final buckets (the overlapped step: once per trainable bucket, and none
    inside accumulating())."""
    x = torch.randn(4, 8)
    for tier, overlap in (("host", False), ("nvme", False), ("host", True)):
        torch.manual_seed(0)
        m = Tiny()
        opt = Zero3Optimizer(m, torch.optim.SGD, lr=0.1, config=OffloadConfig(
            params=tier, optimizer_states=tier, gradients="host", nvme_paths=[str(tmp_path / f"{tier}{overlap}")],
            min_io_bytes=0, overlap_step=overlap))
        rec = GradientEvents()
        opt.coordinator.subscribe(rec)
        trainable = set(opt.layout.trainable_gids())
        m(x).square().mean().backward()
        assert {e[1] for e in rec.log if e[0] == "open"} == trainable
        released = [e for e in rec.log if e[0] == "released"]
        finals = sorted(e[1] for e in rec.log if e[0] == "final")
        if tier == "nvme":  # fp32 masters shared with the parameters, read from nvme: the step may take them
            assert released and all(dtype == torch.float32 for _e, _g, dtype in released)
        else:  # the store lends its own copy on a memory tier (a copy with overlap_step): nothing to offer
            assert released == [] or overlap
        assert finals == (sorted(trainable) if overlap else [])
        assert opt.stats().overlapped == len(finals)
        opt.step()
        opt.zero_grad()
        rec.log.clear()
        with opt.accumulating():
            m(x).square().mean().backward()
        assert [e for e in rec.log if e[0] == "final"] == []
        opt.close()
