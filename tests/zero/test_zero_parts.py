"""The parts Zero3Optimizer is built from: the store-key helper, the sub-group stepper's
typed hand-off, the 8-bit state handling, skipped-parameter handling, and the checkpoint interface."""
from __future__ import annotations

import pytest
import torch

from tests.support import batches, cfg, loss_fn, make_pair
from tierstore.zero import Zero3Optimizer, keys

# tiny tensors: intra-op threads only add contention on the shared CI cores
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _trained(tmp_path, steps=2, net=None, **cfg_kw):
    _, m = make_pair(**(net or {}))
    opt = Zero3Optimizer(m, torch.optim.AdamW, config=cfg(tmp_path, **cfg_kw), lr=1e-2)
    for x, y in batches(steps, d=(net or {}).get("d", 16)):
        loss_fn(m, x, y).backward()
        opt.step()
    return opt


def test_every_store_name_is_built_by_the_key_helper(tmp_path):
    """After steps (gradients kept: no zero_grad), the store holds exactly the names keys.* gives for the
    layout: a parameter shard per sub-group, a master and AdamW's three states per trainable one, a gradient
    partition per trainable one."""
    opt = _trained(tmp_path, params="device", states="host", grads="host")  # not [Note: shared master]
    try:
        want = set()
        for gid in range(len(opt.layout.subgroups)):
            want.add(keys.param(gid))
        for gid in opt.layout.trainable_gids():
            want |= {keys.master(gid), keys.grad(gid)} | {keys.state(gid, k) for k in ("step", "exp_avg", "exp_avg_sq")}
        assert set(opt.store.keys()) == want
        # the names are distinct per kind and per sub-group
        assert len({keys.param(1), keys.master(1), keys.grad(1), keys.state(1, "param"), keys.param(11)}) == 5
    finally:
        opt.close()


class _Layout:
    """Just what Prefetcher reads of a Layout: bucket(gid).numel / .shard_numel / .dtype."""

    class _B:
        numel, shard_numel, dtype = 4, 2, torch.float32

    def bucket(self, gid):
        return self._B()


def test_prefetcher_reads_ahead_hands_over_and_drops():
    """The Prefetcher alone (world size 1: reads only, no all-gather posted): what `ahead` names is read on
    its worker thread, `shard` hands a read-ahead shard over (a hit) or reads now, held buckets are not read,
    and `drop` forgets the rest."""
    from tierstore.zero.hooks.prefetch import Prefetcher
    reads = []

    def fetch(gid):
        reads.append(gid)
        return torch.full((2,), float(gid))

    held = {3}
    pf = Prefetcher(_Layout(), fetch, held.__contains__, device=torch.device("cpu"), depth=1)
    try:
        assert pf.enabled and not pf.gathers_ahead_on and pf.span == 1
        pf.ahead([[0, 3], [1]])  # world 1: every module named is read ahead; 3 is held already
        assert pf.reads_in_flight == 2 and pf.gathers_in_flight == 0
        assert pf.take_gathered(0) is None  # nothing was posted ahead
        assert pf.shard(0).tolist() == [0.0, 0.0] and pf.prefetch_hits == 1
        assert pf.shard(2).tolist() == [2.0, 2.0] and pf.prefetch_hits == 1  # not read ahead: read now
        pf.drop()
        assert pf.reads_in_flight == 0
        assert sorted(reads) == [0, 1, 2] and pf.stage.staged == 2
    finally:
        pf.close()
    off = Prefetcher(_Layout(), fetch, held.__contains__, device=torch.device("cpu"), depth=0)
    off.ahead([[5]])
    assert not off.enabled and off.reads_in_flight == 0 and 5 not in reads


