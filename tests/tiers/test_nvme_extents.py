"""The nvme tier's extents and commit protocol on their own: plain data, no files, no I/O
(tierstore/tiers/nvme/extents.py; see [Note: space is never reused before the manifest stops pointing at it])."""
from __future__ import annotations

from concurrent.futures import Future

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tierstore.errors import CorruptionError, MisuseError, TierFullError, TierstoreValueError
from tierstore.io import ALIGN
from tierstore.tiers.nvme.extents import Extent, ExtentAllocator, ExtentSpace

P = ALIGN  # bytes: one page, the allocation unit


def new_extent(space: ExtentSpace, pages: int, written: Future | None = None) -> Extent:
    f, off = space.allocate(pages * P)
    return Extent(f, off, pages * P, pages * P, 0, written)


def overlaps(a: Extent, b: Extent) -> bool:
    return a.file == b.file and a.offset < b.offset + b.alloc and b.offset < a.offset + a.alloc


# -- the allocator -------------------------------------------------------------------------------------

def test_allocator_first_fit_merges_frees_and_opens_a_file_when_full():
    a = ExtentAllocator(4 * P)
    assert [a.alloc(P) for _ in range(4)] == [(0, 0), (0, P), (0, 2 * P), (0, 3 * P)]
    assert a.alloc(2 * P) == (1, 0)  # file 0 is full
    a.free(0, P, P)
    a.free(0, 2 * P, P)  # merged with the span before
    assert a.free_spans[0] == [(P, 2 * P)]
    assert a.alloc(P) == (0, P)  # first fit in freed space, before the end of file 1
    a.free(0, 3 * P, P)  # the last span of file 0: its end moves back, over the free span before it
    assert a.free_spans[0] == [] and a.ends[0] == 2 * P
    assert a.alloc(5 * P) == (2, 0)  # larger than a file: a file of its own


def test_allocator_rebuild_frees_everything_a_manifest_does_not_name():
    a = ExtentAllocator(16 * P)
    a.rebuild([(0, 2 * P, P), (0, 5 * P, 2 * P), (1, 0, P), (0, 0, 0)])
    assert a.free_spans == [[(0, 2 * P), (3 * P, 2 * P)], []] and a.ends == [7 * P, P]


def test_allocator_refuses_a_file_size_that_is_not_whole_pages():
    with pytest.raises(TierstoreValueError, match="extent_file_bytes"):
        ExtentAllocator(P + 1)


# -- the commit protocol -------------------------------------------------------------------------------

def test_a_committed_extent_is_reused_only_after_a_manifest_without_it_is_durable():
    s = ExtentSpace(64 * P)
    old = new_extent(s, 1)
    s.protect([old])
    s.commit_done([old])  # a manifest naming `old` is durable
    s.free(old)  # replaced by a newer version
    assert s.pending_free() == [old]
    new = new_extent(s, 1)
    assert not overlaps(new, old)
    s.protect([new])
    s.commit_done([new])  # the manifest naming `new`, not `old`, is durable
    assert s.pending_free() == [] and s.budget.used == P
    assert s.allocate(P) == (old.file, old.offset)


def test_freed_while_the_manifest_naming_it_was_written_stays_pending_for_the_next():
    s = ExtentSpace(64 * P)
    e = new_extent(s, 1)
    s.protect([e])
    s.free(e)  # deleted after the snapshot that names it
    s.commit_done([e])
    assert s.pending_free() == [e] and e.committed
    s.commit_done([])
    assert s.pending_free() == [] and s.budget.used == 0


def test_unprotect_frees_what_only_the_unwritten_manifest_kept():
    s = ExtentSpace(64 * P)
    e = new_extent(s, 2)
    protected = s.protect([e])
    s.free(e)
    assert s.budget.used == 2 * P  # pending: the manifest may become durable
    s.unprotect(protected)  # it did not
    assert not e.committed and s.pending_free() == [] and s.budget.used == 0


