"""Store(paths, budgets={...}): one byte budget per tier name ([Note: one budget per tier name] in
tierstore/store_args.py). Names left out keep their defaults; a wrong name, type or value is refused naming
it and the valid names, before anything is created; the old keywords still work, with a DeprecationWarning."""
from __future__ import annotations

import warnings

import pytest
import torch

from tierstore.errors import TierFullError, TierstoreTypeError, TierstoreValueError
from tierstore.store import Store
from tierstore.store_args import BUDGET_NAMES, DEFAULT_BUDGETS, MAX_BUDGET, store_budgets

MiB = 1 << 20  # bytes


def test_the_names_are_the_tiers_and_the_pinned_pool():
    assert BUDGET_NAMES == ("device", "host", "pinned", "nvme")
    assert store_budgets(None, {}) == DEFAULT_BUDGETS


def test_a_name_left_out_keeps_its_default(tmp_path):
    with Store(tmp_path, budgets={"host": 2 * MiB, "pinned": 8 * MiB}) as s:
        st = s.stats()
        assert (st["host"]["budget"], st["device"]["budget"], st["nvme"]["budget"]) == (2 * MiB, 0, None)
        s.put("a", torch.zeros(MiB // 4))  # 1 MiB: the device tier (budget 0) is skipped, host takes it
        assert s.tensor("a").tiers == {"host"}


def test_the_budgets_are_kept_across_open(tmp_path):
    with Store(tmp_path, budgets={"host": 0, "pinned": 8 * MiB}) as s:
        s.put("a", torch.ones(100))
        assert s.tensor("a").tiers == {"nvme"}
    with Store.open(tmp_path, budgets={"host": MiB, "pinned": 8 * MiB}) as s:
        assert s.stats()["host"]["budget"] == MiB
        s.tensor("a").prefetch("host").result()
        assert s.tensor("a").tiers == {"host", "nvme"}


def test_a_full_tier_names_every_budget(tmp_path):
    with Store(tmp_path, budgets={"host": MiB, "nvme": 2 * MiB, "pinned": 8 * MiB}) as s:
        with pytest.raises(TierFullError, match=r"budgets=\{'device': 0 \(0 used\), 'host': 1048576"):
            s.put("big", torch.zeros(MiB), "host")


@pytest.mark.parametrize("budgets, err, match", [
    ({"disk": 0}, TierstoreValueError, r"budgets has no tier named 'disk': the names are \('device', 'host', "
                                       r"'pinned', 'nvme'\)"),
    ({"Host": 0}, TierstoreValueError, "no tier named 'Host'"),
    ({0: 0}, TierstoreValueError, "no tier named 0"),
    ([("host", 0)], TierstoreTypeError, r"must be a mapping tier name -> bytes.*names: \('device'"),
    (1 << 30, TierstoreTypeError, "must be a mapping"),
    ({"host": "1G"}, TierstoreTypeError, r"budgets\['host'\]='1G' must be an int number of bytes \(e.g. 1 << 30"),
    ({"host": 1.0}, TierstoreTypeError, r"budgets\['host'\]=1.0 must be an int .* or None \(no limit\)"),
    ({"nvme": False}, TierstoreTypeError, r"budgets\['nvme'\]=False must be an int"),
    ({"host": -1}, TierstoreValueError, r"budgets\['host'\]=-1 must be >= 0 bytes"),
    ({"pinned": 0}, TierstoreValueError, r"budgets\['pinned'\]=0 must be >= 1 bytes"),
    ({"pinned": None}, TierstoreValueError, r"budgets\['pinned'\]=None: the pinned pool is allocated"),
    ({"host": 2 ** 70}, TierstoreValueError, r"budgets\['host'\]=\d+ bytes is more than any machine holds: pass "
                                             r"at most 1 << 60 bytes, or None for no limit"),
    ({"nvme": MAX_BUDGET + 1}, TierstoreValueError, r"budgets\['nvme'\]=.*more than any machine holds"),
    ({"device": 2 ** 70}, TierstoreValueError, r"budgets\['device'\]=.*more than any machine holds"),
    ({"pinned": 2 ** 70}, TierstoreValueError, r"budgets\['pinned'\]=\d+ bytes is more than any machine holds: pass "
                                               r"at most 1 << 60 bytes$"),
])
def test_a_wrong_budget_is_refused_naming_it(tmp_path, budgets, err, match):
    with pytest.raises(err, match=match):
        Store(tmp_path / "s", budgets=budgets)
    assert not (tmp_path / "s").exists()  # refused before the directory was created


def test_the_largest_budget_is_accepted_where_it_is_a_cap(tmp_path):
    with Store(tmp_path, budgets={"host": MAX_BUDGET, "nvme": MAX_BUDGET, "pinned": 8 * MiB}) as s:
        assert s.stats()["nvme"]["budget"] == MAX_BUDGET


def test_the_old_keywords_still_work_with_a_deprecation_warning(tmp_path):
    with pytest.warns(DeprecationWarning, match=r"Store\(host_budget=, pinned_budget=\) is deprecated: pass "
                                                r"budgets=\{'host': \.\.\., 'pinned': \.\.\.\}"):
        s = Store(tmp_path, host_budget=0, pinned_budget=8 * MiB)
    with s:
        assert s.stats()["host"]["budget"] == 0
    with pytest.warns(DeprecationWarning), pytest.raises(TierstoreValueError, match=r"budgets\['nvme'\]=-1"):
        Store(tmp_path, nvme_budget=-1)


def test_the_warning_points_at_the_caller(tmp_path):
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        Store(tmp_path, device_budget=0, pinned_budget=8 * MiB).close()
    assert [w.filename for w in got if w.category is DeprecationWarning] == [__file__]


def test_a_budget_given_twice_or_an_unknown_keyword_is_refused(tmp_path):
    with pytest.warns(DeprecationWarning), pytest.raises(TierstoreValueError, match="'host' budget is given twice"):
        Store(tmp_path, budgets={"host": 0}, host_budget=0)
    with pytest.raises(TierstoreTypeError, match="unexpected keyword argument 'hst_budget'.*budgets="):
        Store(tmp_path, hst_budget=0)
    with pytest.raises(TypeError):  # also a TypeError, as Python raises for an unknown keyword
        Store(tmp_path, budget={"host": 0})
    assert list(tmp_path.iterdir()) == []
