"""Byte counts for people: the one formatter every layer uses in messages, summaries and tables."""
from __future__ import annotations


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units; whole bytes below 1 KiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
