"""The accelerator run's dry run (`make bench-device DEVICE_DRY=1`): tierstore/bench/device.py with tiny sizes and
the CPU standing in for the accelerator writes every case with every field, and bench/device.sh is valid shell.
The run on an accelerator itself is bench/README.md's, "Accelerator checks"."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tierstore.bench._device_case import CASES
from tierstore.bench.device import FIELDS, TARGETS, Worker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_device_script_is_valid_bash():
    subprocess.run(["bash", "-n", os.path.join(ROOT, "bench", "device.sh")], check=True)


def test_a_silent_case_process_is_ended_at_its_time_limit(tmp_path):
    """A case that hangs cannot hold the run past its budget: the wait ends, the process is killed."""
    w = Worker("hangs", [sys.executable, "-c", "import sys, time; print('chatter', flush=True); time.sleep(60)"],
               dict(os.environ), str(tmp_path / "log"))
    with pytest.raises(RuntimeError, match="within 1 s"):
        w.ask(None, 1.0)
    assert w.proc.poll() is not None


@pytest.mark.slow
def test_dry_run_writes_every_case_and_field(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "tierstore.bench.device", "--dry-run", "--rounds", "1", "--out",
                        str(out), "--dir", str(tmp_path / "data"), "--budget", "150"],
                       cwd=ROOT, capture_output=True, text=True, timeout=240,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((out / "device.json").read_text())
    assert result["dry_run"] and result["rounds_done"] == 1 and result["params"] > 0
    assert set(result["cases"]) == set(CASES)
    for name, c in result["cases"].items():
        if CASES[name]["kind"] == "ds":  # DeepSpeed runs on an accelerator only
            assert c["status"] == "skipped" and c["reason"], c
            continue
        assert c["status"] == "ok", (name, c.get("reason"))
        assert not [f for f in FIELDS if f not in c], name
        assert c["median"]["full"] > 0 and c["tokens_per_s"] > 0 and c["vs_torch"] > 0
        b = c["bytes_per_param_per_step"]
        assert {"nvme_read", "nvme_written"} <= set(b["proc_io"])
        if CASES[name].get("params") == "nvme":  # the store's count by kind, and the raw engine moving its bytes
            assert b["store"]["nvme_read"] > 0 and b["store"]["disk_written_states"] > 0
            assert c["raw_engine_s"] > 0 and c["vs_raw_engine"] > 0
    assert result["cases"]["torch"]["vs_torch"] == 1.0
    assert {t["target"] for t in result["targets"]} == set(TARGETS)
    assert all(t["value"] is not None for t in result["targets"])
    text = (out / "device.txt").read_text()
    assert all(name in text for name in CASES) and "target host tokens/s vs torch" in text
