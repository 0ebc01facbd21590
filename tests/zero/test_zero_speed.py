"""What the training step does not do: copies at world size 1 ([Note: gathering at world size 1] in
hooks/coordinator.py,
[Note: gradient bytes copied once] in gradient_reducer.py), fresh gradient partitions each step ([Note:
persistent gradient partitions] in grad_partitions.py), and the disk bytes it reports by kind ([Note: disk
bytes by kind] in disk_bytes.py)."""
from __future__ import annotations

import copy
import errno
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from tests.support.models import Deep, batches, loss_fn, make_pair
from tests.support.zero import cfg, max_rel
from tierstore.zero import Zero3Optimizer, keys


def _storage_range(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def test_world1_gathered_parameters_are_views_of_the_stored_shard(tmp_path):
    torch.manual_seed(0)
    m = Deep(layers=3, width=64)
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-3, config=cfg(tmp_path, params="host", states="host",
                                                                    sub_group_bytes=64 * 64 * 4 + 256))
    seen = []
    h = m.layers[1].register_forward_pre_hook(lambda mod, args: seen.append(mod.weight.data_ptr()))
    try:
        m(torch.randn(4, 64)).sum().backward()
        gid = opt.layout.param_gids["layers.1.weight"][0]
        # fp32 with params on the states' tier: the gathered bucket is the master itself ([Note: shared master])
        with opt.store.tensor(keys.master(gid)).resident("host") as master:
            lo, hi = _storage_range(master)
        assert lo <= seen[0] < hi, "the gathered weight is a copy, not a view of the stored shard"
        assert not opt.coordinator.stats().buckets_held  # released after use: the lent shard went back
        opt.step()
        opt.zero_grad()
        # gathered() still gives copies: changes made inside it are not written back
        with opt.gathered():
            w = m.layers[1].weight.detach().clone()
            m.layers[1].weight.data.add_(1.0)
        with opt.gathered():
            assert torch.equal(m.layers[1].weight, w)
    finally:
        h.remove()
        opt.close()


def test_world1_gradient_partitions_are_kept_and_reused(tmp_path):
    m, ref = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path, params="host", states="host"))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ptrs = []
    try:
        for x, y in batches(3):
            for model, o in ((m, opt), (ref, ref_opt)):
                loss_fn(model, x, y).backward()
                o.step()
                o.zero_grad()
            with opt.store.tensor(keys.grad(0)).resident("host") as g:
                ptrs.append(g.data_ptr())
        assert len(set(ptrs)) == 1, "a new gradient partition was allocated for a later step"
        for n, p in ref.named_parameters():
            assert torch.equal(opt.full_state_dict()[n], p.detach()), n
    finally:
        opt.close()


def test_world1_gradients_are_computed_in_their_partition(tmp_path):
    """[Note: gradients computed in their partition]: at world size 1 each nn.Linear's weight and bias gradient
    is computed straight into its run of the kept partition -- autograd's .grad is a view of it, no full-size
    gradient is allocated, page-faulted, copied or freed -- on the host and the nvme tier, bit-equal to torch."""
    for grads in ("host", "nvme"):
        torch.manual_seed(0)
        m = Deep(layers=3, width=64)
        ref = copy.deepcopy(m)
        seen: dict[str, int] = {}
        # registered before the optimizer's own hook (which reduces and drops .grad): sees .grad as it landed
        hooks = [p.register_post_accumulate_grad_hook(lambda p, n=n, s=seen: s.__setitem__(n, p.grad.data_ptr()))
                 for n, p in m.named_parameters()]
        opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(
            tmp_path / grads, params="host", states="host", grads=grads, sub_group_bytes=2 * (64 * 64 + 64) * 4))
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        try:
            g = torch.Generator().manual_seed(1)
            for step in range(3):
                x = torch.randn(8, 64, generator=g)
                for model, o in ((m, opt), (ref, ref_opt)):
                    model(x).square().mean().backward()
                    o.step()
                    o.zero_grad()
                st = opt.coordinator.stats()
                assert st.grads_in_place == 6 * (step + 1), "a Linear's gradient was not computed in its partition"
                assert st.peak_grad_bytes == 0, "a full-size .grad was allocated next to the partitions"
            if grads == "host":
                for n in seen:
                    gid = opt.layout.param_gids[n][0]
                    with opt.store.tensor(keys.grad(gid)).resident("host") as part:
                        lo, hi = _storage_range(part)
                    assert lo <= seen[n] < hi, f"{n}'s .grad is not a view of its gradient partition"
            full = opt.full_state_dict()
            for n, p in ref.named_parameters():
                assert torch.equal(full[n], p.detach()), (grads, n)
        finally:
            for h in hooks:
                h.remove()
            opt.close()


