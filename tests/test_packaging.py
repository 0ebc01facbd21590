"""What an install ships besides the modules: the PEP 561 marker, so users' type checkers read tierstore's
annotations (built with setuptools' build_py, as pip does, without compiling the native core)."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_py_typed_ships_with_the_package(tmp_path):
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)], cwd=ROOT,
                   check=True, capture_output=True)
    assert (tmp_path / "tierstore" / "py.typed").is_file()
    assert (tmp_path / "tierstore" / "typing.py").is_file()
