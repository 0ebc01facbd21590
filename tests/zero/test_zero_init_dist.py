"""zero.Init at world size 2 (gloo, ranks forked from one forkserver): each rank keeps about 1/N of the model
while building it, the optimizer's shards equal a plain build's bit for bit (fp32, bf16, fp16; -0.0, inf and
NaN payloads kept), training matches, and mismatched groups or unclaimed parameters fail clearly."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

from tests.support import Deep, batches, loss_fn, peak_growth, rss_follows_live_memory, run_ranks
from tierstore.errors import MisuseError, TierstoreValueError
from tierstore.zero import Init, OffloadConfig, Zero3Optimizer

WORLD = 2


def zcfg(root, name, **kw):
    kw.setdefault("min_io_bytes", 1024)
    kw.setdefault("sub_group_bytes", 8192)  # several buckets, and parameters split over buckets
    return OffloadConfig(nvme_paths=[os.path.join(root, name)], **kw)


class Mixed(nn.Module):
    """Odd sizes (uneven slices), a 1-element parameter (rank 1 holds none of it), a 10000-element parameter
    (split over buckets, several Init chunks), a frozen parameter, a tied weight and special values."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.a = nn.Linear(7, 5, dtype=dtype)
        self.big = nn.Parameter(torch.randn(100, 100, dtype=dtype) * 0.01)
        self.b = nn.Linear(5, 100, dtype=dtype)
        self.scale = nn.Parameter(torch.ones(1, dtype=dtype))
        self.frozen = nn.Parameter(torch.randn(33, dtype=dtype), requires_grad=False)
        self.head = nn.Linear(100, 5, bias=False, dtype=dtype)
        self.tail = nn.Linear(5, 100, bias=False, dtype=dtype)
        self.tail.weight = self.b.weight  # tied

    def forward(self, x):
        h = torch.tanh(self.a(x.to(self.a.weight.dtype)))
        h = torch.tanh(self.b(h) @ self.big) * self.scale + self.frozen.sum() + self.tail(h).mean()
        return self.head(h)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def _same_bits(a: dict, b: dict) -> list[str]:
    return [k for k in b if a[k].dtype != b[k].dtype or not torch.equal(_bits(a[k]), _bits(b[k]))]


def _masters(opt) -> dict:
    return {f"m{gid}": sg["master"] for gid, sg in opt.state_dict()["subgroups"].items()}


NAN = 0x7FC01234  # an fp32 NaN with a payload


class MixedNaN(Mixed):
    """Mixed with -0.0, inf, -inf, +0.0 and a NaN with a payload in its own parameter `big` (set before Init
    offloads it: the outermost __init__ has not returned yet)."""

    def __init__(self, dtype=torch.float32):
        super().__init__(dtype)
        nan = torch.tensor([NAN], dtype=torch.int32).view(torch.float32)
        with torch.no_grad():
            self.big[0, :5] = torch.cat([torch.tensor([-0.0, float("inf"), -float("inf"), 0.0]), nan]).to(dtype)


# -- scenarios, run in every rank ------------------------------------------------------------------------------

def sc_memory(rank, world, root):
    """Peak RSS growth while building 12 x 4 MiB layers under Init (params on host: what a rank keeps stays in
    memory, so the 1/N is what is measured), then the shards equal a plain build's."""
    rss_follows_live_memory()
    c = zcfg(root, f"mem{rank}", params="host", optimizer_states="host", gradients="host",
             sub_group_bytes=8 << 20, min_io_bytes=1 << 20, pinned_bytes=4 << 20)
    torch.manual_seed(0)
    plain_growth, plain = peak_growth(lambda: Deep())
    plain_full = _gather_plain(plain, c)
    del plain
    with Init(c) as init:
        Deep(layers=1)  # warm up (engine threads, lazy imports): see test_zero_init._measure_build
        stored_before = init.offloaded_bytes
        torch.manual_seed(0)
        grown, model = peak_growth(lambda: Deep())
        stored = init.offloaded_bytes - stored_before
    opt = Zero3Optimizer(model, torch.optim.SGD, lr=0.1, config=c)
    mismatched = _same_bits(opt.full_state_dict(), plain_full)
    left = init.stored_chunks  # chunks still stored: none (the warm-up layer, never taken, freed them when dropped)
    opt.close()
    return {"plain": plain_growth, "grown": grown, "stored": stored, "mismatched": mismatched, "left": left}


