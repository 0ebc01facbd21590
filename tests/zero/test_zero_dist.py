"""Zero3Optimizer at world sizes 2 and 4 (gloo on CPU, one spawn per world size running every scenario):
parity with a single-process run on the full batch, unused/tied/reused modules, qwZ + qgZ loss, and
checkpoints written at one world size and loaded at another."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn as nn

from tests.support import Branchy, Checkpointed, Net, Odd, batches, loss_fn, make_pair, max_rel, run_ranks
from tierstore.zero import OffloadConfig, Zero3Optimizer

STEPS = 10


def odd_data(n):
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 10, (8, 5), generator=g), torch.randint(0, 10, (8, 5), generator=g)) for _ in range(n)]


def odd_loss(m, idx, tgt):
    return nn.functional.cross_entropy(m(idx).reshape(-1, 10), tgt.reshape(-1))


class TwoHeads(nn.Module):
    """Both heads run on every rank, but rank r's loss uses head r % 2 only: which parameters get gradients
    differs between ranks (the reduce-scatter sequence must not)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 16)
        self.heads = nn.ModuleList(nn.Linear(16, 4) for _ in range(2))

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return [head(h) for head in self.heads]


def two_heads_loss(outs, y, rank):
    return ((outs[rank % 2] - y) ** 2).mean()


# -- backward gathers and the reduce-scatter schedule ([Note: backward gathers] in backward_schedule.py) -----------

class Scaled(nn.Module):
    """lin(x) * scale: autograd saves `scale` itself, so its backward reads the value gathered for backward."""

    def __init__(self, i, o):
        super().__init__()
        self.lin = nn.Linear(i, o)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, o))

    def forward(self, x):
        return self.lin(x) * self.scale


class SplitHeads(nn.Module):
    """Heads of different widths, every parameter in a bucket of its own (min_io_bytes=0); at step i rank r's
    loss reads head (r + i) % 2 only, so the ranks' backward graphs differ and change every step."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 16)
        self.head0 = nn.Linear(16, 4)
        self.head1 = Scaled(16, 6)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return self.head0(h), self.head1(h)


def split_heads_loss(outs, y, which):
    return ((outs[0] - y[:, :4]) ** 2).mean() if which == 0 else ((outs[1] - y) ** 2).mean()


def split_data(n):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(24, 16, generator=g), torch.randn(24, 6, generator=g)) for _ in range(n)]


class Late(nn.Module):
    """z is called twice. When the loss also reads z's first call (rank 1, every third step), z's gradient
    arrives later in backward than the schedule learnt from the previous backward: its bucket was already
    reduced on every rank, gets more gradient on rank 1, and is reduced again at the end (dirty)."""

    def __init__(self):
        super().__init__()
        self.z = nn.Linear(8, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x, use_early):
        h0 = self.z(x)
        h2 = self.z(torch.tanh(self.a(x)))
        h3 = torch.tanh(self.b(h2))
        return self.head(h3 + h0 if use_early else h3)


def late_use(rank, step):
    return rank == 1 and step % 3 == 2


class Tap(nn.Module):
    """(x @ weight, x): the hook on the second output (x itself) runs only after tap's whole backward."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) / d ** 0.5)

    def forward(self, x):
        return x @ self.weight, x


