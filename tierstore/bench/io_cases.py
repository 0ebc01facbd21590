"""The cases `tierstore bench io` times: our engine, fio and DeepSpeed's aio over the same bytes (sequential),
and the workloads built from them -- random 4 KiB requests, a read and a write at once (mixed) and 20,000
small requests (the memory paths a user meets: io_paths.py). io.py runs them A B A B and reports.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import time
from collections.abc import Callable


class CpuClock:
    """Wraps cases so each also records the CPU seconds (user + system, every thread of this process) it used."""

    def __init__(self):
        self.seconds: dict[str, list[float]] = {}

    def wrap(self, name: str, fn: Callable[[], float | None]) -> Callable[[], float]:
        def run() -> float:
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            r = fn()
            dt, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
            self.seconds.setdefault(name, []).append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
            return dt if r is None else float(r)
        return run


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


def fio_cmd(path: str, op: str, engine: str, bs: int, qd: int, size: int, *extra: str) -> list[str]:
    """The fio command line of one job (op: read, write, randread, randwrite), JSON output."""
    return ["fio", "--name=tierstore-ref", f"--filename={path}", f"--rw={op}", f"--bs={bs}", f"--iodepth={qd}",
            f"--ioengine={engine}", "--direct=1", f"--size={size}", "--output-format=json", "--thread",
            "--group_reporting", *extra]


def fio_job(cmd: list[str]) -> dict:
    """Run one fio job; its JSON report ("jobs"[0])."""
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out[out.index("{"):])["jobs"][0]


def fio_cpu_seconds(job: dict) -> float:
    """fio's own CPU figure: usr+sys percent of the job's runtime, in seconds."""
    runtime = max(job[d]["runtime"] for d in ("read", "write")) / 1e3  # s
    return (job["usr_cpu"] + job["sys_cpu"]) / 100 * runtime


def fio_run(path: str, op: str, engine: str, bs: int, qd: int, size: int) -> float:
    """fio's own bandwidth figure (bytes/s) for one job; its ramp-up and layout are not in it."""
    job = fio_job(fio_cmd(path, op, engine, bs, qd, size))[op]
    return job["io_bytes"] / (job["runtime"] / 1e3) if job["runtime"] else float("nan")


def fio_wall(jobs: list[tuple[str, str]], engine: str, bs: int, qd: int, size: int) -> float:
    """Seconds fio's slowest job took (its own runtime figure), the jobs [(path, "read" | "write")] running at
    the same time, each moving `size` bytes."""
    out = subprocess.run(fio_wall_cmd(jobs, engine, bs, qd, size), capture_output=True, text=True, check=True).stdout
    res = json.loads(out[out.index("{"):])["jobs"]
    return max(j[op]["runtime"] for j, (_p, op) in zip(res, jobs)) / 1e3


def fio_wall_cmd(jobs: list[tuple[str, str]], engine: str, bs: int, qd: int, size: int) -> list[str]:
    cmd = ["fio", "--output-format=json", "--thread", f"--ioengine={engine}", "--direct=1", f"--bs={bs}",
           f"--iodepth={qd}", f"--size={size}"]
    for i, (path, op) in enumerate(jobs):
        cmd += [f"--name=job{i}", f"--filename={path}", f"--rw={op}"]
    return cmd


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


def rand_info(name: str, smp, jobs: list[dict] | None, lats: list[float] | None, nrand: int) -> dict:
    """IOPS (qd 32 cases) or p50/p99 latency in µs (qd 1 cases) of a random-4 KiB case, median over rounds."""
    import statistics

    if jobs:  # fio: its own figures
        out: dict = {}
        if name.endswith("qd1"):
            lat = [j["read"].get("lat_ns", {}).get("percentile") or j["read"]["clat_ns"]["percentile"] for j in jobs]
            out["p50_us"] = statistics.median(p["50.000000"] for p in lat) / 1e3
            out["p99_us"] = statistics.median(p["99.000000"] for p in lat) / 1e3
        else:
            d = "read" if "randread" in name else "write"
            out["iops"] = statistics.median(j[d]["iops"] for j in jobs)
        return out
    if name.endswith("qd1"):
        lats = sorted(lats or [])
        return {"p50_us": lats[len(lats) // 2], "p99_us": lats[min(len(lats) - 1, int(len(lats) * 0.99))]} \
            if lats else {}
    return {"iops": nrand / smp.median}


def random_workload(path: str, size: int, buf, backends: list[str], nrand: int, nlat: int, closers: list,
                    latencies: dict[str, list[float]]) -> dict:
    """Random 4 KiB cases on `path`: read_many / write_many of `nrand` requests at qd 32 (IOPS) and `nlat` reads
    one at a time (latency), into/from 4 KiB slots of the pool buffer `buf`."""
    import numpy as np

    from ..io import Engine

    rng = np.random.default_rng(3)
    pages = size // 4096
    slots = buf.nbytes // 4096
    offs = (rng.integers(0, pages, nrand) * 4096).tolist()
    lat_offs = (rng.integers(0, pages, nlat) * 4096).tolist()
    t = buf.tensor()
    cases: dict = {}
    for be in backends[:1]:  # the backend the store uses
        eng = Engine(backend=be, queue_depth=32)
        eng.register_pool(buf.pool)
        f = eng.open(path, "r+")
        closers.append(eng.close)
        reqs = [(t[(i % slots) * 4096:(i % slots + 1) * 4096], o) for i, o in enumerate(offs)]

        def rread(eng=eng, f=f, reqs=reqs) -> None:
            eng.read_many(f, reqs).result()

        def rwrite(eng=eng, f=f, reqs=reqs) -> None:
            eng.write_many(f, reqs).result()

        name = f"tierstore/{be} randread qd1"
        lat = latencies.setdefault(name, [])  # µs, every round's

        def latency(eng=eng, f=f, one=t[:4096], lat=lat) -> float:
            t0 = time.perf_counter()
            for o in lat_offs:
                s0 = time.perf_counter()
                eng.read(f, one, o).result()
                lat.append((time.perf_counter() - s0) * 1e6)
            return time.perf_counter() - t0
        cases[f"tierstore/{be} randread qd32"] = rread
        cases[f"tierstore/{be} randwrite qd32"] = rwrite
        cases[name] = latency
    return cases


def mixed_workload(rpath: str, wpath: str, size: int, rbuf, wbuf, backends: list[str], closers: list,
                   cpu: CpuClock) -> dict:
    """Reading `rpath` and writing `wpath` at once, 1 MiB requests at qd 32, from two pool buffers."""
    from ..io import Engine

    cases: dict = {}
    for be in backends[:1]:
        eng = Engine(backend=be, queue_depth=32)
        eng.register_pool(rbuf.pool)
        fr, fw = eng.open(rpath, "r+"), eng.open(wpath, "r+")
        closers.append(eng.close)

        def both(eng=eng, fr=fr, fw=fw):
            for off in range(0, size, rbuf.nbytes):
                eng.read(fr, rbuf, off)
                eng.write(fw, wbuf, off)
            eng.wait_all()
        name = f"tierstore/{be} read+write"
        cases[name] = cpu.wrap(name, both)
    return cases


def small_workload(work: str, count: int, backends: list[str], ds):
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
    if ds is not None:
        cases.update(ds.small_cases())
    closers.append(buf.release)
    closers.append(pool.close)
    return cases, {"count": count, "bytes": total, "closers": closers}