def test_gradients_handed_to_the_caller_are_never_partition_memory(tmp_path):
    """Where autograd gives a gradient to the caller instead of accumulating it -- torch.autograd.grad, a
    parameter's own tensor hook, backward(inputs=...) leaving a parameter out -- the partition is not used
    for it: what the caller holds keeps its values through later backwards, and the step stays exact."""
    torch.manual_seed(0)
    m = Deep(layers=2, width=32)
    ref = copy.deepcopy(m)
    opt = Zero3Optimizer(m, torch.optim.SGD, lr=0.1, config=cfg(tmp_path, params="host", states="host"))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    kept = []
    h = m.layers[1].weight.register_hook(lambda g: kept.append(g))
    h_ref = ref.layers[1].weight.register_hook(lambda g: None)
    try:
        x = torch.randn(4, 32)
        w = m.layers[0].weight
        (gw,) = torch.autograd.grad(m(x).sum(), [w])
        (gw_ref,) = torch.autograd.grad(ref(x).sum(), [ref.layers[0].weight])
        assert torch.equal(gw, gw_ref)
        got = gw.clone()
        for model, o in ((m, opt), (ref, ref_opt)):
            model(x).square().sum().backward(inputs=[model.layers[1].weight, model.layers[1].bias])
            o.step()
            o.zero_grad()
            model(2 * x).square().sum().backward()
            o.step()
            o.zero_grad()
        assert torch.equal(gw, got), "a gradient torch.autograd.grad returned changed under a later backward"
        assert torch.equal(kept[0], kept[0].clone()) and kept[0].data_ptr() != kept[1].data_ptr()
        full = opt.full_state_dict()
        for n, p in ref.named_parameters():
            assert torch.equal(full[n], p.detach()), n
    finally:
        h.remove()
        h_ref.remove()
        opt.close()


def test_accumulation_into_kept_partitions_is_exact(tmp_path):
    """Two micro-batches per step, gradients on host (added in place) and on nvme (read, added, written):
    bit-equal to torch's accumulation; zero_grad() forgets what the kept partition held."""
    for grads in ("host", "nvme"):
        m, ref = make_pair()
        opt = Zero3Optimizer(m, torch.optim.SGD, lr=0.1, config=cfg(tmp_path / grads, params="host", states="host",
                                                                     grads=grads))
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        try:
            data = batches(4)
            for i in range(0, 4, 2):
                for model, o in ((m, opt), (ref, ref_opt)):
                    for x, y in data[i:i + 2]:
                        loss_fn(model, x, y).backward()
                    o.step()
                    o.zero_grad()
            full = opt.full_state_dict()
            for n, p in ref.named_parameters():
                assert torch.equal(full[n], p.detach()), (grads, n)
        finally:
            opt.close()


def _one_nvme_step(tmp_path, **kw):
    """(disk bytes read, written by kind in the second step, buckets held between its forward and backward,
    the optimizer's layout and config, bytes of the masters its forward took from the first step) of Deep(2, 64)
    with everything on nvme; the plain step unless `kw` says otherwise."""
    kw.setdefault("overlap_step", False)
    torch.manual_seed(0)
    m = Deep(layers=2, width=64)
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-3, config=cfg(tmp_path, params="nvme", states="nvme",
                                                                    grads="nvme", prefetch_depth=0, **kw))
    try:
        x = torch.randn(4, 64)
        m(x).sum().backward()
        opt.step()
        opt.zero_grad()
        before, nv0 = opt.stats(), opt.store.stats()["nvme"]
        y = m(x).sum()
        held = opt.coordinator.stats().buckets_held  # kept for backward ([Note: kept at the turn])
        y.backward()
        opt.step()
        opt.zero_grad()
        after, nv1 = opt.stats(), opt.store.stats()["nvme"]
        read = {k: after.disk_read[k] - before.disk_read[k] for k in after.disk_read}
        written = {k: after.disk_written[k] - before.disk_written[k] for k in after.disk_written}
        assert sum(read.values()) == nv1["bytes_out"] - nv0["bytes_out"]
        assert sum(written.values()) == nv1["bytes_in"] - nv0["bytes_in"]
        head = opt.shards.forward_head.gids  # [Note: stepped masters kept for the forward]
        assert after.masters_kept - before.masters_kept == len(head)
        return read, written, held, opt.layout, opt.config, sum(4 * opt.layout.shard_numel(g) for g in head)
    finally:
        opt.close()


def test_disk_bytes_by_kind_match_the_store_and_the_sizes(tmp_path):
    read, written, held, layout, _, from_step = _one_nvme_step(tmp_path / "a", reuse_bytes=0)
    assert not held and not from_step
    shard = sum(layout.shard_numel(g) for g in layout.trainable_gids()) * 4  # bytes, fp32
    # fp32 and params with the states: the master is the parameter shard ([Note: shared master])
    assert written == {"params": 0, "grads": shard, "master": shard, "states": written["states"]}
    assert written["states"] >= 2 * shard  # exp_avg, exp_avg_sq (and the step counts)
    assert read["grads"] == shard and read["master"] == shard and read["states"] == written["states"]
    assert read["params"] >= 2 * shard  # gathered for forward and again for backward