class Fork(nn.Module):
    """tap.weight, u.weight and u.bias share one bucket; only odd ranks' losses read u. On those ranks the bucket
    completes (and is released) before the late hook on tap's pass-through output runs, on the others it never
    completes: gathering "what the module misses" there posted an all-gather on odd ranks only."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(16, 8)
        self.tap = Tap(8)
        self.u = nn.Linear(8, 8)
        self.post = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.tanh(self.pre(x))
        y, h_pass = self.tap(h)
        return self.post(y), self.u(y), h_pass


FORK_GROUPS = [{"params": ["pre.weight", "pre.bias", "post.weight", "post.bias"]},
               {"params": ["tap.weight", "u.weight", "u.bias"]}]


def fork_loss(outs, y, rank):
    out, extra, h_pass = outs
    loss = ((out - y) ** 2).mean() + 0.1 * h_pass.square().mean()
    return loss + 0.1 * extra.square().mean() if rank % 2 == 1 else loss


class Stack(nn.Module):
    """Six 32-wide layers, one bucket per parameter: the gradients alive at once during backward are measured."""

    def __init__(self, layers=6, d=32):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


QD, QH = 64, 128  # the quantized runs' model: fc2's shard (128 x 128 / world) reaches the 8-bit state minimum


def teacher_data(n, seed=7):
    """A learnable regression task (a random teacher network), so the final loss is meaningful."""
    torch.manual_seed(seed)
    teacher = Net(d=QD, h=QH)
    g = torch.Generator().manual_seed(seed + 1)
    xs = [torch.randn(32, QD, generator=g) for _ in range(n)]
    with torch.no_grad():
        return [(x, teacher(x)) for x in xs]


def cfg(root, **kw):
    kw.setdefault("min_io_bytes", 1024)
    kw.setdefault("sub_group_bytes", 8192)
    kw.setdefault("nvme_paths", [os.path.join(root, "nvme")])
    return OffloadConfig(**kw)


def train(model, opt, data, rank, world, lossf=loss_fn, steps=None):
    losses = []
    for x, y in data[:steps]:
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        loss = lossf(model, xs, ys)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


# -- scenarios, run in every rank -----------------------------------------------------------------------------

def sc_parity(rank, world, root):
    _, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                         config=cfg(root + "/parity", params="host", optimizer_states="nvme", gradients="host"))
    train(m, opt, batches(STEPS), rank, world)
    out = opt.full_state_dict()
    opt.close()
    return out


def sc_odd(rank, world, root, split=False):
    """Odd (tied, unused, called twice); split: every parameter in a bucket of its own, other tiers."""
    torch.manual_seed(0)
    m = Odd()
    tiers = (dict(params="host", optimizer_states="host", min_io_bytes=0) if split else
             dict(params="device", optimizer_states="host", gradients="device"))
    opt = Zero3Optimizer(m, torch.optim.Adam, lr=1e-2, config=cfg(root + ("/odds" if split else "/odd"), **tiers))
    train(m, opt, odd_data(STEPS), rank, world, lossf=odd_loss)
    out = opt.full_state_dict()
    opt.close()
    return out


def sc_quant(rank, world, root):
    """fp32 vs qwZ + qgZ + 8-bit states on nvme: final held-out loss."""
    data = teacher_data(26)
    res = {}
    local = 2 if world == 4 else None  # world 4: qgZ's two stages (2 "nodes" of 2 ranks)
    runs = [("fp32", {}), ("quant", dict(quantized_weights=True, quantized_gradients=True, state_codec="dynamic8",
                                         optimizer_states="nvme", intra_node_size=local))]
    if world == 4:  # the two-stage int4 qgZ alone (the most lossy part); the others measured alone: ~0.1%
        runs += [("qgZ", dict(quantized_gradients=True, intra_node_size=local))]
    for name, kw in runs:
        torch.manual_seed(0)
        m = Net(d=QD, h=QH)
        opt = Zero3Optimizer(m, torch.optim.AdamW, lr=3e-3, config=cfg(root + "/q" + name, min_io_bytes=0,
                                                                       sub_group_bytes=1 << 20, **kw))
        train(m, opt, data[:25], rank, world)
        with torch.no_grad():
            res[name] = float(loss_fn(m, *data[25]))
        if kw.get("state_codec"):
            res[name + ".8bit_states"] = opt.stats().quantized_states  # states really stored in 8 bits
        opt.close()
    return res


def sc_checkpoint(rank, world, root):
    """Train STEPS, save; the parent resumes from it at world 1 and compares with the continuation here."""
    _, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                         config=cfg(root + "/ck", params="nvme", optimizer_states="nvme", gradients="nvme"))
    data = batches(2 * STEPS)
    train(m, opt, data[:STEPS], rank, world)
    opt.save_checkpoint(os.path.join(root, "ckpt"))
    train(m, opt, data[STEPS:], rank, world)
    out = opt.full_state_dict()
    opt.close()
    return out


def sc_two_heads(rank, world, root):
    torch.manual_seed(0)
    m = TwoHeads()
    opt = Zero3Optimizer(m, torch.optim.SGD, lr=0.1, momentum=0.9,
                         config=cfg(root + "/two", params="nvme", optimizer_states="host", gradients="host"))
    for x, y in batches(STEPS):
        two_heads_loss(m(x.chunk(world)[rank]), y.chunk(world)[rank], rank).backward()
        opt.step()
        opt.zero_grad()
    out = opt.full_state_dict()
    opt.close()
    return out


def sc_split_heads(rank, world, root):
    torch.manual_seed(0)
    m = SplitHeads()
    opt = Zero3Optimizer(m, torch.optim.SGD, lr=0.1, momentum=0.9,
                         config=cfg(root + "/split", params="host", optimizer_states="host", min_io_bytes=0))
    for i, (x, y) in enumerate(split_data(STEPS)):
        split_heads_loss(m(x.chunk(world)[rank]), y.chunk(world)[rank], (rank + i) % 2).backward()
        opt.step()
        opt.zero_grad()
    out = opt.full_state_dict()
    out["counters"] = {"early": opt.coordinator.stats().early_reductions, "buckets": len(opt.layout.trainable_gids())}
    opt.close()
    return out


def sc_late(rank, world, root):
    torch.manual_seed(0)
    m = Late()
    opt = Zero3Optimizer(m, torch.optim.Adam, lr=1e-2,
                         config=cfg(root + "/late", params="host", optimizer_states="host", min_io_bytes=0))
    for i, (x, y) in enumerate(batches(STEPS, d=8)):
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        ((m(xs, late_use(rank, i)) - ys) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    out = opt.full_state_dict()
    st = opt.coordinator.stats()
    out["counters"] = {"early": st.early_reductions, "again": st.rereductions}
    opt.close()
    return out


def sc_fork(rank, world, root):
    torch.manual_seed(0)
    m = Fork()
    opt = Zero3Optimizer(m, torch.optim.Adam, lr=1e-2, param_groups=FORK_GROUPS,
                         config=cfg(root + "/fork", params="host", optimizer_states="host", min_io_bytes=4096))
    shared = [[pc.name for pc in opt.layout.bucket(g).pieces] for g in opt.layout.trainable_gids()]
    for x, y in batches(STEPS):
        fork_loss(m(x.chunk(world)[rank]), y.chunk(world)[rank], rank).backward()
        opt.step()
        opt.zero_grad()
    out = opt.full_state_dict()
    out["buckets"] = shared
    opt.close()
    return out


def sc_grad_memory(rank, world, root):
    """Bytes of full .grad alive at once in each backward: the first holds all of them, later ones follow the
    schedule ([Note: gradient reduce-scatter])."""
    torch.manual_seed(0)
    m = Stack()
    opt = Zero3Optimizer(m, torch.optim.SGD, lr=0.1,
                         config=cfg(root + "/mem", params="host", optimizer_states="host", min_io_bytes=0))
    co = opt.coordinator
    peaks = []
    for x, y in batches(4, d=32):
        loss_fn(m, x.chunk(world)[rank], y.chunk(world)[rank]).backward()
        st = co.stats()
        peaks.append(st.peak_grad_bytes)
        assert st.grad_bytes == 0 and all(p.grad is None for p in m.parameters())
        opt.step()
        opt.zero_grad()
    total = sum(4 * torch.Size(shape).numel() for shape, _dt, _rg in opt.layout.specs.values())
    out = {"peaks": peaks, "early": co.stats().early_reductions, "total": total, "layer": 4 * (32 * 32 + 32)}
    opt.close()
    return out


def sc_accumulate(rank, world, root):
    """Gradient accumulation: 3 micro-batches per step (the schedule is learnt on the first, used on the next)."""
    _, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                         config=cfg(root + "/acc", params="host", optimizer_states="host", min_io_bytes=0))
    data = batches(12)
    for i in range(0, 12, 3):
        for x, y in data[i:i + 3]:
            (loss_fn(m, x.chunk(world)[rank], y.chunk(world)[rank]) / 3).backward()
        opt.step()
        opt.zero_grad()
    out = opt.full_state_dict()
    out["counters"] = {"early": opt.coordinator.stats().early_reductions}
    opt.close()
    return out


def sc_odd_split(rank, world, root):
    return sc_odd(rank, world, root, split=True)


def frozen_base_model():
    """Net with its first layers frozen (an adapter-style fine-tune): their buckets go during backward."""
    m, _ = make_pair()
    for p in list(m.fc1.parameters()) + list(m.norm.parameters()) + list(m.fc2.parameters()):
        p.requires_grad_(False)
    return m


def sc_frozen_base(rank, world, root):
    m = frozen_base_model()
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                         config=cfg(root + "/frozen", params="host", optimizer_states="host", min_io_bytes=0,
                                    prefetch_depth=2))
    data = batches(STEPS)
    for x, y in data:  # inputs require grad, so the first layer reports the end of its backward too
        loss_fn(m, x.chunk(world)[rank].requires_grad_(), y.chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()
    out = opt.full_state_dict()
    opt.close()
    return out


def sc_recompute(rank, world, root):
    """Non-reentrant activation checkpointing at world size N: recomputed forwards gather on demand."""
    torch.manual_seed(0)
    m = Checkpointed(reentrant=False)
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2,
                         config=cfg(root + "/recompute", params="host", optimizer_states="host", prefetch_depth=2))
    train(m, opt, batches(STEPS), rank, world)
    out = opt.full_state_dict()
    opt.close()
    return out


def sc_prefetch(rank, world, root):
    """All-gathers posted ahead of the trace and of the backward cursor; the branch changes at steps 4 and 6
    (the same on every rank), so some posted all-gathers go unused."""
    torch.manual_seed(0)
    m = Branchy()
    # depth 1 on this 3-module model: all-gathers one module ahead, reads two ahead (both stages in use)
    opt = Zero3Optimizer(m, torch.optim.SGD, lr=0.1, config=cfg(root + "/pf", params="nvme", prefetch_depth=1,
                                                                 min_io_bytes=0))
    co = opt.coordinator
    before_change = None
    for i, (x, y) in enumerate(batches(8)):
        m.use_b = i in (4, 5)
        loss_fn(m, x.chunk(world)[rank], y.chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()
        if i == 3:
            st = co.stats()
            before_change = {"hits": st.gather_hits, "backward": st.gather_hits_backward, "dropped": st.gathers_dropped}
    out = opt.full_state_dict()
    st = co.stats()
    out["counters"] = {"before_change": before_change, "hits": st.gather_hits, "dropped": st.gathers_dropped,
                       "ahead": st.gathers_ahead, "most_ahead": st.most_ahead, "rebuilds": st.trace_rebuilds,
                       "staged": st.staged, "copies": st.staged_copies, "pending": st.gathers_in_flight,
                       "most_per_module": most_buckets_per_module(m, opt.layout), "kept": st.kept_at_turn}
    opt.close()
    return out


def most_buckets_per_module(model, layout) -> int:
    """The most buckets one module's own parameters lie in: what one module's gather brings in."""
    return max(len({g for n, _p in mod.named_parameters(prefix=prefix, recurse=False) for g in layout.param_gids[n]})
               for prefix, mod in model.named_modules())


def sc_qwz_prefetch(rank, world, root):
    """qwZ with and without all-gathers posted ahead: the asynchronous quantized all-gather is the same one."""
    from tierstore.quant import collectives as qc
    out = {}
    for depth in (0, 2):
        _, m = make_pair()
        opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(root + f"/qwz{depth}", prefetch_depth=depth,
                                                                        quantized_weights=True, min_io_bytes=0))
        qc.reset_traffic()
        train(m, opt, batches(4), rank, world)
        sent = qc.traffic()["all_gather_quantized"]
        st = opt.coordinator.stats()
        out[depth] = {"hits": st.gather_hits, "gathers": st.gathers, "pending": st.gathers_in_flight,
                      "bytes": sent.bytes_sent, "calls": sent.calls, "state": opt.full_state_dict()}
        opt.close()
    return out


def gated_use(rank, step):
    return rank == 1 and step % 3 == 0


def sc_gated(rank, world, root):
    """head1 gets a gradient only from rank 1, every third step: on the other steps no rank produced one and
    the step skips it, as torch skips a parameter whose grad is None ([Note: no gradient])."""
    torch.manual_seed(0)
    m = SplitHeads()
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                         config=cfg(root + "/gated", params="host", optimizer_states="nvme", min_io_bytes=0))
    for i, (x, y) in enumerate(split_data(STEPS)):
        outs = m(x.chunk(world)[rank])
        yc = y.chunk(world)[rank]
        loss = split_heads_loss(outs, yc, 0)
        if gated_use(rank, i):
            loss = loss + split_heads_loss(outs, yc, 1)
        loss.backward()
        opt.step()
        opt.zero_grad()
    out = opt.full_state_dict()
    opt.close()
    return out


def sc_resume_other_world(rank, world, root):
    """Load the checkpoint the world-2 run wrote (path in <root>/from2) and train the next STEPS here."""
    src = open(os.path.join(root, "from2")).read()
    _, m = make_pair(seed=4)
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=3.0, config=cfg(root + "/resume", params="host",
                                                                   optimizer_states="host", gradients="nvme"))
    opt.load_checkpoint(src)
    assert opt.steps == STEPS
    train(m, opt, batches(2 * STEPS)[STEPS:], rank, world)
    out = opt.full_state_dict()
    opt.close()
    return out


SCENARIOS = {"resume_other_world": sc_resume_other_world, "two_heads": sc_two_heads, "parity": sc_parity, "odd": sc_odd,
             "quant": sc_quant, "checkpoint": sc_checkpoint, "split_heads": sc_split_heads, "late": sc_late,
             "fork": sc_fork, "grad_memory": sc_grad_memory, "accumulate": sc_accumulate, "odd_split": sc_odd_split,
             "prefetch": sc_prefetch, "qwz_prefetch": sc_qwz_prefetch, "gated": sc_gated,
             "frozen_base": sc_frozen_base, "recompute": sc_recompute}
BACKWARD = ["split_heads", "late", "fork", "grad_memory", "accumulate", "odd_split", "prefetch", "qwz_prefetch",
            "gated", "frozen_base", "recompute"]


def run_scenarios(rank, world, root, names):
    """Every scenario in `names`, in order, on this rank (one launch per world size: ranks are slow to start)."""
    out = {"seconds": {}}
    for n in names:
        t0 = time.perf_counter()
        out[n] = SCENARIOS[n](rank, world, root)
        out["seconds"][n] = time.perf_counter() - t0
    return out


_RUNS: dict = {}


def results_for(world, tmp_path_factory):
    """One spawn per world size runs every scenario (world 4 leaves out the quantized run: time budget)."""
    if world not in _RUNS:
        root = tmp_path_factory.mktemp(f"world{world}")
        if world == 2:
            names = [n for n in SCENARIOS if n != "resume_other_world"]
        else:  # world 4 also resumes from the checkpoint world 2 wrote
            (root / "from2").write_text(os.path.join(results_for(2, tmp_path_factory)[1], "ckpt"))
            names = ["resume_other_world", "two_heads", "parity", "odd", "checkpoint", "quant"] + BACKWARD
        results = run_ranks(run_scenarios, world, str(root), names)
        print(f"world {world}: seconds per scenario on rank 0: {results[0]['seconds']}")
        _RUNS[world] = (world, str(root), results)
    return _RUNS[world]


@pytest.fixture(scope="module", params=[2, 4])
def world_results(request, tmp_path_factory):
    return results_for(request.param, tmp_path_factory)


def reference(model, opt, data, lossf=loss_fn):
    for x, y in data:
        lossf(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return model


def test_frozen_base_released_in_backward_keeps_parity(world_results):
    """Frozen buckets released as each call's backward ends ([Note: releasing frozen buckets in backward]):
    local only, so the ranks' collectives and the results stay those of one process."""
    world, _root, res = world_results
    ref_m = frozen_base_model()
    reference(ref_m, torch.optim.AdamW([p for p in ref_m.parameters() if p.requires_grad], lr=1e-2,
                                       weight_decay=0.1), batches(STEPS))
    rel = max_rel(res[0]["frozen_base"], ref_m)
    assert rel <= 1e-5, rel


