"""README's python code blocks run as written (each in a fresh namespace, in a temporary working directory:
the examples keep their files under ./ts-data)."""
from __future__ import annotations

import os
import re

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _blocks() -> list[str]:
    with open(README) as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), flags=re.S | re.M)


def test_readme_has_the_three_examples():
    assert len(_blocks()) == 3


@pytest.mark.parametrize("index", range(len(_blocks())))
def test_readme_example_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = _blocks()[index]
    exec(compile(code, f"README.md python block {index + 1}", "exec"), {"__name__": "__readme__"})
    assert (tmp_path / "ts-data").is_dir()  # it worked where it says, not somewhere else


def _layout() -> tuple[set[str], set[str]]:
    """(packages, modules) the README's Layout block names. A line that starts with ``tierstore.../`` names a
    package; the indented lines under it name its modules, as the leading words ending in ``.py``."""
    with open(README) as f:
        text = f.read()
    section = text.split("\n## Layout\n", 1)[1]
    block = re.search(r"^```\n(.*?)^```", section, flags=re.S | re.M).group(1)
    packages, modules, current = set(), set(), None
    for line in block.splitlines():
        words = line.split()
        if not words:
            continue
        if not line[0].isspace():
            current = words[0] if words[0].startswith("tierstore") and words[0].endswith("/") else None
            if current:
                packages.add(current)
            continue
        assert current, f"README Layout: {line.strip()!r} is indented under no tierstore package"
        for w in words:
            if not w.endswith(".py"):
                break
            modules.add(current + w)
    return packages, modules


def _package_files() -> tuple[set[str], set[str]]:
    """(packages, modules) on disk: every directory of tierstore/ with an __init__.py, every .py file in one."""
    root = os.path.dirname(README)
    packages, modules = set(), set()
    for d, dirs, names in os.walk(os.path.join(root, "tierstore")):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        if "__init__.py" not in names:
            continue
        rel = os.path.relpath(d, root).replace(os.sep, "/") + "/"
        packages.add(rel)
        modules |= {rel + n for n in names if n.endswith(".py")}
    return packages, modules


def test_readme_layout_names_every_module():
    """The Layout section lists each package of tierstore/ and each of its modules, and nothing that is not
    there (an ``__init__.py`` may be left out: the package line stands for it)."""
    named_pkgs, named_mods = _layout()
    pkgs, mods = _package_files()
    assert named_pkgs == pkgs, f"missing: {sorted(pkgs - named_pkgs)}; not on disk: {sorted(named_pkgs - pkgs)}"
    missing = sorted(m for m in mods - named_mods if not m.endswith("/__init__.py"))
    assert not missing, f"README Layout does not name {missing}"
    assert not named_mods - mods, f"README Layout names files that do not exist: {sorted(named_mods - mods)}"