def test_the_forwards_last_buckets_are_not_read_again_by_backward(tmp_path):
    """[Note: kept at the turn]: the buckets the forward used last stay for backward, within reuse_bytes."""
    read0, written0, _, layout, _, _ = _one_nvme_step(tmp_path / "off", reuse_bytes=0)
    read, written, held, _, config, from_step = _one_nvme_step(tmp_path / "on")  # the default budget
    last = set(layout.param_gids["layers.1.weight"] + layout.param_gids["layers.1.bias"])
    kept = sum(layout.bucket(g).numel * 4 for g in held)  # bytes
    assert held and held <= last and 0 < kept <= config.reuse_budget == 2 * config.sub_group_bytes
    # those buckets were not read again, nor those the forward took from the step ([Note: stepped masters kept
    # for the forward])
    assert 0 < from_step <= min(config.reuse_budget, config.prefetch_bytes)
    assert read["params"] == read0["params"] - kept - from_step
    # (the masters backward read are taken by the step too: [Note: masters at hand])
    assert written == written0 and {k: v for k, v in read.items() if k not in ("params", "master")} == \
        {k: v for k, v in read0.items() if k not in ("params", "master")}


# -- the overlapped step ([Note: overlapped step] in overlap.py) ---------------------------------------------
def _train(opt, model, data, *, micro=1, clip=None, ref=False):
    """Steps of `micro` micro-batches each; accumulating() around all but the last (tierstore)."""
    norms = []
    for i in range(0, len(data), micro):
        for j, (x, y) in enumerate(data[i:i + micro]):
            if ref or j == micro - 1:
                loss_fn(model, x, y).backward()
            else:
                with opt.accumulating():
                    loss_fn(model, x, y).backward()
        if clip is not None:
            norms.append(clip(opt))
        opt.step()
        opt.zero_grad()
    return norms


def test_overlapped_step_is_exact_without_clipping(tmp_path):
    for tiers in (("host", "host", "host"), ("nvme", "nvme", "nvme")):
        for micro in (1, 2):
            m, ref = make_pair()
            opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, config=cfg(
                tmp_path / f"{tiers[0]}{micro}", *tiers, overlap_step=True))
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
            try:
                data = batches(6)
                _train(opt, m, data, micro=micro)
                _train(ref_opt, ref, data, micro=micro, ref=True)
                full = opt.full_state_dict()
                for n, p in ref.named_parameters():
                    assert torch.equal(full[n], p.detach()), (tiers, micro, n)
                st = opt.stats()
                assert st.steps == 6 // micro
                # every complete bucket was stepped during backward, none of the accumulating micro-batches'
                assert st.overlapped > 0 and st.overlapped % st.steps == 0
                if tiers[2] == "nvme":  # without accumulation the gradients never went to the disk
                    assert (st.disk_written["grads"] == 0) == (micro == 1)
            finally:
                opt.close()


def test_overlapped_step_clips_with_the_previous_norm(tmp_path):
    m, ref = make_pair()
    opt = Zero3Optimizer(m, torch.optim.SGD, lr=0.1, config=cfg(tmp_path, "host", "nvme", "nvme", overlap_step=True,
                                                                 clip_mode="previous_norm"))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    try:
        norms = []
        for x, y in batches(4):
            loss_fn(m, x, y).backward()
            norms.append(float(opt.clip_grad_norm_(0.05)))
            opt.step()
            opt.zero_grad()
        coefs = [1.0] + [min(1.0, 0.05 / (t + 1e-6)) for t in norms[:-1]]
        assert min(coefs) < 0.5  # the clipping did act
        for (x, y), c in zip(batches(4), coefs):
            loss_fn(ref, x, y).backward()
            for p in ref.parameters():
                p.grad.mul_(c)
            ref_opt.step()
            ref_opt.zero_grad()
        full = opt.full_state_dict()
        for n, p in ref.named_parameters():
            assert torch.equal(full[n], p.detach()), n
    finally:
        opt.close()


