"""`tierstore bench optim` / `bench train` at a tiny size end to end (each case in its own process, the raw engine on
the nvme step's bytes), and the DeepSpeed harness's config builder without DeepSpeed: so the step
benchmarks keep working. The measurements themselves are `tierstore bench ...` runs, not tests (bench/README.md)."""
from __future__ import annotations

import json
import os

import pytest

from tierstore.bench import _ds_case, steps
from tierstore.cli import main

TINY = ["--rounds", "2", "--warmup", "1", "--sub-group", "256K", "--pinned", "4M", "--threads", "1"]



def test_the_overlapped_step_alone_gets_the_raw_engine_on_its_own_bytes(tmp_path):
    out = tmp_path / "optim.json"
    rc = main(["bench", "optim", "--params", "1.5e5", "--width", "128", "--batch", "4",
               "--cases", "torch-fused,nvme-overlap", "--dir", str(tmp_path / "d"), "--json", str(out), *TINY])
    assert rc == 0
    r = json.loads(out.read_text())
    assert set(r["median"]) == {"torch-fused", "nvme-overlap", "raw-both-overlap"}  # no nvme case: no raw-read
    assert r["ratios"]["nvme-overlap full / max(torch-fused full, raw read+write at once)"] > 0


@pytest.mark.slow  # a process per case: ~5 s each on a quiet machine
def test_bench_optim_tiny_runs_every_tierstore_case(tmp_path, capsys):
    out = tmp_path / "optim.json"
    cases = ["torch-fused", "host", "nvme", "nvme8", "nvme-plain", "nvme-overlap", "nvme8-overlap", "nvme-noreuse",
             "nvme-bf16", "nvme8-bf16"]
    rc = main(["bench", "optim", "--params", "1.5e5", "--width", "128", "--batch", "4", "--cases", ",".join(cases),
               "--dir", str(tmp_path / "d"), "--json", str(out), *TINY])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["layers"] == 9 and r["parameters"] == 9 * (128 * 128 + 128)
    assert set(r["median"]) == {*cases, "raw-read", "raw-write", "raw-both", "raw-both-overlap", "raw-both-overlap8"}
    for c in cases:
        m = r["median"][c]
        assert 0 < m["fwd_bwd"] < m["full"] and 0 < m["step"] < m["full"]
        assert len(r["samples"][c]) == 2  # one timed step per round
        assert r["peak_rss"][c] > 50 << 20  # its own process: torch alone is more than that
    by = r["bytes_per_step"]
    n = r["parameters"]
    plain, nvme = by["nvme-plain"], by["nvme"]
    # a plain nvme step reads at least the fp32 master + two states and writes them back (12 bytes per parameter)
    assert plain["nvme_read"] >= 12 * n and plain["nvme_written"] >= 12 * n
    assert by["nvme8"]["nvme_written"] < nvme["nvme_written"]  # 8-bit states: fewer bytes
    assert by["host"]["nvme_read"] == 0
    # by kind (OptimizerStats.disk_read / disk_written): the fp32 master is written once per step
    assert plain["disk_written_master"] == pytest.approx(4 * n, rel=0.05)
    # the default (overlap_step="auto") overlaps the timed steps, as overlap_step=True does: no gradient byte
    # touches the disk, where the plain step writes and reads every one
    assert plain["disk_written_grads"] > 0
    assert nvme["disk_written_grads"] == by["nvme-overlap"]["disk_written_grads"] == 0
    both = by["nvme8-overlap"]  # 8-bit states and no gradient bytes
    assert both["disk_written_grads"] == 0 and both["disk_written_states"] < plain["disk_written_states"] / 3
    # bf16 compute: half the parameter bytes, the master as its 2-byte remainder ([Note: split master]); with
    # dynamic8 fewer state bytes again
    assert by["nvme-bf16"]["disk_written_master"] == pytest.approx(2 * n, rel=0.05)
    assert by["nvme8-bf16"]["disk_written_states"] < by["nvme-bf16"]["disk_written_states"] / 3
    assert r["ratios"]["nvme8-overlap speedup over nvme-overlap, full"] > 0
    assert r["ratios"]["nvme speedup over nvme-plain, full"] > 0
    # the disk's own ratio for the same bytes, moved by the raw engine in the same rounds
    assert r["ratios"]["raw engine: nvme-overlap's bytes over nvme8-overlap's"] > 0
    assert r["ratios"]["nvme8-overlap full / raw read+write of its bytes at once"] > 0
    # each nvme case against the raw engine moving its own bytes
    assert r["ratios"]["nvme-overlap full / max(torch-fused full, raw read+write at once)"] > 0
    # reuse_bytes: backward reads fewer parameters, the step fewer masters, than with it off; the rest the same
    off = by["nvme-noreuse"]
    assert nvme["disk_read_params"] < off["disk_read_params"] and nvme["disk_read_master"] < off["disk_read_master"]
    assert all(nvme[k] == off[k] for k in ("disk_written_master", "disk_read_states", "disk_written_states"))
    assert r["ratios"]["nvme speedup over nvme-noreuse (reuse_bytes), full"] > 0
    for k in ("host/torch-fused full", "nvme8 speedup over nvme, full",
              "nvme full / max(torch-fused full, raw read+write at once)"):
        assert r["ratios"][k] > 0
    # the kernel's bytes per parameter per step, every timed step, checked against their targets
    assert {"nvme", "nvme-bf16", "nvme8-bf16"} <= set(r["byte_rounds"])
    assert all(len(v) == 2 for v in r["byte_rounds"].values())
    assert all(x > 0 for c in ("nvme", "nvme-bf16", "nvme8-bf16") for x in r["byte_rounds"][c])
    assert [row[0] for row in r["byte_verdicts"]] == ["nvme: B/param/step", "nvme-bf16: B/param/step",
                                                      "nvme8-bf16: B/param/step"]
    assert len(r["load_average"]) == 2
    text = capsys.readouterr().out
    assert "load average" in text and "raw engine: read + write at once" in text and "nvme-bf16: B/param/step" in text
    assert not any((tmp_path / "d").iterdir())  # the benchmark removed its files


