"""save_checkpoint campaign: a child trains a small Zero3Optimizer (world size 1) and saves a checkpoint after
every step, writing the oracle of each save (every sub-group's master, states and aux, the steps, the
buffers) before it starts, and a client_state; it is SIGKILLed at random moments. load_checkpoint afterwards
finds the previous checkpoint or the one in progress, complete and exact, with its own client state -- never a
mix -- and the partial directories a kill leaves do not break the next child's saves. See docs/reliability.md."""
from __future__ import annotations

import os
import signal
import time

import torch

from tierstore.zero.checkpoint import read_meta

from . import _children
from ._common import record, seeds, trial, trials
from .test_corruption import same_export

ROUNDS = 3


def test_sigkill_during_save_checkpoint(tmp_path, forkserver):
    campaign = "sigkill in save_checkpoint"
    for seed in seeds(campaign, trials(1, 70)):
        with trial(campaign, seed) as rng:
            root = tmp_path / str(seed)
            os.makedirs(root / "oracle")
            ckpt, log = str(root / "ckpt"), str(root / "log")
            prev = 0  # the step of the checkpoint `latest` names (checked)
            m, opt = _children.make_optimizer(str(root / "check"))
            try:
                for _rnd in range(ROUNDS):
                    open(log, "w").close()
                    p = forkserver.Process(target=_children.checkpoint_child, args=(str(root), log))
                    p.start()
                    # the child builds its optimizer and resumes (seconds on a busy machine): the kill is timed
                    # from its first oracle, i.e. from the start of its first save
                    first = root / "oracle" / f"{prev + 1}.pt"
                    deadline = time.monotonic() + 60
                    while not first.exists() and time.monotonic() < deadline and p.is_alive():
                        time.sleep(0.01)
                    time.sleep(rng.uniform(0.0, 1.5))
                    os.kill(p.pid, signal.SIGKILL)
                    p.join(60)
                    assert p.exitcode == -signal.SIGKILL, "the child died on its own: see its traceback above"
                    with open(log) as f:
                        logged = [int(x) for x in f.read().split()]
                    record(campaign, "(saves returned)", len(logged))
                    last = logged[-1] if logged else prev
                    if not os.path.exists(os.path.join(ckpt, "latest")):
                        assert not logged, "save_checkpoint returned but left no 'latest'"
                        record(campaign, "killed before the first save")
                        continue
                    _sub, body = read_meta(ckpt)
                    step = body["steps"]
                    assert step in (last, last + 1), f"'latest' names step {step}; the last save that returned: {last}"
                    client = opt.load_checkpoint(ckpt)
                    want = torch.load(root / "oracle" / f"{step}.pt", weights_only=True)
                    assert same_export(_children.export_all(opt), want), f"the checkpoint of step {step} is not exact"
                    cw = _children.client_state(step)  # the client state committed with that checkpoint, not another
                    assert client["step"] == step and client["scheduler"] == cw["scheduler"] and \
                        torch.equal(client["marker"], cw["marker"]), f"client state of step {client['step']}"
                    record(campaign, "previous checkpoint" if step == last else "checkpoint completed as it died")
                    prev = step
                # partial directories do not break later saves: one more, complete, then only it and `keep` remain
                if prev:
                    opt.save_checkpoint(ckpt)
                    opt.load_checkpoint(ckpt)
                    dirs = [d for d in os.listdir(ckpt) if d.startswith("ckpt-")]
                    assert all(os.path.exists(os.path.join(ckpt, d, "meta.json")) for d in dirs), dirs
            finally:
                opt.close()