def test_overlapped_step_refuses_what_it_cannot_honour(tmp_path):
    from tierstore.errors import MisuseError, TierstoreValueError
    with pytest.raises(TierstoreValueError, match="float16"):
        cfg(tmp_path, overlap_step=True, compute_dtype=torch.float16)
    with pytest.raises(TierstoreValueError, match="previous_norm"):  # DeepSpeed's gradient_clipping, exact mode
        cfg(tmp_path, overlap_step=True, gradient_clipping=1.0)
    cfg(tmp_path, overlap_step=True, gradient_clipping=1.0, clip_mode="previous_norm")
    with pytest.raises(TierstoreValueError, match="clip_mode"):
        cfg(tmp_path, clip_mode="sometimes")
    m, _ref = make_pair()
    opt = Zero3Optimizer(m, torch.optim.SGD, lr=0.1, config=cfg(tmp_path, "host", "host", "host", overlap_step=True))
    try:
        x, y = batches(1)[0]
        loss_fn(m, x, y).backward()
        with pytest.raises(MisuseError, match="previous_norm"):
            opt.clip_grad_norm_(1.0)  # exact clipping: too late, sub-groups were stepped
        opt.step()
        opt.zero_grad()
        with opt.accumulating():  # nothing stepped during this backward: exact clipping works
            loss_fn(m, x, y).backward()
        assert float(opt.clip_grad_norm_(1.0)) > 0
    finally:
        opt.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_the_next_forwards_first_reads_start_in_the_step(tmp_path, overlap):
    """[Note: prefetch after the step] in prefetch.py: step() reads ahead the shards of the forward's first
    module, so the next forward's first gather uses a shard already read (without it the first module's shard
    is read when the module runs: nothing runs before it to read it ahead); results stay torch's."""
    m, ref = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path, "nvme", "nvme", "nvme", prefetch_depth=1,
                                                                    overlap_step=overlap))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    co = opt.coordinator
    hits_at_first: list[int] = []  # prefetch hits when the first module runs (its gather done), per forward
    m.fc1.register_forward_pre_hook(lambda mod, args: hits_at_first.append(co.stats().prefetch_hits))
    try:
        read_after_step = []
        hits_before = []
        for x, y in batches(4):
            hits_before.append(co.stats().prefetch_hits)
            loss_fn(m, x, y).backward()
            opt.step()
            read_after_step.append(co.stats().reads_in_flight)
            opt.zero_grad()
        _train(ref_opt, ref, batches(4), ref=True)
        # the first forward records the trace: nothing ahead of it; every later one finds fc1 read in the step
        assert [a - b for a, b in zip(hits_at_first, hits_before)][0] == 0
        assert all(a > b for a, b in zip(hits_at_first[1:], hits_before[1:])), (hits_at_first, hits_before)
        assert all(n > 0 for n in read_after_step), read_after_step
        full = opt.full_state_dict()
        for n, p in ref.named_parameters():
            assert torch.equal(full[n], p.detach()), n
    finally:
        opt.close()


def test_norms_of_nvme_gradients_read_back_once_then_taken_at_hand(tmp_path):
    """Gradients on nvme: the first clip_grad_norm_ reads them back (nobody had asked for norms), later
    steps take the norm while the partition is at hand -- no extra disk read; the clipping matches torch."""
    ref_m, z_m = make_pair()
    ref = torch.optim.SGD(ref_m.parameters(), lr=0.1)
    opt = Zero3Optimizer(z_m, torch.optim.SGD, lr=0.1, config=cfg(tmp_path, "host", "host", "nvme"))
    shard = sum(opt.layout.shard_numel(g) for g in opt.layout.trainable_gids()) * 4  # bytes, fp32
    try:
        reads = []
        for x, y in batches(3):
            before = opt.stats().disk_read["grads"]
            norms = []
            for m, o in ((ref_m, ref), (z_m, opt)):
                loss_fn(m, x, y).backward()
                clip = torch.nn.utils.clip_grad_norm_(ref_m.parameters(), 0.05) if o is ref else o.clip_grad_norm_(0.05)
                norms.append(float(clip))
                o.step()
                o.zero_grad()
            assert norms[0] == pytest.approx(norms[1], rel=1e-5) and norms[0] > 0.05
            reads.append(opt.stats().disk_read["grads"] - before)
        assert reads == [2 * shard, shard, shard]  # the step's read, plus the norm's the first time
        assert max_rel(opt.full_state_dict(), ref_m) <= 1e-6
    finally:
        opt.close()


def _train_bf16(path, micro: int, **kw):
    """full_state_dict, disk bytes written by kind, and the stored gradient dtype after 3 steps of Net in
    bfloat16 (AdamW, `micro` micro-batches a step)."""
    m, _ = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(path, compute_dtype=torch.bfloat16, **kw))
    try:
        data = [(x.bfloat16(), y.bfloat16()) for x, y in batches(3 * micro)]
        for i in range(0, len(data), micro):
            for x, y in data[i:i + micro]:
                loss_fn(m, x, y).backward()
            stored = {opt.store.tensor(keys.grad(g)).dtype for g in opt.layout.trainable_gids()}
            opt.step()
            opt.zero_grad()
        return opt.full_state_dict(), opt.stats().disk_written, stored
    finally:
        opt.close()