def test_prefetcher_reads_further_ahead_within_its_bytes():
    """[Note: reading ahead by bytes]: past the depth, modules are read ahead while the shards read ahead and
    not yet used fit in read_bytes, in order; a shard used frees its bytes for the next module."""
    from tierstore.zero.hooks.prefetch import READ_AHEAD_MAX, READ_WORKERS, Prefetcher
    reads = []

    def fetch(gid):
        reads.append(gid)
        return torch.full((2,), float(gid))

    shard = 2 * 4  # bytes of one shard of _Layout
    pf = Prefetcher(_Layout(), fetch, lambda gid: False, device=torch.device("cpu"), depth=1, read_bytes=3 * shard)
    try:
        # private: the read pool's worker count has no public view
        assert pf.span == 1 + READ_AHEAD_MAX and pf._executor._max_workers == READ_WORKERS
        pf.ahead([[0], [], [1, 2], [3], [4]])  # depth: module 0; then 1 and 2 (with 0: 3 shards); 3 would not fit
        assert sorted(pf._prefetched) == [0, 1, 2]
        pf.ahead([[0], [], [1, 2], [3], [4]])  # asked again: nothing twice
        assert pf.shard(0).tolist() == [0.0, 0.0]
        pf.ahead([[], [1, 2], [3], [4]])  # 0 used: room for 3, not for 4
        assert sorted(pf._prefetched) == [1, 2, 3]
        pf.drop()
        assert sorted(reads) == [0, 1, 2, 3] and pf.reads_in_flight == 0
    finally:
        pf.close()
    pf = Prefetcher(_Layout(), fetch, lambda gid: False, device=torch.device("cpu"), depth=1, read_bytes=0)
    try:
        assert pf.span == 1 and pf._executor._max_workers == 1  # by modules only, as before
    finally:
        pf.close()


def test_loaded_subgroup_is_typed_and_the_stepper_steps_it(tmp_path):
    """The stepper's hand-off is a LoadedSubgroup: load -> step_loaded -> save by hand does what step() does
    for that sub-group (the master moves, the states land in the store under keys.state)."""
    from tierstore.zero.step.stepper import LoadedSubgroup
    opt = _trained(tmp_path, steps=1, params="device", states="nvme", grads="host")
    try:
        gid = opt.layout.trainable_gids()[0]
        x, y = next(iter(batches(1)))
        loss_fn(opt.model, x, y).backward()
        before = opt.export_subgroup(gid)
        st = opt._stepper  # private: the stepper's own hand-off is what this tests
        st.skipped.plan(opt.coordinator.grad_names)
        t = st.load(gid)
        assert isinstance(t, LoadedSubgroup) and t.gid == gid
        assert t.resident == {"grad"}  # the gradient stepped in place on host; master and states read from nvme
        assert set(t.tensors) == {"master", "grad", "step", "exp_avg", "exp_avg_sq"}
        st.step_loaded([t], 1.0, "inline")
        assert t.master_out is not None and set(t.new_state) == {"step", "exp_avg", "exp_avg_sq"}
        st.save(t)
        after = opt.export_subgroup(gid)
        assert not torch.equal(before["master"], after["master"])
        assert float(after["state"]["step"]) == float(before["state"]["step"]) + 1
    finally:
        opt.close()


def test_checkpoint_interface_round_trips_a_subgroup(tmp_path):
    """export_subgroup / import_subgroup / hyperparams / scaler_state: what checkpoint/ uses instead of
    the optimizer's private members."""
    net = dict(d=64, h=128)  # sub-groups of 16K elements: their states are packed (>= MIN_QUANT_NUMEL)
    a = _trained(tmp_path / "a", steps=2, net=net, states="nvme", state_codec="dynamic8", min_io_bytes=1 << 14,
                 sub_group_bytes=1 << 16)
    b = _trained(tmp_path / "b", steps=0, net=net)
    try:
        assert a.stats().quantized_states >= 2  # 8-bit states round-trip below, not only fp32 ones
        for gid in a.layout.trainable_gids():
            sg = a.export_subgroup(gid)
            assert sg["master"].dtype == torch.float32 and all(v.dtype == torch.float32 for v in sg["state"].values())
            b.import_subgroup(gid, sg["master"], sg["state"], sg["aux"])
            got = b.export_subgroup(gid)
            assert torch.equal(got["master"], sg["master"])
            assert {k: v.tolist() for k, v in got["state"].items()} == {k: v.tolist() for k, v in sg["state"].items()}
        hp = a.hyperparams()
        assert "params" not in hp[0] and hp[0]["lr"] == 1e-2
        hp[0]["lr"] = 5e-3
        b.set_hyperparams(hp)
        assert b.param_groups[0]["lr"] == 5e-3
        assert b.scaler_state() == a.scaler_state() and set(b.param_aliases) >= set(b.param_aliases.values())
        fresh = b.initial_state_values(b.layout.trainable_gids()[0])
        assert fresh == {"exp_avg": 0.0, "exp_avg_sq": 0.0}
    finally:
        a.close()
        b.close()


