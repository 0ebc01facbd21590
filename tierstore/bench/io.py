"""`tierstore bench io`: the engine against fio and DeepSpeed's aio, in the same run, A B A B.

Sequential: a file of `--size` bytes is written then read whole, from one page-locked buffer, for every
block size x queue depth, by each backend of ours and by each reference. Every write overwrites a file laid
out beforehand (fio lays out its file before timing, so everyone gets the same state). Small requests:
20,000 requests of 4-256 KiB (log-uniform, 4 KiB multiples): ours packed at aligned offsets of one file (the
store's layout), DeepSpeed's as its swapper lays them out (one file per tensor).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable

from ._common import Progress, fmt_bytes, gib_s, interleave, print_table, ratio, size_arg, write_json


def add_arguments(p) -> None:
    p.add_argument("--dir", default="bench-data", help="directory on the disk under test (created)")
    p.add_argument("--size", type=size_arg, default=1 << 30, help="sequential file size (default 1G)")
    p.add_argument("--block-sizes", default="256K,1M,4M", help="comma-separated request sizes")
    p.add_argument("--queue-depths", default="8,32", help="comma-separated queue depths")
    p.add_argument("--rounds", type=int, default=3, help="A B A B rounds (the median is reported)")
    p.add_argument("--small-count", type=int, default=20_000, help="requests in the small-request workload")
    p.add_argument("--no-fio", action="store_true", help="skip the fio reference")
    p.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed aio reference")
    p.add_argument("--quick", action="store_true", help="one round, 1 MiB blocks at qd 32, 2,000 small requests")


# ---- the cases -----------------------------------------------------------------------------------

class Ours:
    """One engine per backend x queue depth x block size, writing from / reading into one pool buffer."""

    def __init__(self, backend: str, qd: int, bs: int, path: str, buf, size: int):
        from ..io import Engine

        self.eng = Engine(backend=backend, queue_depth=qd, block_size=bs)
        self.eng.register_pool(buf.pool)
        self.f = self.eng.open(path, "c")
        self.buf, self.size = buf, size

    def _run(self, op) -> None:
        chunk = self.buf.nbytes
        for off in range(0, self.size, chunk):
            op(self.f, self.buf, off)
        self.eng.wait_all()

    def write(self) -> None:
        self._run(self.eng.write)

    def read(self) -> None:
        self._run(self.eng.read)

    def close(self) -> None:
        self.eng.close()


def fio_run(path: str, op: str, engine: str, bs: int, qd: int, size: int) -> float:
    """fio's own bandwidth figure (bytes/s) for one job; its ramp-up and layout are not in it."""
    cmd = ["fio", "--name=tierstore-ref", f"--filename={path}", f"--rw={op}", f"--bs={bs}",
           f"--iodepth={qd}", f"--ioengine={engine}", "--direct=1", f"--size={size}", "--output-format=json",
           "--thread", "--group_reporting"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0][op]
    return job["io_bytes"] / (job["runtime"] / 1e3) if job["runtime"] else float("nan")