def test_bf16_gradients_on_nvme_are_stored_in_bf16_and_train_as_in_memory(tmp_path):
    """[Note: gradient dtype on nvme]: half the gradient bytes; one micro-batch at world size 1 holds exactly
    autograd's bf16 gradients, so training is bit-equal to the same run with every state in memory."""
    ref, _, _ = _train_bf16(tmp_path / "host", 1, params="host", states="host", grads="host")
    wide, wide_w, wide_dt = _train_bf16(tmp_path / "fp32", 1, params="nvme", states="nvme", grads="nvme")
    low, low_w, low_dt = _train_bf16(tmp_path / "bf16", 1, params="nvme", states="nvme", grads="nvme",
                                     gradient_dtype=torch.bfloat16)
    assert wide_dt == {torch.float32} and low_dt == {torch.bfloat16}
    assert low_w["grads"] * 2 == wide_w["grads"] > 0  # half the bytes to the disk
    assert low_w["master"] == wide_w["master"] and low_w["params"] == wide_w["params"]  # masters stay fp32
    for n in ref:
        assert torch.equal(ref[n], wide[n]) and torch.equal(ref[n], low[n]), n
    # accumulation: the sum is rounded to bf16 where it is written (once per micro-batch but the last)
    acc_ref, _, _ = _train_bf16(tmp_path / "host2", 2, params="host", states="host", grads="host")
    acc, _, _ = _train_bf16(tmp_path / "bf16-2", 2, params="nvme", states="nvme", grads="nvme",
                            gradient_dtype=torch.bfloat16)
    assert all(torch.allclose(acc[n].float(), acc_ref[n].float(), rtol=0, atol=0.05) for n in acc_ref)


def test_a_handed_over_partition_kept_for_step_is_stored_in_the_gradient_dtype(tmp_path):
    """keep() (world size N, overlap_step: a partition handed over that some rank could not step yet) stores it
    as close() would: rounded to gradient_dtype, and counted as gradient bytes written."""
    m, _ = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(
        tmp_path, compute_dtype=torch.bfloat16, params="nvme", states="nvme", grads="nvme",
        gradient_dtype=torch.bfloat16))
    try:
        gid = opt.layout.trainable_gids()[0]
        parts = opt._grads  # private: the partitions' hand-over has no public surface
        part, _fresh = parts.open(gid)
        part.fill_(0.5)
        parts.close(gid, part, hand_over=True)
        before = opt.stats().disk_written["grads"]
        parts.keep(gid)
        got = opt.store.get(keys.grad(gid))
        assert got.dtype == torch.bfloat16 and torch.equal(got.float(), torch.full_like(part, 0.5))
        assert opt.stats().disk_written["grads"] - before == 2 * got.numel()
    finally:
        opt.close()


def test_gradient_dtype_is_fp32_or_the_compute_dtype(tmp_path):
    from tierstore.errors import TierstoreValueError
    with pytest.raises(TierstoreValueError, match="gradient_dtype"):
        cfg(tmp_path, gradient_dtype=torch.bfloat16)  # fp32 compute
    with pytest.raises(TierstoreValueError, match="reuse_bytes"):
        cfg(tmp_path, reuse_bytes=-1)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_step_takes_the_masters_backward_read_instead_of_reading_them_again(tmp_path, overlap):
    """[Note: masters at hand]: fp32, world size 1, everything on nvme: the bucket backward gathered is the
    master; the step uses it instead of reading it again (within reuse_bytes), and training stays bit-equal to
    torch."""
    reads = {}
    for reuse in (0, None):
        torch.manual_seed(0)
        m = Deep(layers=4, width=64)
        ref = copy.deepcopy(m)
        opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-3, config=cfg(
            tmp_path / str(reuse), params="nvme", states="nvme", grads="nvme", reuse_bytes=reuse,
            overlap_step=overlap, sub_group_bytes=64 * 64 * 4 + 1024))
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        try:
            for _ in range(3):
                x = torch.randn(4, 64)
                before = opt.stats().disk_read["master"]
                m(x).sum().backward()
                opt.step()
                opt.zero_grad()
                ref(x).sum().backward()
                ref_opt.step()
                ref_opt.zero_grad()
                reads.setdefault(reuse, []).append(opt.stats().disk_read["master"] - before)
            full = opt.full_state_dict()
            for n, p in ref.named_parameters():
                assert torch.equal(full[n], p.detach()), n
            taken = opt.stats().masters_at_hand
            assert (taken == 0) == (reuse == 0), taken
        finally:
            opt.close()
    shard = sum(opt.layout.shard_numel(g) for g in opt.layout.trainable_gids()) * 4  # bytes
    assert reads[0] == [shard] * 3
    # at most 2 x sub_group_bytes of masters kept for the step: the last layer's sub-groups backward released
    # (the first layer's weight and the packed biases); overlapped, each is stepped as soon as backward
    # releases it, and the budget covers the stream's queue too: every one is at hand
    weight = 64 * 64 * 4  # bytes
    if overlap:
        assert reads[None] == [0, 0, 0], reads
    else:
        assert all(r <= shard - weight for r in reads[None]), reads


