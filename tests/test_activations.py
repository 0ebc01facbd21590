"""tierstore.ActivationOffload without ZeRO-3: saved tensors through the host / nvme tier, gradients bit-equal
to torch's (torch.equal), under torch.utils.checkpoint (both variants) and an HF GPT-2 with gradient
checkpointing; versions, views, dtypes, duplicates, retain_graph, double backward, lifetime, budget."""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from tierstore import ActivationOffload, MisuseError
from tierstore.errors import PinnedMemoryError, TierstoreValueError


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32), nn.LayerNorm(32))
                           for _ in range(3)])


def _grads(model: nn.Module, x: torch.Tensor, act: ActivationOffload | None, reentrant: bool | None) -> list:
    model.zero_grad(set_to_none=True)
    xx = x.clone().requires_grad_()

    def forward():
        h = xx
        for blk in model:
            h = checkpoint(blk, h, use_reentrant=reentrant) if reentrant is not None else blk(h)
        return (h.square() * h).sum()
    if act is None:
        loss = forward()
    else:
        with act:
            loss = forward()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()] + [xx.grad.clone()]


@pytest.fixture
def act_factory(tmp_path):
    made = []

    def make(tier="nvme", **kw):
        kw.setdefault("min_bytes", 1024)
        a = ActivationOffload(tier, paths=[str(tmp_path / f"a{len(made)}")] if tier == "nvme" else None, **kw)
        made.append(a)
        return a
    yield make
    for a in made:
        a.close()


@pytest.mark.parametrize("tier,mode,reentrant", [("nvme", "all", None), ("nvme", "all", False), ("nvme", "all", True),
                                                 ("nvme", "checkpoint", False), ("nvme", "checkpoint", True),
                                                 ("host", "all", None), ("host", "checkpoint", True)])
def test_gradients_bit_equal(act_factory, tier, mode, reentrant):
    x = torch.randn(64, 32)
    ref = _grads(_mlp(), x, None, reentrant)
    act = act_factory(tier, mode=mode)
    got = _grads(_mlp(), x, act, reentrant)
    act.wait_writes()  # a record freed while its write ran is deleted by the writer
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    s = act.stats()
    assert s.offloaded > 0 and s.unpacked >= s.offloaded - s.deduplicated
    assert s.held_bytes == 0  # every record freed once backward used it
    if mode == "checkpoint":
        assert s.offloaded == len(_mlp())  # exactly the blocks' inputs
    assert act.store.keys() == []


def test_checkpoint_mode_without_checkpoint_offloads_nothing(act_factory):
    act = act_factory(mode="checkpoint")
    _grads(_mlp(), torch.randn(64, 32), act, None)
    assert act.stats().offloaded == 0 and act.stats().kept > 0


def test_prefetch_reads_ahead(act_factory):
    act = act_factory(prefetch_bytes=1 << 20)
    m = _mlp()
    x = torch.randn(64, 32)
    with act:
        h = x
        for blk in m:
            h = blk(h) * 1.5
        loss = h.sum()
    act.wait_writes()  # every write done: backward reads them all
    loss.backward()
    s = act.stats()
    assert s.misses <= 1 and s.prefetch_hits >= s.unpacked - 1 > 0



