"""Every script under examples/ runs as documented (docs/integrations.md), at a small size, so they stay runnable.
Each checks its own result (a resumed run equal to the uninterrupted one, data read back equal) and exits non-zero
otherwise."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(tmp_path, *cmd: str) -> str:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, *cmd, "--dir", str(tmp_path / "data")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_store_basics(tmp_path):
    out = run(tmp_path, "examples/store_basics.py", "--mib", "8")
    assert "read back equal through prefetch" in out and "reopened: layer7.weight equal" in out


def test_torchrun_two_processes(tmp_path):
    out = run(tmp_path, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
              "examples/torchrun_train.py", "--steps", "3")
    assert "step 3:" in out and "world 2: checkpoint" in out


def test_trainer_example(tmp_path):
    pytest.importorskip("transformers")
    out = run(tmp_path, "examples/trainer_gpt2.py", "--steps", "4")
    assert "resumed run equal: True" in out


def test_accelerate_example(tmp_path):
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    out = run(tmp_path, "examples/accelerate_gpt2.py", "--steps", "4")
    assert "resumed from save_state equal: True" in out