@pytest.mark.parametrize("ours, theirs, want", [
    ([25.0, 25.5], [32.0, 33.0], ["met", "met"]),
    ([26.0, 28.0], [32.0, 32.0], ["undecided (spread 26.00–28.00 crosses the target)", "met"]),
    ([28.0, 29.0], [27.0, 27.0], ["MISSED", "MISSED"]),
])
def test_byte_targets_are_decided_by_every_step(ours, theirs, want):
    rows = steps.byte_verdicts({"nvme": ours, "ds-infinity": theirs})
    assert [row[0] for row in rows] == ["nvme: B/param/step", "nvme / ds-infinity bytes"]
    assert [row[3] for row in rows] == want


@pytest.mark.slow
def test_bench_train_tiny_reports_tokens_per_second(tmp_path):
    out = tmp_path / "train.json"
    rc = main(["bench", "train", "--params", "2e5", "--context", "32", "--batch", "2", "--cases",
               "torch-fused,nvme", "--no-raw", "--dir", str(tmp_path / "d"), "--json", str(out), *TINY])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["tokens_per_step"] == 64 and set(r["median"]) == {"torch-fused", "nvme"}
    assert r["ratios"]["nvme/torch-fused tokens/s"] == pytest.approx(
        r["median"]["torch-fused"]["full"] / r["median"]["nvme"]["full"])
    # the same model on the same batches: both start from the same loss
    first = {c: r["ready"][c]["last"]["loss"] for c in ("torch-fused", "nvme")}
    assert first["nvme"] == pytest.approx(first["torch-fused"], rel=1e-5)


def test_bench_optim_names_the_deepspeed_install_when_absent(tmp_path, capsys):
    rc = main(["bench", "optim", "--params", "2e4", "--width", "64", "--cases", "ds-offload",
               "--deepspeed-python", str(tmp_path / "no-venv" / "python"), "--dir", str(tmp_path), *TINY])
    assert rc == 0
    text = capsys.readouterr().out
    assert "skipped ds-offload" in text and "pip install torch==2.13.0 deepspeed==0.19.8" in text


def test_bench_optim_refuses_an_unknown_case(tmp_path):
    with pytest.raises(SystemExit, match="unknown case"):
        main(["bench", "optim", "--cases", "torch-fused,zero9", "--dir", str(tmp_path)])


SPEC = {"sub_group_bytes": 64 << 20, "batch": 16, "lr": 1e-3, "dir": "/nvme/run"}


def test_ds_config_zero_offload():
    cfg = _ds_case.ds_config("ds-offload", SPEC, layers=32, largest_param=1 << 20)
    z = cfg["zero_optimization"]
    assert z["stage"] == 3 and z["offload_optimizer"]["device"] == "cpu" and "offload_param" not in z
    assert z["sub_group_size"] == (64 << 20) // 4  # the tierstore cases' sub-group, in fp32 elements
    assert cfg["optimizer"]["type"] == "AdamW" and cfg["train_micro_batch_size_per_gpu"] == 16
    assert "bf16" not in cfg and "fp16" not in cfg  # fp32, as the tierstore and torch cases
    assert "aio" not in cfg


