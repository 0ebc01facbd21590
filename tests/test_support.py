"""The multi-process launcher every `_dist` test uses (tests/support/dist.py): results come back by rank, a
failing rank's traceback is the failure, and a hang fails instead of blocking."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.support import RanksFailed, run_isolated, run_ranks


def _sum_ranks(rank, world, offset):
    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    return {"rank": rank, "world": dist.get_world_size(), "sum": float(t)}


def _one_rank_raises(rank, world):
    if rank == 1:
        raise ValueError("rank one cannot go on")
    dist.barrier()  # waits for rank 1, which never arrives: it fails (or hangs) because of rank 1


def _sleeps(rank, world):
    time.sleep(600)


def _no_group(x):
    return x * 2, dist.is_initialized()


def test_results_come_back_by_rank():
    res = run_ranks(_sum_ranks, 3, 10)
    assert [r["rank"] for r in res] == [0, 1, 2] and all(r["world"] == 3 for r in res)
    assert all(r["sum"] == 10 + 11 + 12 for r in res)


def test_the_failing_rank_s_traceback_comes_first():
    with pytest.raises(RanksFailed) as ei:
        run_ranks(_one_rank_raises, 2)
    msg = str(ei.value)
    assert msg.startswith("rank 1 raised:") and "ValueError: rank one cannot go on" in msg
    assert "_one_rank_raises" in msg  # the traceback, not only the message


def test_a_hang_fails_with_the_ranks_named():
    with pytest.raises(RanksFailed, match=r"ranks \[0, 1\] of 2 still running after 3 s"):
        run_ranks(_sleeps, 2, timeout=3)


def test_isolated_run_has_no_process_group():
    assert run_isolated(_no_group, 21) == (42, False)


def _returns_a_lambda(rank, world):
    return lambda: rank


def test_a_result_that_cannot_be_sent_back_is_a_failure_that_says_so():
    with pytest.raises(RanksFailed, match="rank 0 raised:\nits result could not be saved"):
        run_ranks(_returns_a_lambda, 1)