# -- [Note: stepped masters kept for the forward] in stepper.py ------------------------------------------------
def _nvme_deep(path, **kw):
    torch.manual_seed(0)
    m = Deep(layers=4, width=64)
    ref = copy.deepcopy(m)
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-3, config=cfg(
        path, params="nvme", states="nvme", grads="nvme", sub_group_bytes=64 * 64 * 4 + 1024, **kw))
    return m, ref, opt


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("codec", [None, "dynamic8"])
def test_the_forward_takes_the_masters_the_step_wrote(tmp_path, overlap, codec):
    """fp32 with everything on nvme: the next forward reads none of the masters the step kept for it (the
    trace's first sub-groups within reuse_bytes and prefetch_bytes) and training stays bit-equal to torch;
    reuse_bytes=0 keeps none."""
    fwd_reads = {}
    for reuse in (0, None):
        m, ref, opt = _nvme_deep(tmp_path / str(reuse), reuse_bytes=reuse, overlap_step=overlap, state_codec=codec,
                                 prefetch_depth=0)  # the forward reads what it uses when it uses it
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        try:
            for _ in range(3):
                x = torch.randn(4, 64)
                before = opt.stats().disk_read["params"]
                y = m(x).sum()
                fwd_reads.setdefault(reuse, []).append(opt.stats().disk_read["params"] - before)
                y.backward()
                opt.step()
                opt.zero_grad()
                if codec is None:
                    ref(x).sum().backward()
                    ref_opt.step()
                    ref_opt.zero_grad()
            head = opt.shards.forward_head.gids
            assert opt.stats().masters_kept == (0 if reuse == 0 else 2 * len(head))  # the 2nd and 3rd forwards
            if codec is None:
                full = opt.full_state_dict()
                for n, p in ref.named_parameters():
                    assert torch.equal(full[n], p.detach()), n
        finally:
            opt.close()
    shard = sum(opt.layout.shard_numel(g) for g in opt.layout.trainable_gids()) * 4  # bytes
    kept = sum(4 * opt.layout.shard_numel(g) for g in head)  # bytes
    assert head and 0 < kept <= min(opt.config.reuse_budget, opt.config.prefetch_bytes)
    assert all(r >= shard for r in fwd_reads[0])  # (a small bucket several modules use is read for each)
    assert all(r <= r0 - kept for r, r0 in zip(fwd_reads[None][1:], fwd_reads[0][1:])), fwd_reads


def _slow_writes(monkeypatch, opt, *, delay: float = 0.0, fail: bool = False) -> list:
    """From on.append(True) on (`on`, the list returned), each write of the store finishes `delay` seconds
    after the disk has it -- a disk that holds on to its writes -- or fails with EIO if `fail`; the time each
    was issued is appended to `on`. Reaches into the store's engine to set up the fault."""
    engine = opt.store._engine
    real = engine.write
    on: list = []

    def write(f, buf, offset=0):
        io = real(f, buf, offset)
        if not on:
            return io
        on.append(time.perf_counter())
        out: Future = Future()

        def finish():
            io.exception()  # the real write is done
            time.sleep(delay)
            if fail:
                out.set_exception(OSError(errno.EIO, "Input/output error (injected)"))
            else:
                out.set_result(io.result())
        threading.Thread(target=finish, daemon=True).start()
        return out
    monkeypatch.setattr(engine, "write", write)
    return on