def test_activation_checkpointing_keeps_parity(world_results):
    world, _root, res = world_results
    torch.manual_seed(0)
    ref_m = Checkpointed(reentrant=False)
    reference(ref_m, torch.optim.AdamW(ref_m.parameters(), lr=1e-2), batches(STEPS))
    rel = max_rel(res[0]["recompute"], ref_m)
    assert rel <= 1e-5, rel


def test_parity_with_single_process_full_batch(world_results):
    world, _root, res = world_results
    ref_m, _ = make_pair()
    reference(ref_m, torch.optim.AdamW(ref_m.parameters(), lr=1e-2, weight_decay=0.1), batches(STEPS))
    for r in range(world):
        assert all(torch.equal(res[0]["parity"][k], res[r]["parity"][k]) for k in res[0]["parity"])
    rel = max_rel(res[0]["parity"], ref_m)
    print(f"world {world}: max relative difference vs single process {rel:.2e}")
    assert rel <= 1e-5, rel


@pytest.mark.parametrize("scenario", ["odd", "odd_split"])  # odd_split: a bucket per parameter
def test_unused_tied_and_reused_modules(world_results, scenario):
    world, _root, res = world_results
    torch.manual_seed(0)
    ref_m = Odd()
    reference(ref_m, torch.optim.Adam(ref_m.parameters(), lr=1e-2), odd_data(STEPS), lossf=odd_loss)
    full = res[0][scenario]
    assert torch.equal(full["out.weight"], full["emb.weight"])
    rel = max_rel(full, ref_m)
    assert rel <= 1e-5, rel


