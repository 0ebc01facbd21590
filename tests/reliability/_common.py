"""What every fault campaign shares: trial counts (short for `make test`, long for `make soak`), seeds that
replay a failing trial, the oracle of what a store must hold, loop-mounted filesystems, and the per-campaign
tally of outcomes that `make soak` prints at the end.

[Note: short and soak runs]
Every campaign runs `trials(short, soak)` trials: the short count under `make test`, the soak count when
TIERSTORE_SOAK=1 (`make soak`). TIERSTORE_TRIALS overrides both and TIERSTORE_SEED sets the base seed (trial
k of a campaign uses seed base + k), so a failure printed as "replay: TIERSTORE_SEED=s TIERSTORE_TRIALS=1"
runs that very trial alone. The kill and shutdown moments come from the same seed but race the child's
progress, so a replay repeats the operations exactly and the fault moment only approximately.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
from collections import Counter, defaultdict

import pytest
import torch

SOAK = os.environ.get("TIERSTORE_SOAK", "") not in ("", "0")
BASE_SEED = int(os.environ.get("TIERSTORE_SEED", "20251123"))

# campaign -> Counter(outcome -> trials); printed by conftest.pytest_terminal_summary
TALLY: dict[str, Counter] = defaultdict(Counter)


def trials(short: int, soak: int) -> int:
    if "TIERSTORE_TRIALS" in os.environ:
        return int(os.environ["TIERSTORE_TRIALS"])
    return soak if SOAK else short


def seeds(campaign: str, n: int) -> list[int]:
    """The seeds of a campaign's n trials: BASE_SEED + k, offset per campaign so campaigns differ."""
    off = sum(campaign.encode()) * 1000 if "TIERSTORE_SEED" not in os.environ else 0
    return [BASE_SEED + off + k for k in range(n)]


@contextlib.contextmanager
def trial(campaign: str, seed: int):
    """One trial: on failure the exception carries (and stdout shows) how to replay it."""
    try:
        yield random.Random(seed)
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, pytest.skip.Exception)):
            raise
        note = f"{campaign} trial failed; replay: TIERSTORE_SEED={seed} TIERSTORE_TRIALS=1"
        print(note)
        e.add_note(note)
        TALLY[campaign]["FAILED"] += 1
        raise


def record(campaign: str, outcome: str, n: int = 1) -> None:
    TALLY[campaign][outcome] += n


# -- values and the oracle ---------------------------------------------------------------------------------
# A value is named by a small spec, {"n": elements, "dtype": name, "seed": int, "codec": config or None},
# and rebuilt from it bit for bit: the oracle of a flush is the JSON of name -> spec (kilobytes, not the
# megabytes it describes), written and fsynced before the flush starts.
SIZES = {"tiny": (1, 300), "mid": (150_000, 153_600), "big": (600_000, 900_000)}  # elements: packed, ~600 KiB,
# multi-MiB (more than the stores' 1 MiB staging buffers: streamed)
DTYPES = ["float32", "bfloat16", "int32", "uint8", "float64"]
CODECS = [None, None, {"id": "zstd", "level": 1}, {"id": "blosc", "cname": "lz4", "clevel": 3, "shuffle": 1,
                                                     "blocksize": 0}]


def value_of(spec: dict) -> torch.Tensor:
    g = torch.Generator().manual_seed(spec["seed"])
    dt = getattr(torch, spec["dtype"])
    n = spec["n"]
    if dt.is_floating_point:
        # a few distinct values: compressible, so the codecs have something to do
        return (torch.randint(-8, 8, (n,), generator=g).to(torch.float32) / 4).to(dt)
    return torch.randint(0, 100, (n,), generator=g).to(dt)


def codec_of(config: dict | None):
    if config is None:
        return None
    import numcodecs
    return numcodecs.get_codec(dict(config))


def random_spec(rng: random.Random, sizes=("tiny", "tiny", "tiny", "mid", "big")) -> dict:
    lo, hi = SIZES[rng.choice(sizes)]
    return {"n": rng.randint(lo, hi), "dtype": rng.choice(DTYPES), "seed": rng.getrandbits(31),
            "codec": rng.choice(CODECS)}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


def write_json_durably(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json(path: str):
    with open(path) as f:
        return json.load(f)


def check_store(store, want: dict[str, dict], where: str) -> None:
    """The store holds exactly the tensors `want` names (name -> spec), bit for bit."""
    assert sorted(store.keys()) == sorted(want), f"{where}: names {sorted(store.keys())} != {sorted(want)}"
    got = store.get_many(list(want))
    for name, spec in want.items():
        assert same_bits(got[name], value_of(spec)), f"{where}: {name!r} differs from its spec {spec}"


# -- loop-mounted filesystems ------------------------------------------------------------------------------


def check_reopen(d: str, oracle: str, logged: list[int], prev: int, campaign: str, event: str) -> int:
    """After a child's death (`event`: "killed", "shut down"): reopen the store in `d` and check it holds
    exactly the flush the oracle recorded for its generation -- the last one the child logged as returned,
    or the one in progress, which may have completed as it died. Returns the generation found (`prev`
    when the store was never flushed)."""
    from tierstore.store import Store

    record(campaign, "(flushes returned)", len(logged))
    last = logged[-1] if logged else prev
    if prev == 0 and not os.path.exists(os.path.join(d, "manifest.json")):
        assert not logged, f"a flush returned before the child was {event}, but no manifest survived it"
        record(campaign, f"{event} before the first flush")
        return prev
    with Store.open(d, lock_memory=False) as s:
        g = s.generation
        assert g in (last, last + 1), (f"after the child was {event} the store is at generation {g}; the last "
                                       f"flush that returned made {last}")
        check_store(s, read_json(os.path.join(oracle, f"{g}.json")) if g else {}, f"generation {g}")
        s.close(flush=False)
    record(campaign, "last returned flush" if g == last else "flush in progress completed")
    return g