def test_a_kept_master_is_not_used_before_its_write_has_finished(tmp_path, monkeypatch):
    """The master the step kept is lent to its write: nothing uses it before that write has finished (the
    forward waits for it), and then the forward computes what torch does. Overlapped, the forward's first
    sub-groups are stepped last: their writes are still in flight when step() returns."""
    m, ref, opt = _nvme_deep(tmp_path, overlap_step=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    slow = _slow_writes(monkeypatch, opt, delay=1.0)
    try:
        x = torch.randn(4, 64)
        for model, o in ((m, opt), (ref, ref_opt)):
            model(x).sum().backward()
            o.step()
            o.zero_grad()
            model(x).sum().backward()
            if o is opt:
                slow.append(True)  # this step's writes take a second to finish
            o.step()
            o.zero_grad()
        last = max(slow[1:])  # when the step issued its last write (a state of the forward's first sub-group)
        y = m(x).sum().detach()
        # its master was written just before: the forward could not use it sooner
        assert time.perf_counter() >= last + 1.0 - 0.1
        assert opt.stats().masters_kept == 2 * len(opt.shards.forward_head.gids) > 0  # the 2nd and 3rd forwards
        assert torch.equal(y, ref(x).sum().detach())
    finally:
        opt.close()


def test_a_failed_write_of_a_kept_master_is_reported_by_the_forward(tmp_path, monkeypatch):
    """The forward does not read the masters the step kept, so it does not meet their write's error the way a
    read would: it asks for it, and raises it as the read does (reuse_bytes=0)."""
    errors = {}
    for reuse in (0, None):
        m, _ref, opt = _nvme_deep(tmp_path / str(reuse), reuse_bytes=reuse)
        failing = _slow_writes(monkeypatch, opt, fail=True)
        try:
            x = torch.randn(4, 64)
            m(x).sum().backward()
            opt.store.flush()  # the gradients' staged writes must not fail with the step's
            failing.append(True)
            opt.step()  # its writes fail on the disk, after the step returned (they are not waited for)
            opt.zero_grad()
            with pytest.raises(OSError) as ei:
                m(x).sum()
            errors[reuse] = ei.value.errno
            assert opt.stats().masters_kept == 0
        finally:
            failing.clear()
            monkeypatch.undo()
            opt.close()
    assert errors == {0: errno.EIO, None: errno.EIO}


def test_masters_kept_for_the_forward_are_dropped_when_a_master_is_written(tmp_path):
    """load_state_dict between the step and the forward: the forward computes with the loaded values, not the
    masters the step kept."""
    m, _ref, opt = _nvme_deep(tmp_path)
    try:
        x = torch.randn(4, 64)
        m(x).sum().backward()
        opt.step()
        opt.zero_grad()
        torch.manual_seed(5)
        other = Deep(layers=4, width=64)
        m.load_state_dict(other.state_dict())
        before = opt.stats().masters_kept  # (the load may take them, to read what it does not replace)
        assert torch.equal(m(x), other(x))
        assert opt.stats().masters_kept == before
    finally:
        opt.close()


def test_the_steps_reads_ahead_are_bounded_by_the_sub_groups_bytes(tmp_path):
    """[Note: step pipeline] in pipeline.py: the optimizer gives the step pipeline each sub-group's master
    bytes on this rank, so a reader faster than the step loads at most about ahead x sub_group_bytes ahead.
    (The sizes once came from the inner optimizer's placeholders, empty outside the step: every size was 0,
    and a reader faster than the step loaded the whole step ahead -- 0.6 GiB more peak RSS at 256M.)"""
    torch.manual_seed(0)
    m = Deep(layers=16, width=64)
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-3, config=cfg(
        tmp_path, params="nvme", states="nvme", grads="nvme", sub_group_bytes=64 * 64 * 4 + 1024))
    try:
        x = torch.randn(4, 64)
        m(x).sum().backward()
        opt.step()
        opt.zero_grad()
        st = opt._stepper  # private: the step is slowed by hand to let the reader run ahead
        step_loaded = st.step_loaded

        def slow(items, coef, path):  # the reader runs ahead meanwhile
            time.sleep(0.02)
            return step_loaded(items, coef, path)
        st.step_loaded = slow
        m(x).sum().backward()
        opt.step()
        pl = st._pipeline  # private: the pipeline's own bound is what this tests
        assert len(opt.layout.trainable_gids()) >= 16
        # the one stepped, one (full) sub-group read ahead plus the next being read, one being written
        assert pl.peak_in_flight <= 1 + (pl.ahead + 1) + pl.behind, pl.peak_in_flight
    finally:
        opt.close()


def test_8bit_states_are_one_extent_each_scales_and_codes_together(tmp_path):
    """A sub-group's 8-bit moment is stored as one tensor -- the blocks' absmax
    (scales) then the codes ([Note: packed layout] in quant/packed.py) -- so one extent of the nvme tier, read
    and written with one request; the step's disk bytes for states are exactly those (and the step counts)."""
    from tierstore.quant import packed
    from tierstore.tiers.nvme.extents import Extent
    torch.manual_seed(0)
    m = Deep(layers=2, width=64)
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-3, config=cfg(
        tmp_path, params="nvme", states="nvme", grads="nvme", state_codec="dynamic8", sub_group_bytes=64 * 64 * 4))
    try:
        x = torch.randn(4, 64)
        for _ in range(2):
            before = opt.stats().disk_read["states"]
            m(x).sum().backward()
            opt.step()
            opt.zero_grad()
        read = opt.stats().disk_read["states"] - before
        expect = 0
        packed_states = 0
        for gid in opt.layout.trainable_gids():
            q8 = opt._stepper.states8  # private: which states are stored in 8 bits has no public surface
            for k in opt._stepper.state_keys[gid]:
                t = opt.store.tensor(keys.state(gid, k))
                # private: a handle's placement record, to damage its extent
                copy_ = t._p.copies["nvme"]
                assert isinstance(copy_, Extent) and copy_.length == t.encoded_nbytes  # one extent, all of it
                expect += t.encoded_nbytes
                if q8.is_packed(gid, k):
                    scheme, n = q8.packed[(gid, k)]
                    assert t.dtype == torch.uint8 and t.encoded_nbytes == packed.nbytes(scheme, n, 256)
                    packed_states += 1
        assert packed_states >= 2 and read == expect
    finally:
        opt.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["step", "overlapped"])