def test_skipped_params_plan_and_put_back():
    """SkippedParams alone: a bucket some of whose parameters got no gradient is stepped, their elements
    recorded as runs; keep/restore put those elements of the master and of old states back, and give a
    state this step creates its fresh value there."""
    from tierstore.zero.params.layout import Layout
    from tierstore.zero.step.skipped import SkippedParams
    layout = Layout([("a", (4,), torch.float32, True), ("b", (4,), torch.float32, True),
                     ("c", (4,), torch.float32, True)], [([], {})], 1, min_io_bytes=1 << 20, bucket_bytes=1 << 20)
    opt = torch.optim.Adam([torch.zeros(1)], lr=0.1)
    sk = SkippedParams(layout, 0, torch.optim.Adam, {"lr": 0.1}, opt.param_groups, [{}], torch.device("cpu"))
    assert sk.plan(set()) == [] and sk.runs == {}
    gids = sk.plan({"b"})
    assert gids == [0]
    assert sum(e - a for a, e in sk.runs[0]) == 8  # a's and c's elements
    master = torch.arange(12, dtype=torch.float32)
    old = {"exp_avg": torch.ones(12)}
    kept = sk.keep(0, 0, master, old)
    master.add_(100)
    new = {"exp_avg": torch.full((12,), 7.0), "exp_avg_sq": torch.full((12,), 9.0)}
    sk.restore(kept, master, new)
    skipped = torch.zeros(12, dtype=torch.bool)
    for a, e in sk.runs[0]:
        skipped[a:e] = True
    assert torch.equal(master[skipped], torch.arange(12, dtype=torch.float32)[skipped])
    assert (master[~skipped] >= 100).all()
    assert (new["exp_avg"][skipped] == 1).all() and (new["exp_avg"][~skipped] == 7).all()
    assert (new["exp_avg_sq"][skipped] == 0).all() and (new["exp_avg_sq"][~skipped] == 9).all()
    assert sk.partly_skipped == 1


def test_eight_bit_states_pack_and_unpack(tmp_path):
    """EightBitStates alone: a large exp_avg goes to the store packed in 8 bits and comes back within the
    codec's error; a state the policy keeps fp32 (or no policy) is stored as it is."""
    from tierstore.quant.states import StatePolicy
    from tierstore.store import Store
    from tierstore.zero.step.state8 import EightBitStates
    from tierstore.zero.step.stepper import BufferPool
    with Store([str(tmp_path / "s")], budgets={"device": 0, "host": 0}) as store:
        q = EightBitStates(store, "nvme", StatePolicy.make(), BufferPool(torch.device("cpu"), 2))
        v = torch.randn(1 << 14)
        q.put(3, "exp_avg", v)
        assert q.is_packed(3, "exp_avg") and store.tensor(keys.state(3, "exp_avg")).dtype == torch.uint8
        back = q.unpack(3, "exp_avg", store.get(keys.state(3, "exp_avg")), torch.empty(v.numel()))
        assert (back - v).abs().max() <= 0.05 * v.abs().max()
        q.put(3, "step", torch.tensor(2.0))
        assert not q.is_packed(3, "step") and store.get(keys.state(3, "step")).item() == 2.0
        plain = EightBitStates(store, "nvme", None, BufferPool(torch.device("cpu"), 2))
        plain.put(4, "exp_avg", v)
        assert not plain.is_packed(4, "exp_avg") and torch.equal(store.get(keys.state(4, "exp_avg")), v)


def test_step_stream_queues_by_bytes_loads_by_depth_and_keeps_order():
    """StepStream ([Note: the stream's queue is in bytes] in pipeline.py): submit() returns at once while the
    sub-groups not yet saved fit queue_bytes (one is always admitted), at most `depth` are loaded and not saved,
    they are stepped and saved in the order submitted, and an error is raised by wait() once all have finished."""
    import threading
    import time

    from tierstore.zero.step.pipeline import StepStream

    gate = threading.Event()
    lock = threading.Lock()
    loaded_now, most_loaded, saved = [0], [0], []

    def load(item):
        gate.wait(10)
        with lock:
            loaded_now[0] += 1
            most_loaded[0] = max(most_loaded[0], loaded_now[0])
        if item == "bad":
            raise OSError("disk gone")
        return item

    def save(item, t):
        with lock:
            loaded_now[0] -= 1
        saved.append(item)

    stream = StepStream(2, load, lambda item, t: t, save, queue_bytes=10)
    try:
        for i in range(5):
            stream.submit(i, 2)  # 10 bytes: all fit, none loaded yet (the gate is shut)
        t0 = time.perf_counter()
        threading.Timer(0.3, gate.set).start()
        stream.submit(5, 2)  # 12 > 10: waits until one is saved
        assert time.perf_counter() - t0 >= 0.25
        assert stream.wait() == list(range(6)) and saved == list(range(6))
        assert most_loaded[0] <= 2
        stream.submit("big", 50)  # larger than the whole queue, alone: admitted
        stream.submit("bad", 1)
        stream.submit(7, 1)
        with pytest.raises(OSError, match="disk gone"):
            stream.wait()
        assert saved[-2:] == ["big", 7]  # the error did not stop the others, nor leak a slot
        for i in range(4):
            stream.submit(i, 5)
        assert stream.wait() == list(range(4))
    finally:
        gate.set()
        stream.close()


