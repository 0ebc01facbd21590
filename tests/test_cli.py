"""The command line: `tierstore info`, a tiny `tierstore demo` and tiny `tierstore bench io` / `store` runs end to end
(JSON checked)."""
from __future__ import annotations

import json

from tierstore.cli import main


def _o_direct_opens(directory) -> bool:
    """Whether a file in `directory` opens with O_DIRECT, asked of the kernel here, apart from `info`."""
    import errno
    import os
    path = os.path.join(directory, "direct-probe")
    open(path, "wb").close()
    try:
        os.close(os.open(path, os.O_RDWR | os.O_DIRECT))
        return True
    except OSError as e:
        assert e.errno == errno.EINVAL, e  # the refusal of a filesystem without O_DIRECT, nothing else
        return False
    finally:
        os.unlink(path)


def test_info_reports_the_machine(tmp_path, capsys):
    out = tmp_path / "info.json"
    assert main(["info", "--dir", str(tmp_path), "--json", str(out)]) == 0
    facts = json.loads(out.read_text())
    assert facts["default_backend"] in ("io_uring", "threads")
    assert facts["o_direct"]["available"] is _o_direct_opens(tmp_path) and facts["o_direct"]["why"]
    assert "io_uring" in capsys.readouterr().out


def test_bench_io_runs_small(tmp_path):
    out = tmp_path / "io.json"
    rc = main(["bench", "io", "--dir", str(tmp_path / "d"), "--size", "8M", "--block-sizes", "1M",
               "--queue-depths", "4", "--rounds", "1", "--small-count", "64", "--no-fio", "--no-deepspeed",
               "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["size"] == 8 << 20 and len(res["sequential"]) == 2
    for row in res["sequential"]:
        assert row["threads_gib_s"] > 0
    assert all(v["requests_per_s"] > 0 for v in res["small"].values())
    assert not any((tmp_path / "d").iterdir())  # the benchmark cleans up its files


def test_demo_trains_on_nvme_equal_to_torch(tmp_path):
    out = tmp_path / "demo.json"
    rc = main(["demo", "--dir", str(tmp_path / "d"), "--width", "32", "--layers", "1", "--steps", "30",
               "--resume-steps", "2", "--json", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0 and res["ok"]
    assert res["losses"]["zero3"] == res["losses"]["torch"]  # parameters and fp32 states on nvme: same arithmetic
    assert res["resumed"]["zero3"] == res["resumed"]["resumed"] and len(res["resumed"]["zero3"]) == 2
    assert res["nvme_bytes"] > 12 * res["parameters"]  # master + 2 states in fp32 (and the parameters) on disk
    assert not any((tmp_path / "d").iterdir())  # the demo cleans up its files


def test_bench_store_runs_small(tmp_path):
    out = tmp_path / "store.json"
    (tmp_path / "d").mkdir()
    rc = main(["bench", "store", "--dir", str(tmp_path / "d"), "--count", "100", "--size", "1M", "--large-count", "2",
               "--rounds", "1", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())["results"]
    for part, n in (("small", 100), ("large", 2)):
        assert res[part]["tensors"] == n
        samples = res[part]["samples"]
        assert {"engine write+fsync", "engine read", "store put+flush", "store get (out=)"} <= set(samples)
        assert all(s > 0 for v in samples.values() for s in v["seconds"])
    assert not any((tmp_path / "d").iterdir())  # the benchmark cleans up its files
