"""Full-disk campaign on a real filesystem (a small loop-mounted ext4, with a ballast file taking most of
it): random put / update / delete / get / flush until the disk is full. Every call either succeeds or raises
a tierstore error; after every error a copy of the store's files (what a crash would leave) reopens to the
last completed flush; values a call accepted without error are readable and stored by the next flush() that
succeeds; and freeing space (the ballast) lets flush() succeed again. See docs/reliability.md."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from tierstore.errors import TierstoreError
from tierstore.store import Store

from ._common import SOAK, check_store, codec_of, random_spec, record, same_bits, seeds, trial, trials, value_of

NAMES = [f"t{k}" for k in range(12)]
ABSENT = None  # an `uncertain` candidate: the name may be missing


def write_ballast(path: str, nbytes: int) -> None:
    with open(path, "wb") as f:
        chunk = b"\xa5" * (1 << 20)
        left = nbytes
        while left > 0:
            left -= f.write(chunk[:min(left, len(chunk))])
        f.flush()
        os.fsync(f.fileno())


def check_live(s: Store, model: dict, uncertain: dict, where: str) -> dict:
    """The live store holds `model`, where a name in `uncertain` may hold any of its candidates; returns the
    model as found."""
    found = {}
    names = set(model) | set(uncertain)
    for name in sorted(names):
        cands = uncertain.get(name, [model.get(name)])
        if name not in s:
            assert ABSENT in cands, f"{where}: {name!r} is gone, but a call accepted {model.get(name)} for it"
            continue
        got = s.get(name)
        match = [c for c in cands if c is not ABSENT and same_bits(got, value_of(c))]
        assert match, f"{where}: {name!r} holds none of {cands}"
        found[name] = match[0]
    assert sorted(s.keys()) == sorted(found), f"{where}: unexpected names {set(s.keys()) - set(found)}"
    return found


def check_copy(d: str, snap: str, committed: dict, where: str) -> None:
    """A copy of the store's files as they are now (what a crash now would leave) reopens to `committed`."""
    shutil.rmtree(snap, ignore_errors=True)
    shutil.copytree(d, snap, ignore=shutil.ignore_patterns("tierstore.lock"))
    if not committed and not os.path.exists(os.path.join(snap, "manifest.json")):
        return
    with Store.open(snap, lock_memory=False) as c:
        check_store(c, committed, where)
        c.close(flush=False)


def fill_until_full(fs, tmp_path, rng, host_budget: int, tiers: list, campaign: str, errors_wanted: int) -> None:
    d, ballast, snap = os.path.join(fs.mnt, "store"), os.path.join(fs.mnt, "ballast"), str(tmp_path / "snap")
    if os.path.exists(ballast):  # the previous trial's
        os.unlink(ballast)
    write_ballast(ballast, fs.free_bytes() - rng.randint(256 << 10, 2 << 20))
    s = Store(d, budgets={"host": host_budget, "pinned": 4 << 20}, buffer_bytes=1 << 20, lock_memory=False)
    model: dict[str, dict] = {}  # what the calls accepted
    committed: dict[str, dict] = {}  # the last completed flush
    errors = 0
    try:
        for step in range(1000):
            if errors >= errors_wanted:
                break
            name = rng.choice(NAMES)
            u = rng.random()
            uncertain = {}
            try:
                if u < 0.45 or (u < 0.8 and name not in model):
                    spec = random_spec(rng, ("tiny", "tiny", "mid", "mid"))
                    uncertain = {name: [model.get(name, ABSENT), spec]}
                    s.put(name, value_of(spec), rng.choice(tiers), codec=codec_of(spec["codec"]))
                    model[name] = spec
                elif u < 0.65:
                    spec = dict(model[name], seed=rng.getrandbits(31))
                    uncertain = {name: [model[name], spec]}
                    s.tensor(name).update(value_of(spec))
                    model[name] = spec
                elif u < 0.7 and name in model:
                    uncertain = {name: [model[name], ABSENT]}
                    s.delete(name)
                    del model[name]
                elif u < 0.85 and name in model:
                    assert same_bits(s.get(name), value_of(model[name])), f"step {step}: get({name!r}) is wrong"
                else:
                    s.flush()
                    committed = dict(model)
                continue
            except TierstoreError as e:
                errors += 1
                record(campaign, f"({type(e).__name__})")
                print(f"step {step}: {type(e).__name__}: {e}")
            except Exception as e:
                raise AssertionError(f"step {step}: {type(e).__name__} is not a tierstore error: {e}") from e
            # after an error: a crash now would leave the last completed flush
            check_copy(d, snap, committed, f"step {step}: a copy after the error")
            # freeing space lets flush() succeed, and it stores every value a call accepted
            os.unlink(ballast)
            s.flush()
            model = check_live(s, model, uncertain, f"step {step}: after freeing space and flushing again")
            committed = dict(model)
            check_copy(d, snap, committed, f"step {step}: a copy after the retried flush")
            write_ballast(ballast, max(0, fs.free_bytes() - rng.randint(256 << 10, 2 << 20)))
        assert errors, "the disk never filled: the campaign tested nothing"
    finally:
        s.close(flush=False)
    with Store.open(d, lock_memory=False) as s:
        check_store(s, committed, "reopened at the end")
        s.close(flush=False)
    record(campaign, "recovered from every error")


@pytest.mark.parametrize("host_budget,tiers", [
    # nothing held in memory: a put/update the disk has no room for fails at the call
    pytest.param(0, [None, "nvme"], id="host0"),
    # every value also held in host memory: the retried flush() writes it
    pytest.param(32 << 20, [None], id="host32MiB-held"),
    # put(tier="nvme") with a host budget: as host0
    pytest.param(32 << 20, ["nvme"], id="host32MiB-nvme")])
