"""Crash safety: a child process puts and flushes in a loop and is SIGKILLed at a random moment; the parent
reopens the store and finds exactly the tensors of the last completed flush (or of the one that completed
as it died), bit-exact, and the store usable. Many rounds, each continuing the same store."""
from __future__ import annotations

import os
import random
import signal
import time

import torch

from tests.support.dist import context
from tierstore.store import Store

NAMES = 20


def gen_plan(g: int) -> tuple[dict[str, torch.Tensor], str | None]:
    """What generation g puts, and the name it deletes: a pure function of g."""
    puts = {}
    for i in range(5):
        k = (g * 7 + i) % NAMES
        n = 3 << 18 if k == 0 else (150_000 if k % 5 == 0 else 200 + 37 * k)  # elements: 3 MiB, 600 KiB, small
        puts[f"t{k}"] = torch.full((n,), float(g * 100 + i)) + torch.arange(n, dtype=torch.float32) % 7
    gone = f"t{(g * 3) % NAMES}"
    return puts, (gone if gone not in puts else None)


def model(g: int) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for h in range(1, g + 1):
        puts, gone = gen_plan(h)
        state.update(puts)
        if gone:
            state.pop(gone, None)
    return state


def child(d: str, log_fd: int) -> None:
    s = Store(d, pinned_budget=4 << 20, buffer_bytes=1 << 20, host_budget=1 << 20)
    g = s.generation
    while True:
        g += 1
        puts, gone = gen_plan(g)
        for k, v in puts.items():
            s.put(k, v, random.choice([None, "host", "nvme"] if v.numel() < 200_000 else [None, "nvme"]))
        if gone and gone in s:
            s.delete(gone)
        s.flush()
        assert s.generation == g
        os.write(log_fd, f"{g}\n".encode())


def child_main(d: str, log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    random.seed(os.getpid())
    child(d, fd)


def test_sigkill_during_put_flush_loop(tmp_path):
    d = str(tmp_path / "store")
    log = str(tmp_path / "log")
    rng = random.Random(1234)
    # A fork server started once (torch imported there) forks each child quickly and from a clean,
    # single-threaded process; forking pytest itself could inherit locks held by its threads.
    ctx = context()
    seen_gens = []
    for _round in range(20):
        with open(log, "w"):
            pass
        proc = ctx.Process(target=child_main, args=(d, log))
        proc.start()
        time.sleep(rng.uniform(0.02, 0.3))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL, "the child died on its own: see its traceback above"
        with open(log) as f:
            logged = [int(x) for x in f.read().split()]
        if not os.path.exists(os.path.join(d, "manifest.json")):
            assert not logged  # killed before its first flush completed
            continue
        with Store.open(d) as s:
            g = s.generation
            last = logged[-1] if logged else None
            assert last is None or g in (last, last + 1), (g, logged)
            want = model(g)
            assert sorted(s.keys()) == sorted(want)
            got = s.get_many(list(want))
            for k, v in want.items():
                assert torch.equal(got[k], v), (g, k)
            seen_gens.append(g)
            s.close(flush=False)
    assert seen_gens and seen_gens[-1] >= 3  # the loop made progress across rounds
    with Store.open(d) as s:  # and the store is usable afterwards
        s.put("after", torch.ones(10))
    with Store.open(d) as s:
        assert torch.equal(s.get("after"), torch.ones(10))