def _gather_plain(model, c):
    opt = Zero3Optimizer(model, torch.optim.SGD, lr=0.1, config=OffloadConfig(
        params="host", optimizer_states="host", gradients="host", sub_group_bytes=c.sub_group_bytes,
        min_io_bytes=c.min_io_bytes, nvme_paths=[c.nvme_paths[0] + "-plain"]))
    full = opt.full_state_dict()
    opt.close()
    return full


CASES = [  # (model dtype, compute dtype, params tier)
    (torch.float32, torch.float32, "nvme"),
    (torch.bfloat16, torch.bfloat16, "host"),
    (torch.float32, torch.bfloat16, "nvme"),
    (torch.float16, torch.float16, "device"),
]


def sc_bits(rank, world, root):
    """Init build vs plain build, same seed: gathered parameters and fp32 masters bit for bit."""
    import tierstore.zero.params.init as zinit
    zinit.CHUNK_MIN_BYTES = 0  # (this rank's later scenarios too) chunks of sub_group_bytes, 8 KiB: big's slice spans 3
    out = {}
    for i, (mdt, cdt, tier) in enumerate(CASES):
        groups = [{"params": ["a.weight", "a.bias"], "weight_decay": 0.0}, {"params": ["big", "b.weight"]}]
        res = {}
        for how in ("plain", "init"):
            c = zcfg(root, f"bits{i}-{how}", params=tier, compute_dtype=cdt)
            torch.manual_seed(5)
            if how == "init":
                with Init(c) as init:
                    m = MixedNaN(mdt)
                res["stored"] = init.offloaded_bytes
            else:
                m = MixedNaN(mdt)
            m.extra = nn.Parameter(torch.full((3,), 2.5, dtype=mdt))  # added after Init: a plain parameter
            opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, param_groups=groups, config=c)
            res[how] = (opt.full_state_dict(), _masters(opt))
            opt.close()
        full_ok = _same_bits(res["init"][0], res["plain"][0])
        masters_ok = _same_bits(res["init"][1], res["plain"][1])
        special = res["init"][0]["big"][0, :5]
        out[i] = {"full": full_ok, "masters": masters_ok, "special": special,
                  "stored": res["stored"], "numel": len(res["init"][1])}
    return out


def sc_training(rank, world, root):
    """Ten AdamW steps on rank shards of the batch: the Init-built model equals the plain-built one."""
    res = {}
    for how in ("plain", "init"):
        c = zcfg(root, f"train-{how}", params="nvme", optimizer_states="host", gradients="host")
        torch.manual_seed(2)
        if how == "init":
            with Init(c):
                m = Mixed()
        else:
            m = Mixed()
        opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, config=c)
        for x, y in batches(10, d=7, o=5):
            loss_fn(m, x.chunk(world)[rank], y.chunk(world)[rank]).backward()
            opt.step()
            opt.zero_grad()
        res[how] = opt.full_state_dict()
        opt.close()
    return {"mismatched": _same_bits(res["init"], res["plain"]),
            "moved": not torch.equal(res["init"]["big"], _initial_big())}


def _initial_big():
    torch.manual_seed(2)
    return Mixed().big.detach()


def sc_errors(rank, world, root):
    import torch.distributed as dist
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group, in order
    out = {}
    # built under Init at world 2, optimizer over a group of 1
    with Init(zcfg(root, f"e1-{rank}")):
        m = Mixed()
    try:
        Zero3Optimizer(m, torch.optim.SGD, lr=0.1, config=zcfg(root, f"e1o-{rank}"), process_group=singles[rank])
        out["smaller_group"] = "no error"
    except TierstoreValueError as e:
        out["smaller_group"] = str(e)
    # rank 0 built under Init over a group of 1, rank 1 over the world: both ranks must raise, none hang
    with Init(zcfg(root, f"e2-{rank}"), process_group=singles[0] if rank == 0 else None):
        m = Mixed()
    try:
        Zero3Optimizer(m, torch.optim.SGD, lr=0.1, config=zcfg(root, f"e2o-{rank}"))
        out["one_rank_wrong"] = "no error"
    except TierstoreValueError as e:
        out["one_rank_wrong"] = str(e)
    # a module built under Init that no optimizer took: its forward names it
    with Init(zcfg(root, f"e3-{rank}")):
        m = Mixed()
        stray = nn.Linear(4, 4)
    opt = Zero3Optimizer(m, torch.optim.SGD, lr=0.1, config=zcfg(root, f"e3o-{rank}"))
    m(torch.randn(2, 7))  # the optimizer's model runs (its guard hooks remove themselves)
    try:
        stray(torch.randn(2, 4))
        out["stray"] = "no error"
    except MisuseError as e:
        out["stray"] = str(e)
    opt.close()
    return out


