"""Every design-note reference resolves: a `[Note: name]` cited anywhere names a Note defined somewhere, and
one cited as `[Note: name] in path` is defined in that file. A Note is defined where its bracket opens a
line (after indentation and comment markers) and its text follows: a title that a wrapped sentence happens to
put at a line's start is a citation -- one followed by "in path", "(path)" or punctuation, or one the
previous line leads into ("see", "and", an open parenthesis ...). Names may wrap across lines."""
from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("tierstore", "tests", "docs", "bench", "native")
_NOTE = re.compile(r"\[Note: ([^\]]+)\]")
_IN_PATH = re.compile(r"\]\s+in\s+([\w./-]+\.(?:py|md|c|h))")
# after a title at a line's start: what makes it a citation -- "in path", "(path)", or punctuation closing the
# sentence or parenthesis it sits in (a definition's title is followed by its text, or by nothing on its line)
_CITED_AFTER = re.compile(r"\s+in\s+[\w./-]+\.(?:py|md|c|h)\b|\s*\([\w./-]+\.(?:py|md|c|h)\)|[.,;)]")
# the end of the previous line leading into the title: "see", "(see", "and", "in", "of", "'s", "(", "," ...
_LEADS_IN = re.compile(r"(?:\b(?:see|cf\.|and|or|in|by|per|with|of|the|under|from)|'s|[(,;])\s*$", re.I)


def _files():
    for top in SOURCES:
        for d, _dirs, names in os.walk(os.path.join(ROOT, top)):
            for n in names:
                if n.endswith((".py", ".md", ".c", ".h")) and n != os.path.basename(__file__):
                    yield os.path.join(d, n)
    yield os.path.join(ROOT, "README.md")


def _scan(path: str):
    """(definitions, [(name, cited path or None, line)]) of one file."""
    lines = open(path, encoding="utf-8").read().splitlines()
    # one text with comment markers gone and lines joined, remembering where each line starts
    text, starts = "", []
    for ln in lines:
        starts.append(len(text))
        text += re.sub(r"^\s*(#+|//|/?\*+)?\s*", "", ln) + " "
    defs, refs = set(), []
    for m in _NOTE.finditer(text):
        name = " ".join(m.group(1).split())
        line = next(k for k in range(len(starts) - 1, -1, -1) if starts[k] <= m.start()) + 1
        if m.start() in starts and _defines(text, starts, line - 1, m.end()):
            defs.add(name)
            continue
        cited = _IN_PATH.match(text, m.end() - 1)
        refs.append((name, cited.group(1) if cited else None, line))
    return defs, refs


def _defines(text: str, starts: list[int], k: int, end: int) -> bool:
    """Whether the title that opens line k (ending at `end`) defines its Note rather than cites it."""
    if _CITED_AFTER.match(text, end):
        return False
    prev = text[starts[k - 1]:starts[k]] if k else ""
    return not _LEADS_IN.search(prev)


def _resolve(cited: str, by_file: dict[str, set[str]]) -> list[str]:
    """The scanned files a citation like 'tiers/nvme/writes.py' or 'store.py' can mean."""
    return [f for f in by_file if f.endswith("/" + cited) or f == cited]


def test_every_note_reference_resolves():
    by_file, refs = {}, []
    for f in _files():
        rel = os.path.relpath(f, ROOT)
        defs, rs = _scan(f)
        by_file[rel] = defs
        refs += [(rel, *r) for r in rs]
    everywhere = set().union(*by_file.values())
    assert len(everywhere) > 40, "the scan found too few Notes: the pattern is broken"
    bad = []
    for where, name, cited, line in refs:
        if cited is None:
            if name not in everywhere:
                bad.append(f"{where}:{line}: [Note: {name}] is defined nowhere")
            continue
        targets = _resolve(cited, by_file)
        if not targets:
            bad.append(f"{where}:{line}: [Note: {name}] cites {cited}, which does not exist")
        elif not any(name in by_file[t] for t in targets):
            homes = sorted(f for f, d in by_file.items() if name in d) or ["nowhere"]
            bad.append(f"{where}:{line}: [Note: {name}] is not in {cited} (defined in {', '.join(homes)})")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("text, ok", [
    ("[Note: a thing]\nbody\n\nsee [Note: a thing]\n", True),
    ("see [Note: missing]\n", False),
    ("# [Note: wrapped\n# name]\n# body\nx = 1  # [Note: wrapped name]\n", True),
])
def test_the_scan_itself(tmp_path, text, ok):
    p = tmp_path / "f.py"
    p.write_text(text)
    defs, refs = _scan(str(p))
    assert all(name in defs for name, _c, _l in refs) is ok


@pytest.mark.parametrize("text, defines", [
    ("# [Note: a thing]\n# body\n", True),
    ("# [Note: a thing] Its text on the same line.\n", True),
    ("x = f()\n# [Note: a thing]: its text after a colon.\n", True),
    ("y = 2\n\n# [Note: a\n# thing]\n# body\n", True),
    # a citation that wrapping puts at a line's start
    ("# the reason is told there, see\n# [Note: a thing] in other.py.\n", False),
    ("# why: see\n# [Note: a thing] in other.py, which says it.\n", False),
    ("# the reason is told there (see\n# [Note: a thing]).\n", False),
    ("# as the step does, see\n# [Note: a thing].\n", False),
    ("# both [Note: other thing] and\n# [Note: a thing] say why.\n", False),
    ("x = 1\n# [Note: a thing] (other.py): why x is 1.\n", False),
    ("x = 1\n# [Note: a thing] in other.py: why x is 1.\n", False),
])
def test_a_title_wrapped_to_a_line_start_is_not_a_definition(tmp_path, text, defines):
    """A definition is a title opening a comment line, followed by its text; a citation that wrapping puts at
    the start of a line ("see" before it, "in file.py" or closing punctuation after it) defines nothing."""
    p = tmp_path / "f.py"
    p.write_text(text)
    defs, _refs = _scan(str(p))
    assert ("a thing" in defs) is defines
