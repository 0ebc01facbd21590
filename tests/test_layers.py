"""The store's layers import one way: Store -> residency -> placement -> tiers -> io, with the handle, the
manifest, zarr and encoding beside them, and no import circle -- not even one hidden under TYPE_CHECKING."""
from __future__ import annotations

import ast
import graphlib
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "tierstore")

# Each module may import only modules of a lower rank (and the leaves any module may use).
RANK = {
    "tierstore.store": 7,
    "tierstore.store_args": 6,
    "tierstore.tensor": 6,
    "tierstore.residency": 5,
    "tierstore.zarr_io": 4, "tierstore.manifest": 4, "tierstore.placement": 4,
    "tierstore.tiers": 3,  # the package and its modules
    "tierstore.encoding": 2,
    "tierstore.io": 1,
    "tierstore.errors": 0, "tierstore._units": 0, "tierstore._native": 0,
}
STORE_MODULES = ["tierstore.encoding", "tierstore.manifest", "tierstore.zarr_io", "tierstore.placement",
                 "tierstore.residency", "tierstore.tensor", "tierstore.store_args", "tierstore.store",
                 "tierstore.tiers", "tierstore.tiers.base", "tierstore.tiers.device", "tierstore.tiers.host",
                 "tierstore.tiers.nvme", "tierstore.io", "tierstore.io.engine", "tierstore.io.pieces",
                 "tierstore.io.backends", "tierstore.io.tune"]


def _rank(module: str) -> int | None:
    parts = module.split(".")
    while parts:
        r = RANK.get(".".join(parts))
        if r is not None:
            return r
        parts.pop()
    return None


def _imports(module: str) -> list[tuple[str, int]]:
    """Every tierstore module `module` imports (at any depth of its code, TYPE_CHECKING blocks included)."""
    rel = module.split(".")[1:]
    path = os.path.join(PKG, *rel) + ".py"
    is_pkg = not os.path.exists(path)
    if is_pkg:
        path = os.path.join(PKG, *rel, "__init__.py")
    package = module.split(".") if is_pkg else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            found += [(n, node.lineno) for n in names]
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
    return [(n, line) for n, line in found if n.startswith("tierstore")]


@pytest.mark.parametrize("module", STORE_MODULES)
def test_imports_only_go_down(module):
    own = _rank(module)

    def allowed(n: str) -> bool:
        r = _rank(n)
        same_package = any(n.startswith(pkg) and module.startswith(pkg) for pkg in ("tierstore.tiers", "tierstore.io"))
        return r is None or r < own or same_package
    up = [(n, line) for n, line in _imports(module) if not allowed(n)]
    assert not up, f"{module} imports a layer at or above its own: {up}"


@pytest.mark.parametrize("module", ["tierstore.residency", "tierstore.placement"])
def test_residency_knows_nothing_of_the_store_or_the_handle(module):
    names = {n for n, _line in _imports(module)}
    assert not {n for n in names if n.startswith(("tierstore.store", "tierstore.tensor", "tierstore.zarr_io"))}


CHILD = """
import importlib, sys, torch, numpy, traceback
failed = []
for m in sys.argv[1:]:
    for k in [k for k in sys.modules if k.startswith("tierstore")]:
        del sys.modules[k]
    try:
        importlib.import_module(m)
    except Exception:
        failed.append(m + ": " + traceback.format_exc(limit=3))
print("\\n".join(failed))
"""


def test_each_module_imports_alone():
    """Importing any store module first (nothing of tierstore loaded before it) works: no circle depends on
    the order modules happen to be imported in."""
    r = subprocess.run([sys.executable, "-c", CHILD, *STORE_MODULES], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout[-3000:] + r.stderr[-2000:]


@pytest.mark.parametrize("module", ["tierstore.demo", "tierstore.info", "tierstore.io.tune", "tierstore.gpt",
                                    "tierstore.plot", "tierstore._report"])
def test_the_commands_outside_bench_import_nothing_from_it(module):
    """`tierstore demo`, `info` and `tune` (and what they share with the benchmarks) stand on their own: the
    benchmarks import them, never the other way round."""
    from_bench = [(n, line) for n, line in _imports(module) if n == "tierstore.bench" or
                  n.startswith("tierstore.bench.")]
    assert not from_bench, f"{module} imports from tierstore.bench: {from_bench}"


# -- zero/: wings around a small core ---------------------------------------------------------------------------
# The core's leaves (configuration, process-group helpers, keys) at the bottom, then the wings, each one concern,
# then the optimizer that assembles them. A wing may import its own modules and anything ranked below it.
ZERO_RANK = {
    "tierstore.zero.params": 1,
    "tierstore.zero.hooks": 2,
    "tierstore.zero.step": 3,
    "tierstore.zero.checkpoint": 4,
    "tierstore.zero.inference": 5,
    "tierstore.zero.release": 5,
    "tierstore.zero.optimizer": 6, "tierstore.zero.ds_config": 7,
    "tierstore.zero": 8,  # the package's own __init__: the public names
}


def _modules(top: str = PKG) -> list[str]:
    """The dotted names of the modules and packages below `top`."""
    out = []
    for d, _dirs, names in os.walk(top):
        for n in names:
            if n.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, n), ROOT)[:-3].replace(os.sep, ".")
                out.append(rel[:-len(".__init__")] if rel.endswith(".__init__") else rel)
    return sorted(out)


MODULES = set(_modules())


def _module_of(name: str) -> str | None:
    """The tierstore module an imported name lives in (`tierstore.zero.params.init.Init` -> its module)."""
    parts = name.split(".")
    while parts and ".".join(parts) not in MODULES:
        parts.pop()
    return ".".join(parts) if parts else None


def _zero_place(module: str) -> tuple[int, str]:
    """(rank, wing) of a zero module; a core leaf (not named in ZERO_RANK) ranks 0, its wing is itself."""
    parts = module.split(".")
    for k in range(len(parts), 2, -1):
        r = ZERO_RANK.get(".".join(parts[:k]))
        if r is not None:
            return r, ".".join(parts[:k])
    return 0, module


@pytest.mark.parametrize("module", _modules(os.path.join(PKG, "zero")))
def test_zero_imports_only_go_down(module):
    own_rank, own_wing = _zero_place(module)
    up = []
    for name, line in _imports(module):
        target = _module_of(name)
        if target is None or not target.startswith("tierstore.zero.") or target == module:
            continue
        rank, wing = _zero_place(target)
        if (wing == own_wing and rank > 0) or target.startswith(module + "."):
            continue  # within one wing, or a package importing its own modules
        if rank < own_rank or (rank == own_rank == 0):
            continue  # below, or a core leaf using another core leaf (circles are caught below)
        up.append((name, line))
    assert not up, f"{module} imports a zero module at or above its own rank: {up}"


def test_no_import_circles_anywhere():
    """No circle among tierstore's modules, lazy imports and TYPE_CHECKING blocks included (a package's
    __init__ importing its own modules, and they it, is not one)."""
    graph = {m: {t for n, _ in _imports(m) if (t := _module_of(n)) and t != m and not m.startswith(t + ".")
                 and not t.startswith(m + ".")} for m in MODULES}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        raise AssertionError(f"import circle: {' -> '.join(e.args[1])}") from None
