"""Offloaded inference's reads within a small budget ([Note: reads in flight within a small budget] in
tierstore/zero/inference/offload.py): a bucket is read in READ_PIECE requests, and the reads ahead take all the
budget beside the module running."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.support import Deep
from tierstore.zero import offload_for_inference
from tierstore.zero.inference.offload import READ_PIECE, read_ahead_bytes

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_large_bucket_is_read_in_one_mib_requests(tmp_path):
    torch.manual_seed(0)
    m = Deep(layers=3, width=1024)  # a Linear of 4 MiB each: one bucket each
    x = torch.randn(2, 1024)
    with torch.no_grad():
        ref = m(x)
    with offload_for_inference(m, nvme_path=tmp_path, budget_bytes=16 << 20) as off:
        assert READ_PIECE == 1 << 20 == off.store.stats()["io"]["buffer_bytes"]
        engine = off.store._engine
        read, sizes = engine.read, []

        def counted(file, buffer, offset=0):
            sizes.append(buffer.numel() * buffer.element_size())
            return read(file, buffer, offset)
        engine.read = counted
        try:
            with torch.no_grad():
                out = m(x)
        finally:
            del engine.read
    assert torch.equal(out, ref)
    assert len(sizes) >= 3 * 4 and max(sizes) <= READ_PIECE, sizes


def test_reads_ahead_take_the_budget_beside_the_running_module(tmp_path):
    torch.manual_seed(0)
    m = Deep(layers=24, width=256)  # 24 buckets of 257 KiB
    x = torch.randn(2, 256)
    with torch.no_grad():
        ref = m(x)
    budget = 4 << 20
    with offload_for_inference(m, nvme_path=tmp_path, budget_bytes=budget) as off:
        module = off._largest_module_bytes(m, off.params)
        pf = off.coordinator.prefetcher
        assert pf.read_bytes == read_ahead_bytes(budget, module) == budget - module
        with torch.no_grad():
            m(x)  # the trace
        fetch, lock, most = pf.fetch_shard, threading.Lock(), [0]

        def slow(gid):  # a slow disk, so that the reads ahead pile up to what the budget allows
            with lock:
                most[0] = max(most[0], pf._ahead_bytes)
            time.sleep(0.01)
            return fetch(gid)
        pf.fetch_shard = slow
        off.reset_peak()
        with torch.no_grad():
            out = m(x)
        peak = off.stats().peak_resident_bytes
    assert torch.equal(out, ref)
    assert most[0] > budget - 2 * module, (most[0], budget, module)  # more than the old reserve left
    assert 0 < peak <= budget, peak


def test_the_next_forwards_first_buckets_are_read_before_the_last_module_runs(tmp_path):
    """[Note: reads across forwards] in hooks/prefetch.py: near a forward's end the reads ahead go on into the next
    forward's first modules, and the forward's end keeps them: the next forward reads each bucket once."""
    torch.manual_seed(0)
    m = Deep(layers=24, width=256)  # 24 buckets of 257 KiB; a 4 MiB budget reads about 14 ahead
    x = torch.randn(2, 256)
    with torch.no_grad():
        ref = m(x)
    with offload_for_inference(m, nvme_path=tmp_path, budget_bytes=4 << 20) as off:
        coord, pf = off.coordinator, off.coordinator.prefetcher
        first = [coord._module_gids[id(layer)][0] for layer in m.layers[:4]]
        seen = []
        m.layers[-1].register_forward_pre_hook(lambda mod, args: seen.append([g in pf._prefetched for g in first]))
        with torch.no_grad():
            m(x)  # the trace
            m(x)
            kept = [g in pf._prefetched for g in first]
            pf.settle()  # the reads in flight are counted once done
            before, ahead0 = off.stats(), len(pf._prefetched)
            out = m(x)
            pf.settle()
            after, ahead1 = off.stats(), len(pf._prefetched)
    assert torch.equal(out, ref)
    assert seen[-1] == [True] * 4 and kept == [True] * 4, (seen, kept)
    # each bucket read once: the forward's own minus those read before it, plus those read for the next one
    assert after.fetches - before.fetches == 24 - ahead0 + ahead1, (before, after, ahead0, ahead1)
    assert after.prefetch_hits - before.prefetch_hits == 24
    assert 0 < after.peak_resident_bytes <= 4 << 20
