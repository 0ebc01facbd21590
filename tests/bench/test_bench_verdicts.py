"""The verdicts `bench optim` and `bench train` print, from synthetic rounds (no benchmark runs): "met" and
"MISSED" only when every round's ratio is on one side of the target and the load stayed low; the order of the
cases changes each round; per-round ratios come from each round's own A and B; the bytes-per-parameter table
sets the kernel's count beside the store's."""
from __future__ import annotations

import pytest

from tierstore.bench import bytes_table, steps, verdict
from tierstore.bench.verdict import Load, round_order


def quiet(cores: int = 4) -> Load:
    return Load(cores=cores, samples=[0.5, 1.0, 0.8])


def busy(cores: int = 2) -> Load:
    return Load(cores=cores, samples=[7.6, 9.1, 8.2])


@pytest.mark.parametrize("values, target, want", [
    ([1.02, 1.05, 1.08], ("<=", 1.1), "met"),
    ([1.12, 1.3, 1.2], ("<=", 1.1), "MISSED"),
    ([0.96, 0.99], (">=", 0.95), "met"),
    ([0.5, 0.6, 0.7], (">=", 0.95), "MISSED"),
    ([1.1, 1.1], ("<=", 1.1), "met"),  # on the bound counts as met
])
def test_a_quiet_run_with_its_whole_spread_on_one_side_decides(values, target, want):
    assert verdict.verdict(values, target, quiet()) == want


def test_a_spread_across_the_target_is_undecided_and_says_the_spread():
    got = verdict.verdict([0.19, 0.57, 0.22], ("<=", 0.5), quiet())
    assert got == "undecided (spread 0.19–0.57 crosses the target)"


def test_a_busy_machine_decides_nothing_timed_even_with_a_clean_spread():
    # torch slowed 4x by a neighbour: the overlapped tier looked 1.64x faster than torch, every round
    got = verdict.verdict([1.64, 1.6, 1.7], (">=", 0.85), busy())
    assert got == "undecided (load 9.10 on 2 cores)"


def test_load_and_spread_are_both_named_when_both_fail():
    got = verdict.verdict([0.8, 0.9], (">=", 0.85), busy())
    assert got.startswith("undecided (load 9.10 on 2 cores; spread 0.80–0.90")


def test_the_load_limit_is_relative_to_the_cores():
    at_limit = Load(cores=2, samples=[1.0, 2 * verdict.LOAD_PER_CORE])
    assert verdict.verdict([1.0, 1.0], ("<=", 1.1), at_limit) == "met"
    over = Load(cores=2, samples=[1.0, 2 * verdict.LOAD_PER_CORE + 0.01])
    assert verdict.verdict([1.0, 1.0], ("<=", 1.1), over).startswith("undecided (load")
    assert verdict.verdict([1.0, 1.0], ("<=", 1.1), Load(cores=8, samples=[9.1])) == "met"  # 9.1 on 8 cores


def test_one_round_has_no_spread_to_judge():
    assert verdict.verdict([1.0], ("<=", 1.1), quiet()) == "undecided (1 round: no spread)"


def test_an_untimed_measure_decides_from_its_one_value_whatever_the_load():
    assert verdict.verdict([0.4], ("<=", 0.5), busy(), timed=False) == "met"
    assert verdict.verdict([0.6], ("<=", 0.5), busy(), timed=False) == "MISSED"


def test_missing_values_are_passed_over_and_none_is_undecided():
    assert verdict.verdict([float("nan"), 1.0, 1.05], ("<=", 1.1), quiet()) == "met"
    assert verdict.verdict([], ("<=", 1.1), quiet()) == "undecided (no value)"
    with pytest.raises(ValueError, match="target"):
        verdict.verdict([1.0, 1.0], ("<", 1.1), quiet())


def test_load_reports_start_end_and_most():
    load = Load(cores=2, samples=[1.5, 4.0, 2.5])
    assert (load.start, load.end, load.max, load.limit) == (1.5, 2.5, 4.0, 2 * verdict.LOAD_PER_CORE)
    d = load.as_dict()
    assert d["max"] == 4.0 and d["samples"] == [1.5, 4.0, 2.5]
    assert "4.00 at most" in load.describe() and "2 cores" in load.describe()
    assert Load(cores=1).sample() >= 0


def test_round_order_puts_each_case_in_every_position():
    cases = ["a", "b", "c"]
    orders = [round_order(cases, k) for k in range(6)]
    assert orders[0] == ["a", "b", "c"] and orders[1] == ["c", "b", "a"] and orders[2] == ["b", "c", "a"]
    for o in orders:
        assert sorted(o) == cases
    for pos in range(3):
        assert {o[pos] for o in orders} == set(cases)
    firsts = [o[0] for o in orders]
    assert len(set(firsts)) == 3  # no case always runs first
    assert round_order([], 3) == []


def test_spread_text():
    assert verdict.spread_text([1.2, 0.9, 1.0]) == "0.90–1.20x"
    assert verdict.spread_text([0.5]) == "0.50x" and verdict.spread_text([]) == "-"


