"""`tierstore bench store`: Store put+flush and get vs the raw engine and torch.save/torch.load, same run.

torch is measured two ways (see [Note: two torch references]): all tensors as one dict in one file, and one
file per tensor.

(a) many small tensors (default 10,000 of 4 KiB-1 MiB, log-uniform sizes) and (b) a few large ones
(default 8 of 256 MiB). Every case moves the same bytes; rounds alternate A B A B. Writes end durable
(fsync) in every case; before every read the page cache of the files is dropped (posix_fadvise), so the
reads come from the disk for the store, the engine and torch.load alike. Store reads are measured twice:
into tensors allocated once beforehand (`get_many(names, out=...)`, what a trainer does every step; the
engine reference also reads into memory it allocated before) and into fresh tensors (`get_many(names)`,
which pays the page faults of new memory, as torch.load does).

(d) open cost (`--only open`, store_open.py): Store.open of a store of `--tensors` small tensors, its
seconds and peak memory in a fresh process.

(c) row reads (`--only rows`): a table (default 256 MiB of float32 rows of 4 KiB) on the nvme tier, a lookup
of random rows (default 4096, an embedding batch), a sparse one (1/16 as many) and a slice of consecutive
rows, page cache dropped before
each: `get(name, rows=...)` against np.memmap of the same bytes in a plain file (its fancy index / slice) and
against reading the whole tensor and indexing it. Bytes from the disk are /proc/self/io's read_bytes.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
import time

from ._common import (
    Progress,
    drop_page_cache,
    engine_pass,
    fmt_bytes,
    gib_s,
    interleave,
    print_table,
    ratio,
    size_arg,
    write_json,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default=".", help="directory on the disk under test (default: .)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply tensor counts (a) and sizes (b) by this")
    p.add_argument("--count", type=int, default=10_000, help="(a) number of small tensors")
    p.add_argument("--size", type=size_arg, default=256 << 20, help="(b) bytes per large tensor")
    p.add_argument("--large-count", type=int, default=8, help="(b) number of large tensors")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pinned", type=size_arg, default=128 << 20, help="the store's budgets['pinned']")
    p.add_argument("--only", choices=["small", "large", "rows", "open"], help="run one workload")
    p.add_argument("--table", type=size_arg, default=256 << 20, help="(c) bytes of the table rows are read from")
    p.add_argument("--lookups", type=int, default=4096, help="(c) random rows per lookup")
    p.add_argument("--tensors", type=int, default=20_000, help="(d) tensors of the store whose open is timed")


def _files(d: str) -> list[str]:
    return [os.path.join(d, f) for f in os.listdir(d) if f.startswith("extents-")]


def _workload(name: str, tensors: dict, root: str, args, progress) -> dict:
    import time

    import torch

    from ..io import Engine
    from ..store import Store
    from ..tiers.host import aligned_empty
    from ..tiers.nvme import align_up

    total = sum(t.numel() * t.element_size() for t in tensors.values())  # bytes
    names = list(tensors)
    sdir = os.path.join(root, f"{name}-store")
    tfile = os.path.join(root, f"{name}.pt")
    rfile = os.path.join(root, f"{name}-raw.bin")
    # the raw engine's reference: the same bytes, laid out back to back at 4 KiB boundaries, O_DIRECT
    offsets, pos = {}, 0
    for k, t in tensors.items():
        offsets[k] = pos
        pos += align_up(t.numel() * t.element_size())
    packed = name == "small"  # small tensors: one aligned staging area; large: each tensor from aligned memory
    if packed:
        src = aligned_empty(pos)
        for k, t in tensors.items():
            n = t.numel() * t.element_size()
            src[offsets[k]:offsets[k] + n].copy_(t.reshape(-1).view(torch.uint8))
        dst = aligned_empty(pos)
    else:
        srcs = {}
        for k, t in tensors.items():
            a = aligned_empty(t.numel() * t.element_size())
            a.copy_(t.reshape(-1).view(torch.uint8))
            srcs[k] = a
        dsts = {k: aligned_empty(a.numel()) for k, a in srcs.items()}
    eng = Engine()

    def store_put():
        shutil.rmtree(sdir, ignore_errors=True)
        s = Store(sdir, budgets={"pinned": args.pinned, "host": 0})
        t0 = time.perf_counter()
        for k, t in tensors.items():
            s.put(k, t, "nvme")
        s.flush()
        dt = time.perf_counter() - t0
        s.close(flush=False)
        return dt

    def store_get():
        s = Store.open(sdir, budgets={"pinned": args.pinned, "host": 0})
        drop_page_cache(_files(sdir))
        t0 = time.perf_counter()
        got = s.get_many(names)
        dt = time.perf_counter() - t0
        assert len(got) == len(names)
        s.close(flush=False)
        return dt

    # what a trainer does: read into tensors it allocated once (plain torch.empty, touched before)
    outs = [torch.zeros_like(t) for t in tensors.values()]

    def store_get_out():
        s = Store.open(sdir, budgets={"pinned": args.pinned, "host": 0})
        drop_page_cache(_files(sdir))
        t0 = time.perf_counter()
        got = s.get_many(names, out=outs)
        dt = time.perf_counter() - t0
        assert len(got) == len(names)
        s.close(flush=False)
        return dt

    w_pieces = [(src, 0)] if packed else [(a, offsets[k]) for k, a in srcs.items()]
    r_pieces = [(dst, 0)] if packed else [(a, offsets[k]) for k, a in dsts.items()]

    def raw_write():
        return engine_pass(eng, rfile, "w", w_pieces)

    def raw_read():
        return engine_pass(eng, rfile, "r", r_pieces)

    def torch_save():
        t0 = time.perf_counter()
        with open(tfile, "wb") as f:
            torch.save(tensors, f)
            f.flush()
            os.fsync(f.fileno())
        return time.perf_counter() - t0

    def torch_load():
        drop_page_cache([tfile])
        t0 = time.perf_counter()
        got = torch.load(tfile)
        dt = time.perf_counter() - t0
        assert len(got) == len(names)
        return dt

    # [Note: two torch references] One dict in one file is the fastest torch.save can be, but it is no store:
    # one tensor cannot be read or replaced alone. A file per tensor is what a trainer without a store does
    # to keep named tensors apart (DeepSpeed's swapper layout); both are measured and reported.
    pdir = os.path.join(root, f"{name}-per-file")
    os.makedirs(pdir, exist_ok=True)
    pfiles = {k: os.path.join(pdir, f"{k}.pt") for k in names}

    def torch_save_files():
        t0 = time.perf_counter()
        for k, t in tensors.items():
            with open(pfiles[k], "wb") as f:
                torch.save(t, f)
                f.flush()
                os.fsync(f.fileno())
        return time.perf_counter() - t0

    def torch_load_files():
        drop_page_cache(pfiles.values())
        t0 = time.perf_counter()
        got = {k: torch.load(pfiles[k]) for k in names}
        dt = time.perf_counter() - t0
        assert len(got) == len(names)
        return dt

    cases = {"store put+flush": store_put, "engine write+fsync": raw_write, "torch.save+fsync": torch_save,
             "torch.save per file+fsync": torch_save_files,
             "store get (out=)": store_get_out, "store get": store_get, "engine read": raw_read,
             "torch.load": torch_load, "torch.load per file": torch_load_files}
    res = interleave(cases, args.rounds, progress)
    # correctness of what the benchmark measured
    with Store.open(sdir, budgets={"pinned": args.pinned}) as s:
        for k in names[:: max(1, len(names) // 50)]:
            assert torch.equal(s.get(k), tensors[k]), k
    for k, o in list(zip(names, outs))[:: max(1, len(names) // 50)]:
        assert torch.equal(o, tensors[k]), k
    eng.close()
    for p in (sdir, pdir):
        shutil.rmtree(p, ignore_errors=True)
    for p in (tfile, rfile):
        os.unlink(p)
    return {"bytes": total, "tensors": len(tensors), "samples": res}


def _read_bytes() -> int:
    """Bytes this process has caused to be read from storage (/proc/self/io)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no read_bytes line")