def test_quantized_collectives_and_8bit_states_loss(world_results):
    """Target: final loss within 2% of fp32, for everything on together and (world 4, where qgZ runs
    its two stages over 2 "nodes" of 2 ranks) for qgZ alone. The model is wide enough that fc2's
    state shards reach the 8-bit minimum (4096 elements); with a 16/32-wide model qgZ alone moved the loss
    +3.6% at world 4 (int4 error relative to tiny buckets)."""
    world, _root, res = world_results
    q = res[0]["quant"]
    assert q["quant.8bit_states"] >= 2  # exp_avg and exp_avg_sq of at least one sub-group
    q = {k: v for k, v in q.items() if not k.endswith(".8bit_states")}
    rel = {k: q[k] / q["fp32"] - 1 for k in q if k != "fp32"}
    print(f"world {world}: held-out loss fp32 {q['fp32']:.5f}; " +
          ", ".join(f"{k} {q[k]:.5f} ({100 * v:+.2f}%)" for k, v in rel.items()))
    assert all(abs(v) <= 0.02 for v in rel.values()), q


def test_checkpoint_from_world_n_resumes_at_world_1_on_other_tiers(world_results, tmp_path):
    world, root, res = world_results
    _, m = make_pair(seed=9)  # other initial values: everything comes from the checkpoint
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1.0, config=cfg(str(tmp_path), params="device",
                                                                  optimizer_states="host", gradients="device",
                                                                  sub_group_bytes=1 << 20, min_io_bytes=1 << 16))
    opt.load_checkpoint(os.path.join(root, "ckpt"))
    assert opt.steps == STEPS and opt.param_groups[0]["lr"] == 1e-2
    reference(m, opt, batches(2 * STEPS)[STEPS:])
    rel = max_rel(opt.full_state_dict(), _as_module(res[0]["checkpoint"]))
    print(f"world {world} -> 1 resume: max relative difference {rel:.2e}")
    assert rel <= 1e-5, rel
    opt.close()


