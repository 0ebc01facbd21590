"""`tierstore tune DIR [DIR ...]`: sweep the engine's knobs on the disks under test in minutes and write the
configuration it recommends (a tierstore.io.Tuning JSON file, tuning.py), which `Engine.from_tuning(path)`,
`Store(..., io_tuning=path)` and `OffloadConfig(io_tuning=path)` take.

[Note: how tune searches]
One knob at a time, in the order backend, queue depth, block size (the engine's piece), request size (the
pool buffer the nvme tier streams with), workers (threads moving tensors at once), stripe unit (only with
several directories): each candidate value runs the same workload -- a file of `--size` bytes written then
read, O_DIRECT, from page-locked buffers -- alternated A B A B with the best so far, and is kept only when
its median is better by more than `--min-gain` (noise on a shared disk must not move a knob). A time budget
bounds the sweep: when it is spent, the knobs not yet tried keep their defaults, and the file says which.
DeepSpeed's ds_nvme_tune runs every combination and takes over an hour; this takes the budget.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from concurrent.futures import Future
from typing import Any

from .._report import fmt_bytes, gib_s, print_table, size_arg, write_json

KNOBS = {  # knob -> candidate values, the default first
    "queue_depth": [32, 8, 16, 64],
    "block_size": [1 << 20, 256 << 10, 4 << 20],
    "buffer_bytes": [4 << 20, 1 << 20, 16 << 20],
    "workers": [2, 1, 4],
    "stripe_unit": [1 << 20, 256 << 10, 4 << 20],
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dirs", nargs="+", metavar="DIR", help="directory on each disk to tune for (one per drive)")
    p.add_argument("--out", default=None, help="where to write the recommendation (default: DIR/tierstore-io.json)")
    p.add_argument("--budget", type=float, default=120.0, help="seconds for the whole sweep (default 120)")
    p.add_argument("--size", type=size_arg, default=256 << 20, help="bytes written then read per trial (256M)")
    p.add_argument("--rounds", type=int, default=2, help="A B rounds per candidate (the median is compared)")
    p.add_argument("--min-gain", type=float, default=0.05, help="a candidate must beat the best by this (0.05: 5%%)")


class Trial:
    """Write then read `size` bytes of one (striped) file with one setting; seconds for both."""

    def __init__(self, dirs: list[str], size: int):
        self.dirs, self.size = dirs, size

    def __call__(self, s: dict) -> float:
        from .engine import Engine
        from .pool import BufferPool

        reqs = self.size // s["buffer_bytes"]
        workers = s["workers"]
        pool = BufferPool(s["buffer_bytes"] * max(workers, min(reqs, 16)), s["buffer_bytes"], lock=False)
        bufs = [pool.lease() for _ in range(pool.count)]
        for b in bufs:
            b.tensor().fill_(0x3C)
        eng = Engine(backend=s["backend"], queue_depth=s["queue_depth"], block_size=s["block_size"], pool=pool)
        try:
            f = eng.open_striped(self.dirs, "tune.bin", "c", stripe_unit=s["stripe_unit"])
            per = -(-reqs // workers)  # requests per worker

            def go(op, w: int) -> None:
                fn = eng.write if op == "w" else eng.read
                window = len(bufs) // workers
                futs: list[Future] = []
                for k in range(w * per, min(reqs, (w + 1) * per)):
                    if len(futs) >= window:
                        futs.pop(0).result()
                    futs.append(fn(f, bufs[w * window + k % window], k * s["buffer_bytes"]))
                for fu in futs:
                    fu.result()

            t0 = time.perf_counter()
            for op in ("w", "r"):
                ts = [threading.Thread(target=go, args=(op, w)) for w in range(workers)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                eng.wait_all()
                if op == "w":
                    f.fsync()
            dt = time.perf_counter() - t0
            eng.close_file(f)
            return dt
        finally:
            eng.close()
            for b in bufs:
                b.release()
            pool.close()


def tune(dirs: list[str], *, budget: float, size: int, rounds: int, min_gain: float, log=print) -> dict:
    """Run the sweep (see [Note: how tune searches]); returns {"tuning": Tuning, "trials": [...], ...}."""
    from .backends import io_uring_status
    from .tuning import Tuning

    deadline = time.monotonic() + budget
    work = [tempfile.mkdtemp(prefix="tierstore-tune-", dir=d) for d in dirs]
    trial = Trial(work, size)
    best: dict[str, Any] = {k: v[0] for k, v in KNOBS.items()}
    best["backend"] = "io_uring" if io_uring_status()[0] else "threads"
    trials: list[dict] = []
    skipped: list[str] = []
    best_times: list[float] = []

    def measure(setting: dict) -> float:
        dt = trial(setting)
        trials.append({**setting, "seconds": dt, "gib_s": gib_s(2 * size, dt)})
        return dt

    try:
        best_times.append(measure(best))
        knobs: list[tuple[str, list]] = []
        if best["backend"] == "io_uring":
            knobs.append(("backend", ["threads"]))
        knobs += [(k, v[1:]) for k, v in KNOBS.items() if k != "stripe_unit" or len(dirs) > 1]
        if len(dirs) == 1:
            skipped.append("stripe_unit (one directory: nothing is striped)")
        for knob, values in knobs:
            for v in values:
                if time.monotonic() >= deadline:
                    skipped.append(f"{knob}={v} (budget spent)")
                    continue
                cand = {**best, knob: v}
                if cand["buffer_bytes"] < cand["block_size"]:
                    continue  # a request smaller than a block: the same as block == request
                times, ref = [], []
                for _ in range(rounds):  # A B A B with the best so far
                    times.append(measure(cand))
                    ref.append(measure(best))
                    if time.monotonic() >= deadline:
                        break
                gain = statistics.median(ref) / statistics.median(times) - 1
                log(f"  {knob}={v}: {gain:+.0%} vs {knob}={best[knob]}")
                if gain > min_gain:
                    best, best_times = cand, times
                else:
                    best_times += ref
    finally:
        for d in work:
            shutil.rmtree(d, ignore_errors=True)
    gib = gib_s(2 * size, statistics.median(best_times))
    tuning = Tuning(backend=best["backend"], queue_depth=best["queue_depth"], block_size=best["block_size"],
                    buffer_bytes=best["buffer_bytes"], stripe_unit=best["stripe_unit"], workers=best["workers"],
                    measured={"gib_s_write_then_read": gib, "trials": len(trials), "size": size, "dirs": dirs,
                              "not_tried": skipped, "load_average": list(os.getloadavg())})
    return {"tuning": tuning, "trials": trials, "not_tried": skipped}


def run(args) -> int:
    for d in args.dirs:
        os.makedirs(d, exist_ok=True)
    out = args.out or os.path.join(args.dirs[0], "tierstore-io.json")
    if args.budget <= 0 or args.size < (16 << 20) or args.rounds < 1:
        raise SystemExit("tierstore tune: --budget must be > 0, --size >= 16M and --rounds >= 1")
    print(f"tuning {', '.join(args.dirs)}: {fmt_bytes(args.size)} written then read per trial, budget "
          f"{args.budget:.0f} s")
    res = tune(args.dirs, budget=args.budget, size=args.size, rounds=args.rounds, min_gain=args.min_gain)
    t = res["tuning"]
    t.save(out)
    rows = [(k, str(getattr(t, k)) if k in ("backend", "queue_depth", "workers") else fmt_bytes(getattr(t, k)),
             str(KNOBS[k][0]) if k in ("queue_depth", "workers") else
             fmt_bytes(KNOBS[k][0]) if k in KNOBS else "auto")
            for k in ("backend", "queue_depth", "block_size", "buffer_bytes", "workers", "stripe_unit")]
    print_table(f"recommended ({len(res['trials'])} trials, {t.measured['gib_s_write_then_read']:.2f} GiB/s "
                "write then read)", ["knob", "recommended", "default"], rows,
                caption="not tried: " + ("; ".join(res["not_tried"]) or "nothing"))
    print(f"wrote {out}: use it with Engine.from_tuning({out!r}), Store(dirs, io_tuning={out!r}) or "
          f"OffloadConfig(io_tuning={out!r})")
    write_json(getattr(args, "json", None), {"tuning": {"path": out, **vars(t)}, "trials": res["trials"],
                                             "not_tried": res["not_tried"]})
    return 0