def test_buffers_lent_to_writes_are_bounded_until_given_back():
    """[Note: lent buffers are bounded]: lent() waits while the buffers out on loan exceed lend_bytes (one loan
    always goes out), give() of a lent buffer makes room, and a loan counted without waiting is still counted."""
    import threading
    import time

    from tierstore.zero.step.stepper import BufferPool

    pool = BufferPool(torch.device("cpu"), 4, lend_bytes=8 << 20)
    a, b, c = (pool.take(1 << 20, torch.float32) for _ in range(3))  # 4 MiB each
    pool.lent([a])
    pool.lent([b])  # 8 MiB: at the bound, not over it
    assert pool.lent_bytes == 8 << 20
    threading.Timer(0.3, pool.give, args=(a,)).start()  # the disk has a's bytes
    t0 = time.perf_counter()
    pool.lent([c])
    assert time.perf_counter() - t0 >= 0.25 and pool.lent_bytes == 8 << 20
    pool.lent([a], wait=False)  # over the bound, counted all the same
    assert pool.lent_bytes == 12 << 20
    for t in (a, b, c):
        pool.give(t)
    assert pool.lent_bytes == 0
    pool.give(pool.take(1 << 20, torch.float32))  # never lent: nothing to count
    assert pool.lent_bytes == 0
    solo = BufferPool(torch.device("cpu"), 4, lend_bytes=1 << 20)
    solo.lent([pool.take(1 << 20, torch.float32)])  # larger than the bound, alone: goes out
    assert solo.lent_bytes == 4 << 20


def test_only_the_pools_own_buffers_are_recycled():
    """[Note: only the pool's own buffers are recycled]: a buffer the pool made comes back from take(), with
    huge pages advised; a 4 KiB-aligned tensor made elsewhere (torch's allocator, another mapping) is not
    kept, and neither is memory at the address of an own buffer that is gone."""
    import gc
    import re

    from tierstore.tiers.host import aligned_empty
    from tierstore.zero.step.stepper import BufferPool

    def huge_advised(addr: int) -> bool:
        span = None
        with open("/proc/self/smaps") as f:
            for line in f:
                m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
                if m:
                    span = (int(m.group(1), 16), int(m.group(2), 16))
                elif span and span[0] <= addr < span[1] and line.startswith("VmFlags:"):
                    return " hg" in line
        raise AssertionError(f"{addr:#x} is in no mapping")

    pool = BufferPool(torch.device("cpu"), 4)
    own = pool.take(1 << 20, torch.float32)
    assert huge_advised(own.data_ptr())
    pool.give(own)
    assert pool.take(1 << 20, torch.float32) is own
    foreign = aligned_empty(4 << 20, lock=False, huge=False).view(torch.float32)
    assert foreign.data_ptr() % 4096 == 0
    pool.give(foreign)
    got = pool.take(1 << 20, torch.float32)
    assert got is not foreign and huge_advised(got.data_ptr())
    addr = got.data_ptr()
    del got
    gc.collect()
    assert addr not in pool._own  # its mapping went: the address is no longer the pool's
    small = pool.take(16, torch.float32)  # under ALIGNED_MIN: torch's memory, not recycled as one of ours
    pool.give(small)
    assert pool.take(16, torch.float32) is not small