def _as_module(state):
    m = Net()
    m.load_state_dict(state)
    return m


def test_rank_dependent_unused_parameters_do_not_hang(world_results):
    """Each rank leaves a different head without gradient; the result equals the mean of the ranks' losses
    on one process."""
    world, _root, res = world_results
    torch.manual_seed(0)
    ref = TwoHeads()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches(STEPS):
        loss = sum(two_heads_loss(ref(xc), yc, r) for r, (xc, yc) in enumerate(zip(x.chunk(world), y.chunk(world))))
        (loss / world).backward()
        opt.step()
        opt.zero_grad()
    rel = max_rel(res[0]["two_heads"], ref)
    assert rel <= 1e-5, rel


def test_checkpoint_from_world_2_resumes_at_world_4(tmp_path_factory):
    """10 steps at world 2, checkpoint, 10 more at world 2 == load at world 4 (other tiers) + the same 10."""
    _w, _r, res2 = results_for(2, tmp_path_factory)
    _w, _r, res4 = results_for(4, tmp_path_factory)
    want = _as_module(res2[0]["checkpoint"])
    got = res4[0]["resume_other_world"]
    rel = max_rel(got, want)
    print(f"world 2 -> 4 resume: max relative difference {rel:.2e}")
    assert rel <= 1e-5, rel


