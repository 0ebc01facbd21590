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


def test_demo_trains_on_nvme_and_reports_what_ran(tmp_path):
    out = tmp_path / "demo.json"
    rc = main(["demo", "--dir", str(tmp_path / "d"), "--width", "64", "--layers", "1", "--context", "32",
               "--steps", "30", "--resume-steps", "2", "--exact-steps", "3", "--lr", "3e-3", "--text", "256K",
               "--budget", "8G", "--json", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0 and res["ok"] and all(c["passed"] for c in res["checks"]) and len(res["checks"]) == 4
    ex = res["exactness"]["losses"]
    assert ex["zero3"] == ex["torch"] and len(ex["torch"]) == 3  # everything on nvme, fp32: same arithmetic
    steps = res["steps"]
    assert len(steps) == 30 and res["resumed"] == [s["loss"] for s in steps[28:]]
    assert sum(s["read_bytes"] for s in steps) > 0 and sum(s["write_bytes"] for s in steps) > 0
    kinds = res["bytes_by_kind"]  # parameters, gradients and states all on nvme, nothing on host
    assert set(kinds) >= {"gradients", "fp32 master", "optimizer states"}
    assert all(set(v) == {"nvme"} for v in kinds.values())
    assert res["states_bytes"] >= 16 * res["parameters"] * 0.99  # master (= fp32 params), grad, exp_avg, exp_avg_sq
    for s in steps:
        assert 0 <= s["compute_s"] <= s["fwd_bwd_s"] and s["step_s"] > 0
    assert not any((tmp_path / "d").iterdir())  # the demo cleans up its files (the figures went to --json)
    png = tmp_path / "demo.png"
    try:
        import matplotlib  # noqa: F401
        assert png.read_bytes()[:4] == b"\x89PNG"
    except ImportError:
        assert not png.exists()


def test_demo_fails_a_budget_it_did_not_keep(tmp_path):
    rc = main(["demo", "--dir", str(tmp_path / "d"), "--width", "64", "--layers", "1", "--context", "32",
               "--steps", "2", "--resume-steps", "0", "--exact-steps", "0", "--text", "64K", "--budget", "1M",
               "--json", str(tmp_path / "demo.json")])
    res = json.loads((tmp_path / "demo.json").read_text())
    assert rc == 1 and not res["ok"]
    assert [c["passed"] for c in res["checks"] if c["what"].startswith("within the budget")] == [False]


def test_demo_big_picks_a_model_bigger_than_the_ram(tmp_path):
    from tierstore.bench.gpt import count_params, shape_for
    from tierstore.demo import _big_params
    ram = 2 << 30  # bytes
    w, layers = shape_for(_big_params(ram, "fp32"))
    assert 16 * count_params(w, layers, 128) >= 1.5 * ram


def test_bench_scale_runs_small(tmp_path):
    out = tmp_path / "scale.json"
    rc = main(["bench", "scale", "--sizes", "2e5,8e5", "--steps", "2", "--context", "16", "--dir", str(tmp_path),
               "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())["results"]
    assert [r["parameters"] < 2e6 for r in res] == [True, True] and res[0]["parameters"] < res[1]["parameters"]
    for r in res:
        assert r["peak_rss"] > 0 and r["on_disk"] >= r["states_bytes"] > 0 and r["step_s"] > 0
    expected = ["scale.json", "scale.png"] if _has_matplotlib() else ["scale.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == expected  # the nvme files are gone, the figures stay


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        return False


def test_bench_store_runs_small(tmp_path):
    out = tmp_path / "store.json"
    (tmp_path / "d").mkdir()
    rc = main(["bench", "store", "--dir", str(tmp_path / "d"), "--count", "100", "--size", "1M", "--large-count", "2",
               "--table", "4M", "--lookups", "64", "--rounds", "1", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())["results"]
    for part, n in (("small", 100), ("large", 2)):
        assert res[part]["tensors"] == n
        samples = res[part]["samples"]
        assert {"engine write+fsync", "engine read", "store put+flush", "store get (out=)"} <= set(samples)
        assert all(s > 0 for v in samples.values() for s in v["seconds"])
    rows = res["rows"]  # (c) row reads: the store read only the blocks of a slice, not the 4 MiB table
    assert {"store rows= slice", "np.memmap slice", "store whole+index lookup"} <= set(rows["samples"])
    assert rows["disk_bytes"]["store rows= slice"] < rows["bytes"] // 2
    assert not any((tmp_path / "d").iterdir())  # the benchmark cleans up its files