def test_ds_config_zero_infinity_has_the_buffers_its_nvme_path_needs():
    cfg = _ds_case.ds_config("ds-infinity", SPEC, layers=32, largest_param=(1 << 20) + 5)
    z = cfg["zero_optimization"]
    assert z["offload_optimizer"]["device"] == "nvme" and z["offload_param"]["device"] == "nvme"
    assert z["offload_optimizer"]["nvme_path"] == z["offload_param"]["nvme_path"] == "/nvme/run/ds-infinity"
    assert z["offload_optimizer"]["buffer_count"] >= 8  # DeepSpeed issue #3062
    assert z["offload_param"]["buffer_count"] >= 32 + 2
    assert z["offload_param"]["buffer_size"] >= (1 << 20) + 5  # holds the largest parameter
    assert z["offload_param"]["buffer_size"] % (1 << 18) == 0  # whole MiB of fp32
    assert cfg["aio"]["block_size"] == 1 << 20


def test_ds_config_refuses_bad_input():
    with pytest.raises(ValueError, match="ds-offload"):
        _ds_case.ds_config("zero-9", SPEC, layers=4, largest_param=10)
    with pytest.raises(ValueError, match="layers"):
        _ds_case.ds_config("ds-infinity", SPEC, layers=0, largest_param=10)


def test_deepspeed_python_names_the_install_command(tmp_path):
    py, why = steps.deepspeed_python(str(tmp_path / "absent" / "python"))
    assert py is None and steps.DS_INSTALL in why


def test_tier_bytes_takes_the_optimizers_count_by_kind_where_there_is_one():
    from types import SimpleNamespace

    from tierstore.bench._case import tier_bytes

    store = SimpleNamespace(stats=lambda: {"host": {"bytes_out": 1, "bytes_in": 2},
                                           "nvme": {"bytes_out": 30, "bytes_in": 40}})
    plain = SimpleNamespace(store=store)  # an optimizer without per-kind counts: store totals only
    assert tier_bytes(plain) == {"host_read": 1, "host_written": 2, "nvme_read": 30, "nvme_written": 40}
    counted = SimpleNamespace(store=store, stats=lambda: SimpleNamespace(
        disk_read={"master": 10, "states": 20}, disk_written={"master": 11, "states": 22}))
    b = tier_bytes(counted)
    assert b["disk_read_master"] == 10 and b["disk_written_states"] == 22 and b["nvme_read"] == 30


def test_step_profile_reports_phases_disk_and_threads(tmp_path, capsys):
    """python -m tierstore.bench.step_profile: the phases of a step, the disk's busy share in each, and the
    CPU seconds per thread (the tiny model's I/O threads may not reach a clock tick) and their waits for a core."""
    from tierstore.bench import step_profile
    assert step_profile.main(["--case", "nvme-overlap", "--model", "linear", "--params", "3e5", "--width", "128",
                              "--batch", "4", "--steps", "2", "--sub-group", "256K", "--pinned", "4M",
                              "--threads", "1", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "seconds     forward" in out and "disk busy" in out
    assert any(line.startswith("  CPU s/step") for line in out.splitlines())  # threads with a clock tick
    assert "waiting for a core, s/step" in out and "MainThread in backward:" in out
    assert os.listdir(tmp_path) == []  # its store is removed
    with pytest.raises(SystemExit):
        step_profile.main(["--case", "nvme9", "--dir", str(tmp_path)])


def test_proc_io_counts_the_bytes_this_process_writes_to_its_disk(tmp_path):
    """_harness.proc_io, the DeepSpeed worker's byte count: 4 MiB written and fsynced show up in nvme_written."""
    from tierstore.bench import _harness
    if os.major(os.stat(tmp_path).st_dev) == 0:
        pytest.skip(f"{tmp_path} is not on a block device (tmpfs, overlay): no storage bytes to count")
    before = _harness.proc_io()
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, b"x" * (4 << 20))
        os.fsync(fd)
    finally:
        os.close(fd)
    after = _harness.proc_io()
    assert after["nvme_written"] - before["nvme_written"] >= 4 << 20
    assert after["nvme_read"] >= before["nvme_read"]


def test_load_memory_measures_from_pretrained_plain_and_under_init(tmp_path, capsys):
    """python -m tierstore.bench.load_memory at a tiny size: both loads run in their own processes; under Init
    every tensor is read (the file's pages mapped: file-backed RSS of at least half the file), plainly they
    stay untouched views of the file."""
    pytest.importorskip("transformers")
    from tierstore.bench import load_memory
    out = tmp_path / "lm.json"
    assert load_memory.main(["--params", "4e6", "--width", "64", "--rounds", "1", "--dir",
                             str(tmp_path), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "plain" in text and "init" in text
    got = json.loads(out.read_text())
    by = {s["mode"]: s for s in got["samples"]}
    assert set(by) == {"plain", "init"}
    assert by["init"]["RssFile_peak_over_start"] >= got["file_bytes"] // 2
    assert by["plain"]["RssFile_peak_over_start"] < by["init"]["RssFile_peak_over_start"]