# -- backward gathers and the reduce-scatter schedule ------------------------------------------------------------

def _same_on_every_rank(res, name, world):
    for r in range(1, world):
        assert all(torch.equal(res[0][name][k], res[r][name][k]) for k in res[0][name] if k not in ("counters",
                                                                                                  "buckets"))


def test_rank_dependent_heads_in_their_own_buckets(world_results):
    """The ranks' backward graphs differ (and change every step) and the heads' buckets differ in size:
    backward gathers must not follow which module backwards run locally ([Note: backward gathers])."""
    world, _root, res = world_results
    torch.manual_seed(0)
    ref = SplitHeads()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for i, (x, y) in enumerate(split_data(STEPS)):
        loss = sum(split_heads_loss(ref(xc), yc, (r + i) % 2)
                   for r, (xc, yc) in enumerate(zip(x.chunk(world), y.chunk(world))))
        (loss / world).backward()
        opt.step()
        opt.zero_grad()
    _same_on_every_rank(res, "split_heads", world)
    c = res[0]["split_heads"]["counters"]
    assert c["buckets"] == 7 and c["early"] > 0
    rel = max_rel(res[0]["split_heads"], ref)
    print(f"world {world}: split heads max relative difference {rel:.2e}, early reductions {c['early']}")
    assert rel <= 1e-5, rel


