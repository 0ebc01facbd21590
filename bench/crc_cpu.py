"""CPU seconds per GiB of Store.put (aligned tensor, nvme tier, until written) and get(out=), with the checksum
computed by tierstore.io.checksum's native crc32c and by the crc32c package, alternated round by round:

    python bench/crc_cpu.py --dir bench-data/crc-cpu

Prints the medians over the rounds (CPU from os.times(): whole process, 10 ms ticks, so the transfers are
large). Needs native/crc.c's folding on this CPU (`tierstore info`, row crc32c); otherwise both cases are the
package and the script says so.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tierstore import Store  # noqa: E402
from tierstore.io import checksum  # noqa: E402
from tierstore.tiers.host import aligned_empty  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="bench-data/crc-cpu")
    ap.add_argument("--mib", type=int, default=115, help="MiB per tensor (3 tensors a round)")
    ap.add_argument("--rounds", type=int, default=8)
    a = ap.parse_args()
    native = checksum._native_crc
    if native is None:
        print(f"the checksum is the crc32c package here ({checksum.implementation()}): nothing to compare")
        return 2
    n = a.mib << 20
    srcs = [aligned_empty(n, lock=False).view(torch.float32).normal_() for _ in range(3)]
    out = aligned_empty(n, lock=False).view(torch.float32).zero_()
    gib = 3 * n / 2**30
    res: dict[str, tuple[list[float], list[float]]] = {"native": ([], []), "crc32c package": ([], [])}

    def cpu() -> float:
        t = os.times()
        return t.user + t.system
    with Store(a.dir, budgets={"host": 0}) as s:
        for _ in range(a.rounds):
            for which, (put, get) in res.items():
                checksum._native_crc = native if which == "native" else None
                c0 = cpu()
                for i, t in enumerate(srcs):
                    s.put(f"x{i}", t, tier="nvme", lend=lambda: None)
                for i in range(3):
                    s.tensor(f"x{i}").wait_written()
                c1 = cpu()
                for i in range(3):
                    s.get(f"x{i}", out=out)
                c2 = cpu()
                assert torch.equal(out, srcs[-1])  # what was read is what was written (outside the timing)
                put.append((c1 - c0) / gib)
                get.append((c2 - c1) / gib)
    checksum._native_crc = native
    print(f"{a.rounds} rounds of 3 x {a.mib} MiB, alternated; load average {os.getloadavg()[0]:.2f}")
    for which, (put, get) in res.items():
        print(f"  {which:15s} put CPU s/GiB {statistics.median(put):.3f}   "
              f"get(out=) CPU s/GiB {statistics.median(get):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
