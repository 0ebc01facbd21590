"""The OffloadConfig reference in docs/zero.md, generated from the fields' own metadata (config.py's ``knob``)
and MEMORY_BOUNDS, so the docs cannot drift from the code: ``reference_table()`` is the markdown between the
markers BEGIN and END in docs/zero.md (tests/zero/test_config_docs.py compares them), and

    python -m tierstore.zero.config_docs --write docs/zero.md

rewrites that region in place (without --write: prints it).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from .config import GROUPS, MEMORY_BOUNDS, OffloadConfig, show

BEGIN = "<!-- offload-config:begin -->"
END = "<!-- offload-config:end -->"
REGENERATE = "python -m tierstore.zero.config_docs --write docs/zero.md"


def _default(f: dataclasses.Field) -> str:
    if f.metadata["shown"] is not None:
        return f.metadata["shown"]
    return show(f.name, f.default)


def reference_table() -> str:
    """OffloadConfig's fields as one markdown table, a heading row a group (GROUPS' order, fields in declaration
    order), then the memory bounds, each once ([Note: memory bounds] in config.py). Ends with a newline."""
    fields = dataclasses.fields(OffloadConfig)
    out = [f"<!-- generated from OffloadConfig's field metadata (tierstore/zero/config.py); to regenerate: "
           f"{REGENERATE} -->", "", "| field | default | meaning |", "|---|---|---|"]
    for group, title in GROUPS.items():
        rows = [f for f in fields if f.metadata["group"] == group]
        if not rows:
            continue
        note = ": all a first run needs; every other default is the one to start from" if group == "tiers" else ""
        out.append(f"| **{title}**{note} | | |")
        for f in rows:
            bound = f.metadata["bound"]
            sets = f" Sets the *{bound}* memory bound." if bound else ""
            out.append(f"| `{f.name}` | `{_default(f)}` | {f.metadata['doc']}.{sets} |")
    out.append("")
    out += ["**Memory bounds** ([Note: memory bounds] in config.py): each bound once, the knobs that set it and "
            "everything it covers; `config.describe()` shows what they come to for a config.", ""]
    for name, b in MEMORY_BOUNDS.items():
        out.append(f"- *{name}*, `{b.sets}`: {b.what}.")
        out += [f"  - {c}." for c in b.covers]
    return "\n".join(out) + "\n"


def region(text: str) -> str:
    """What lies between the markers in `text` (a ValueError when they are missing or out of order)."""
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise ValueError(f"the markers {BEGIN} ... {END} are missing or out of order")
    return text[i + len(BEGIN):j].strip("\n") + "\n"


def with_table(text: str) -> str:
    """`text` with the region between the markers replaced by reference_table()."""
    region(text)  # the markers are there
    i, j = text.find(BEGIN) + len(BEGIN), text.find(END)
    return text[:i] + "\n" + reference_table() + text[j:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tierstore.zero.config_docs", description=__doc__.split("\n")[0])
    ap.add_argument("--write", metavar="MARKDOWN", help="rewrite the region between the markers in this file")
    a = ap.parse_args(argv)
    if a.write is None:
        sys.stdout.write(reference_table())
        return 0
    with open(a.write, encoding="utf-8") as f:
        text = f.read()
    new = with_table(text)
    if new != text:
        with open(a.write, "w", encoding="utf-8") as f:
            f.write(new)
    print(f"{a.write}: {'rewritten' if new != text else 'up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