def rounds(full: list[float]) -> list[dict]:
    return [{"fwd_bwd": f / 2, "step": f / 2, "full": f} for f in full]


def test_summarize_takes_each_rounds_ratio_from_that_rounds_a_and_b():
    samples = {"torch-fused": rounds([1.0, 4.0, 1.0]),  # a neighbour slowed torch in round 2
               "host": rounds([1.2, 1.2, 1.2]),
               "nvme": rounds([1.2, 1.3, 1.25]), "raw-both": rounds([1.5, 1.1, 1.0])}
    final = {c: {"peak_rss": 100 << 20} for c in ("torch-fused", "host", "nvme")}
    ready = {c: {} for c in final}
    r = steps.summarize(samples, final, ready, tokens=64)
    assert r["ratio_rounds"]["host/torch-fused full"] == pytest.approx([1.2, 0.3, 1.2])
    assert r["ratio_rounds"]["nvme/torch-fused tokens/s"] == pytest.approx([1 / 1.2, 4 / 1.3, 1 / 1.25])
    maxed = r["ratio_rounds"]["nvme full / max(torch-fused full, raw read+write at once)"]
    assert maxed == pytest.approx([1.2 / 1.5, 1.3 / 4.0, 1.25 / 1.0])
    v = steps.verdicts(r, quiet())
    # the slowed round alone would have passed the host: the run cannot decide
    assert v["host/torch-fused full"] == "undecided (spread 0.30–1.20 crosses the target)"
    assert v["nvme/torch-fused tokens/s"] == "undecided (spread 0.80–3.08 crosses the target)"
    # without the slowed round, the run decides
    samples["torch-fused"] = rounds([1.0, 1.0, 1.0])
    r = steps.summarize(samples, final, ready, tokens=64)
    v = steps.verdicts(r, quiet())
    assert v["host/torch-fused full"] == "MISSED" and v["nvme/torch-fused tokens/s"] == "MISSED"
    assert v["nvme full / max(torch-fused full, raw read+write at once)"].startswith("undecided (spread")
    samples["host"] = rounds([1.0, 1.05, 1.02])
    v = steps.verdicts(steps.summarize(samples, final, ready, tokens=64), quiet())
    assert v["host/torch-fused full"] == "met" and v["host/torch-fused tokens/s"] == "met"
    assert steps.verdicts(r, busy())["host/torch-fused full"].startswith("undecided (load")


def test_peak_rss_ratio_is_decided_from_its_one_value():
    samples = {"host": rounds([1.0, 1.0]), "ds-offload": rounds([2.0, 2.0])}
    final = {"host": {"peak_rss": 40}, "ds-offload": {"peak_rss": 100}}
    r = steps.summarize(samples, final, {}, tokens=0)
    v = steps.verdicts(r, busy())
    assert v["host/ds-offload peak RSS"] == "met"
    assert v["host/ds-offload full"].startswith("undecided (load")


def test_bytes_table_sets_the_kernels_count_beside_the_stores_by_kind():
    n = 1000
    by = {"torch-fused": {"kernel_read": 0, "kernel_written": 0},
          "nvme": {"nvme_read": 16000, "nvme_written": 12000, "kernel_read": 16000, "kernel_written": 12500,
                   "disk_read_params": 4000, "disk_read_master": 4000, "disk_read_states": 8000,
                   "disk_written_master": 4000, "disk_written_states": 8000},
          "ds-infinity": {"nvme_read": 30000, "nvme_written": 20000, "kernel_read": 30000, "kernel_written": 20000}}
    cols, got = bytes_table.rows(by, n, steps.LABELS)
    assert cols[3:] == ["store: params r|w", "store: master r|w", "store: states r|w"]
    rows = {r[0]: r[1:] for r in got}
    assert rows[steps.LABELS["nvme"]] == ["16.00 + 12.50 = 28.50", "16.00 + 12.00 = 28.00", "4.00|0.00",
                                          "4.00|4.00", "8.00|8.00"]
    assert rows[steps.LABELS["ds-infinity"]] == ["30.00 + 20.00 = 50.00", "-", "-", "-", "-"]
    assert rows[steps.LABELS["torch-fused"]][0] == "0.00 + 0.00 = 0.00"
    assert bytes_table.per_param(by, n)["nvme"]["kernel_written"] == 12.5
    assert bytes_table.kinds_of(by) == ["params", "master", "states"]


def test_kernel_bytes_are_added_to_each_steps_figures():
    from tierstore.bench import _harness

    step = _harness.with_kernel_bytes(lambda: {"full": 1.0, "bytes": {"nvme_read": 5}})
    out = step()
    assert out["bytes"]["nvme_read"] == 5
    if _harness.kernel_io():  # a kernel with /proc/self/io
        assert out["bytes"]["kernel_read"] >= 0 and out["bytes"]["kernel_written"] >= 0