def test_unfree_keeps_a_committed_version_the_tensor_reverts_to():
    s = ExtentSpace(64 * P)
    e = new_extent(s, 1)
    s.protect([e])
    s.commit_done([e])
    s.free(e)
    s.unfree(e)  # the newer version's write failed: the tensor is back at `e`
    s.commit_done([e])
    assert not e.freed and e.committed and s.budget.used == P
    assert s.allocate(P) != (e.file, e.offset)


def test_space_is_freed_after_its_write_finishes():
    s = ExtentSpace(64 * P)
    w: Future = Future()
    e = new_extent(s, 1, w)
    s.free(e)
    assert s.budget.used == P and s.allocate(P) != (e.file, e.offset)  # still being written
    w.set_result(P)
    assert s.allocate(P) == (e.file, e.offset)  # the next allocation takes the finished write's space back first
    assert s.budget.used == 2 * P


def test_space_is_freed_by_its_last_reader_and_a_freed_extent_cannot_be_read():
    s = ExtentSpace(64 * P)
    e = new_extent(s, 1)
    s.begin_read(e)
    s.begin_read(e)
    s.free(e)
    s.end_read(e)
    assert s.budget.used == P
    s.end_read(e)
    assert s.budget.used == 0
    with pytest.raises(MisuseError, match="was freed"):
        s.begin_read(e)


def test_a_full_budget_refuses_and_changes_nothing():
    s = ExtentSpace(64 * P, budget_bytes=2 * P)
    new_extent(s, 1)
    with pytest.raises(TierFullError, match="raise budgets.'nvme'. or delete tensors"):
        s.allocate(2 * P)
    assert s.budget.used == P and s.alloc.ends == [P]


def test_check_refuses_a_missing_file_or_overlapping_extents_naming_the_field():
    s = ExtentSpace(64 * P)
    a, b = Extent(0, 0, 2 * P, 2 * P, 0), Extent(0, P, P, P, 0)
    def names(*ns):
        return lambda i: ns[i]
    with pytest.raises(CorruptionError, match=r"field b\.file: extent file extents-0001\.bin does not exist"):
        s.check([a, Extent(1, 0, P, P, 0)], "m.json", 1, names("a", "b"))
    with pytest.raises(CorruptionError, match="field b: its extent overlaps that of a"):
        s.check([a, b], "m.json", 1, names("a", "b"))
    s.check([a, Extent(0, 2 * P, P, P, 0), Extent(0, 0, 0, 0, 0)], "m.json", 1, names("a", "b", "empty"))


def test_adopt_makes_the_manifest_the_only_used_space():
    s = ExtentSpace(64 * P)
    new_extent(s, 8)
    kept = [Extent(0, 2 * P, P, P, 0), Extent(0, 4 * P, 2 * P, 2 * P, 0)]
    s.adopt(kept)
    assert s.budget.used == 3 * P and s.alloc.free_spans[0] == [(0, 2 * P), (3 * P, P)]


# -- a state machine: random allocations, frees, reads, writes and commits -----------------------------

