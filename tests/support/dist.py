"""One launcher for every multi-process test: `run_ranks(fn, world, *args)`.

Each rank is a fresh process forked from one fork server (torch, torch.distributed and tierstore.zero are
imported there once, instead of paying seconds of imports per rank; unlike a plain fork, no rank inherits
the test process's threads). Rank r joins a gloo group of `world` ranks on a free local port, runs
fn(r, world, *args) and sends back what it returned (anything torch.save can write). A rank that raises
fails the test with that rank's traceback; a rank that does not finish within `timeout` seconds (a hang:
ranks waiting on a collective the others never post) fails it too, with the ranks still running named.
"""
from __future__ import annotations

import datetime
import multiprocessing
import multiprocessing.connection
import os
import shutil
import socket
import tempfile
import time
import traceback

import torch

# Imported once in the fork server (its first start fixes the list for the whole test process).
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "numcodecs", "tierstore.store", "tierstore.zero",
           "tests.support", "tests.reliability._children"]
TIMEOUT = 150  # seconds for a whole run of the ranks
GROUP_TIMEOUT = 60  # seconds a rank waits in a collective before gloo gives up
GRACE = 10  # seconds the other ranks get to finish once one has failed (they may wait on it)


class RanksFailed(AssertionError):
    """A rank raised, exited abnormally, or the ranks did not finish in time. An AssertionError, so pytest
    shows its message (the failing rank's traceback) as the failure."""


def context():
    """The fork-server multiprocessing context every test process shares (see the module docstring)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank: int, world: int, port: int | None, out: str, args: tuple,
               node_size: int | None = None) -> None:
    torch.set_num_threads(1)  # tiny tensors, several ranks on few cores: intra-op threads only add contention
    if node_size is not None:  # simulated nodes of `node_size` consecutive ranks, named as torchrun names them
        os.environ.update(LOCAL_WORLD_SIZE=str(node_size), LOCAL_RANK=str(rank % node_size))
    dist = None
    try:
        if port is not None:
            import torch.distributed as dist
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this machine
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=GROUP_TIMEOUT))
            result = fn(rank, world, *args)
        else:
            result = fn(*args)
        payload = {"result": result}
    except BaseException:
        payload = {"error": traceback.format_exc(), "at": time.time()}
    finally:
        if dist is not None and dist.is_initialized():
            dist.destroy_process_group()
    try:
        torch.save(payload, out)
    except Exception:  # a result torch.save cannot write
        payload = {"error": f"its result could not be saved:\n{traceback.format_exc()}", "at": time.time()}
        torch.save(payload, out)
    if "error" in payload:
        os._exit(1)  # skip interpreter teardown: other ranks may still hold this one's sockets


def _launch(fn, world: int, args: tuple, timeout: float, group: bool, node_size: int | None = None) -> list:
    ctx = context()
    tmp = tempfile.mkdtemp(prefix="tierstore-ranks-")
    try:
        port = free_port() if group else None
        outs = [os.path.join(tmp, f"rank{r}.pt") for r in range(world)]
        procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, outs[r], args, node_size), daemon=True,
                             name=f"rank{r}") for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        running = list(procs)
        while running and time.monotonic() < deadline:
            multiprocessing.connection.wait([p.sentinel for p in running], deadline - time.monotonic())
            running = [p for p in procs if p.exitcode is None]
            if any(p.exitcode not in (None, 0) for p in procs):  # one failed: the others may wait on it
                deadline = min(deadline, time.monotonic() + GRACE)
        hung = [r for r, p in enumerate(procs) if p.exitcode is None]
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join(10)
        payloads = [torch.load(o, weights_only=False) if os.path.exists(o) else None for o in outs]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    failed = sorted((pl["at"], r) for r, pl in enumerate(payloads) if pl and "error" in pl)
    errors = [f"rank {r} raised:\n{payloads[r]['error']}" for _at, r in failed]
    if errors:  # the first to fail is the cause: the others failed (or hung) waiting on it, so it comes first
        extra = f"\n(ranks {hung} were still running and were killed)" if hung else ""
        raise RanksFailed("\n".join(errors) + extra)
    if hung:
        raise RanksFailed(f"ranks {hung} of {world} still running after {timeout} s (a hang); killed")
    died = {r: p.exitcode for r, p in enumerate(procs) if payloads[r] is None}
    if died:
        raise RanksFailed(f"ranks exited without a result (exit codes {died}; a negative code is the signal)")
    return [pl["result"] for pl in payloads]


def run_ranks(fn, world: int, *args, timeout: float = TIMEOUT, node_size: int | None = None) -> list:
    """Run fn(rank, world, *args) in `world` processes joined in a gloo group; return what each rank
    returned, by rank. `fn` must be importable by name (a module-level function of a test module or of
    tests.support), and its arguments and result must be what torch.save can write. `node_size`: simulate
    nodes of that many consecutive ranks (LOCAL_WORLD_SIZE and LOCAL_RANK set as torchrun sets them)."""
    if node_size is not None and (node_size < 1 or world % node_size):
        raise ValueError(f"node_size={node_size} must divide world={world}")
    return _launch(fn, world, args, timeout, group=True, node_size=node_size)


def run_isolated(fn, *args, timeout: float = TIMEOUT):
    """Run fn(*args) in one fresh process (no process group) and return its result: for measurements the
    test process's own history would spoil (peak memory of a build), with the same error reporting."""
    return _launch(fn, 1, args, timeout, group=False)[0]