def test_full_disk(tmp_path, small_ext4, host_budget, tiers):
    campaign = f"full disk (host_budget {host_budget >> 20} MiB, tier {'/'.join(map(str, tiers))})"
    for seed in seeds(campaign, trials(1, 25)):
        with trial(campaign, seed) as rng:
            d = os.path.join(small_ext4.mnt, "store")
            shutil.rmtree(d, ignore_errors=True)
            fill_until_full(small_ext4, tmp_path, rng, host_budget, tiers, campaign, errors_wanted=3 if SOAK else 2)


def test_failed_replacement_never_reads_the_old_bytes_as_the_new_dtype(small_ext4):
    d, ballast = os.path.join(small_ext4.mnt, "store"), os.path.join(small_ext4.mnt, "ballast")
    old, new = torch.arange(300_000, dtype=torch.float32), torch.full((300_000,), 7, dtype=torch.int32)  # same bytes
    s = Store(d, budgets={"host": 0}, lock_memory=False)
    try:
        s.put("x", old)
        s.flush()
        write_ballast(ballast, small_ext4.free_bytes() - (64 << 10))
        try:
            s.put("x", new)
            s.flush()
        except TierstoreError:
            pass
        try:
            got = s.get("x")
        except TierstoreError:
            return
        assert same_bits(got, old) or same_bits(got, new), f"get('x') is neither value: {got[:4]}"
    finally:
        s.close(flush=False)


CALL_S = 30  # seconds a call on the full disk may take at most: it raises, never waits for space


def _timed(what: str, fn):
    import time
    t0 = time.monotonic()
    try:
        return fn()
    finally:
        took = time.monotonic() - t0
        assert took < CALL_S, f"{what} took {took:.0f} s on a full disk: it waited instead of raising"


def train_until_full(fs, rng, campaign: str) -> None:
    """A Zero3Optimizer (parameters and states on nvme) with activation offload to nvme trains and saves a
    checkpoint after every step while a ballast file fills the disk, before the forward or before the save;
    after an error it saves at once (on the full disk), then frees the space. Every call returns or raises a
    tierstore error within CALL_S; at the end, with space, a save and a load into a new optimizer work."""
    import torch.nn as nn

    from tierstore.zero import OffloadConfig, Zero3Optimizer
    def net() -> nn.Module:  # ~50k parameters: its store, activations and checkpoints fit the 16 MiB disk
        return nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.GELU()) for _ in range(3)], nn.Linear(128, 8))
    torch.manual_seed(rng.getrandbits(31))
    model = net()

    def config(run: str) -> OffloadConfig:
        return OffloadConfig(params="nvme", optimizer_states="nvme", gradients=rng.choice(["host", "nvme"]),
                             nvme_paths=[os.path.join(fs.mnt, run)], activation_offload="nvme",
                             sub_group_bytes=64 << 10, min_io_bytes=16 << 10, pinned_bytes=rng.choice([4, 8]) << 20,
                             prefetch_bytes=1 << 20, overlap_step=rng.random() < 0.5)
    opt = Zero3Optimizer(model, torch.optim.AdamW, config=config("run"), lr=1e-3)
    ballast, ck = os.path.join(fs.mnt, "ballast"), os.path.join(fs.mnt, "ck")

    def fill() -> None:
        if not os.path.exists(ballast):
            write_ballast(ballast, max(0, fs.free_bytes() - rng.randint(0, 512 << 10)))
    try:
        for step in range(10):
            phase = rng.choice(["forward", "forward", "save", "none"])
            try:
                if phase == "forward":
                    fill()
                x = torch.randn(rng.choice([128, 256, 512]), 128)
                _timed("forward and backward", lambda: model(x).square().mean().backward())  # noqa: B023
                _timed("step", opt.step)
                opt.zero_grad()
                if phase == "save":
                    fill()
                _timed("save_checkpoint", lambda: opt.save_checkpoint(ck))
                record(campaign, "calls succeeded")
            except TierstoreError as e:
                record(campaign, f"({type(e).__name__})")
                print(f"step {step}: {type(e).__name__}: {e}")
                try:
                    _timed("save_checkpoint right after an error", lambda: opt.save_checkpoint(ck))
                except TierstoreError as e2:
                    record(campaign, f"(emergency save: {type(e2).__name__})")
                _timed("zero_grad", opt.zero_grad)
                if os.path.exists(ballast):
                    os.unlink(ballast)
        if os.path.exists(ballast):
            os.unlink(ballast)
        _timed("save_checkpoint with space", lambda: opt.save_checkpoint(ck))
        want = opt.full_state_dict()
    finally:
        opt.close()
    opt2 = Zero3Optimizer(net(), torch.optim.AdamW, config=config("run2"), lr=1e-3)
    try:
        opt2.load_checkpoint(ck)
        got = opt2.full_state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want), "the checkpoint saved with space again differs"
    finally:
        opt2.close()
    record(campaign, "saved and loaded once space was freed")


def test_full_disk_training_with_activation_offload(small_ext4):
    campaign = "full disk (training, activation offload, save_checkpoint)"
    for seed in seeds(campaign, trials(1, 11)):
        with trial(campaign, seed) as rng:
            for d in ("run", "run2", "ck", "ballast"):
                p = os.path.join(small_ext4.mnt, d)
                shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else None
                if os.path.isfile(p):
                    os.unlink(p)
            train_until_full(small_ext4, rng, campaign)
