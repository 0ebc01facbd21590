"""`tierstore bench store --only open`: what opening a store of many tensors costs -- seconds and the peak
memory of `Store.open` alone, measured in a fresh process (so neither the build nor an earlier case is
counted), next to the manifest's size.

The store holds `--tensors` tensors of 16 float32 each (a 64-byte tensor keeps a 4 KiB block of the
extent files, as any small tensor does), named like a model's parameters.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def build(sdir: str, n: int, progress=None) -> int:
    """A store of `n` small tensors at `sdir`, flushed; returns the manifest's size in bytes."""
    import torch

    from ..store import Store

    x = torch.zeros(16)
    with Store(sdir, budgets={"host": 0}) as s:
        for i in range(n):
            s.put(f"model.layers.{i // 8}.weight{i % 8}", x, "nvme")
    return os.path.getsize(os.path.join(sdir, "manifest.json"))


def _status(field: str) -> int:
    """A size field of /proc/self/status (VmRSS, VmHWM), bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # the kernel reports KiB
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(sdir: str) -> None:
    """In a fresh interpreter: import, reset the peak RSS to the current RSS, open the store read-only;
    print seconds (wall and CPU), the RSS before and the peak RSS during the open."""
    from ..store import Store

    try:  # 5: reset the peak RSS (VmHWM) to the current RSS, so the import's own peak is not counted
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    before = _status("VmRSS")
    t0, c0 = time.perf_counter(), time.process_time()
    s = Store.open(sdir, mode="r")
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = _status("VmHWM")
    n = len(s)
    s.close()
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "rss_before": before, "peak": max(peak, before),
                      "tensors": n}))


def measure(sdir: str, rounds: int) -> list[dict]:
    """`rounds` opens of the store at `sdir`, each in a fresh process."""
    out = []
    for _ in range(rounds):
        r = subprocess.run([sys.executable, "-m", "tierstore.bench.store_open", sdir], capture_output=True,
                           text=True, check=True, timeout=3600)
        out.append(json.loads(r.stdout.strip().splitlines()[-1]))
    return out


if __name__ == "__main__":
    child(sys.argv[1])
