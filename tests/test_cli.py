"""The command line: `tierstore info`, a tiny `tierstore demo` and tiny `tierstore bench io` / `store` runs end to end
(JSON checked)."""
from __future__ import annotations

import json
import os
import shlex

import pytest

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
    assert facts["crc32c"] in ("avx512", "crc32c package")
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
    assert res["indicative"] is True and res["fio_commands"] == {}
    rnd = res["random"]
    assert any(k.endswith("randread qd32") and v["iops"] > 0 for k, v in rnd.items())
    assert any(k.endswith("randread qd1") and 0 < v["p50_us"] <= v["p99_us"] for k, v in rnd.items())
    assert all(v["gib_s"] > 0 and v["cpu_s_per_gib"] >= 0 for v in res["mixed"].values())
    assert len(res["paths"]) == 4 and all(v["ratio"] > 0 for v in res["paths"].values())
    assert all(row["cpu_s_per_gib"] is not None for row in res["sequential"])


FAKE_FIO = r"""#!{python}
import json, sys
args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(json.dumps(args) + "\n")
ops = [a.split("=", 1)[1] for a in args if a.startswith("--rw=")]
size = int(next(a.split("=", 1)[1] for a in args if a.startswith("--size=")))
pct = {{"50.000000": 80000, "99.000000": 150000}}
def side(active):
    return {{"io_bytes": size if active else 0, "runtime": 500 if active else 0, "iops": 5000.0 if active else 0,
            "lat_ns": {{"percentile": pct}}, "clat_ns": {{"percentile": pct}}}}
jobs = [{{"read": side("read" in op), "write": side("write" in op), "usr_cpu": 10.0, "sys_cpu": 5.0}} for op in ops]
print("note: fio prints this line before its JSON")
print(json.dumps({{"jobs": jobs}}))
"""


def test_bench_io_runs_fio_and_reports_its_command_lines(tmp_path, monkeypatch, capsys):
    """fio's command lines are printed and kept in the JSON, exactly as run (a stand-in fio records them)."""
    import sys

    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "fio.log"
    fio = bindir / "fio"
    fio.write_text(FAKE_FIO.format(python=sys.executable, log=str(log)))
    fio.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    out = tmp_path / "io.json"
    rc = main(["bench", "io", "--dir", str(tmp_path / "d"), "--size", "8M", "--quick", "--small-count", "32",
               "--random-count", "64", "--latency-count", "20", "--no-deepspeed", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    ran = [shlex.join(["fio", *json.loads(line)]) for line in log.read_text().splitlines()]
    assert sorted(res["fio_commands"].values()) == sorted(set(ran))
    text = capsys.readouterr().out
    assert all(cmd in text for cmd in ran) and "indicative" in text
    assert any("--rw=randread" in c and "--iodepth=1" in c for c in ran)
    row = res["sequential"][0]
    assert row["fio_best_gib_s"] > 0 and row["fio_cpu_s_per_gib"] > 0 and row["fio_command"] in ran
    assert res["random"]["fio/io_uring randread qd1"]["p50_us"] == 80.0


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
    from tierstore.demo import _big_params
    from tierstore.gpt import count_params, shape_for
    ram = 2 << 30  # bytes
    w, layers = shape_for(_big_params(ram, "fp32"))
    assert 16 * count_params(w, layers, 128) >= 1.5 * ram


def test_demo_big_refuses_a_disk_too_small_before_building_anything(tmp_path, monkeypatch):
    import collections

    import tierstore.demo as demo
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(demo.shutil, "disk_usage", lambda _p: usage(1 << 40, 0, 1 << 30))
    with pytest.raises(SystemExit, match=r"has 1\.0 GiB free, the run needs about .*--resume-steps 0"):
        main(["demo", "--big", "--ram-gib", "2", "--dir", str(tmp_path / "d")])
    assert not any((tmp_path / "d").iterdir())


def test_bench_scale_runs_small(tmp_path):
    out = tmp_path / "scale.json"
    work = tmp_path / "not" / "made"  # a --dir that does not exist yet is made
    rc = main(["bench", "scale", "--sizes", "2e5,8e5", "--steps", "2", "--context", "16", "--dir", str(work),
               "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())["results"]
    assert [r["parameters"] < 2e6 for r in res] == [True, True] and res[0]["parameters"] < res[1]["parameters"]
    for r in res:
        assert r["peak_rss"] > 0 and r["on_disk"] >= r["states_bytes"] > 0 and r["step_s"] > 0
    expected = ["not", "scale.json", "scale.png"] if _has_matplotlib() else ["not", "scale.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == expected  # the figures stay
    assert not any(work.iterdir())  # the nvme files are gone


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


def test_version_is_the_package_version(capsys):
    import tomllib

    import tierstore
    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as f:
        declared = tomllib.load(f)["project"]["version"]
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"tierstore {declared}" == f"tierstore {tierstore.__version__}"


def test_bench_inference_runs_small(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = tmp_path / "r.json"
    rc = main(["bench", "inference", "--dir", str(tmp_path / "d"), "--params", "2e5", "--tokens", "3", "--rounds", "1",
               "--train-steps", "1", "--threads", "1", "--cases", "memory,accelerate,nvme-int8", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    cases = r["cases"]
    assert cases["accelerate"]["same_tokens_as_memory"] and cases["accelerate"]["tokens_s"] > 0
    assert cases["nvme-int8"]["stored_bytes"] < r["weight_bytes"] / 2  # int8 at rest
    assert cases["nvme-int8"]["peak_weights"] <= r["budget"]
    assert abs(cases["nvme-int8"]["ppl"] / cases["memory"]["ppl"] - 1) < 0.05
    assert not any((tmp_path / "d").iterdir())  # the benchmark cleans up its files


def test_demo_warms_up_over_a_quarter_of_a_default_run():
    """The default rate ramps over a quarter of the default run: at step 3, where a 5-step ramp had Adam throw
    the loss of the default model up (8.3), the rate is still under a third of its peak."""
    import argparse
    from types import SimpleNamespace

    from tierstore.demo import _default_rate, _warm, add_arguments
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args([])
    _default_rate(args)
    opt = SimpleNamespace(param_groups=[{"lr": None}])
    lrs = []
    for i in range(args.steps):
        _warm(opt, args, i)
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == sorted(lrs) and lrs[-1] == args.lr
    assert lrs[2] < args.lr / 3
    assert lrs.index(args.lr) + 1 >= args.steps // 4


def test_demo_default_budget_holds_what_the_load_decides(tmp_path):
    """The default budget is a third of the states plus every buffer the configuration lets be in flight at
    once (read-ahead, the step pipeline, the pinned pool): whether those are alive at the peak depends on the
    machine's load, which must not decide the check ([Note: the budget and the load] in tierstore/demo.py)."""
    import argparse

    from tierstore.demo import _config
    rc = main(["demo", "--dir", str(tmp_path / "d"), "--width", "64", "--layers", "1", "--context", "32",
               "--steps", "2", "--resume-steps", "0", "--exact-steps", "0", "--text", "64K",
               "--json", str(tmp_path / "demo.json")])
    res = json.loads((tmp_path / "demo.json").read_text())
    cfg = _config(str(tmp_path), argparse.Namespace(pinned=32 << 20, states="fp32"))
    least = cfg.prefetch_bytes + 2 * cfg.pipeline_depth * cfg.sub_group_bytes + cfg.pinned_bytes
    assert res["in_flight"] >= least
    assert res["budget"] == res["states_bytes"] // 3 + res["in_flight"]
    assert rc == (0 if res["ok"] else 1)