def fio_wall(jobs: list[tuple[str, str]], engine: str, bs: int, qd: int, size: int) -> float:
    """Seconds fio's slowest job took (its own runtime figure), the jobs [(path, "read" | "write")] running at
    the same time, each moving `size` bytes."""
    cmd = ["fio", "--output-format=json", "--thread", f"--ioengine={engine}", "--direct=1", f"--bs={bs}",
           f"--iodepth={qd}", f"--size={size}"]
    for i, (path, op) in enumerate(jobs):
        cmd += [f"--name=job{i}", f"--filename={path}", f"--rw={op}"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    res = json.loads(out[out.index("{"):])["jobs"]
    return max(j[op]["runtime"] for j, (_p, op) in zip(res, jobs)) / 1e3


def deepspeed_aio():
    """DeepSpeed's AsyncIOBuilder op module, or (None, why)."""
    try:
        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        from deepspeed.ops.op_builder import AsyncIOBuilder

        b = AsyncIOBuilder()
        if not b.is_compatible(verbose=False):
            return None, "DeepSpeed's async_io op is not compatible here (needs libaio-dev)"
        return b.load(verbose=False), ""
    except Exception as e:  # an optional reference: absent or broken means no column
        return None, f"DeepSpeed aio unavailable: {type(e).__name__}: {e}"


class DeepSpeed:
    """aio_handle(block_size, queue_depth, single_submit=False, overlap_events=True, threads=1) over the
    same bytes, from a page-locked tensor of its own making (one, shared by every handle of the sweep)."""

    def __init__(self, mod, qd: int, bs: int, path: str, locked):
        self.h = mod.aio_handle(bs, qd, False, True, 1)
        self.t, self.path = locked, path

    def write(self) -> None:
        self.h.sync_pwrite(self.t, self.path)

    def read(self) -> None:
        self.h.sync_pread(self.t, self.path)


def layout(path: str, size: int) -> None:
    """Write the file once, so every timed write overwrites allocated blocks (as fio's does)."""
    with open(path, "wb") as f:
        chunk = b"\xa5" * (64 << 20)
        left = size
        while left > 0:
            f.write(chunk[:min(left, len(chunk))])
            left -= len(chunk)
        f.flush()
        os.fsync(f.fileno())


def small_sizes(count: int, seed: int = 0) -> list[int]:
    import numpy as np

    rng = np.random.default_rng(seed)
    pages = np.exp(rng.uniform(np.log(1), np.log(64), count)).round().astype(int)  # 4 KiB pages: 4-256 KiB
    return [int(p) * 4096 for p in pages]


# ---- the run -------------------------------------------------------------------------------------

def run(args) -> int:
    import torch

    from ..io import BufferPool, io_uring_status

    bss = [size_arg(x) for x in args.block_sizes.split(",")]
    qds = [int(x) for x in args.queue_depths.split(",")]
    rounds, small_count = args.rounds, args.small_count
    if args.quick:
        bss, qds, rounds, small_count = [1 << 20], [32], 1, min(small_count, 2000)
    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="io-", dir=args.dir)
    size = args.size // (4 << 20) * (4 << 20) or (4 << 20)
    backends = (["io_uring"] if io_uring_status()[0] else []) + ["threads"]
    notes = []
    if "io_uring" not in backends:
        notes.append(f"io_uring unavailable: {io_uring_status()[1]}")
    fio = None if args.no_fio else shutil.which("fio")
    if not args.no_fio and fio is None:
        notes.append("fio not on PATH: no fio column (apt-get install fio)")
    ds_mod, why = (None, "skipped") if args.no_deepspeed else deepspeed_aio()
    if ds_mod is None and not args.no_deepspeed:
        notes.append(why)
    fio_engines = ["io_uring", "libaio"]

    chunk = min(size, 64 << 20)  # bytes: one pool buffer, reused for every request of the sweep
    pool = BufferPool(chunk, chunk)
    buf = pool.lease()
    buf.tensor().fill_(0xA5)
    seq_path = os.path.join(work, "seq.bin")
    layout(seq_path, size)
    results: dict = {"size": size, "rounds": rounds, "notes": notes, "sequential": [], "small": {}}
    ds_owner = ds_mod.aio_handle(1 << 20, 8, False, True, 1) if ds_mod is not None else None
    ds_locked = ds_owner.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8)) if ds_owner else None
    try:
        cases: dict = {}
        closers = [lambda: ds_owner.free_cpu_locked_tensor(ds_locked)] if ds_owner else []
        for bs in bss:
            for qd in qds:
                for be in backends:
                    o = Ours(be, qd, bs, seq_path, buf, size)
                    closers.append(o.close)
                    cases[("write", bs, qd, f"tierstore/{be}")] = o.write
                    cases[("read", bs, qd, f"tierstore/{be}")] = o.read
                if ds_mod is not None:
                    d = DeepSpeed(ds_mod, qd, bs, seq_path, ds_locked)
                    cases[("write", bs, qd, "deepspeed")] = d.write
                    cases[("read", bs, qd, "deepspeed")] = d.read
                if fio:
                    for eng_name in fio_engines:
                        for op in ("write", "read"):
                            cases[(op, bs, qd, f"fio/{eng_name}")] = (
                                lambda op=op, e=eng_name, bs=bs, qd=qd: size / fio_run(seq_path, op, e, bs, qd, size))
        small_cases, small_info = small_workload(work, small_count, backends, ds_mod)
        closers.extend(small_info.pop("closers"))
        with Progress(rounds * (len(cases) + len(small_cases)), "bench io") as prog:
            seq = interleave(cases, rounds, prog)
            small = interleave(small_cases, rounds, prog)
        for c in closers:
            c()
    finally:
        buf.release()
        pool.close()
        shutil.rmtree(work, ignore_errors=True)

    # ---- report ----
    def thr(key):  # GiB/s, median over rounds
        s = seq.get(key)
        return gib_s(size, s.median) if s else None

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
                mine = u if u is not None else t
                for name, v in (("tierstore", mine), ("fio", fb), ("deepspeed", d)):
                    if v is not None and v > best.get((op, name), (0,))[0]:
                        best[(op, name)] = (v, bs, qd)
                rows.append((op, fmt_bytes(bs), qd, _g(u), _g(t), _g(fb) + (f" ({fbest_name})" if fb else ""),
                             _g(d), ratio(mine, fb), ratio(mine, d), ratio(t, u)))
                results["sequential"].append({"op": op, "block": bs, "qd": qd, "io_uring_gib_s": u, "threads_gib_s": t,
                                              "fio_best_gib_s": fb, "fio_engine": fbest_name, "fio": fios,
                                              "deepspeed_gib_s": d})
    print_table(f"sequential, {fmt_bytes(size)} file, O_DIRECT, median of {rounds} rounds (GiB/s)",
                ["op", "block", "qd", "io_uring", "threads", "fio best", "DeepSpeed", "ours/fio", "ours/DS",
                 "threads/uring"], rows, caption="ours = the io_uring backend where available")

    srows = []
    ref = small.get("deepspeed (file per tensor)")
    ref_packed = small.get("deepspeed (packed, one file)")
    for name, s in small.items():
        rate = small_info["count"] / s.median
        srows.append((name, f"{rate:,.0f}", _g(gib_s(small_info["bytes"], s.median)),
                      ratio(1 / s.median, 1 / ref.median) if ref else "-",
                      ratio(1 / s.median, 1 / ref_packed.median) if ref_packed else "-"))
        results["small"][name] = {"requests_per_s": rate, "seconds": s.seconds}
    print_table(f"small requests: {small_info['count']:,} of 4-256 KiB ({fmt_bytes(small_info['bytes'])}), "
                "written then read", ["case", "requests/s", "GiB/s", "vs DS file/tensor", "vs DS packed"], srows)

    summary = []
    for op in ("write", "read"):
        ours_best = best.get((op, "tierstore"))
        for ref_name in ("fio", "deepspeed"):
            r = best.get((op, ref_name))
            if ours_best and r:
                summary.append(f"{op}: best tierstore {ours_best[0]:.2f} GiB/s vs best {ref_name} {r[0]:.2f} GiB/s "
                               f"-> {ours_best[0] / r[0]:.2f}x")
    for line in summary + notes:
        print(line)
    results["summary"] = summary
    write_json(args.json, results)
    print(_plot(results, args.json))
    return 0


