"""One small plotting helper for the demo and the benchmarks: a column of line panels saved as a PNG next to
the JSON that holds the same figures. matplotlib is optional (``pip install tierstore[plot]``): without it
no PNG is written and the caller prints the note returned.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass
class Series:
    label: str
    x: list
    y: list
    style: str = "-"  # matplotlib format string: "-", "o-", "--" ...


@dataclass
class Panel:
    title: str
    ylabel: str
    series: list[Series] = field(default_factory=list)
    xlabel: str = ""
    logx: bool = False
    logy: bool = False
    hlines: list[tuple[float, str]] = field(default_factory=list)  # (y, label): a budget, a bound


def png_path(json_path: str | None, default: str | None) -> str | None:
    """The PNG next to `json_path` (same name, .png), or `default` when no JSON file is written."""
    if json_path and json_path != "-":
        return os.path.splitext(json_path)[0] + ".png"
    return default


def save_png(path: str | None, title: str, panels: list[Panel]) -> str:
    """Draw `panels` one under the other into `path`; returns a line saying where it went, or why not."""
    if not path:
        return "no PNG: give --json PATH to get one next to it"
    try:
        import matplotlib
    except ImportError:
        return "no PNG: matplotlib is not installed (pip install 'tierstore[plot]')"
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.8 * len(panels)), squeeze=False)
    for ax, p in zip(axes[:, 0], panels):
        for s in p.series:
            ax.plot(s.x, s.y, s.style, label=s.label, markersize=3)
        for y, label in p.hlines:
            ax.axhline(y, linestyle=":", color="grey")
            ax.annotate(label, (0.01, y), xycoords=("axes fraction", "data"), va="bottom", fontsize=8,
                        color="dimgrey")
        ax.set_title(p.title, fontsize=10)
        ax.set_ylabel(p.ylabel)
        ax.set_xlabel(p.xlabel)
        if p.logx:
            ax.set_xscale("log")
        if p.logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if len(p.series) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plot: {path}"
