"""`bench io`'s DeepSpeed aio reference runs in the DeepSpeed venv's Python, as a worker process
(tierstore/bench/_ds_aio_case.py): its protocol end to end against a stand-in `deepspeed` package whose aio
handle does plain file I/O (no DeepSpeed needed), and the message when no DeepSpeed venv is there."""
from __future__ import annotations

import os
import sys
import textwrap

import pytest

from tierstore.bench import _ds_aio_case, steps
from tierstore.bench._ds_aio_case import DeepSpeedAio

FAKE_OP = '''
import torch

calls = []


class Handle:
    def __init__(self, *args):
        self.args = args

    def new_cpu_locked_tensor(self, n, like):
        return torch.empty(n, dtype=torch.uint8)

    def free_cpu_locked_tensor(self, t):
        pass

    def sync_pwrite(self, t, path):
        with open(path, "r+b" if __import__("os").path.exists(path) else "wb") as f:
            f.write(t.numpy().tobytes())

    def sync_pread(self, t, path):
        with open(path, "rb") as f:
            data = f.read(t.numel())
        t[:len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def async_pwrite(self, t, path, offset):
        mode = "r+b" if __import__("os").path.exists(path) else "wb"
        with open(path, mode) as f:
            f.seek(offset)
            f.write(t.numpy().tobytes())

    def async_pread(self, t, path, offset):
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(t.numel())
        t.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def wait(self):
        return 0


class Module:
    aio_handle = Handle


class AsyncIOBuilder:
    def is_compatible(self, verbose=False):
        return COMPATIBLE

    def load(self, verbose=False):
        return Module()
'''


def fake_deepspeed(root, compatible: bool) -> str:
    """A `deepspeed` package with only what the worker uses, and a python that finds it first."""
    pkg = root / "site" / "deepspeed"
    (pkg / "ops" / "op_builder").mkdir(parents=True)
    (pkg / "__init__.py").write_text("__version__ = '0.0-stand-in'\n")
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "ops" / "op_builder" / "__init__.py").write_text(f"COMPATIBLE = {compatible}\n" + FAKE_OP)
    py = root / "python"
    site = root / "site"
    py.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        PYTHONPATH={site}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} "$@"
        """))
    py.chmod(0o755)
    return str(py)


def test_the_worker_times_sequential_and_small_requests_in_its_own_process(tmp_path):
    py = fake_deepspeed(tmp_path, compatible=True)
    work = tmp_path / "work"
    work.mkdir()
    seq = work / "seq.bin"
    seq.write_bytes(b"\0" * (1 << 20))
    sizes = [4096, 8192, 4096 * 3]
    ds, why = DeepSpeedAio.start(str(work), str(seq), 1 << 20, [(1 << 18, 8)], sizes, python=py, timeout=120)
    assert ds is not None, why
    assert "0.0-stand-in" in why
    try:
        cases = {"w": ds.case("seq", "write", 1 << 18, 8), "r": ds.case("seq", "read", 1 << 18, 8),
                 **ds.small_cases()}
        assert set(ds.small_cases()) == set(_ds_aio_case.SMALL_CASES)
        for fn in cases.values():
            assert 0 <= fn() < 60
        assert seq.read_bytes() == b"\xa5" * (1 << 20)  # it wrote its page-locked buffer over the file
        files = sorted(os.listdir(work / "ds-files"))
        assert len(files) == len(sizes)  # one file per tensor, as DeepSpeed's swapper lays them out
        assert os.path.getsize(work / "packed-ds.bin") == sum(sizes)
        with pytest.raises(RuntimeError, match="unknown request"):
            ds.request(["zero9"])
    finally:
        ds.close()
    assert ds.worker.proc.poll() is not None  # it ended


def test_the_worker_says_why_when_the_aio_op_cannot_load(tmp_path):
    py = fake_deepspeed(tmp_path, compatible=False)
    ds, why = DeepSpeedAio.start(str(tmp_path), str(tmp_path / "seq.bin"), 1 << 20, [], [], python=py,
                                 timeout=120)
    assert ds is None and "libaio" in why


def test_no_deepspeed_venv_names_the_install(tmp_path):
    ds, why = DeepSpeedAio.start(str(tmp_path), str(tmp_path / "seq.bin"), 1 << 20, [], [],
                                 python=str(tmp_path / "absent" / "python"))
    assert ds is None and steps.DS_INSTALL in why


def test_bench_io_gets_its_deepspeed_column_from_the_deepspeed_venv(tmp_path, monkeypatch):
    import json

    from tierstore.cli import main
    monkeypatch.setenv("TIERSTORE_DS_PYTHON", fake_deepspeed(tmp_path, compatible=True))
    out = tmp_path / "io.json"
    rc = main(["bench", "io", "--dir", str(tmp_path / "d"), "--size", "8M", "--block-sizes", "1M",
               "--queue-depths", "4", "--rounds", "1", "--small-count", "64", "--random-count", "64",
               "--latency-count", "20", "--no-fio", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert all(row["deepspeed_gib_s"] > 0 for row in res["sequential"])
    assert all(res["small"][name]["requests_per_s"] > 0 for name in _ds_aio_case.SMALL_CASES)
