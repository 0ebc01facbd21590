"""The backward schedule of ZeRO-3 on its own, with plain data: entries, cursor, visits, the agreed
reduction order ([Note: backward gathers], [Note: schedule state machine] in backward_schedule.py)."""
from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from tierstore.zero.hooks.backward_schedule import BackwardSchedule, Entry, Visit


def forward(s: BackwardSchedule, entries) -> None:
    s.new_forward()
    for key, gids in entries:
        s.record(key, gids)


def walk(s: BackwardSchedule, pulls) -> list[Visit]:
    """One backward on one rank: the hooks that run pull the cursor to their entries, then the end of
    backward walks to the bottom."""
    s.begin()
    visits = []
    for index in list(pulls) + [0]:
        while (v := s.step_to(index)) is not None:
            visits.append(v)
    s.end()
    return visits


ENTRIES = [("emb", (0,)), ("l1", (1, 2)), ("l2", (2, 3)), ("head", (4,))]


def test_record_returns_indices_and_new_forward_makes_old_serials_stale():
    s = BackwardSchedule()
    s.new_forward()
    serial = s.serial
    assert [s.record(k, g) for k, g in ENTRIES] == [0, 1, 2, 3]
    assert s.entries[1] == Entry("l1", (1, 2))
    assert s.current(serial, 3) and not s.current(serial, 4) and not s.current(serial, None)
    s.new_forward()
    assert s.entries == [] and not s.current(serial, 0)


def test_cursor_visits_every_entry_once_from_the_last_down():
    s = BackwardSchedule()
    forward(s, ENTRIES)
    s.begin()
    assert s.step_to(3) == Visit(3, (4,), (), 0)  # the last entry's own hook: the cursor moves onto it
    assert s.step_to(3) is None  # already there
    assert s.below(2) == [(2, 3), (1, 2)]
    assert [v.entry for v in iter(lambda: s.step_to(1), None)] == [2, 1]
    assert s.step_to(2) is None  # a hook whose entry the cursor passed visits nothing
    assert s.below(5) == [(0,)]
    assert s.step_to(0) == Visit(0, (0,), (), 3)
    assert s.cursor == 0 and s.visits == 4 and s.below(1) == []


def test_first_backward_has_no_schedule_then_the_agreed_positions_fall_due():
    s = BackwardSchedule()
    forward(s, ENTRIES)
    assert all(v.due == () for v in walk(s, [3, 2, 1, 0]))
    # a second backward, recording arrivals: bucket 4 after the first visit, 2 and 3 after the second, ...
    s.begin()
    s.step_to(3)
    s.arrived([4])
    s.step_to(2)
    s.arrived([2, 3])
    s.step_to(1)
    s.arrived([1, 2])  # bucket 2's last gradient arrives later: its position moves
    s.step_to(0)
    assert s.positions([0, 1, 2, 3, 4]) == [-1, 3, 3, 2, 1]  # bucket 0 got no gradient
    s.agree([0, 1, 2, 3, 4], s.positions([0, 1, 2, 3, 4]))
    s.end()
    visits = walk(s, [3, 2, 1, 0])
    # at visit k (before its gathers) every bucket whose position is <= k, in (position, gid) order; a bucket
    # that got no gradient anywhere goes to the end of backward (never due during a visit)
    assert [(v.number, v.due) for v in visits] == [(0, ()), (1, (4,)), (2, (3,)), (3, (1, 2))]


def test_the_schedule_needs_the_same_entries():
    s = BackwardSchedule()
    forward(s, ENTRIES)
    s.begin()
    s.agree([1, 4], [0, 1])
    s.end()
    forward(s, ENTRIES)  # same modules, same buckets: the schedule applies
    assert [v.due for v in walk(s, [])] == [(1,), (4,), (), ()]
    forward(s, ENTRIES[:3] + [("head", (4, 5))])  # a module's buckets changed: no schedule
    assert all(v.due == () for v in walk(s, []))
    forward(s, ENTRIES)  # back to the entries it was learnt on
    assert [v.due for v in walk(s, [])] == [(1,), (4,), (), ()]


def test_end_forgets_the_arrivals_and_a_later_agree_replaces_the_schedule():
    s = BackwardSchedule()
    forward(s, ENTRIES)
    s.begin()
    s.arrived([4])
    s.end()
    assert s.positions([4]) == [-1]
    s.agree([4], [2])
    s.agree([4], [0])
    assert [v.due for v in walk(s, [])] == [(4,), (), (), ()]


@st.composite
def _backward_of_ranks(draw):
    n = draw(st.integers(1, 8))
    gids = list(range(draw(st.integers(1, 6))))
    entries = [(f"m{i}", tuple(draw(st.lists(st.sampled_from(gids), min_size=1, max_size=3, unique=True))))
               for i in range(n)]
    ranks = draw(st.lists(st.tuples(
        st.lists(st.integers(0, n - 1), max_size=n, unique=True),  # the entries whose hooks run here
        st.lists(st.integers(-1, n), min_size=len(gids), max_size=len(gids))),  # this rank's arrivals
        min_size=2, max_size=4))
    return entries, gids, ranks


@settings(max_examples=200, deadline=None)
@given(_backward_of_ranks())
def test_every_rank_makes_the_same_visits_and_reductions_whatever_its_graph(case):
    """The property the collectives rest on: the visits and the buckets due at each are a function of the
    entries and the agreed positions only, not of which hooks ran on a rank."""
    entries, gids, ranks = case
    agreed = [max(pos[i] for _pulls, pos in ranks) for i in range(len(gids))]  # the all_reduce MAX
    seen = []
    for pulls, _positions in ranks:
        s = BackwardSchedule()
        forward(s, entries)
        s.begin()
        s.agree(gids, agreed)
        s.end()
        visits = walk(s, sorted(pulls, reverse=True))  # a hook pulls the cursor down, never up
        seen.append([(v.entry, v.gids, v.due, v.number) for v in visits])
        assert [v.entry for v in visits] == list(range(len(entries) - 1, -1, -1))
        due = [g for v in visits for g in v.due]
        assert sorted(due) == sorted(g for g, p in zip(gids, agreed) if 0 <= p < len(entries))
    assert all(s == seen[0] for s in seen)