def _plot(results: dict, json_path: str | None) -> str:
    """The sequential sweep, one panel per direction, each engine a line; the PNG goes next to the JSON."""
    from .plot import Panel, Series, png_path, save_png

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


DS_WINDOW = 1024  # DeepSpeed ops outstanding at once in the small-request workload (see its note)


def small_workload(work: str, count: int, backends: list[str], ds_mod):
    """Cases writing then reading `count` small requests; returns (cases, info)."""
    import torch

    from ..io import BufferPool, Engine

    sizes = small_sizes(count)
    offsets, total = [], 0
    for s in sizes:
        offsets.append(total)
        total += s
    pool = BufferPool(total, total)
    buf = pool.lease()
    src = buf.tensor()
    src.copy_(torch.randint(0, 256, (total,), dtype=torch.uint8))
    cases: dict[str, Callable[[], float | None]] = {}
    closers: list[Callable[[], object]] = []
    for be in backends:
        eng = Engine(backend=be, queue_depth=32)
        eng.register_pool(pool)
        f = eng.open(os.path.join(work, f"packed-{be}.bin"), "c")

        reqs = [(src[o:o + s], o) for o, s in zip(offsets, sizes)]

        def one(eng=eng, f=f, reqs=reqs):
            eng.write_many(f, reqs).result()
            eng.read_many(f, reqs).result()

        cases[f"tierstore/{be} (packed, one file)"] = one
        closers.append(eng.close)
    if ds_mod is not None:
        h = ds_mod.aio_handle(1 << 20, 32, False, True, 1)
        dsbuf = h.new_cpu_locked_tensor(total, torch.empty(0, dtype=torch.uint8))
        dsbuf.copy_(src)
        ddir = os.path.join(work, "ds-files")
        os.makedirs(ddir, exist_ok=True)
        paths = [os.path.join(ddir, f"t{i}.swp") for i in range(count)]

        # [Note: DeepSpeed's window] Its handle keeps a file open per outstanding op and does not check
        # the open (EMFILE past `ulimit -n` is printed, the op silently skipped), so it waits every
        # DS_WINDOW ops, as its swappers do per batch of tensors.
        def ds_run(op, targets):
            for i, (p, o, s) in enumerate(zip(targets, offsets, sizes)):
                op(dsbuf[o:o + s], p, o if p == packed else 0)
                if i % DS_WINDOW == DS_WINDOW - 1:
                    h.wait()
            h.wait()

        def ds_one():
            ds_run(h.async_pwrite, paths)
            ds_run(h.async_pread, paths)

        # The same engine on our layout (packed at aligned offsets of one file), to tell the layout's share
        # of the difference from the engine's. (Its pread takes a path, which it opens per request.)
        packed = os.path.join(work, "packed-ds.bin")

        def ds_packed():
            ds_run(h.async_pwrite, [packed] * count)
            ds_run(h.async_pread, [packed] * count)

        cases["deepspeed (packed, one file)"] = ds_packed
        cases["deepspeed (file per tensor)"] = ds_one
        closers.append(lambda: h.free_cpu_locked_tensor(dsbuf))
    closers.append(buf.release)
    closers.append(pool.close)
    return cases, {"count": count, "bytes": total, "closers": closers}