def test_prefetch_window_of_one_tensor_reads_every_one_ahead(act_factory):
    """The bytes of the tensor being unpacked leave the read-ahead window before the next reads start: with a
    window of one tensor, every unpack but the first finds its read started (not every other one). The reads
    started depend on the unpack order only, not on how fast they finish."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(12)])  # each saves its input, once
    x = torch.randn(256, 64)  # every saved activation: 64 KiB
    act = act_factory(prefetch_bytes=64 << 10)
    with act:
        loss = model(x).sum()
    act.wait_writes()
    loss.backward()
    s = act.stats()
    assert s.unpacked == s.offloaded == 12 and s.misses == 1 and s.prefetch_hits == 11, s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
                                   torch.int32, torch.uint8, torch.bool])
def test_dtypes_and_layouts_round_trip(act_factory, dtype):
    act = act_factory(min_bytes=0)
    base = (torch.randn(64, 48) * 100).to(dtype)
    views = {"contiguous": base, "transpose": base.t(), "permute": base.view(8, 8, 48).permute(2, 0, 1),
             "slice": base[:, 1:40], "strided": base[::3], "expand": base[:1].expand(64, 48),
             "sparse-ish": base[::16, ::16]}
    packed = {}
    with act:
        for name, v in views.items():
            # private: the pack / unpack hooks called directly, without a graph, to check each layout
            packed[name] = act._pack(v)
    act.wait_writes()
    for name, v in views.items():
        # private: the unpack hook itself, called as autograd calls it
        back = act._unpack(packed[name])
        assert back.dtype == v.dtype and back.shape == v.shape, name
        assert torch.equal(back, v), name
        if name in ("transpose", "permute", "slice", "expand", "contiguous"):
            assert back.stride() == v.stride(), name  # the span is stored: the same strides come back


def test_inplace_after_save_raises(act_factory):
    act = act_factory()
    x = torch.randn(64, 64, requires_grad=True)
    with act:
        y = x.exp()  # saves its output
        z = y.sum()
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()
    small = act_factory(min_bytes=1 << 30)  # kept in memory: checked too
    with small:
        y = x.exp()
        z = y.sum()
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()


def test_same_tensor_saved_twice_is_stored_once(act_factory):
    act = act_factory()
    x = torch.randn(64, 64, requires_grad=True)
    ref_grad = torch.autograd.grad((x * x * x).sum(), x)[0]
    with act:
        h = x * 1.0
        loss = (h * h * h).sum()  # h saved by both products
    s = act.stats()
    assert s.deduplicated >= 1
    g = torch.autograd.grad(loss, x)[0]
    assert torch.equal(g, ref_grad)


def test_retain_graph_and_double_backward(act_factory):
    act = act_factory()
    x = torch.randn(64, 64, requires_grad=True)
    with act:
        y = torch.tanh(x * 1.5)
        loss = (y * y).sum()
    g1 = torch.autograd.grad(loss, x, retain_graph=True)[0]
    g2 = torch.autograd.grad(loss, x, create_graph=True)[0]  # second use: read again from the store
    gg = torch.autograd.grad(g2.sum(), x)[0]
    xr = x.detach().requires_grad_()
    yr = torch.tanh(xr * 1.5)
    r1 = torch.autograd.grad((yr * yr).sum(), xr, create_graph=True)[0]
    rr = torch.autograd.grad(r1.sum(), xr)[0]
    assert torch.equal(g1, r1) and torch.equal(g2, r1) and torch.equal(gg, rr)
    del loss, y, g2
    gc.collect()
    act.wait_writes()
    assert act.stats().held_bytes == 0 and act.store.keys() == []


def test_never_unpacked_is_freed_with_its_graph(act_factory):
    act = act_factory()
    x = torch.randn(128, 64, requires_grad=True)
    with act:
        loss = torch.tanh(x @ x.t()).sum()
    act.wait_writes()
    assert act.stats().held_bytes > 0 and act.store.keys()
    del loss
    gc.collect()
    act.wait_writes()
    assert act.stats().held_bytes == 0 and act.store.keys() == []


def test_close_before_backward_raises(tmp_path):
    act = ActivationOffload("nvme", paths=[str(tmp_path)], min_bytes=0)
    x = torch.randn(64, 64, requires_grad=True)
    with act:
        loss = x.exp().sum()
    act.close()
    with pytest.raises(MisuseError, match="closed"):
        loss.backward()


def test_parameters_and_small_tensors_stay(act_factory):
    act = act_factory(min_bytes=4096)
    lin = nn.Linear(64, 64)
    x = torch.randn(8, 64, requires_grad=True)  # 2 KiB: small
    with act:
        lin(x).sum()
        torch.mm(x, lin.weight.t())  # a view of a parameter (16 KiB) and a small input
    assert act.stats().offloaded == 0


def test_budget_keeps_the_rest_in_memory(act_factory):
    act = act_factory(budget_bytes=100_000)
    x = torch.randn(64, 64, requires_grad=True)  # 16 KiB per saved tensor
    ref = torch.autograd.grad(torch.tanh(torch.tanh(x * 2) * 3).exp().sum(), x)[0]
    with act:
        h = x
        for _ in range(12):
            h = torch.tanh(h * 1.01)
        loss = h.exp().sum()
    s = act.stats()
    assert s.kept_over_budget > 0 and s.peak_held_bytes <= 100_000
    loss.backward()
    assert ref is not None


@pytest.mark.parametrize("compress,bound", [("bf16", 2 ** -8), ("int8", 1 / 127)])
def test_compression_error_is_bounded(act_factory, compress, bound):
    act = act_factory(compress=compress, min_bytes=0)
    t = torch.randn(256, 256)
    with act:
        # private: the pack / unpack hooks called directly, without a graph
        p = act._pack(t)
    act.wait_writes()  # written: the unpack reads what the store holds
    back = act._unpack(p)
    rel = ((back - t).abs().max() / t.abs().max()).item()
    assert 0 < rel <= bound
    assert back.dtype == t.dtype


def test_bad_arguments():
    with pytest.raises(TierstoreValueError, match="tier"):
        ActivationOffload("device")
    with pytest.raises(TierstoreValueError, match="mode"):
        ActivationOffload("host", mode="some")
    with pytest.raises(TierstoreValueError, match="compress"):
        ActivationOffload("host", compress="bf16")
    with pytest.raises(TierstoreValueError, match="budget_bytes"):
        ActivationOffload("host", budget_bytes=-1)


@pytest.mark.parametrize("kw,err,said", [
    (dict(pinned_bytes=2**60), PinnedMemoryError, "pinned_bytes"),
    (dict(tier="host", pinned_bytes=2**60), PinnedMemoryError, "pinned_bytes"),
    (dict(prefix=5), TierstoreValueError, "prefix"),
    (dict(store="/tmp/x"), TierstoreValueError, "store"),
    (dict(paths=5), TierstoreValueError, "paths"),
    (dict(paths=[None]), TierstoreValueError, "paths"),
    (dict(paths=[""]), TierstoreValueError, "paths"),
    (dict(paths=b"/tmp/x"), TierstoreValueError, "paths")])
def test_bad_arguments_create_nothing(tmp_path, monkeypatch, kw, err, said):
    """Before: a huge pinned_bytes left a temporary directory (or the given one) behind; the others raised a
    TypeError, or were accepted (paths=[''] made a store in the current directory)."""
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.chdir(tmp_path / "tmp")
    for paths in ([kw.pop("paths")] if "paths" in kw else [None, [tmp_path / "given"]]):
        with pytest.raises(err, match=said) as ei:
            ActivationOffload(**kw, paths=paths)
        assert str(ei.value).startswith(f"ActivationOffload({said}="), str(ei.value)
        assert sorted(p.name for p in tmp_path.rglob("*")) == ["tmp"]  # nothing created


def test_store_that_cannot_be_made_leaves_no_temporary_directory(tmp_path, monkeypatch):
    """What only trying tells (the page-lock limit refusing the host tier's memory): our own temporary
    directory is removed again."""
    import tempfile

    import tierstore.activations as acts
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def refused(*a, **kw):  # an injected fault: mlock refused
        raise PinnedMemoryError("cannot page-lock 16 MiB of host memory")
    monkeypatch.setattr(acts, "Store", refused)
    with pytest.raises(PinnedMemoryError):
        ActivationOffload("host")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.filterwarnings("ignore:.*gradient_checkpointing_enable.*:FutureWarning")
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("mode", ["all", "checkpoint"])
def test_hf_gpt2_with_gradient_checkpointing(act_factory, reentrant, mode):
    import transformers  # the [test] extra pins it
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)

    def run(act):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.train()
        ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
        if act is None:
            loss = model(ids, labels=ids).loss
        else:
            with act:
                loss = model(ids, labels=ids).loss
        loss.backward()
        return [p.grad for p in model.parameters()]
    ref = run(None)
    act = act_factory(mode=mode, min_bytes=1024)
    got = run(act)
    assert act.stats().offloaded > 0
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


@pytest.mark.parametrize("compress", ["bf16", "int8"])
def test_compressed_backward_is_close_not_exact(act_factory, compress):
    x = torch.randn(64, 32)
    ref = _grads(_mlp(), x, None, None)
    act = act_factory(compress=compress, write_behind_bytes=0)  # every write waited for: values come from the store
    got = _grads(_mlp(), x, act, None)
    assert act.stats().offloaded > 0 and act.stats().unwritten_hits == 0
    worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, ref))
    assert 0 < worst < 0.05


def test_bench_activations_runs_small(tmp_path):
    import json

    from tierstore.cli import main
    out = tmp_path / "act.json"
    rc = main(["bench", "activations", "--cases", "nvme", "--rounds", "1", "--steps", "2", "--layers", "2",
               "--width", "64", "--context", "64", "--dir", str(tmp_path), "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    run = res["runs"]["nvme"][0]
    assert run["stats"]["offloaded"] > 0 and run["peak_rss"] > 0 and run["step_s"] > 0
    assert 0 < res["compression_errors"]["int8"]["gradients"] < 0.05
    rc = main(["bench", "activations", "--floor", "--layers", "8", "--width", "64", "--context", "64", "--dir",
               str(tmp_path), "--json", str(out), "--small-batch", "16K"])
    assert rc == 0
    per = json.loads(out.read_text())["per_block"]
    assert per["none"][0] > 0 and per["offload"][2] > 0 and per["offload"][1] > 0


def test_bookkeeping_per_offloaded_tensor_is_small(act_factory):
    """What the forward leaves in Python objects per offloaded tensor (ours and the store's) stays small: the
    write's future (a Condition with its lock and deque, ~1.5 KiB) is let go once written, and the dedupe
    keys of tensors already gone are dropped at the end of the forward ([Note: per-save bookkeeping]).
    tracemalloc counts allocations, not time: the figure does not depend on the machine's load."""
    import tracemalloc
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(48)])
    x = torch.randn(128, 64, requires_grad=True)  # every saved activation: 32 KiB
    act = act_factory(min_bytes=16 << 10)

    def forward():
        with act:
            out = model(x).sum()
        act.wait_writes()
        return out
    forward().backward()  # warm: the store's files, the threads, torch's caches
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        n0 = act.stats().offloaded
        loss = forward()
        gc.collect()
        per = (tracemalloc.get_traced_memory()[0] - before) / (act.stats().offloaded - n0)
    finally:
        tracemalloc.stop()
    assert act.stats().offloaded - n0 == 49  # x and each ReLU's output (a Linear's input, saved once)
    assert per < 2048, f"{per:.0f} bytes of Python objects per offloaded tensor"
    # private: the per-save bookkeeping itself is what this checks; stats() does not count it
    live = [r() for r in act._order if r() is not None]
    assert live and all(r.write is None and r.data is None for r in live)
    kept_keys = [r() for r in act._by_storage.values()]  # only x is alive of what was saved: one key is kept
    assert len(kept_keys) == 1 and kept_keys[0].ref() is x
    del live, kept_keys
    loss.backward()
    # private: the read-ahead order has no public view
    assert [r for r in act._order if r() is not None] == []


