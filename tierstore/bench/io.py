"""`tierstore bench io`: the engine against fio and DeepSpeed's aio, in the same run, A B A B.

Sequential: a file of `--size` bytes is written then read whole, from one page-locked buffer, for every
block size x queue depth, by each backend of ours and by each reference. Every write overwrites a file laid
out beforehand (fio lays out its file before timing, so everyone gets the same state). Small requests:
20,000 requests of 4-256 KiB (log-uniform, 4 KiB multiples): ours packed at aligned offsets of one file (the
store's layout), DeepSpeed's as its swapper lays them out (one file per tensor).

For I/O engineers, the same run also measures, ours and fio's alternated: the latency of random 4 KiB reads
at queue depth 1 (p50, p99), random 4 KiB IOPS at queue depth 32 (read and write), CPU seconds per GiB moved
(the process's user+system time for ours, fio's own usr+sys figure for fio), and a read and a write of two
files at once (mixed). Every case reports the spread of its rounds ((max - min) / median); every fio command
line is printed and kept in the JSON. Then the memory paths a user meets (io_paths.py; alone with --only
paths): the engine with an ordinary torch tensor vs a pool buffer, Store put+flush of one vs the engine's
write, get() into a fresh result vs the engine's read, each ratio with its verdict. A one-round run (--quick)
labels its ratios as indicative.
"""
from __future__ import annotations

import os
import shlex
import shutil
import tempfile
from collections.abc import Callable

from ._common import Progress, fmt_bytes, gib_s, interleave, print_table, ratio, size_arg, write_json
from ._ds_aio_case import DeepSpeedAio
from .io_cases import (
    CpuClock,
    Ours,
    fio_cmd,
    fio_cpu_seconds,
    fio_job,
    fio_wall,
    fio_wall_cmd,
    layout,
    mixed_workload,
    rand_info,
    random_workload,
    small_sizes,
    small_workload,
)
from .io_paths import paths_workload, report_paths, run_paths
from .verdict import Load


def add_arguments(p) -> None:
    p.add_argument("--dir", default="bench-data", help="directory on the disk under test (created)")
    p.add_argument("--size", type=size_arg, default=1 << 30, help="sequential file size (default 1G)")
    p.add_argument("--block-sizes", default="256K,1M,4M", help="comma-separated request sizes")
    p.add_argument("--queue-depths", default="8,32", help="comma-separated queue depths")
    p.add_argument("--rounds", type=int, default=3, help="A B A B rounds (the median is reported)")
    p.add_argument("--small-count", type=int, default=20_000, help="requests in the small-request workload")
    p.add_argument("--no-fio", action="store_true", help="skip the fio reference")
    p.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed aio reference")
    p.add_argument("--random-count", type=int, default=16384, help="random 4 KiB requests per IOPS case")
    p.add_argument("--latency-count", type=int, default=2000, help="random 4 KiB reads at qd 1 for the latencies")
    p.add_argument("--only", choices=["paths"], help="run one part: 'paths', the memory paths a user meets")
    p.add_argument("--paths-size", type=size_arg, default=None, help="bytes of the memory-path cases (default: "
                                                                      "--size, at most 1G)")
    p.add_argument("--quick", action="store_true", help="one round, 1 MiB blocks at qd 32, fewer small and random "
                                                        "requests; its ratios are indicative")


# ---- the run -------------------------------------------------------------------------------------

def spread(samples) -> str:
    """(max - min) / median of a case's rounds, '-' with one round."""
    t = samples.seconds
    return "-" if len(t) < 2 else f"{(max(t) - min(t)) / samples.median:.0%}"


def run_only_paths(args, rounds: int, indicative: str) -> int:
    """`--only paths`: the memory-path cases alone (io_paths.py)."""
    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="io-", dir=args.dir)
    cpu, load = CpuClock(), Load()
    closers: list[Callable[[], object]] = []
    try:
        pcases = paths_workload(work, args.paths_size or args.size, closers)
        with Progress(rounds * len(pcases), "bench io paths") as prog:
            paths = run_paths({k: cpu.wrap(k, fn) for k, fn in pcases.items()}, rounds, load, prog)
    finally:
        for c in closers:
            c()
        shutil.rmtree(work, ignore_errors=True)
    res = report_paths(paths, pcases.nbytes, load, cpu.seconds, pcases.bounced, indicative)
    write_json(args.json, {"benchmark": "io", "only": "paths", "size": pcases.nbytes, "rounds": rounds,
                           "load": load.as_dict(), "paths": res})
    return 0