class SpaceMachine(RuleBasedStateMachine):
    """The model: `live` extents (tensors' current copies), the manifests that are or may become durable,
    reads and writes in flight. The space of any of them is never handed out again."""

    def __init__(self):
        super().__init__()
        self.space = ExtentSpace(8 * P)  # small files: allocations spread over several
        self.live: list[Extent] = []
        self.manifests: list[list[Extent]] = []  # [last durable, then any that may become durable]
        self.writing: tuple[list[Extent], list[Extent]] | None = None  # (snapshot, newly protected)
        self.reading: list[Extent] = []  # one entry per begin_read
        self.writes: list[Future] = []  # not yet finished
        self.all: list[Extent] = []  # every extent handed out

    @initialize(layout=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 3)), max_size=6))
    def reopen(self, layout):
        """A store reopened from a manifest naming extents with gaps between them."""
        pos, exts = 0, []
        for gap, pages in layout:
            pos += gap * P
            exts.append(Extent(0, pos, pages * P, pages * P, 0))
            exts[-1].committed = True
            pos += pages * P
        self.space.adopt(exts)
        self.live = list(exts)
        self.manifests = [list(exts)]

    def held(self) -> list[Extent]:
        """Every extent whose space must not be reused now."""
        out = {id(e): e for e in self.live}
        for m in self.manifests:
            out.update((id(e), e) for e in m)
        if self.writing is not None:
            out.update((id(e), e) for e in self.writing[0])
        out.update((id(e), e) for e in self.reading)
        out.update((id(e), e) for e in self.all if e.written is not None and not e.written.done())
        return list(out.values())

    @rule(pages=st.integers(1, 3), in_flight=st.booleans())
    def put(self, pages, in_flight):
        w: Future | None = Future() if in_flight else None
        e = new_extent(self.space, pages, w)
        held = self.held()
        clash = [h for h in held if overlaps(h, e)]
        assert not clash, f"{e!r} handed out over {clash}"
        # right after an allocation (finished writes taken back), the budget counts exactly what is held
        assert self.space.budget.used == sum(h.alloc for h in held) + e.alloc
        self.all.append(e)
        self.live.append(e)
        if w is not None:
            self.writes.append(w)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def delete(self, data):
        e = data.draw(st.sampled_from(self.live))
        self.live.remove(e)
        self.space.free(e)

    @precondition(lambda self: self.writes)
    @rule(data=st.data())
    def write_finishes(self, data):
        w = data.draw(st.sampled_from(self.writes))
        self.writes.remove(w)
        w.set_result(0)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def read_begins(self, data):
        e = data.draw(st.sampled_from(self.live))
        self.space.begin_read(e)
        self.reading.append(e)

    @precondition(lambda self: self.reading)
    @rule(data=st.data())
    def read_ends(self, data):
        e = data.draw(st.sampled_from(self.reading))
        self.reading.remove(e)
        self.space.end_read(e)

    @precondition(lambda self: self.writing is None)
    @rule()
    def flush_begins(self):
        snapshot = list(self.live)
        self.writing = (snapshot, self.space.protect(snapshot))
        self.manifests.append(snapshot)  # from now on it may become durable

    @precondition(lambda self: self.writing is not None)
    @rule()
    def manifest_durable(self):
        snapshot, _ = self.writing
        self.writing = None
        self.space.commit_done(snapshot)
        self.manifests = [snapshot]

    @precondition(lambda self: self.writing is not None)
    @rule()
    def manifest_not_written(self):
        _, protected = self.writing
        self.writing = None
        self.manifests.pop()
        self.space.unprotect(protected)

    @precondition(lambda self: self.writing is not None)
    @rule()
    def manifest_renamed_but_not_durable(self):
        """The directory fsync failed after the rename: either manifest may be the one found after a crash."""
        self.writing = None

    @precondition(lambda self: self.writing is None and self.reverts())
    @rule(data=st.data())
    def failed_write_reverts(self, data):
        """A tensor's newer version failed to write: it is back at the version the last manifest names."""
        e = data.draw(st.sampled_from(self.reverts()))
        self.space.unfree(e)
        self.live.append(e)

    def reverts(self) -> list[Extent]:
        live = {id(e) for e in self.live}
        return [e for e in self.manifests[-1] if id(e) not in live] if self.manifests else []

    @invariant()
    def held_space_is_allocated_and_disjoint(self):
        held = self.held()
        a = self.space.alloc
        for i, e in enumerate(held):
            if not e.alloc:
                continue
            assert e.file < len(a.ends) and e.offset + e.alloc <= a.ends[e.file], f"{e!r} is past the used space"
            for start, n in a.free_spans[e.file]:
                assert e.offset + e.alloc <= start or start + n <= e.offset, f"{e!r} is in free span {start, n}"
            assert not any(overlaps(e, h) for h in held[i + 1:])


TestSpaceMachine = SpaceMachine.TestCase
TestSpaceMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
