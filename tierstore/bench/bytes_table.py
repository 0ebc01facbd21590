"""The bytes per parameter per step of `bench optim` and `bench train`, two counts side by side: the kernel's
(read_bytes / write_bytes of /proc/self/io in each case's own process, the storage bytes it caused: O_DIRECT
counts at submission, the page cache's hits not at all) and the store's own by kind (OptimizerStats.disk_read
/ disk_written: params, grads, master, states). The DeepSpeed cases have only the kernel's count; a tierstore
case whose two totals differ moves bytes its own count does not name (or the kernel counts what the store
did not ask for).
"""
from __future__ import annotations

from ._common import print_table


def kinds_of(by: dict[str, dict]) -> list[str]:
    """The kinds any case counted (disk_read_<kind> / disk_written_<kind>), in a stable order."""
    order = ["params", "grads", "master", "states"]
    got = {k.split("_", 2)[2] for b in by.values() for k in b if k.startswith(("disk_read_", "disk_written_"))}
    return [k for k in order if k in got] + sorted(got - set(order))


def per_param(by: dict[str, dict], nparams: int) -> dict[str, dict[str, float]]:
    """Each case's median bytes per step (`by`: case -> {key: bytes}) divided by the parameter count."""
    return {c: {k: v / nparams for k, v in b.items()} for c, b in by.items()} if nparams else {}


def rows(by: dict[str, dict], nparams: int, labels: dict[str, str]) -> tuple[list[str], list[list[str]]]:
    """(columns, rows): case, kernel read + written, store read + written, then read|written per kind, for
    each case that has a count."""
    kinds = kinds_of(by)
    out = []
    for c, b in by.items():
        if "kernel_read" not in b and not any(k.startswith("disk_") for k in b):
            continue
        kr, kw = b.get("kernel_read"), b.get("kernel_written")
        kernel = "-" if kr is None or kw is None else \
            f"{kr / nparams:.2f} + {kw / nparams:.2f} = {(kr + kw) / nparams:.2f}"
        counted = [k for k in kinds if f"disk_read_{k}" in b or f"disk_written_{k}" in b]
        sr = sum(b.get(f"disk_read_{k}", 0) for k in counted)
        sw = sum(b.get(f"disk_written_{k}", 0) for k in counted)
        store = f"{sr / nparams:.2f} + {sw / nparams:.2f} = {(sr + sw) / nparams:.2f}" if counted else "-"
        per_kind = [f"{b.get(f'disk_read_{k}', 0) / nparams:.2f}|{b.get(f'disk_written_{k}', 0) / nparams:.2f}"
                    if k in counted else "-" for k in kinds]
        out.append([labels.get(c, c), kernel, store, *per_kind])
    return ["case", "kernel (/proc/self/io)", "store (its own count)", *(f"store: {k} r|w" for k in kinds)], out


def print_bytes_table(title: str, by: dict[str, dict], nparams: int, labels: dict[str, str]) -> None:
    cols, r = rows(by, nparams, labels) if nparams else ([], [])
    if r:
        print_table(f"{title}: bytes per parameter per step (medians), read + written", cols, r,
                    caption="kernel: read_bytes / write_bytes of the case's own process; store: "
                            "OptimizerStats.disk_read / disk_written, by kind (DeepSpeed keeps none)")
