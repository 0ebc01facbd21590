"""tierstore.partition: the layout's guarantees over random models, and the data helpers on real tensors.

The checks read the layout through `locate`/`pieces`/`shard_slice` and the data through `flatten`/`shard`/
`unflatten`, so one path checks the other; the oracle for data is always the original tensors.
"""
from __future__ import annotations

import json
import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierstore.errors import TierstoreError, TierstoreValueError
from tierstore.partition import Location, Plan, plan, reshard_copies, reshard_shards

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.bool, torch.float64]
MiB = 1 << 20

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def random_model(seed: int, n: int, max_numel: int) -> dict:
    """n parameters name -> (shape, dtype): scalars, empty tensors, 1-4 dims, sizes log-uniform up to
    max_numel, dtypes mixed (runs of one dtype too, as in real models)."""
    rng = random.Random(seed)
    specs, dtype = {}, rng.choice(DTYPES)
    for i in range(n):
        if rng.random() < 0.3:
            dtype = rng.choice(DTYPES)
        kind = rng.random()
        if kind < 0.08:
            shape = ()
        elif kind < 0.15:
            shape = tuple(rng.randint(0, 5) for _ in range(rng.randint(1, 3)))
            shape = shape[:-1] + (0,)
        else:
            numel = int(math.exp(rng.uniform(0, math.log(max_numel))))
            ndim = rng.randint(1, 4)
            shape = tuple(max(1, round(numel ** (1 / ndim) * rng.uniform(0.5, 1.5))) for _ in range(ndim))
        specs[f"layer{i // 7}.p{i}"] = (shape, dtype)
    return specs


