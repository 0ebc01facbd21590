"""`tierstore bench io --only paths` (tierstore/bench/io_paths.py): the four memory-path ratios against the
engine's pool-buffer path measured in the same run, each with its per-round spread and a verdict that respects
[Note: a verdict the load cannot flip]; the engine's bounced bytes show which path each engine case took."""
from __future__ import annotations

import json

from tierstore.bench import io_paths
from tierstore.bench.verdict import Load
from tierstore.cli import main


def test_only_paths_reports_the_four_ratios_with_verdicts_and_bounced_bytes(tmp_path, capsys):
    out = tmp_path / "paths.json"
    rc = main(["bench", "io", "--only", "paths", "--dir", str(tmp_path / "d"), "--size", "8M", "--rounds", "2",
               "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["size"] == 8 << 20 and res["load"]["samples"]
    paths = res["paths"]
    assert set(paths) == {case for case, _ref, _t in io_paths.PATH_PAIRS}
    for case, ref, target in io_paths.PATH_PAIRS:
        row = paths[case]
        assert row["reference"] == ref and row["target"] == list(target) and len(row["per_round"]) == 2
        assert row["verdict"] in ("met", "MISSED") or row["verdict"].startswith("undecided (")
    # the plain tensor is never 4 KiB aligned: every byte of it went through the bounce buffers, the pool none
    assert paths[io_paths.PLAIN_WRITE]["bounced_bytes"] == [8 << 20] * 2
    assert paths[io_paths.PLAIN_READ]["bounced_bytes"] == [8 << 20] * 2
    text = capsys.readouterr().out
    assert "memory paths" in text and "verdicts need at most" in text
    assert not any((tmp_path / "d").iterdir())  # cleaned up


def test_the_cases_run_in_another_order_each_round_and_the_load_is_sampled_between(monkeypatch):
    order: list[str] = []
    cases = {name: (lambda name=name: order.append(name) or 1.0) for name in ("a", "b", "c")}
    load = Load(cores=2)
    monkeypatch.setattr("tierstore.bench.verdict.load_average", lambda: 0.5)
    got = io_paths.run_paths(cases, 2, load)
    assert order == ["a", "b", "c", "c", "b", "a"] and all(s.seconds == [1.0, 1.0] for s in got.values())
    assert len(load.samples) == 7 and load.quiet