def test_gradient_arriving_after_its_bucket_was_reduced_is_reduced_again(world_results):
    world, _root, res = world_results
    torch.manual_seed(0)
    ref = Late()
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for i, (x, y) in enumerate(batches(STEPS, d=8)):
        loss = sum(((ref(xc, late_use(r, i)) - yc) ** 2).mean()
                   for r, (xc, yc) in enumerate(zip(x.chunk(world), y.chunk(world))))
        (loss / world).backward()
        opt.step()
        opt.zero_grad()
    _same_on_every_rank(res, "late", world)
    c = res[0]["late"]["counters"]
    assert c["again"] > 0 and c["early"] > 0, c  # the dirty path really ran
    assert all(res[r]["late"]["counters"] == c for r in range(world))  # the same collectives on every rank
    rel = max_rel(res[0]["late"], ref)
    print(f"world {world}: late gradient max relative difference {rel:.2e}, counters {c}")
    assert rel <= 1e-5, rel


def test_release_on_completion_does_not_change_backward_gathers(world_results):
    world, _root, res = world_results
    assert ["tap.weight", "u.weight", "u.bias"] in res[0]["fork"]["buckets"]  # the shared bucket the test needs
    torch.manual_seed(0)
    ref = Fork()
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for x, y in batches(STEPS):
        loss = sum(fork_loss(ref(xc), yc, r) for r, (xc, yc) in enumerate(zip(x.chunk(world), y.chunk(world))))
        (loss / world).backward()
        opt.step()
        opt.zero_grad()
    _same_on_every_rank(res, "fork", world)
    rel = max_rel(res[0]["fork"], ref)
    assert rel <= 1e-5, rel


def test_schedule_lowers_gradients_alive_during_backward(world_results):
    """Counted by the coordinator (bytes of full .grad alive at once), not timed: the first backward holds
    every gradient until its end; with the schedule about one layer's are alive at a time."""
    world, _root, res = world_results
    for r in range(world):
        g = res[r]["grad_memory"]
        print(f"world {world} rank {r}: peak .grad bytes per backward {g['peaks']} (all: {g['total']}, "
              f"one layer: {g['layer']})")
        assert g["peaks"][0] == g["total"]
        assert all(p <= 2 * g["layer"] for p in g["peaks"][1:]), g
        assert g["early"] == 3 * 12  # every bucket but the first layer's two (due at the very end), 3 backwards