@pytest.mark.parametrize("reentrant", [None, False, True])
def test_small_batches_gradients_bit_equal(act_factory, reentrant):
    """small_batch_bytes: the small saves are copied into shared batches, offloaded as one record each
    ([Note: small saves batched]); gradients stay torch.equal, also when read back from the store."""
    x = torch.randn(64, 32)
    ref = _grads(_mlp(), x, None, reentrant)
    act = act_factory(min_bytes=1 << 20, small_batch_bytes=8192, mode="all")
    # private: every unpack made to read the store, not the tensor still in memory
    orig = act._unpack
    act._unpack = lambda p: (act.wait_writes(), orig(p))[1]  # every batch written: read back, not from memory
    got = _grads(_mlp(), x, act, reentrant)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    s = act.stats()
    assert s.batched >= 3 and s.offloaded >= 2 and s.kept <= 3 * 6  # only the parameters stay (and views of them)
    assert s.misses + s.prefetch_hits >= 3


def test_small_batches_layouts_versions_and_retain_graph(act_factory):
    act = act_factory(min_bytes=1 << 20, small_batch_bytes=4096)
    values = [torch.randn(5, 7), torch.randn(7, 5).t(), torch.arange(10, dtype=torch.int64),
              torch.rand(9) > 0.5, torch.randn(3, 4, dtype=torch.bfloat16), torch.tensor(2.5)]
    with act:
        # private: the pack / unpack hooks called directly, without a graph, to check each layout
        packed = [act._pack(v) for v in values]
    act.wait_writes()
    for v, p in zip(values, packed):
        # private: the unpack hook itself, called as autograd calls it
        got = act._unpack(p)
        assert got.dtype == v.dtype and got.shape == v.shape and got.stride() == v.stride() and torch.equal(got, v)
    again = act._unpack(packed[1])  # read a second time (a second backward): the same value
    assert torch.equal(again, values[1])
    values[0].add_(1)  # modified in place after the save: the unpack refuses, as torch does
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        act._unpack(packed[0])
    w = torch.randn(6, 6, requires_grad=True)
    h = torch.randn(6, 6, requires_grad=True)
    with act:
        loss = (w * h).sin().sum()
    loss.backward(retain_graph=True)
    g1 = w.grad.clone()
    loss.backward()
    assert torch.equal(w.grad, 2 * g1)
    del packed, p
    gc.collect()
    act.wait_writes()
    assert act.stats().held_bytes == 0
