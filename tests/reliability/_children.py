"""What the killed child processes run (imported by the fork server once, so each child starts at once).

A store child applies seeded random put / update / delete operations and flushes; before each flush it
writes (and fsyncs) the oracle of the generation that flush makes, ``<oracle>/<generation>.json``, mapping
each name to the spec of its value (see _common.value_of); after the flush returns it appends the generation
to its log. The parent then knows what every generation must hold and which flushes returned.
"""
from __future__ import annotations

import os
import random
import time

import torch

from tierstore.store import Store
from tierstore.zero import keys

from ._common import codec_of, random_spec, read_json, value_of, write_json_durably

NAMES = [f"t{k}" for k in range(16)]


def store_child(d: str, oracle: str, log: str, seed: int, host_budget: int, sizes: tuple[str, ...],
                max_live_big: int = 4) -> None:
    """Random operations and flushes on the store in `d` until killed (see the module docstring)."""
    torch.set_num_threads(1)
    rng = random.Random(seed)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    s = Store(d, budgets={"host": host_budget, "pinned": 4 << 20}, buffer_bytes=1 << 20, lock_memory=False)
    g = s.generation
    model: dict[str, dict] = read_json(os.path.join(oracle, f"{g}.json")) if g else {}
    while True:
        for _op in range(rng.randint(1, 6)):
            kind = rng.random()
            name = rng.choice(NAMES)
            if kind < 0.5 or name not in model:
                spec = random_spec(rng, sizes)
                if spec["n"] > 500_000 and sum(v["n"] > 500_000 for v in model.values()) >= max_live_big:
                    spec = random_spec(rng, ("tiny",))
                tier = rng.choice([None, "nvme"] + (["host"] if host_budget and spec["n"] < 100_000 else []))
                s.put(name, value_of(spec), tier, codec=codec_of(spec["codec"]))
                model[name] = spec
            elif kind < 0.8:
                spec = dict(model[name], seed=rng.getrandbits(31))
                s.tensor(name).update(value_of(spec))
                model[name] = spec
            else:
                s.delete(name)
                del model[name]
        write_json_durably(os.path.join(oracle, f"{g + 1}.json"), model)
        s.flush()
        g += 1
        assert s.generation == g, (s.generation, g)
        os.write(fd, f"{g}\n".encode())


# -- save_checkpoint ---------------------------------------------------------------------------------------
class Net(torch.nn.Module):
    def __init__(self, d: int = 16, h: int = 256, o: int = 4):
        super().__init__()
        self.fc1 = torch.nn.Linear(d, h)
        self.norm = torch.nn.LayerNorm(h)
        self.fc2 = torch.nn.Linear(h, h)
        self.head = torch.nn.Linear(h, o)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen += 1
        return self.head(torch.tanh(self.fc2(torch.relu(self.norm(self.fc1(x))))))


def make_optimizer(work: str):
    from tierstore.zero import OffloadConfig, Zero3Optimizer
    torch.manual_seed(0)
    m = Net()
    cfg = OffloadConfig(params="host", optimizer_states="nvme", gradients="host", nvme_paths=[work],
                        sub_group_bytes=1 << 16, min_io_bytes=1 << 12, pinned_bytes=8 << 20)
    return m, Zero3Optimizer(m, torch.optim.AdamW, lr=1e-3, weight_decay=0.1, config=cfg)


def export_all(opt) -> dict:
    """Everything a checkpoint holds of this rank: every sub-group's master, states and aux, the steps and
    the model's buffers."""
    out = {"steps": opt.steps, "buffers": {n: b.detach().clone() for n, b in opt.model.named_buffers()}}
    for gl in opt.layout.groups:
        for gid in gl.gids:
            out[gid] = opt.export_subgroup(gid) if gl.trainable else opt.store.get(keys.param(gid), device="cpu")
    return out


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def client_state(step: int) -> dict:
    """What the child saves as the client state of the checkpoint of `step` (a scheduler-like dict and a
    tensor record), so a load can tell whose client state it got."""
    return {"step": step, "scheduler": {"last_epoch": step, "lrs": [1e-3 * step]},
            "marker": torch.full((4096,), float(step))}


def checkpoint_child(root: str, log: str) -> None:
    """Train, and save a checkpoint after every step, until killed; the oracle of each save is written
    (fsynced) before the save starts, its step logged after it returns."""
    torch.set_num_threads(1)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    ckpt = os.path.join(root, "ckpt")
    m, opt = make_optimizer(os.path.join(root, "work"))
    if os.path.exists(os.path.join(ckpt, "latest")):
        opt.load_checkpoint(ckpt)
    while True:
        x, y = batch(opt.steps)
        ((m(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        path = os.path.join(root, "oracle", f"{opt.steps}.pt")
        torch.save(export_all(opt), path + ".tmp")
        with open(path + ".tmp", "rb+") as f:
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
        opt.save_checkpoint(ckpt, client_state=client_state(opt.steps))
        os.write(fd, f"{opt.steps}\n".encode())


# -- two jobs, one checkpoint directory --------------------------------------------------------------------
def digest(state: dict) -> str:
    """A hash of a state_dict (names, dtypes, shapes, bytes): what the oracle of a two-writer save records."""
    import hashlib
    h = hashlib.sha256()
    for k in sorted(state):
        t = state[k].detach().contiguous().cpu()
        h.update(f"{k}:{t.dtype}:{list(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


def writer_child(root: str, job: str, log: str) -> None:
    """One job saving into root/ckpt after every step, until killed: before each save, the digest of the
    model it saves goes into root/oracle/<digest> (``job step``); after it, ``<time> ok <step>`` or, when
    another job holds the directory, ``<time> refused <step>`` goes into `log` (and it trains on and tries
    again, as a job restarted by a scheduler would)."""
    from tierstore.errors import MisuseError
    torch.set_num_threads(1)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    ckpt = os.path.join(root, "ckpt")
    m, opt = make_optimizer(os.path.join(root, f"work-{job}"))
    salt = {"A": 0, "B": 100_000}[job]  # the jobs train on other data: other models
    while True:
        x, y = batch(opt.steps + salt)
        ((m(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        write_json_durably(os.path.join(root, "oracle", digest(opt.full_state_dict())), [job, opt.steps])
        try:
            opt.save_checkpoint(ckpt, keep=1, client_state={"job": job, "step": opt.steps})
            os.write(fd, f"{time.time()} ok {opt.steps}\n".encode())
        except MisuseError:
            os.write(fd, f"{time.time()} refused {opt.steps}\n".encode())
            time.sleep(0.05)