def run(args) -> int:
    import statistics

    from ..io import BufferPool, io_uring_status

    bss = [size_arg(x) for x in args.block_sizes.split(",")]
    qds = [int(x) for x in args.queue_depths.split(",")]
    rounds, small_count = args.rounds, args.small_count
    nrand, nlat = args.random_count, args.latency_count
    if args.quick:
        bss, qds, rounds, small_count = [1 << 20], [32], 1, min(small_count, 2000)
        nrand, nlat = min(nrand, 4096), min(nlat, 500)
    indicative = " (indicative: 1 round)" if rounds < 2 else ""
    if args.only == "paths":
        return run_only_paths(args, rounds, indicative)
    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="io-", dir=args.dir)
    size = args.size // (4 << 20) * (4 << 20) or (4 << 20)
    backends = (["io_uring"] if io_uring_status()[0] else []) + ["threads"]
    notes = []
    if "io_uring" not in backends:
        notes.append(f"io_uring unavailable: {io_uring_status()[1]}")
    fio = None if args.no_fio else shutil.which("fio")
    if not args.no_fio and fio is None:
        notes.append("fio not on PATH: no fio column (Debian/Ubuntu: apt-get install fio; `make bench` does it "
                     "as root)")
    fio_engines = ["io_uring", "libaio"]
    fio_cmds: dict[str, str] = {}  # case -> the exact fio command line it ran

    chunk = min(size, 64 << 20)  # bytes: one pool buffer, reused for every request of the sweep
    pool = BufferPool(2 * chunk, chunk)
    buf, buf2 = pool.lease(), pool.lease()
    buf.tensor().fill_(0xA5)
    buf2.tensor().fill_(0x5A)
    seq_path = os.path.join(work, "seq.bin")
    mix_path = os.path.join(work, "mix.bin")
    layout(seq_path, size)
    layout(mix_path, size)
    results: dict = {"size": size, "rounds": rounds, "indicative": bool(indicative), "notes": notes,
                     "sequential": [], "small": {}, "random": {}, "mixed": {}, "paths": {}, "fio_commands": fio_cmds,
                     "load_average": os.getloadavg()}
    ds, why = (None, "skipped") if args.no_deepspeed else DeepSpeedAio.start(  # in .venv-ds: _ds_aio_case.py
        work, seq_path, size, [(bs, qd) for bs in bss for qd in qds], small_sizes(small_count))
    if ds is None and not args.no_deepspeed:
        notes.append(why)
    cpu = CpuClock()
    load = Load()
    fio_cpu: dict[str, list[float]] = {}
    fio_extra: dict[str, list[dict]] = {}
    try:
        cases: dict = {}
        closers = [ds.close] if ds else []

        def fio_case(key, cmd):
            fio_cmds[_label(key)] = shlex.join(cmd)

            def one():
                job = fio_job(cmd)
                fio_cpu.setdefault(str(key), []).append(fio_cpu_seconds(job))
                fio_extra.setdefault(str(key), []).append(job)
                d = job["read"] if job["read"]["io_bytes"] else job["write"]
                return d["runtime"] / 1e3
            return one

        for bs in bss:
            for qd in qds:
                for be in backends:
                    o = Ours(be, qd, bs, seq_path, buf, size)
                    closers.append(o.close)
                    for op in ("write", "read"):
                        key = (op, bs, qd, f"tierstore/{be}")
                        cases[key] = cpu.wrap(str(key), getattr(o, op))
                if ds is not None:
                    for op in ("write", "read"):
                        cases[(op, bs, qd, "deepspeed")] = ds.case("seq", op, bs, qd)
                if fio:
                    for eng_name in fio_engines:
                        for op in ("write", "read"):
                            key = (op, bs, qd, f"fio/{eng_name}")
                            cases[key] = fio_case(key, fio_cmd(seq_path, op, eng_name, bs, qd, size))
        latencies: dict[str, list[float]] = {}
        rand_cases = random_workload(seq_path, size, buf, backends, nrand, nlat, closers, latencies)
        if fio:
            fe = fio_engines[0]
            for op in ("randread", "randwrite"):
                rand_cases[f"fio/{fe} {op} qd32"] = fio_case(
                    f"fio/{fe} {op} qd32", fio_cmd(seq_path, op, fe, 4096, 32, size, f"--number_ios={nrand}"))
            rand_cases[f"fio/{fe} randread qd1"] = fio_case(
                f"fio/{fe} randread qd1", fio_cmd(seq_path, "randread", fe, 4096, 1, size, f"--number_ios={nlat}",
                                                  "--lat_percentiles=1"))
        mix_cases = mixed_workload(seq_path, mix_path, size, buf, buf2, backends, closers, cpu)
        if fio:
            mix_jobs = [(seq_path, "read"), (mix_path, "write")]
            fio_cmds["fio/io_uring read+write"] = shlex.join(fio_wall_cmd(mix_jobs, "io_uring", 1 << 20, 32, size))
            mix_cases["fio/io_uring read+write"] = lambda: fio_wall(mix_jobs, "io_uring", 1 << 20, 32, size)
        pcases = paths_workload(work, args.paths_size or min(size, 1 << 30), closers)
        path_cases: dict[str, Callable[[], float]] = {k: cpu.wrap(k, fn) for k, fn in pcases.items()}
        small_cases, small_info = small_workload(work, small_count, backends, ds)
        closers.extend(small_info.pop("closers"))
        total = rounds * (len(cases) + len(small_cases) + len(rand_cases) + len(mix_cases) + len(path_cases))
        with Progress(total, "bench io") as prog:
            seq: dict = interleave(cases, rounds, prog)
            rnd = interleave(rand_cases, rounds, prog)
            mix = interleave(mix_cases, rounds, prog)
            paths = run_paths(path_cases, rounds, load, prog)
            small = interleave(small_cases, rounds, prog)
        for c in closers:
            c()
    finally:
        buf.release()
        buf2.release()
        pool.close()
        shutil.rmtree(work, ignore_errors=True)

    # ---- report ----
    def thr(key):  # GiB/s, median over rounds
        s = seq.get(key)
        return gib_s(size, s.median) if s else None

    def cpu_per_gib(key: object) -> float | None:  # CPU seconds per GiB moved, median over rounds
        got = cpu.seconds.get(str(key)) or fio_cpu.get(str(key))
        return statistics.median(got) / (size / (1 << 30)) if got else None

    rows = []
    best: dict[tuple[str, str], tuple[float, int, int]] = {}  # (op, who) -> (GiB/s, block, queue depth)
    for op in ("write", "read"):
        for bs in bss:
            for qd in qds:
                u, t, d = thr((op, bs, qd, "tierstore/io_uring")), thr((op, bs, qd, "tierstore/threads")), \
                    thr((op, bs, qd, "deepspeed"))
                fios = {e: thr((op, bs, qd, f"fio/{e}")) for e in fio_engines} if fio else {}
                fbest_name = max(fios, key=lambda e: fios[e]) if fios else None
                fb = fios.get(fbest_name) if fbest_name else None
                mine_be = "io_uring" if u is not None else "threads"
                mine = u if u is not None else t
                for name, v in (("tierstore", mine), ("fio", fb), ("deepspeed", d)):
                    if v is not None and v > best.get((op, name), (0,))[0]:
                        best[(op, name)] = (v, bs, qd)
                mkey = (op, bs, qd, f"tierstore/{mine_be}")
                fkey = (op, bs, qd, f"fio/{fbest_name}") if fbest_name else None
                cm, cf = cpu_per_gib(mkey), cpu_per_gib(fkey) if fkey else None
                rows.append((op, fmt_bytes(bs), qd, _g(u), _g(t), _g(fb) + (f" ({fbest_name})" if fb else ""),
                             _g(d), ratio(mine, fb), ratio(mine, d), ratio(t, u), spread(seq[mkey]),
                             _g(cm), _g(cf)))
                results["sequential"].append({
                    "op": op, "block": bs, "qd": qd, "io_uring_gib_s": u, "threads_gib_s": t, "fio_best_gib_s": fb,
                    "fio_engine": fbest_name, "fio": fios, "deepspeed_gib_s": d, "cpu_s_per_gib": cm,
                    "fio_cpu_s_per_gib": cf, "spread": spread(seq[mkey]),
                    "fio_command": fio_cmds.get(_label(fkey)) if fkey else None})
    print_table(f"sequential, {fmt_bytes(size)} file, O_DIRECT, median of {rounds} rounds (GiB/s)",
                ["op", "block", "qd", "io_uring", "threads", "fio best", "DeepSpeed", "ours/fio" + indicative,
                 "ours/DS", "threads/uring", "spread", "CPU s/GiB", "fio CPU s/GiB"], rows,
                caption="ours = the io_uring backend where available; spread = (max-min)/median of ours' rounds")

    for name, smp in rnd.items():
        info = rand_info(name, smp, fio_extra.get(name), latencies.get(name), nrand)
        results["random"][name] = {**info, "seconds": smp.seconds, "fio_command": fio_cmds.get(name)}
    fio_of = {k.split(" ", 1)[1]: k for k in rnd if k.startswith("fio/")}  # "randread qd32" -> fio's case
    rrows = []
    for name, smp in rnd.items():
        mine = results["random"][name]
        theirs = results["random"].get(fio_of.get(name.split(" ", 1)[1], ""), {}) if not name.startswith("fio/") \
            else {}
        vs = (mine["iops"] / theirs["iops"] if mine.get("iops") and theirs.get("iops") else
              theirs["p50_us"] / mine["p50_us"] if mine.get("p50_us") and theirs.get("p50_us") else None)
        mine["vs_fio"] = vs
        rrows.append((name, f"{mine['iops']:,.0f}" if mine.get("iops") else "-", _us(mine.get("p50_us")),
                      _us(mine.get("p99_us")), "-" if vs is None else f"{vs:.2f}x", spread(smp)))
    print_table(f"random 4 KiB, {fmt_bytes(size)} file: IOPS at qd 32, latency at qd 1 (median of {rounds} rounds)",
                ["case", "IOPS", "p50 latency", "p99 latency", "vs fio" + indicative, "spread"], rrows,
                caption="latency, ours: from the call to the future's result (Python included); fio: its lat_ns "
                        "(submission to completion). vs fio: IOPS ratio, or fio's p50 / ours")

    mrows = []
    mref = mix.get("fio/io_uring read+write")
    for name, smp in mix.items():
        g = gib_s(2 * size, smp.median)
        mc = cpu.seconds.get(name)
        results["mixed"][name] = {"gib_s": g, "seconds": smp.seconds, "fio_command": fio_cmds.get(name),
                                  "cpu_s_per_gib": statistics.median(mc) / (2 * size / (1 << 30)) if mc else None}
        mrows.append((name, _g(g), ratio(1 / smp.median, 1 / mref.median) if mref else "-", spread(smp),
                      _g(results["mixed"][name]["cpu_s_per_gib"])))
    print_table(f"mixed: read one {fmt_bytes(size)} file while writing another, 1 MiB at qd 32 (GiB/s, both)",
                ["case", "GiB/s", "vs fio" + indicative, "spread", "CPU s/GiB"], mrows)

    results["paths"] = report_paths(paths, pcases.nbytes, load, cpu.seconds, pcases.bounced, indicative)

    srows = []
    ref = small.get("deepspeed (file per tensor)")
    ref_packed = small.get("deepspeed (packed, one file)")
    for name, s in small.items():
        rate = small_info["count"] / s.median
        srows.append((name, f"{rate:,.0f}", _g(gib_s(small_info["bytes"], s.median)),
                      ratio(1 / s.median, 1 / ref.median) if ref else "-",
                      ratio(1 / s.median, 1 / ref_packed.median) if ref_packed else "-", spread(s)))
        results["small"][name] = {"requests_per_s": rate, "seconds": s.seconds}
    print_table(f"small requests: {small_info['count']:,} of 4-256 KiB ({fmt_bytes(small_info['bytes'])}), "
                "written then read", ["case", "requests/s", "GiB/s", "vs DS file/tensor", "vs DS packed", "spread"],
                srows)

    summary = []
    for op in ("write", "read"):
        ours_best = best.get((op, "tierstore"))
        for ref_name in ("fio", "deepspeed"):
            r = best.get((op, ref_name))
            if ours_best and r:
                summary.append(f"{op}: best tierstore {ours_best[0]:.2f} GiB/s vs best {ref_name} {r[0]:.2f} GiB/s "
                               f"-> {ours_best[0] / r[0]:.2f}x{indicative}")
    if fio_cmds:
        print("fio command lines:")
        for case_name, line in fio_cmds.items():
            print(f"  {case_name}: {line}")
    la = results["load_average"]
    print(f"load average at start: {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}")
    for line in summary + notes:
        print(line)
    results["summary"] = summary
    write_json(args.json, results)
    print(_plot(results, args.json))
    return 0


