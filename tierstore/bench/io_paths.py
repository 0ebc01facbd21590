"""The memory paths a user of the standalone store meets, timed by `tierstore bench io` (alone with `--only
paths`): plain torch tensors against the engine's own pool buffers, over the same bytes, in the same run.

    engine write, plain torch tensor   vs  engine write, pool buffer   (target >= 0.9x)
    engine read, plain torch tensor    vs  engine read, pool buffer    (target >= 0.9x)
    Store put+flush, plain tensor      vs  engine write, pool buffer   (target >= 0.9x)
    Store get(), fresh result          vs  engine read, pool buffer    (target >= 0.8x)

A plain tensor is an ordinary torch allocation, never 4 KiB aligned (the engine bounces it: [Note: bounce
buffers] in io/engine.py). Every write ends durable (fsync); before every read the page cache of its file is
dropped. Each pair's ratio is taken round by round -- the case's time over its reference's in the same round
-- the cases in another order each round (verdict.round_order), the load sampled between cases, so the
verdict respects [Note: a verdict the load cannot flip] in verdict.py.
"""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

from ._common import Samples, fmt_bytes, gib_s, print_table
from .verdict import Load, round_order, spread_text, verdict

PLAIN_WRITE, POOL_WRITE = "engine write, plain torch tensor", "engine write, pool buffer"
PLAIN_READ, POOL_READ = "engine read, plain torch tensor", "engine read, pool buffer"
PUT, GET = "Store put+flush, plain tensor", "Store get(), fresh result"
PATH_PAIRS = [(PLAIN_WRITE, POOL_WRITE, (">=", 0.9)), (PLAIN_READ, POOL_READ, (">=", 0.9)),
              (PUT, POOL_WRITE, (">=", 0.9)), (GET, POOL_READ, (">=", 0.8))]


class PathCases(dict):
    """name -> case (returns its seconds), with the bytes each moves and the engine whose stats count them."""

    nbytes = 0
    bounced: dict[str, list[int]]  # case -> bytes the engine bounced, per round


def paths_workload(work: str, nbytes: int, closers: list) -> PathCases:
    """The cases of PATH_PAIRS over `nbytes`; their clean-up goes to `closers`."""
    import torch

    from ..io import BufferPool, Engine
    from ..store import Store
    from ..tiers.host import RESULTS
    from ._common import drop_page_cache
    from .io_cases import layout

    pool = BufferPool(nbytes, nbytes, lock=False)
    pbuf = pool.lease()
    pbuf.tensor().fill_(7)
    plain = torch.full((nbytes + 64,), 7, dtype=torch.uint8)[64:]  # an ordinary allocation, never 4 KiB aligned
    if plain.data_ptr() % 4096 == 0:
        plain = torch.full((nbytes + 128,), 7, dtype=torch.uint8)[128:]
    eng = Engine(pool=pool)
    path = os.path.join(work, "paths.bin")
    layout(path, nbytes)
    f = eng.open(path, "r+")
    sdir = os.path.join(work, "paths-store")
    cases = PathCases()
    cases.nbytes = nbytes
    cases.bounced = {}

    def counted(name: str, fn: Callable[[], float]) -> Callable[[], float]:
        def one() -> float:
            before = eng.stats()["bounced"]
            dt = fn()
            cases.bounced.setdefault(name, []).append(eng.stats()["bounced"] - before)
            return dt
        return one

    def ewrite(src):
        def one():
            t0 = time.perf_counter()
            eng.write(f, src, 0)
            eng.wait_all()
            eng.fsync(f)
            return time.perf_counter() - t0
        return one

    def eread(dst):
        def one():
            drop_page_cache([path])
            t0 = time.perf_counter()
            eng.read(f, dst, 0)
            eng.wait_all()
            return time.perf_counter() - t0
        return one

    def extent_files():
        return [os.path.join(sdir, n) for n in os.listdir(sdir) if n.startswith("extents-")]

    # A trainer puts the same names every step: each put goes to free space of the store's extent file that
    # earlier versions used (copy-on-write), as the engine's reference overwrites its laid-out file.
    with Store(sdir, budgets={"host": 0}) as s:
        for _ in range(3):
            s.put("x", plain, "nvme")
            s.flush()

    def put():
        with Store.open(sdir, budgets={"host": 0}) as s:
            t0 = time.perf_counter()
            s.put("x", plain, "nvme")
            s.flush()
            return time.perf_counter() - t0

    def get():
        RESULTS.trim()  # a result in memory new to the process, as a new user's first get()
        with Store.open(sdir, budgets={"host": 0}) as s:
            drop_page_cache(extent_files())
            t0 = time.perf_counter()
            got = s.get("x")
            dt = time.perf_counter() - t0
        del got
        return dt

    cases.update({POOL_WRITE: counted(POOL_WRITE, ewrite(pbuf)), PLAIN_WRITE: counted(PLAIN_WRITE, ewrite(plain)),
                  POOL_READ: counted(POOL_READ, eread(pbuf)), PLAIN_READ: counted(PLAIN_READ, eread(plain)),
                  PUT: put, GET: get})

    def close():
        eng.close()
        pbuf.release()
        pool.close()
    closers.append(close)
    return cases


def run_paths(cases: dict[str, Callable[[], float]], rounds: int, load: Load, progress=None) -> dict[str, Samples]:
    """Every case once per round, in round_order's order, the load sampled before the first and after each."""
    out = {name: Samples(name) for name in cases}
    names = list(cases)
    load.sample()
    for k in range(rounds):
        for name in round_order(names, k):
            out[name].seconds.append(float(cases[name]()))
            load.sample()
            if progress is not None:
                progress.advance()
    return out


def report_paths(samples: dict[str, Samples], nbytes: int, load: Load, cpu: dict[str, list[float]],
                 bounced: dict[str, list[int]], indicative: str = "") -> dict:
    """Print the four ratios with their spread and verdict; returns them for the JSON."""
    def cpu_per_gib(case: str) -> float | None:
        got = cpu.get(case)
        return statistics.median(got) / (nbytes / (1 << 30)) if got else None

    def g(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    rows, out = [], {}
    for case, ref, target in PATH_PAIRS:
        a, b = samples[case], samples[ref]
        per_round = [tb / ta for ta, tb in zip(a.seconds, b.seconds)]  # the reference's time over the case's
        med = b.median / a.median
        v = verdict(per_round, target, load)
        out[case] = {"gib_s": gib_s(nbytes, a.median), "reference": ref, "reference_gib_s": gib_s(nbytes, b.median),
                     "ratio": med, "per_round": per_round, "target": list(target), "verdict": v,
                     "seconds": a.seconds, "reference_seconds": b.seconds, "cpu_s_per_gib": cpu_per_gib(case),
                     "reference_cpu_s_per_gib": cpu_per_gib(ref), "bounced_bytes": bounced.get(case)}
        rows.append((case, g(gib_s(nbytes, a.median)), ref, g(gib_s(nbytes, b.median)), f"{med:.2f}x",
                     spread_text(per_round), f"{target[0]} {target[1]}x", v, g(cpu_per_gib(case)), g(cpu_per_gib(ref))))
    print_table(f"memory paths, {fmt_bytes(nbytes)}, O_DIRECT (GiB/s, median of {len(samples[GET].seconds)} rounds)",
                ["case", "GiB/s", "reference", "GiB/s", "case/reference" + indicative, "per round", "target",
                 "verdict", "CPU s/GiB", "ref CPU s/GiB"], rows,
                caption=f"per round: the least and the most of the rounds' ratios; {load.describe()}")
    return out