def make_tensors(specs: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in specs.items():
        if dtype == torch.bool:
            out[name] = torch.randint(0, 2, shape, generator=g).bool()
        elif dtype == torch.int8:
            out[name] = torch.randint(-128, 128, shape, generator=g).to(torch.int8)
        else:
            out[name] = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return out


def assert_same_tensors(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name, t in want.items():
        assert got[name].shape == t.shape and got[name].dtype == t.dtype, name
        assert torch.equal(got[name], t), name


def cap_of(world: int, min_io: int, alignment: int, bucket_bytes: int | None) -> int:
    unit = world * alignment
    b = max(256 * MiB, 2 * world * min_io, unit) if bucket_bytes is None else bucket_bytes
    return b // unit * unit


def check_layout(pl: Plan, specs: dict, world: int, min_io: int, alignment: int, bucket_bytes: int | None):
    """Every guarantee docs/partition.md makes about the layout."""
    cap = cap_of(world, min_io, alignment, bucket_bytes)
    target = min(world * min_io, cap)
    unit = world * alignment
    nbytes = {n: math.prod(s) * d.itemsize for n, (s, d) in specs.items()}
    order = {n: i for i, n in enumerate(specs)}
    assert list(pl.params) == list(specs)
    assert pl.bucket_bytes == cap

    # Buckets: one dtype, packed pieces from 0, equal aligned shards, minimal padding, under the cap.
    for i, b in enumerate(pl.buckets):
        assert b.index == i and b.pieces
        assert b.numel == world * b.shard_numel
        assert b.shard_nbytes % alignment == 0 and b.nbytes % unit == 0
        assert b.nbytes <= cap
        assert 0 <= b.nbytes - b.payload_nbytes < unit
        at = 0
        for p in b.pieces:
            assert specs[p.name][1] == b.dtype
            assert p.bucket == i and p.offset == at and p.numel > 0
            at = p.end
        keys = [(order[p.name], p.param_offset) for p in b.pieces]
        assert keys == sorted(keys), "pieces inside a bucket follow model order"
        for r in range(world):
            s = pl.shard_slice(r, i)
            assert (s.start * b.itemsize) % alignment == 0 and ((s.stop - s.start) * b.itemsize) % alignment == 0
    firsts = [(order[b.pieces[0].name], b.pieces[0].param_offset) for b in pl.buckets]
    assert firsts == sorted(firsts), "buckets follow model order of their first element"

    # Every element of every parameter lands in exactly one (bucket, rank, offset) slot, and no slot holds two.
    slots: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for name, (shape, dtype) in specs.items():
        locs = pl.locate(name)
        at = 0
        for loc in sorted(locs, key=lambda loc: loc.param_offset):
            assert loc.param_offset == at and loc.numel > 0
            b = pl.buckets[loc.bucket]
            assert b.dtype == dtype and 0 <= loc.offset and loc.offset + loc.numel <= b.shard_numel
            slots.setdefault((loc.bucket, loc.rank), []).append((loc.offset, loc.offset + loc.numel))
            at += loc.numel
        assert at == math.prod(shape), name
        if at == 0:
            assert pl.pieces(name) == ()
    for runs in slots.values():
        runs.sort()
        assert all(a[1] <= b[0] for a, b in zip(runs, runs[1:]))

    # Packing: a bucket holds pieces of at most one large parameter; a parameter is cut only when it exceeds
    # the cap, into ceil(bytes / cap) pieces; a request under min_io_bytes only where the model (or the cap)
    # leaves no choice.
    large = {n for n, nb in nbytes.items() if nb and nb >= target}
    for b in pl.buckets:
        assert len({p.name for p in b.pieces} & large) <= 1
    for name, nb in nbytes.items():
        want = 0 if nb == 0 else max(1, math.ceil(nb / cap))
        assert len(pl.pieces(name)) == want, name
        assert (name in pl.split_params) == (want > 1)
    if cap >= 2 * target:
        for b in pl.buckets:
            if any(p.name in pl.split_params for p in b.pieces):
                assert b.shard_nbytes // alignment >= cap // unit // 2, "a piece holds at least half a cap"
            elif b.payload_nbytes < target:
                others = [c for c in pl.buckets if c.dtype == b.dtype and c is not b]
                assert all(c.payload_nbytes + b.payload_nbytes > cap for c in others), (
                    f"bucket {b.index} ({b.payload_nbytes} B < {target} B) could have joined another")
    summary = pl.summary()
    assert summary.payload_bytes == sum(nbytes.values())
    assert summary.payload_bytes + summary.padding_bytes == sum(b.nbytes for b in pl.buckets)
    assert summary.requests_per_rank == len(pl.buckets)
    assert summary.rank_bytes == pl.rank_bytes == sum(b.shard_nbytes for b in pl.buckets)


@st.composite
def options(draw):
    world = draw(st.integers(1, 64))
    alignment = draw(st.sampled_from([8, 64, 512, 4096]))
    min_io = draw(st.sampled_from([0, 1, 4096, 64 << 10, MiB]))
    unit = world * alignment
    # Real caps are MiBs to GiBs; a parameter (up to 128 MiB here) is cut in at most 32 pieces.
    bucket_bytes = draw(st.one_of(st.none(), st.integers(22, 30).map(lambda e: max(unit, 1 << e)),
                                  st.integers(4 << 20, 256 << 20).map(lambda b: max(unit, b))))
    return world, min_io, alignment, bucket_bytes


@settings(max_examples=80, **SETTINGS)
@given(seed=st.integers(0, 2**32), n=st.integers(0, 500), opts=options(), new_world=st.integers(1, 64))
def test_layout_guarantees_on_random_models(seed, n, opts, new_world):
    world, min_io, alignment, bucket_bytes = opts
    specs = random_model(seed, n, max_numel=1 << 24)
    pl = plan(specs, world, min_io_bytes=min_io, alignment=alignment, bucket_bytes=bucket_bytes)
    check_layout(pl, specs, world, min_io, alignment, bucket_bytes)

    # Deterministic, and serialisable through JSON into an equal plan.
    assert plan(specs, world, min_io_bytes=min_io, alignment=alignment, bucket_bytes=bucket_bytes) == pl
    again = Plan.from_dict(json.loads(json.dumps(pl.to_dict())))
    assert again == pl and again.to_dict() == pl.to_dict()
    assert [again.locate(name) for name in specs] == [pl.locate(name) for name in specs]

    # reshard is planning again for the new world; the copies between the two cover every element once.
    if bucket_bytes is not None and bucket_bytes < new_world * alignment:
        with pytest.raises(TierstoreValueError, match="bucket_bytes"):
            pl.reshard(new_world)
        return
    other = pl.reshard(new_world)
    assert other == plan(specs, new_world, min_io_bytes=min_io, alignment=alignment, bucket_bytes=bucket_bytes)
    copies = reshard_copies(pl, other)
    assert sum(c.numel for c in copies) == sum(math.prod(s) for s, _ in specs.values())
    for c in copies:
        assert pl.buckets[c.src_bucket].dtype == other.buckets[c.dst_bucket].dtype
        assert c.src_offset + c.numel <= pl.buckets[c.src_bucket].shard_numel
        assert c.dst_offset + c.numel <= other.buckets[c.dst_bucket].shard_numel


@st.composite
def small_models(draw):
    """Models with real data: 0-500 parameters of at most 64 elements, every dtype, scalars and empties."""
    seed = draw(st.integers(0, 2**32))
    n = draw(st.one_of(st.integers(0, 12), st.integers(0, 500)))
    return random_model(seed, n, max_numel=64)


@st.composite
def small_options(draw):
    world = draw(st.integers(1, 64))
    alignment = draw(st.sampled_from([8, 16, 64]))
    min_io = draw(st.sampled_from([0, 1, 16, 256]))
    bucket_bytes = draw(st.one_of(st.none(), st.integers(1, 8).map(lambda k: k * world * alignment)))
    return world, min_io, alignment, bucket_bytes


@settings(max_examples=60, **SETTINGS)
@given(specs=small_models(), opts=small_options())
def test_flatten_shard_gather_is_identity(specs, opts):
    world, min_io, alignment, bucket_bytes = opts
    pl = plan(specs, world, min_io_bytes=min_io, alignment=alignment, bucket_bytes=bucket_bytes)
    check_layout(pl, specs, world, min_io, alignment, bucket_bytes)
    tensors = make_tensors(specs)
    flat = [pl.flatten(tensors, b) for b in pl.buckets]
    for b, t in zip(pl.buckets, flat):
        assert not t[b.payload_numel:].any(), "padding is zeros"
    shards = {(b.index, r): pl.shard(flat[b.index], b, r) for b in pl.buckets for r in range(world)}
    for (i, r), s in shards.items():
        assert s.numel() == pl.buckets[i].shard_numel
        assert torch.equal(pl.flatten_shard(tensors, i, r), s)
    # Each rank holds only its shards; concatenating every rank's shard of a bucket gives the bucket back.
    gathered = [torch.cat([shards[b.index, r] for r in range(world)]) for b in pl.buckets]
    assert_same_tensors(pl.unflatten(gathered), tensors)

    # Zero-copy views of whole parameters; copies back into parameter tensors for every piece.
    for b, t in zip(pl.buckets, gathered):
        for name, v in pl.views(t, b).items():
            assert name not in pl.split_params
            assert v.data_ptr() >= t.data_ptr() and torch.equal(v, tensors[name])
    restored = {n: torch.zeros_like(t) for n, t in tensors.items()}
    for b, t in zip(pl.buckets, gathered):
        pl.unflatten_into(t, b, restored)
    assert_same_tensors(restored, tensors)


@settings(max_examples=60, **SETTINGS)
@given(specs=small_models(), opts=small_options(), new_world=st.integers(1, 64),
       new_alignment=st.sampled_from([8, 32, 64]), data=st.data())
def test_reshard_round_trip(specs, opts, new_world, new_alignment, data):
    world, min_io, alignment, bucket_bytes = opts
    src = plan(specs, world, min_io_bytes=min_io, alignment=alignment, bucket_bytes=bucket_bytes)
    dst = src.reshard(new_world, alignment=new_alignment, bucket_bytes=None)
    tensors = make_tensors(specs)
    saved = {(b.index, r): src.flatten_shard(tensors, b, r) for b in src.buckets for r in range(world)}

    moved = reshard_shards(src, dst, saved)
    assert set(moved) == {(b.index, r) for b in dst.buckets for r in range(new_world)}
    for (i, r), t in moved.items():
        assert torch.equal(t, dst.flatten_shard(tensors, i, r)), (i, r)
    gathered = [torch.cat([moved[b.index, r] for r in range(new_world)]) for b in dst.buckets]
    assert_same_tensors(dst.unflatten(gathered), tensors)
    back = reshard_shards(dst, src, moved)
    assert set(back) == set(saved) and all(torch.equal(back[k], saved[k]) for k in saved)

    # One rank resuming reads each source shard it needs once, and only those.
    rank = data.draw(st.integers(0, new_world - 1))
    loaded = []

    def load(bucket, r):
        loaded.append((bucket, r))
        return saved[bucket, r]

    mine = reshard_shards(src, dst, load, dst_ranks=[rank])
    assert set(mine) == {(b.index, rank) for b in dst.buckets}
    assert all(torch.equal(t, moved[k]) for k, t in mine.items())
    assert len(loaded) == len(set(loaded))
    assert set(loaded) == {(c.src_bucket, c.src_rank) for c in reshard_copies(src, dst, dst_ranks=[rank])}


# ------------------------------------------------------------------------------------------------------------
# Worked examples


def test_small_parameters_are_packed_and_large_ones_stand_alone():
    f32 = torch.float32
    specs = {"ln.w": ((1024,), f32), "ln.b": ((1024,), f32), "fc.w": ((1024, 1024), f32), "fc.b": ((1024,), f32),
             "out.w": ((512, 1024), f32), "out.b": ((1024,), f32), "h.w": ((256, 1024), f32),
             "h.b": ((256,), f32)}
    pl = plan(specs, 2, min_io_bytes=1 << 20, alignment=4096)
    # 2 ranks x 1 MiB: parameters of >= 2 MiB stand alone (fc.w 4 MiB, out.w 2 MiB). The small ones
    # (h.w 1 MiB and the vectors) pack into one bucket that never reaches 2 MiB; rather than make requests
    # of ~0.5 MiB it joins the nearest bucket of its dtype, keeping model order inside it.
    assert [b.names for b in pl.buckets] == [("ln.w", "ln.b", "fc.w", "fc.b", "out.b", "h.w", "h.b"), ("out.w",)]
    assert all(b.shard_nbytes >= 1 << 20 for b in pl.buckets)
    # With room for it, the same small parameters would form their own packed bucket.
    more = dict(specs, **{"h2.w": ((256, 1024), f32)})
    names = [b.names for b in plan(more, 2, min_io_bytes=1 << 20, alignment=4096).buckets]
    assert names == [("ln.w", "ln.b", "fc.b", "out.b", "h.w", "h.b", "h2.w"), ("fc.w",), ("out.w",)]


def test_worked_example_locate_and_views():
    f32 = torch.float32
    specs = {"a": ((2, 3), f32), "b": ((), f32), "c": ((0, 5), f32), "d": ((10,), f32)}
    pl = plan(specs, 2, min_io_bytes=1 << 20, alignment=16)
    # All four fit in one bucket (the model is smaller than one 1 MiB request): 17 floats, padded to 2 x 12.
    assert len(pl.buckets) == 1
    b = pl.buckets[0]
    assert b.names == ("a", "b", "d") and b.numel == 24 and b.shard_numel == 12 and b.payload_numel == 17
    assert pl.shard_slice(1, 0) == slice(12, 24)
    assert pl.locate("a") == [Location(0, 0, 0, 0, 6)]
    assert pl.locate("d") == [Location(0, 0, 7, 0, 5), Location(0, 1, 0, 5, 5)]
    assert pl.locate("c") == [] and pl.pieces("c") == ()
    flat = torch.arange(24, dtype=f32)
    v = pl.views(flat, 0)
    assert set(v) == {"a", "b", "d"}
    assert torch.equal(v["a"], torch.tensor([[0., 1, 2], [3, 4, 5]])) and v["b"].shape == ()
    v["b"].fill_(-1)
    assert flat[6] == -1, "views write the bucket"
    assert torch.equal(pl.shard(flat, 0, 1), flat[12:])
    out = pl.unflatten([flat])
    assert out["c"].shape == (0, 5) and torch.equal(out["d"], torch.arange(7, 17, dtype=f32))


def test_parameter_larger_than_bucket_bytes_is_split():
    specs = {"emb": ((1000, 10), torch.float32), "bias": ((10,), torch.float32)}
    # unit = 4 ranks * 64 B = 256 B (64 floats); cap 4096 B (1024 floats = 16 units): emb's 10000 floats need
    # 157 units -> 10 pieces of 15 or 16 units, the larger last; only the last is padded (976 + 48 floats).
    pl = plan(specs, 4, min_io_bytes=64, alignment=64, bucket_bytes=4096 + 100)
    assert pl.bucket_bytes == 4096
    assert pl.split_params == ("emb",)
    pieces = pl.pieces("emb")
    assert [p.numel for p in pieces] == [960] * 3 + [1024] * 6 + [976]
    assert [p.param_offset for p in pieces] == [0, 960, 1920] + list(range(2880, 10000, 1024))
    assert all(p.offset == 0 for p in pieces)
    tensors = make_tensors(specs)
    flat = {b.index: pl.flatten(tensors, b) for b in pl.buckets}
    # No bucket can view all of emb; views give the whole parameters only.
    assert all("emb" not in pl.views(t, i) for i, t in flat.items())
    assert any("bias" in pl.views(t, i) for i, t in flat.items())
    assert_same_tensors(pl.unflatten(flat), tensors)
    # locate: 10000 floats over 10 buckets of 4 shards of 256 floats.
    locs = pl.locate("emb")
    assert sum(loc.numel for loc in locs) == 10000 and all(loc.numel <= 256 for loc in locs)


def test_inputs_module_iterable_mapping_and_meta_tensors():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(100, 16), torch.nn.Linear(16, 100, bias=True))
    model[1].weight = model[0].weight  # tied: planned once
    from_module = plan(model, 4, alignment=64)
    assert list(from_module.params) == ["0.weight", "1.bias"]
    from_iter = plan(list(model.named_parameters()), 4, alignment=64)
    from_meta = plan({n: torch.empty(p.shape, dtype=p.dtype, device="meta") for n, p in model.named_parameters()},
                     4, alignment=64)
    from_specs = plan({"0.weight": ([100, 16], "float32"), "1.bias": (torch.Size([100]), "torch.float32")}, 4,
                      alignment=64)
    assert from_module == from_iter == from_meta == from_specs
    tensors = dict(model.named_parameters())
    flat = [from_module.flatten(tensors, b) for b in from_module.buckets]
    with torch.no_grad():
        assert_same_tensors(from_module.unflatten(flat), {n: t.detach() for n, t in tensors.items()})


def test_empty_model_and_empty_parameters():
    for specs in ({}, {"e": ((0,), torch.float32), "f": ((3, 0), torch.int8)}):
        pl = plan(specs, 8)
        assert pl.buckets == () and pl.rank_bytes == 0
        assert Plan.from_dict(pl.to_dict()) == pl
        out = pl.unflatten([])
        assert [tuple(t.shape) for t in out.values()] == [s for s, _ in specs.values()]
        assert "no requests" in str(pl.summary())
        assert reshard_shards(pl, pl.reshard(3), {}) == {}


def test_one_rank_and_exact_fit():
    # 1024 bf16 = 2 KiB = 2 ranks x 1 KiB shards exactly: no padding at all.
    pl = plan({"w": ((1024,), torch.bfloat16)}, 2, alignment=1024, min_io_bytes=0)
    assert pl.buckets[0].numel == 1024 and pl.summary().padding_bytes == 0
    pl1 = plan({"w": ((3,), torch.float32)}, 1, alignment=4096)
    assert pl1.buckets[0].shard_nbytes == 4096 and pl1.locate("w") == [Location(0, 0, 0, 0, 3)]


def test_summary_text():
    pl = plan({f"b{i}": ((256,), torch.float32) for i in range(100)}, 4, min_io_bytes=4096, alignment=4096)
    s = pl.summary()
    assert s.requests_per_rank == len(pl.buckets) and s.request_bytes_min >= 4096
    text = str(pl)
    assert "100 parameters" in text and "requests of" in text and "% of the model" in text and "4096 bytes" in text
    assert s.padding_pct == pytest.approx(100 * s.padding_bytes / (100 * 256 * 4))


def test_dict_format_is_stable():
    """The serialised layout is what checkpoints keep: a change here must be deliberate (bump FORMAT)."""
    specs = {"a": ((2, 3), torch.bfloat16), "big": ((40,), torch.float32), "m": ((5,), torch.bool),
             "s": ((), torch.float32)}
    pl = plan(specs, 2, min_io_bytes=32, alignment=16, bucket_bytes=64)
    assert pl.to_dict() == {
        "format": "tierstore.partition/1", "world_size": 2, "min_io_bytes": 32, "alignment": 16, "bucket_bytes": 64,
        "params": [["a", [2, 3], "bfloat16"], ["big", [40], "float32"], ["m", [5], "bool"], ["s", [], "float32"]],
        "buckets": [
            {"dtype": "bfloat16", "numel": 16, "pieces": [["a", 0, 6]]},
            {"dtype": "float32", "numel": 16, "pieces": [["big", 0, 8], ["s", 0, 1]]},
            {"dtype": "float32", "numel": 16, "pieces": [["big", 8, 16]]},
            {"dtype": "float32", "numel": 16, "pieces": [["big", 24, 16]]},
            {"dtype": "bool", "numel": 32, "pieces": [["m", 0, 5]]},
        ]}


# ------------------------------------------------------------------------------------------------------------
# Errors say what was wrong and how to fix it


def test_bad_options_and_inputs():
    f32 = {"w": ((4,), torch.float32)}
    cases = [
        (lambda: plan(f32, 0), "world_size"),
        (lambda: plan(f32, 2, alignment=0), "alignment"),
        (lambda: plan(f32, 2, alignment=6), "multiple of the 4-byte itemsize"),
        (lambda: plan(f32, 2, min_io_bytes=-1), "min_io_bytes"),
        (lambda: plan(f32, 4, alignment=4096, bucket_bytes=8192), "world_size \\* alignment"),
        (lambda: plan(f32, True), "world_size"),
        (lambda: plan([("w", ((4,), torch.float32)), ("w", ((4,), torch.float32))], 2), "twice"),
        (lambda: plan({"w": ((-1,), torch.float32)}, 2), "shape"),
        (lambda: plan({"w": ((2.5,), torch.float32)}, 2), "shape"),
        (lambda: plan({"w": ((4,), "floaty")}, 2), "dtype"),
        (lambda: plan({"w": 3}, 2), "neither a tensor"),
        (lambda: plan({1: ((4,), torch.float32)}, 2), "str"),
        (lambda: plan("w", 2), "mapping"),
        (lambda: plan([("w",)], 2), "pair"),
    ]
    for fn, match in cases:
        with pytest.raises(TierstoreValueError, match=match):
            fn()
    assert issubclass(TierstoreValueError, ValueError) and issubclass(TierstoreValueError, TierstoreError)


def test_bad_tensors():
    specs = {"a": ((3,), torch.float32), "b": ((2, 2), torch.float32)}
    pl = plan(specs, 2, alignment=16)
    t = make_tensors(specs)
    flat = pl.flatten(t, 0)
    with pytest.raises(TierstoreValueError, match="pass it in the tensors mapping"):
        pl.flatten({"a": t["a"]}, 0)
    with pytest.raises(TierstoreValueError, match="the plan says"):
        pl.flatten({"a": t["a"], "b": t["b"].double()}, 0)
    with pytest.raises(TierstoreValueError, match="1-D float32 tensor of 8 elements"):
        pl.views(flat[:-1], 0)
    with pytest.raises(TierstoreValueError, match="out"):
        pl.flatten(t, 0, out=torch.empty(3))
    with pytest.raises(TierstoreValueError, match="rank 2"):
        pl.shard(flat, 0, 2)
    with pytest.raises(TierstoreValueError, match="bucket 5"):
        pl.shard_slice(0, 5)
    with pytest.raises(TierstoreValueError, match="not a parameter"):
        pl.locate("zz")
    with pytest.raises(TierstoreValueError, match="contiguous"):
        pl.unflatten_into(flat, 0, {"a": t["a"], "b": torch.zeros(2, 2).t()})
    with pytest.raises(TierstoreValueError, match="all 1 buckets"):
        pl.unflatten([])
    with pytest.raises(TierstoreValueError, match="different parameters"):
        reshard_copies(pl, plan({"a": ((3,), torch.float32)}, 2))
    with pytest.raises(TierstoreValueError, match="in the destination"):
        reshard_copies(pl, plan({"a": ((3,), torch.float32), "b": ((4,), torch.float32)}, 2))
    with pytest.raises(TierstoreValueError, match="source shard"):
        reshard_shards(pl, pl.reshard(1), {(0, 0): torch.zeros(3), (0, 1): torch.zeros(4)})
    with pytest.raises(TierstoreValueError, match="unknown options"):
        pl.reshard(3, world_size=2)


def test_from_dict_refuses_damaged_layouts():
    pl = plan({"a": ((10,), torch.float32), "b": ((3,), torch.int8)}, 2, alignment=16, min_io_bytes=0)
    good = pl.to_dict()

    def damaged(edit):
        d = json.loads(json.dumps(good))
        edit(d)
        return d

    bad = [
        damaged(lambda d: d.update(format="tierstore.partition/0")),
        damaged(lambda d: d["buckets"][0]["pieces"][0].__setitem__(2, 9)),  # loses an element
        damaged(lambda d: d["buckets"][0]["pieces"][0].__setitem__(1, 1)),  # does not start at 0
        damaged(lambda d: d["buckets"][0].update(numel=10)),  # 5-float shards are not 16-byte aligned
        damaged(lambda d: d["buckets"][0].update(numel=4)),  # pieces overflow
        damaged(lambda d: d["buckets"][0].update(dtype="float16")),  # not the parameter's dtype
        damaged(lambda d: d["buckets"][1]["pieces"].append(["a", 0, 1])),  # an element twice
        damaged(lambda d: d["buckets"][1]["pieces"][0].__setitem__(0, "zz")),  # unknown parameter
        damaged(lambda d: d["buckets"][1].pop("pieces")),
        damaged(lambda d: d["buckets"][1]["pieces"][0].__setitem__(2, 3.0)),
        damaged(lambda d: d.update(world_size=0)),
        damaged(lambda d: d["params"].pop()),
        [],
    ]
    assert Plan.from_dict(good) == pl
    for d in bad:
        with pytest.raises(TierstoreValueError):
            Plan.from_dict(d)