def _label(key) -> str:
    """A case's name: ("write", 1 MiB, 32, "fio/io_uring") -> "write 1.0 MiB qd32 fio/io_uring"."""
    if isinstance(key, tuple):
        op, bs, qd, who = key
        return f"{op} {fmt_bytes(bs)} qd{qd} {who}"
    return str(key)


def _us(v) -> str:
    return "-" if v is None else f"{v:.0f} µs"


def _plot(results: dict, json_path: str | None) -> str:
    """The sequential sweep, one panel per direction, each engine a line; the PNG goes next to the JSON."""
    from ..plot import Panel, Series, png_path, save_png

    panels = []
    for op in ("write", "read"):
        rows = [r for r in results["sequential"] if r["op"] == op]
        x = [f"{fmt_bytes(r['block'])} qd{r['qd']}" for r in rows]
        series = []
        for key, label in (("io_uring_gib_s", "tierstore io_uring"), ("threads_gib_s", "tierstore threads"),
                           ("fio_best_gib_s", "fio (best engine)"), ("deepspeed_gib_s", "DeepSpeed aio")):
            if any(r.get(key) for r in rows):
                series.append(Series(label, x, [r.get(key) or float("nan") for r in rows], "o-"))
        panels.append(Panel(f"sequential {op}, O_DIRECT, median of {results['rounds']} rounds", "GiB/s", series,
                            xlabel="request size, queue depth"))
    return save_png(png_path(json_path, None), f"tierstore bench io: {fmt_bytes(results['size'])} file", panels)


def _g(v) -> str:
    return "-" if v is None else f"{v:.2f}"