SCENARIOS = {"memory": sc_memory, "bits": sc_bits, "training": sc_training, "errors": sc_errors}


def run_scenarios(rank, world, root):
    return {name: fn(rank, world, root) for name, fn in SCENARIOS.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(run_scenarios, WORLD, str(tmp_path_factory.mktemp("init-world2")))


def test_init_peak_memory_at_world_2_is_a_layer_plus_half_the_model(results):
    layer = 1024 * 1024 * 4  # bytes of one layer's weight
    model = 12 * (layer + 1024 * 4)  # bytes
    for r, res in enumerate(results):
        m = res["memory"]
        print(f"rank {r}: building 12 x 4 MiB layers at world 2: peak RSS +{m['plain'] / 2**20:.1f} MiB plain, "
              f"+{m['grown'] / 2**20:.1f} MiB under zero.Init (stores {m['stored'] / 2**20:.1f} MiB; model "
              f"{model / 2**20:.1f} MiB)")
        assert m["stored"] == model // WORLD  # this rank's even slices: exactly half of every parameter
        assert m["plain"] >= 10 * layer  # the measurement sees the model when it is in memory
        assert m["grown"] >= 0.9 * model / WORLD  # ...and the slices this rank keeps (host tier)
        assert m["grown"] <= model / WORLD + 2.5 * layer, m["grown"]  # a layer + 1/N of the model, not the model
        assert m["mismatched"] == [] and m["left"] == 0


def test_init_shards_equal_a_plain_build_bit_for_bit(results):
    for r, res in enumerate(results):
        for i, (mdt, cdt, tier) in enumerate(CASES):
            b = res["bits"][i]
            where = f"rank {r}, model {mdt}, compute {cdt}, params on {tier}"
            assert b["numel"] > 3, where  # several sub-groups compared
            assert b["full"] == [] and b["masters"] == [], (where, b)
            # -0.0 keeps its sign and infinities stay (bit for bit equal to the plain build, asserted above,
            # whatever a NaN's payload became in dtype conversions); an fp32 NaN keeps its payload
            want = torch.tensor([-0.0, float("inf"), -float("inf"), 0.0], dtype=cdt)
            assert torch.equal(_bits(b["special"][:4]), _bits(want)) and b["special"][4].isnan(), where
            if mdt == cdt == torch.float32:
                assert int(_bits(b["special"])[4]) == NAN, where
    stored = [res["bits"][0]["stored"] for res in results]
    torch.manual_seed(5)
    total = sum(p.numel() * p.element_size() for p in MixedNaN().parameters())
    total += 100 * 5 * 4  # tail's own weight: offloaded when tail was built, then replaced by the tied one
    assert sum(stored) == total and max(stored) <= total // 2 + 64  # the ranks' slices partition the model


def test_training_after_init_equals_plain_build(results):
    for res in results:
        assert res["training"]["moved"] and res["training"]["mismatched"] == []


def test_mismatched_groups_and_unclaimed_parameters_fail_clearly(results):
    for r, res in enumerate(results):
        e = res["errors"]
        assert "world size 2" in e["smaller_group"] and "process_group" in e["smaller_group"], e["smaller_group"]
        assert "no error" not in e["one_rank_wrong"]
        if r == 0:
            assert "world size 1" in e["one_rank_wrong"], e["one_rank_wrong"]
        else:
            assert "another rank refused" in e["one_rank_wrong"], e["one_rank_wrong"]
        assert "Linear" in e["stray"] and "'weight'" in e["stray"] and "slice" in e["stray"], e["stray"]
