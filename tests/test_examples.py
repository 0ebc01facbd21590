"""Every script under examples/ runs as documented (docs/integrations.md), at a small size, so they stay runnable.
Each checks its own result (a resumed run equal to the uninterrupted one, data read back equal) and exits non-zero
otherwise."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(tmp_path, *cmd: str) -> str:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    # its own process group, killed whole on a timeout: torchrun's workers must not outlive a stuck run
    p = subprocess.Popen([sys.executable, *cmd, "--dir", str(tmp_path / "data")], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"{' '.join(cmd)} ran past 240 s (killed with its workers): {out[-3000:]}{err[-3000:]}")
    assert p.returncode == 0, out[-3000:] + err[-3000:]
    return out


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


def test_generate_big_example_tiny(tmp_path):
    pytest.importorskip("transformers")
    out = run(tmp_path, "examples/generate_big.py", "--size", "4M", "--tokens", "3", "--budget", "2M", "--check")
    assert "tokens/s" in out and "same tokens as the model built in memory: True" in out


def test_trainer_under_torchrun_two_processes(tmp_path):
    pytest.importorskip("transformers")
    out = run(tmp_path, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
              "examples/trainer_ddp.py", "--steps", "4")
    assert "world 2: trained 4 steps, global batch 8" in out and "world 2: resumed run equal: True" in out
