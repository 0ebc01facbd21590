"""What the training step does not do: copies at world size 1 ([Note: gathering at world size 1] in hooks.py,
[Note: gradient bytes copied once] in gradient_reducer.py), fresh gradient partitions each step ([Note:
persistent gradient partitions] in grad_partitions.py), and the disk bytes it reports by kind ([Note: disk
bytes by kind] in disk_bytes.py)."""
from __future__ import annotations

import copy

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


def test_disk_bytes_by_kind_match_the_store_and_the_sizes(tmp_path):
    torch.manual_seed(0)
    m = Deep(layers=2, width=64)
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-3, config=cfg(tmp_path, params="nvme", states="nvme",
                                                                    grads="nvme", prefetch_depth=0))
    try:
        x = torch.randn(4, 64)
        m(x).sum().backward()
        opt.step()
        opt.zero_grad()
        before, nv0 = opt.stats(), opt.store.stats()["nvme"]
        m(x).sum().backward()
        opt.step()
        opt.zero_grad()
        after, nv1 = opt.stats(), opt.store.stats()["nvme"]
        read = {k: after.disk_read[k] - before.disk_read[k] for k in after.disk_read}
        written = {k: after.disk_written[k] - before.disk_written[k] for k in after.disk_written}
        assert sum(read.values()) == nv1["bytes_out"] - nv0["bytes_out"]
        assert sum(written.values()) == nv1["bytes_in"] - nv0["bytes_in"]
        shard = sum(opt.layout.shard_numel(g) for g in opt.layout.trainable_gids()) * 4  # bytes, fp32
        # fp32 and params with the states: the master is the parameter shard ([Note: shared master])
        assert written == {"params": 0, "grads": shard, "master": shard, "states": written["states"]}
        assert written["states"] >= 2 * shard  # exp_avg, exp_avg_sq (and the step counts)
        assert read["grads"] == shard and read["master"] == shard and read["states"] == written["states"]
        assert read["params"] >= 2 * shard  # gathered for forward and again for backward
    finally:
        opt.close()


# -- the overlapped step ([Note: overlapped step] in optimizer.py) ---------------------------------------------
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
