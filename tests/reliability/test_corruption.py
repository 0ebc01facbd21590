"""Corruption campaign: random byte flips, truncations and zeroed 4 KiB pages in a flushed store's extent
files and manifest, and in a checkpoint's files (meta.json, the rank file, buffers.bin, latest). Every read
either returns exactly the right data or raises a tierstore error -- never silently wrong data, never
another exception type. See docs/reliability.md."""
from __future__ import annotations

import os
import random
import shutil

import pytest
import torch

from tierstore.errors import CorruptionError
from tierstore.store import Store
from tierstore.zero import consolidate

from . import _children
from ._common import codec_of, random_spec, record, same_bits, seeds, trial, trials, value_of

PAGE = 4096  # bytes


def damage(path: str, rng: random.Random, how: str) -> str:
    """Damage file `path` (how: 'flip', 'zero page', 'truncate', 'set 0xff'); returns what was done."""
    size = os.path.getsize(path)
    if how == "set 0xff":
        at = rng.randrange(size)
        with open(path, "r+b") as f:
            f.seek(at)
            f.write(b"\xff")
        return f"set byte {at} of {path} to 0xff"
    if how == "truncate":
        cut = rng.randrange(size)
        os.truncate(path, cut)
        return f"truncated {path} to {cut} of {size} bytes"
    with open(path, "r+b") as f:
        if how == "zero page" or size == 0:
            at = rng.randrange(max(1, size)) // PAGE * PAGE
            f.seek(at)
            f.write(bytes(min(PAGE, max(0, size - at))))
            return f"zeroed {path} [{at}, {at + PAGE})"
        spots = sorted(rng.randrange(size) for _ in range(rng.randint(1, 8)))
        for at in spots:
            f.seek(at)
            b = f.read(1)[0]
            f.seek(at)
            f.write(bytes([b ^ (1 << rng.randrange(8))]))
        return f"flipped bits of {path} at {spots}"


def outcome(e: BaseException | None) -> str:
    return "exact" if e is None else f"detected: {type(e).__name__}"


def must_be_tierstore_error(e: BaseException, what: str) -> None:
    """Detected damage is a CorruptionError (a tierstore error naming the file)."""
    if not isinstance(e, CorruptionError):
        raise AssertionError(f"{what}: {type(e).__name__} is not a CorruptionError: {e}") from e


@pytest.fixture(scope="module")
def pristine_store(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("pristine") / "store")
    rng = random.Random(7)
    want = {}
    with Store(d, budgets={"host": 0, "pinned": 4 << 20}, buffer_bytes=1 << 20, lock_memory=False) as s:
        for i, size in enumerate(["tiny"] * 10 + ["mid"] * 2 + ["big"]):
            spec = random_spec(rng, (size,))
            if i % 4 == 1:
                spec["codec"] = {"id": "zstd", "level": 1}
            s.put(f"t{i}", value_of(spec), codec=codec_of(spec["codec"]))
            want[f"t{i}"] = spec
    return d, want


KINDS = ["flip", "zero page", "truncate"]


@pytest.mark.parametrize("how", KINDS)
def test_store_corruption(tmp_path, pristine_store, how):
    src, want = pristine_store
    files = sorted(f for f in os.listdir(src) if f.startswith("extents-")) + ["manifest.json"]
    campaign = f"corruption (store, {how})"
    for seed in seeds(campaign, trials(10, 200)):
        with trial(campaign, seed) as rng:
            d = str(tmp_path / "store")
            shutil.rmtree(d, ignore_errors=True)
            shutil.copytree(src, d)
            # the extent files first: the truncations a short run makes hit them
            what = damage(os.path.join(d, files[0] if seed == seeds(campaign, 1)[0] else rng.choice(files)), rng, how)
            print(what)
            try:
                s = Store.open(d, budgets={"host": 0}, lock_memory=False)
            except Exception as e:
                must_be_tierstore_error(e, f"Store.open after {what}")
                record(campaign, f"open: {outcome(e)}")
                continue
            worst = None
            try:
                for name, spec in want.items():
                    try:
                        got = s.get(name)
                    except Exception as e:
                        must_be_tierstore_error(e, f"get({name!r}) after {what}")
                        print(f"get({name!r}): {type(e).__name__}: {e}")
                        worst = worst or e
                        continue
                    assert same_bits(got, value_of(spec)), f"get({name!r}) returned wrong data after {what}"
            finally:
                s.close(flush=False)
            record(campaign, f"reads: {outcome(worst)}")


@pytest.fixture(scope="module")
def pristine_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine-ckpt")
    torch.set_num_threads(1)
    m, opt = _children.make_optimizer(str(root / "work"))
    for step in range(3):
        x, y = _children.batch(step)
        ((m(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    opt.save_checkpoint(root / "ckpt")
    ref = _children.export_all(opt)
    opt.close()
    return str(root / "ckpt"), ref, consolidate(root / "ckpt", dtype=torch.float32)


def same_export(a: dict, b: dict) -> bool:
    if a.keys() != b.keys() or a["steps"] != b["steps"]:
        return False
    if any(not same_bits(a["buffers"][n], b["buffers"][n]) for n in a["buffers"]):
        return False
    for k in a:
        if k in ("steps", "buffers"):
            continue
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            if not same_bits(x, y):
                return False
        elif (not same_bits(x["master"], y["master"]) or x["state"].keys() != y["state"].keys()
              or any(not same_bits(x["state"][s], y["state"][s]) for s in x["state"]) or x["aux"] != y["aux"]):
            return False
    return True


@pytest.mark.parametrize("target", ["latest", "meta.json", "rank00000.bin", "buffers.bin"])
def test_checkpoint_corruption(tmp_path, pristine_checkpoint, target):
    src, ref, full = pristine_checkpoint
    sub = [d for d in os.listdir(src) if d.startswith("ckpt-")][0]
    path = target if target == "latest" else f"{sub}/{target}"
    campaign = f"corruption (checkpoint {target})"
    m, opt = _children.make_optimizer(str(tmp_path / "work"))
    try:
        for k, seed in enumerate(seeds(campaign, trials(5, 100))):
            with trial(campaign, seed) as rng:
                d = str(tmp_path / "ckpt")
                shutil.rmtree(d, ignore_errors=True)
                shutil.copytree(src, d)
                # the first trial writes a byte no UTF-8 or JSON text holds: the case a short run must cover
                what = damage(os.path.join(d, path), rng, "set 0xff" if k == 0 else rng.choice(
                    ["flip", "flip", "truncate", "zero page"]))
                print(what)
                err = None
                try:
                    opt.load_checkpoint(d)
                except Exception as e:
                    must_be_tierstore_error(e, f"load_checkpoint after {what}")
                    err = e
                else:
                    assert same_export(_children.export_all(opt), ref), \
                        f"load_checkpoint loaded wrong data after {what}"
                try:
                    got = consolidate(d, dtype=torch.float32)
                except Exception as e:
                    must_be_tierstore_error(e, f"consolidate after {what}")
                    err = err or e
                else:
                    assert got.keys() == full.keys() and all(same_bits(got[k], full[k]) for k in full), \
                        f"consolidate returned wrong data after {what}"
                record(campaign, outcome(err))
    finally:
        opt.close()
