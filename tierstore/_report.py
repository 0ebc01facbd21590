"""How the command line reports: sizes read from arguments ('256M'), byte counts for people, tables on
stdout, JSON files -- what `tierstore info`, `tierstore demo`, `tierstore tune` and the benchmarks share.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import asdict

from ._units import fmt_bytes

__all__ = ["fmt_bytes", "gib_s", "parse_size", "print_table", "size_arg", "write_json"]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30, "T": 1 << 40, "TB": 1 << 40, "TIB": 1 << 40}


def parse_size(text: str | int) -> int:
    """'256M', '1GiB', '4096', '1.5G' -> bytes (binary units)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"size {text!r} is not understood; write e.g. 4096, 256K, 64M, 2G")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def size_arg(text: str) -> int:
    """argparse type for sizes."""
    import argparse

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def gib_s(nbytes: int, seconds: float) -> float:
    """Throughput in GiB/s of `nbytes` moved in `seconds` (inf for no time)."""
    return nbytes / seconds / (1 << 30) if seconds > 0 else float("inf")


def print_table(title: str, columns: list[str], rows: Iterable[Iterable], caption: str | None = None) -> None:
    """A table on stdout (rich), every cell already formatted by the caller."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, caption=caption)
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*[str(x) for x in r])
    Console(width=max(100, len(columns) * 19)).print(table)


def write_json(path: str | None, payload: dict) -> None:
    if not path:
        return
    text = json.dumps(payload, indent=2, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o))
    if path == "-":
        print(text)
    else:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(text + "\n")