def _rows_workload(root: str, args, progress) -> dict:
    import time

    import numpy as np
    import torch

    from ..store import Store

    cols = 1024  # float32: 4 KiB rows
    nrows = max(args.lookups, args.table // (cols * 4))
    g = torch.Generator().manual_seed(1)
    table = torch.randn(nrows, cols, generator=g)
    sdir, mfile = os.path.join(root, "rows-store"), os.path.join(root, "rows.raw")
    with Store(sdir, budgets={"host": 0, "pinned": args.pinned}) as s:
        s.put("table", table, "nvme")
    table.numpy().tofile(mfile)
    idx = torch.randint(0, nrows, (args.lookups,), generator=g)
    sparse = idx[:max(1, args.lookups // 16)]
    sl = slice(nrows // 3, nrows // 3 + args.lookups)
    disk: dict[str, list[int]] = {}

    def timed(case: str, files, fn, want):
        drop_page_cache(files)
        b0 = _read_bytes()
        t0 = time.perf_counter()
        got = fn()
        dt = time.perf_counter() - t0
        disk.setdefault(case, []).append(_read_bytes() - b0)
        assert torch.equal(torch.as_tensor(got), want), case
        return dt

    def store_case(case, rows, want):
        def fn():
            with Store.open(sdir, budgets={"host": 0, "pinned": args.pinned}) as s:
                return timed(case, _files(sdir), lambda: s.get("table", rows=rows), want)
        return fn

    def whole_case(case, rows, want):
        def fn():
            with Store.open(sdir, budgets={"host": 0, "pinned": args.pinned}) as s:
                return timed(case, _files(sdir), lambda: s.get("table")[rows], want)
        return fn

    def memmap_case(case, rows, want):
        def fn():
            m = np.memmap(mfile, dtype=np.float32, mode="r", shape=(nrows, cols))
            np_rows = rows.numpy() if isinstance(rows, torch.Tensor) else rows
            return timed(case, [mfile], lambda: np.array(m[np_rows]), want)
        return fn

    cases = {}
    for what, rows in (("lookup", idx), ("sparse", sparse), ("slice", sl)):
        want = table[rows]
        cases[f"store rows= {what}"] = store_case(f"store rows= {what}", rows, want)
        cases[f"np.memmap {what}"] = memmap_case(f"np.memmap {what}", rows, want)
        cases[f"store whole+index {what}"] = whole_case(f"store whole+index {what}", rows, want)
    res = interleave(cases, args.rounds, progress)
    shutil.rmtree(sdir, ignore_errors=True)
    os.unlink(mfile)
    return {"bytes": table.numel() * 4, "rows": nrows, "asked": {"lookup": len(idx), "sparse": len(sparse),
                                                                 "slice": args.lookups}, "samples": res,
            "disk_bytes": {k: sorted(v)[len(v) // 2] for k, v in disk.items()}}


def _rows_report(r: dict) -> None:
    from ..tiers.nvme.extents import CRC_BLOCK

    rows = []
    for what in ("lookup", "sparse", "slice"):
        want = r["asked"][what] * 4096  # bytes of the rows asked for
        t = {c: r["samples"][f"{c} {what}"].median for c in ("store rows=", "np.memmap", "store whole+index")}
        d = {c: r["disk_bytes"][f"{c} {what}"] for c in t}
        for c in t:
            rows.append([f"{what}: {r['asked'][what]} rows of {fmt_bytes(r['bytes'])}", c, f"{t[c] * 1e3:.1f}",
                         fmt_bytes(d[c]), f"{d[c] / want:.1f}x", ratio(t["np.memmap"], t[c])])
    print_table("Row reads from a cold cache (medians of interleaved rounds)",
                ["workload", "case", "ms", "read from disk", "disk / asked", "memmap time / case time"], rows,
                caption="disk bytes from /proc/self/io read_bytes; the store reads whole "
                        f"{fmt_bytes(CRC_BLOCK)} checksummed blocks")


def _open_workload(root: str, args) -> dict:
    from . import store_open

    sdir, empty = os.path.join(root, "open-store"), os.path.join(root, "open-empty")
    t0 = time.perf_counter()
    manifest = store_open.build(sdir, args.tensors)
    built = time.perf_counter() - t0
    store_open.build(empty, 0)
    return {"tensors": args.tensors, "manifest_bytes": manifest, "build_seconds": built,
            "opens": store_open.measure(sdir, args.rounds), "empty": store_open.measure(empty, args.rounds)}


def _open_report(r: dict) -> None:
    def median(opens: list[dict]) -> dict:
        return sorted(opens, key=lambda o: o["seconds"])[len(opens) // 2]
    full, empty = median(r["opens"]), median(r["empty"])
    n = r["tensors"]
    grew = (full["peak"] - full["rss_before"]) - (empty["peak"] - empty["rss_before"])  # bytes
    spent = full["seconds"] - empty["seconds"]
    print_table(f"(d) Store.open of {n} tensors (medians of {len(r['opens'])} opens, each in a fresh process)",
                ["manifest", "open seconds (CPU)", "peak RSS", "above an empty store's open", "per tensor"],
                [[fmt_bytes(r["manifest_bytes"]), f"{full['seconds']:.2f} ({full['cpu_seconds']:.2f})",
                  fmt_bytes(full["peak"]),
                  f"{spent:.2f} s, {fmt_bytes(grew)}", f"{spent / n * 1e6:.1f} us, {fmt_bytes(grew / n)}"]],
                caption="peak RSS: VmHWM during the open (reset after the import). An empty store's open (its "
                        "pinned pool, the engine's bounce buffers) is subtracted for the per-tensor cost")


def run(args) -> int:
    import torch

    root = tempfile.mkdtemp(prefix="tierstore-bench-store-", dir=args.dir)
    g = torch.Generator().manual_seed(0)
    results = {}
    try:
        workloads = []
        if args.only in (None, "small"):
            n = max(1, int(args.count * args.scale))
            lo, hi = math.log(4 << 10), math.log(1 << 20)
            sizes = [int(math.exp(lo + (hi - lo) * float(u))) // 4 * 4 for u in torch.rand(n, generator=g)]
            workloads.append(("small", {f"s{i}": torch.randn(b // 4, generator=g) for i, b in enumerate(sizes)}))
        if args.only in (None, "large"):
            nb = max(4096, int(args.size * (args.scale if args.only is None and args.scale != 1.0 else 1)))
            nb = nb // 4 * 4
            workloads.append(("large", {f"l{i}": torch.randn(nb // 4, generator=g) for i in range(args.large_count)}))
        with Progress((len(workloads) * 9 + (9 if args.only in (None, "rows") else 0)) * args.rounds,
                      "store bench") as progress:
            for name, tensors in workloads:
                progress.describe(f"{name}: {len(tensors)} tensors")
                results[name] = _workload(name, tensors, root, args, progress)
            if args.only in (None, "rows"):
                progress.describe("rows")
                results["rows"] = _rows_workload(root, args, progress)
            if args.only in (None, "open"):
                progress.describe(f"open: {args.tensors} tensors")
                results["open"] = _open_workload(root, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for name, r in results.items():
        if name in ("rows", "open"):
            continue
        b = r["bytes"]
        thr = {case: gib_s(b, smp.median) for case, smp in r["samples"].items()}  # GiB/s
        label = f"({'a' if name == 'small' else 'b'}) {r['tensors']} x ~{fmt_bytes(b / r['tensors'])}"
        cols = [("store put+flush", "engine write+fsync", "torch.save+fsync", "torch.save per file+fsync", "write"),
                ("store get (out=)", "engine read", "torch.load", "torch.load per file", "read into out="),
                ("store get", "engine read", "torch.load", "torch.load per file", "read, fresh tensors")]
        for case, eng_case, one, per, what in cols:
            rows.append([f"{label} {what}", f"{thr[case]:.2f}", f"{thr[eng_case]:.2f}", f"{thr[one]:.2f}",
                         f"{thr[per]:.2f}", ratio(thr[case], thr[eng_case]), ratio(thr[case], thr[one]),
                         ratio(thr[case], thr[per])])
    if "rows" in results:
        _rows_report(results["rows"])
    if "open" in results:
        _open_report(results["open"])
    if rows:
        print_table("Store vs raw engine vs torch.save/torch.load (GiB/s, medians of interleaved rounds)",
                    ["workload", "store", "engine", "torch 1 file", "torch file/tensor", "store/engine",
                     "store/torch 1 file", "store/torch file/tensor"], rows,
                    caption="targets: (a) store/torch >= 5x, (b) store/engine >= 0.9x")
    write_json(getattr(args, "json", None), {"benchmark": "store", "args": vars(args), "results": results})
    return 0