def test_gradient_accumulation_matches_single_process(world_results):
    world, _root, res = world_results
    ref_m, _ = make_pair()
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2, weight_decay=0.1)
    data = batches(12)
    for i in range(0, 12, 3):
        for x, y in data[i:i + 3]:
            (loss_fn(ref_m, x, y) / 3).backward()
        ref.step()
        ref.zero_grad()
    _same_on_every_rank(res, "accumulate", world)
    assert res[0]["accumulate"]["counters"]["early"] > 0
    rel = max_rel(res[0]["accumulate"], ref_m)
    assert rel <= 1e-5, rel


# -- prefetch: all-gathers posted ahead ([Note: prefetch stages] in prefetch.py) -----------------------------------

def test_all_gathers_posted_ahead_are_used_and_an_order_change_neither_hangs_nor_changes_results(world_results):
    world, _root, res = world_results
    torch.manual_seed(0)
    ref = Branchy()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i, (x, y) in enumerate(batches(8)):
        ref.use_b = i in (4, 5)
        loss_fn(ref, x, y).backward()
        opt.step()
        opt.zero_grad()
    _same_on_every_rank(res, "prefetch", world)
    c = res[0]["prefetch"]["counters"]
    print(f"world {world}: prefetch counters {c}")
    assert all(res[r]["prefetch"]["counters"] == c for r in range(world))  # the same collectives everywhere
    before = c["before_change"]
    assert before["hits"] > before["backward"] > 0  # forward and backward waited on all-gathers posted ahead
    assert before["dropped"] == 0  # while the order held, every all-gather posted ahead was used
    assert c["rebuilds"] >= 2 and c["dropped"] > 0  # the order changed: mispredicted ones were dropped...
    assert c["hits"] + c["dropped"] + c["pending"] == c["ahead"]  # ...after being waited for; pending: the
    # first module's all-gathers the last step posted for the next forward ([Note: prefetch after the step])
    assert 0 < c["pending"] <= c["most_per_module"]
    assert 0 < c["most_ahead"] <= c["most_per_module"]  # at most prefetch_depth (1) modules' buckets ahead
    assert c["staged"] > 0 and c["copies"] == 0  # reads ahead went through the host->device stage (CPU: as is)
    assert c["kept"] > 0  # the forward's last buckets stayed for backward, on every rank ([Note: kept at the turn])
    rel = max_rel(res[0]["prefetch"], ref)
    assert rel <= 1e-5, rel


def test_quantized_all_gather_posted_ahead_equals_the_synchronous_one(world_results):
    world, _root, res = world_results
    q = res[0]["qwz_prefetch"]
    assert q[0]["hits"] == 0 and q[2]["hits"] > 0
    for d in (0, 2):  # every all-gather was quantized and counted in quant.collectives.traffic() once waited for
        # (pending: those the last step posted for the next forward, [Note: prefetch after the step])
        assert q[d]["bytes"] > 0 and q[d]["calls"] == q[d]["gathers"] - q[d]["pending"]
    assert q[0]["pending"] == 0 and q[2]["pending"] > 0
    assert all(torch.equal(q[0]["state"][k], q[2]["state"][k]) for k in q[0]["state"])  # bit for bit


def test_parameter_without_gradient_on_any_rank_is_skipped_like_torch(world_results):
    """AdamW with weight decay: a head that no rank used in a step must not move (nor its moments or step count
    change), as torch skips it; a rank-dependent use is agreed over the ranks."""
    world, _root, res = world_results
    torch.manual_seed(0)
    ref = SplitHeads()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for i, (x, y) in enumerate(split_data(STEPS)):
        loss = 0
        for r, (xc, yc) in enumerate(zip(x.chunk(world), y.chunk(world))):
            outs = ref(xc)
            loss = loss + split_heads_loss(outs, yc, 0)
            if gated_use(r, i):
                loss = loss + split_heads_loss(outs, yc, 1)
        (loss / world).backward()
        opt.step()
        opt.zero_grad()
    _same_on_every_rank(res, "gated", world)
    rel = max_rel(res[0]["gated"], ref)
    print(f"world {world}: parameter without gradient max relative difference {rel:.2e}")
    assert rel <= 1e-5, rel