def test_the_steps_writes_come_from_its_buffers_which_come_back_only_when_written(tmp_path, monkeypatch, overlap):
    """[Note: lent tensors]: the step writes each sub-group's states out of the aligned buffers it stepped them
    in, and backward its gradient partitions out of the buffers they were reduced in (no copy into pool
    buffers first); a buffer is recycled only once every write from it has finished; training stays
    bit-equal to torch."""
    from tierstore.tiers.nvme.writes import ExtentWriter
    from tierstore.zero.step.stepper import BufferPool

    paths: dict[str, list[str]] = {"direct": [], "streamed": []}
    real_direct, real_streamed = ExtentWriter._write_direct, ExtentWriter._write_streamed

    def direct(self, src, n, alen, what, lend):
        paths["direct"].append(what)
        return real_direct(self, src, n, alen, what, lend)

    def streamed(self, addr, n, alen, what):
        paths["streamed"].append(what)
        return real_streamed(self, addr, n, alen, what)

    monkeypatch.setattr(ExtentWriter, "_write_direct", direct)
    monkeypatch.setattr(ExtentWriter, "_write_streamed", streamed)
    in_flight: list[tuple[int, int, object]] = []  # (address, bytes, future) of every engine write
    early: list[int] = []  # buffers given back while a write from them was in flight
    real_give = BufferPool.give

    def give(self, t, **kw):
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        if any(lo <= a < hi and not f.done() for a, _n, f in list(in_flight)):
            early.append(lo)
        return real_give(self, t, **kw)

    monkeypatch.setattr(BufferPool, "give", give)
    torch.manual_seed(0)
    m = Deep(layers=2, width=1100)  # each weight's sub-group (4.6 MiB) is larger than a pool buffer (4 MiB)
    ref = copy.deepcopy(m)
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-3, config=cfg(
        tmp_path, params="nvme", states="nvme", grads="nvme", sub_group_bytes=8 << 20, overlap_step=overlap))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    real_write = opt.store._engine.write  # private: the fault is set up in the store's engine

    def write(f, buf, offset=0):
        fut = real_write(f, buf, offset)
        in_flight.append((buf.data_ptr(), buf.numel() * buf.element_size(), fut))
        return fut

    monkeypatch.setattr(opt.store._engine, "write", write)
    try:
        for i in range(3):
            x = torch.randn(4, 1100, generator=torch.Generator().manual_seed(i))
            for model, o in ((m, opt), (ref, ref_opt)):
                model(x).sum().backward()
                o.step()
                o.zero_grad()
            if i == 0:  # the first step creates its states
                paths["streamed"].clear()
                paths["direct"].clear()
        full = opt.full_state_dict()
        for n, p in ref.named_parameters():
            assert torch.equal(full[n], p.detach()), n
    finally:
        opt.close()
    # the last two steps wrote the states, and backward the gradient partitions, from their own buffers; the
    # masters here are the ones backward read, at hand ([Note: masters at hand]), in aligned result memory
    # ([Note: result memory] in tiers/host.py): nothing was copied
    assert not paths["streamed"], paths["streamed"]
    assert any("'s" in w for w in paths["direct"]), paths
    assert not early


def test_synchronize_waits_for_the_reads_the_step_started_and_its_writes(tmp_path):
    """Zero3Optimizer.synchronize(): the next forward's reads that step() started ([Note: prefetch after the
    step]) and the writes still in flight have finished when it returns; the shards read stay for the forward."""
    torch.manual_seed(0)
    m = Deep(layers=3, width=1100)
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-3, config=cfg(
        tmp_path, params="nvme", states="nvme", grads="nvme", sub_group_bytes=8 << 20))
    try:
        pf = opt.coordinator.prefetcher
        fetch = pf.fetch_shard
        for i in range(2):
            m(torch.randn(4, 1100)).sum().backward()
            if i == 1:  # reads that take a while
                pf.fetch_shard = lambda gid: (time.sleep(0.3), fetch(gid))[1]
            opt.step()
            opt.zero_grad()
        assert pf.reads_in_flight  # the next forward's first shards, read ahead by the step
        assert not all(f.done() for f in pf._prefetched.values())
        opt.synchronize()
        # private: the prefetch's own futures; reads_in_flight is the public count
        assert all(f.done() for f in pf._prefetched.values()) and pf.reads_in_flight
        writer = opt.store._nvme._writer  # private: the tier's writes in flight have no public surface
        assert all(f.done() for f in list(writer._inflight))  # every write submitted has finished
        m(torch.randn(4, 1100)).sum().backward()  # and they are used as before
        assert pf.prefetch_hits > 0
    finally:
        opt.close()
