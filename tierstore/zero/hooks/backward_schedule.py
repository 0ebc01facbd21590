"""The order of backward's gathers and early reductions, as a pure state machine: entries, a cursor over
them, the visits made, and the reduce-scatter schedule the ranks agreed. No torch, no collectives: the
coordinator (hooks/coordinator.py) asks it what to do and does it.

[Note: backward gathers]
Which module backwards run, and when, is a local matter: with a rank-dependent loss (rank 0 reads head 0,
rank 1 head 1) the ranks' autograd graphs differ, and a bucket's release on completion differs with them
(rank 1 may have completed a bucket that rank 0, lacking a gradient for one of its parameters, never
completes). Gathering "whatever the module about to run is missing" therefore posts different collectives
on different ranks (a silent exchange of the wrong shards, or a hang). So backward gathers follow a
sequence every rank shares instead: the *entries*, one per hooked forward call whose output requires grad,
in the order the forward post-hooks ran (identical on every rank, since forward order must be). Backward
walks the entries from the last one down with a cursor; the hook on a module's outputs (run before its
backward) pulls the cursor down to that module's entry, *visiting* every entry on the way: a visit gathers
the entry's buckets that have not been gathered since the backward began (the "protocol" view, kept apart
from which buckets this rank still holds). The end-of-backward callback walks the cursor to the bottom, so
every rank makes the same visits in the same order whatever its graph; a visit during that final walk
drops what it gathered at once. A hook whose entry the cursor already passed gathers nothing: its buckets
were gathered by that visit and are either still held or were released because every trainable parameter
in them already had its gradient -- and then no backward node left needs their values.
Not covered: hooks of an older graph (several forwards before one backward, retain_graph, activation
recomputation inside backward) gather what they miss on demand, deterministic only when every rank's
backward graph is the same.

[Note: schedule state machine]
``BackwardSchedule`` holds only what every rank computes alike from the entries and the agreed positions,
so it can be checked with plain data: ``record`` appends an entry during forward; ``begin`` puts the cursor
above the last entry and picks the agreed schedule when the entries are the ones it was learnt on;
``step_to(i)`` moves the cursor one entry down towards ``i`` and returns that ``Visit`` with the buckets
falling due at it ([Note: gradient reduce-scatter] in gradient_reducer.py); ``arrived`` records the visit
count at which a bucket's gradient landed, ``positions`` hands those to the end-of-backward all_reduce, and
``agree`` keeps its result as the next backward's schedule. ``new_forward`` drops the entries and bumps
the serial, so hooks created for an older graph can tell they are stale.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import NamedTuple


class Entry(NamedTuple):
    key: Hashable  # the module (its id): two forwards over the same modules and buckets share a schedule
    gids: tuple[int, ...]  # the buckets its call gathers


class Visit(NamedTuple):
    entry: int  # index of the entry visited
    gids: tuple[int, ...]
    due: tuple[int, ...]  # buckets the agreed schedule reduces at this visit, before its gathers
    number: int  # visits made before this one in this backward


class BackwardSchedule:
    """Entries of the last forward, the cursor of the backward in progress and the agreed reduction order.
    See [Note: backward gathers], [Note: schedule state machine]."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []  # one per hooked forward call whose output requires grad
        self.serial = 0  # bumped when the entries are dropped: hooks carrying an older serial are stale
        self.cursor = 0  # entries[cursor:] were visited in this backward
        self.visits = 0  # visits made in this backward
        self._arrival: dict[int, int] = {}  # gid -> visits made when its last gradient arrived
        self._agreed: list[tuple[int, int]] | None = None  # (position, gid), sorted
        self._agreed_on: tuple | None = None  # the entries the agreed schedule was learnt on
        self._due: list[tuple[int, int]] = []  # this backward's schedule
        self._due_at = 0

    # -- forward ----------------------------------------------------------------------------------------
    def new_forward(self) -> None:
        """A forward begins: the previous graph's entries (and the hooks pointing at them) are stale."""
        self.entries = []
        self.serial += 1

    def record(self, key: Hashable, gids: Iterable[int]) -> int:
        """A hooked call whose output requires grad ended: its entry's index."""
        self.entries.append(Entry(key, tuple(gids)))
        return len(self.entries) - 1

    def current(self, serial: int, index: int | None) -> bool:
        """Whether (serial, index) names an entry of the present forward."""
        return serial == self.serial and index is not None and 0 <= index < len(self.entries)

    # -- backward ---------------------------------------------------------------------------------------
    def begin(self) -> None:
        self.cursor = len(self.entries)
        self.visits = 0
        self._due = self._agreed if self._agreed is not None and tuple(self.entries) == self._agreed_on else []
        self._due_at = 0

    def step_to(self, index: int) -> Visit | None:
        """Visit the next entry down if the cursor is above `index`; None once it is not."""
        if self.cursor <= index:
            return None
        self.cursor -= 1
        k = self.visits
        due = []
        while self._due_at < len(self._due) and self._due[self._due_at][0] <= k:
            due.append(self._due[self._due_at][1])
            self._due_at += 1
        self.visits += 1
        return Visit(self.cursor, self.entries[self.cursor].gids, tuple(due), k)

    def below(self, n: int) -> list[tuple[int, ...]]:
        """The buckets of the (at most) `n` entries under the cursor, nearest first."""
        c = self.cursor
        return [self.entries[j].gids for j in range(c - 1, max(c - 1 - n, -1), -1)]

    def arrived(self, gids: Iterable[int]) -> None:
        """A gradient of these buckets landed now (after the visits made so far)."""
        for gid in gids:
            self._arrival[gid] = self.visits

    def positions(self, gids: Sequence[int]) -> list[int]:
        """Per bucket, the visits made when its last gradient arrived in this backward; -1: none arrived."""
        return [self._arrival.get(g, -1) for g in gids]

    def agree(self, gids: Sequence[int], positions: Sequence[int]) -> None:
        """Keep the positions every rank agreed on (the MAX over ranks of `positions`) as the schedule of the
        next backward over the same entries; a bucket that got no gradient anywhere goes at the end."""
        n = len(self.entries)
        self._agreed = sorted((p if p >= 0 else n, g) for g, p in zip(gids, positions))
        self._agreed_on = tuple(self.entries)

    def end(self) -> None:
        """The backward is over (or abandoned)."""
        self._arrival.clear()
        self._due = []
        self._due_at = 0