def test_importing_a_subgroup_without_states_forgets_its_8bit_ones(tmp_path):
    """import_subgroup with an empty state (a sub-group no step reached) deletes the sub-group's states; the
    record of which were packed in 8 bits goes with them, and the next step creates them again as in a new
    run, packed again."""
    from tests.support.models import Deep
    torch.manual_seed(0)
    m = Deep(layers=2, width=128)
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-3, config=cfg(tmp_path, params="nvme", states="nvme",
                                                                    grads="nvme", state_codec="dynamic8",
                                                                    sub_group_bytes=4096 * 4))
    try:
        x = torch.randn(4, 128)
        m(x).sum().backward()
        opt.step()
        opt.zero_grad()
        packed = opt.stats().quantized_states
        assert packed, "the test needs a state packed in 8 bits"
        for gid in opt.layout.trainable_gids():
            opt.import_subgroup(gid, opt.export_subgroup(gid)["master"], {}, {})
            assert opt.export_subgroup(gid)["state"] == {}
        assert opt.stats().quantized_states == 0
        m(x).sum().backward()
        opt.step()
        assert opt.stats().quantized_states == packed
    finally:
        opt.close()


def test_the_cpu_step_warning_applies_only_to_an_unchosen_implementation_for_an_accelerator_model():
    from tierstore.zero.step.stepper import cpu_path_warning

    cpu, acc = torch.device("cpu"), torch.device("cuda")  # a device object only: nothing runs there

    def warning(cls=torch.optim.AdamW, step=cpu, model=acc, **kw):
        return cpu_path_warning(cls([torch.zeros(1, requires_grad=True)], **kw), 0, step, model, "host")

    msg = warning()
    assert msg and "AdamW" in msg and "fused=True" in msg and "host tier" in msg and "foreach=False" in msg
    assert warning(torch.optim.Adam) is not None
    assert warning(fused=True) is None and warning(foreach=False) is None and warning(foreach=True) is None
    assert warning(model=cpu) is None  # torch's own default on the CPU: the user's baseline is the same loop
    assert warning(step=acc) is None  # states on the device tier: the step runs there
    assert warning(torch.optim.RMSprop) is None  # no fused kernel to recommend


@pytest.mark.parametrize("kw", [
    dict(params="device", states="host", grads="host"),
    dict(params="nvme", states="nvme", grads="nvme"),
    dict(params="device", states="host", grads="host", overlap_step=True),
    dict(params="device", states="nvme", grads="host", state_codec="dynamic8", min_io_bytes=1 << 14,
         sub_group_bytes=1 << 14),
], ids=["memory", "nvme-shared-master", "overlapped", "fused8"])
def test_stats_name_the_step_paths_a_run_took(tmp_path, kw):
    """OptimizerStats.step_paths counts each sub-group step once under the way it was driven and once under
    each other path it took ([Note: step paths] in stepper.py); the paths agree with the other counters."""
    d = 64 if kw.get("state_codec") else 16  # 8-bit states only for states this large
    _, m = make_pair(d=d, h=128)
    opt = Zero3Optimizer(m, torch.optim.AdamW, config=cfg(tmp_path, **kw), lr=1e-2)
    try:
        for x, y in batches(3, d=d):
            loss_fn(m, x, y).backward()
            opt.step()
            opt.zero_grad()
        st, n = opt.stats(), len(opt.layout.trainable_gids())
        paths = st.step_paths
        drivers = {k: paths.get(k, 0) for k in ("in-place", "inline", "pipelined", "overlapped")}
        assert sum(drivers.values()) == 3 * n  # every sub-group step driven one way
        assert paths["first"] == n  # the first step creates the states
        assert paths.get("fused8", 0) == st.fused_steps
        assert paths.get("masters-at-hand", 0) == st.masters_at_hand
        assert paths.get("partly-skipped", 0) == st.partly_skipped
        if kw.get("overlap_step"):
            assert paths["overlapped"] == st.overlapped > 0
        elif kw["states"] == "nvme":  # overlap_step="auto": the first step plain, then overlapped
            assert paths["pipelined"] == n and paths["overlapped"] == st.overlapped == 2 * n
        elif kw["states"] == "host":  # memory tiers: the first step one sub-group at a time, then one inner step
            assert paths == {"first": n, "inline": n, "in-place": 2 * n}
        else:
            assert paths["pipelined"] == 3 * n
        if kw["params"] == "nvme":  # fp32 with the parameters on the states' tier
            assert paths["shared-master"] == 3 * n and paths["kept-for-forward"] > 0
        if kw.get("state_codec"):
            assert paths["fused8"] > 0
        assert set(paths) <= {"in-place", "inline", "pipelined", "overlapped", "first", "fused8", "partly-skipped",
                              "masters-at-hand", "shared-master", "kept-for-forward"}
    finally:
        opt.close()
