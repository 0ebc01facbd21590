"""DeepSpeed's aio, the reference of `tierstore bench io`, run where DeepSpeed is installed: a worker process in
the DeepSpeed venv's Python (`make .venv-ds`), and the client bench io drives it with (DeepSpeedAio).

The worker, `.venv-ds/bin/python tierstore/bench/_ds_aio_case.py`, imports no tierstore module (tierstore is
not installed in that venv; it loads _harness.py by path for the line protocol). It reads one JSON line of
set-up from stdin -- the sequential file and its size, the (block size, queue depth) pairs, the sizes of the
small requests and a directory for their files -- makes its page-locked buffers and one aio handle per pair,
says ready, then answers one JSON line per request: {"seconds": the operation's own elapsed time}, so that
neither the pipe nor its start-up is timed. "done" (or the end of stdin) ends it. Where DeepSpeed's aio op
cannot load (no libaio headers), it answers {"error": why} and exits.
"""
from __future__ import annotations

import json
import os
import sys
import time

DS_WINDOW = 1024  # DeepSpeed ops outstanding at once in the small-request workload (see its note)
SMALL_CASES = ("deepspeed (packed, one file)", "deepspeed (file per tensor)")


# ---- the worker (the DeepSpeed venv's Python) ---------------------------------------------------------------

def aio_module():
    """DeepSpeed's AsyncIOBuilder op module, or (None, why)."""
    import logging

    try:
        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        from deepspeed.ops.op_builder import AsyncIOBuilder

        b = AsyncIOBuilder()
        if not b.is_compatible(verbose=False):
            return None, "DeepSpeed's async_io op is not compatible here (needs libaio-dev)"
        return b.load(verbose=False), ""
    except Exception as e:  # noqa: BLE001 - an optional reference: absent or broken means no column
        return None, f"DeepSpeed aio unavailable: {type(e).__name__}: {e}"


class Server:
    """The handles and buffers of one bench io run, and the operations it times."""

    def __init__(self, mod, setup: dict):
        import torch

        self.mod, self.seq_path, size = mod, setup["seq_path"], setup["size"]
        self.owner = mod.aio_handle(1 << 20, 8, False, True, 1)
        self.locked = self.owner.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
        self.locked.fill_(0xA5)
        self.handles = {(bs, qd): mod.aio_handle(bs, qd, False, True, 1) for bs, qd in setup["pairs"]}
        self.small = None
        if setup.get("small_sizes"):
            self.sizes = setup["small_sizes"]
            self.offsets, total = [], 0
            for s in self.sizes:
                self.offsets.append(total)
                total += s
            self.h = mod.aio_handle(1 << 20, 32, False, True, 1)
            self.small = self.h.new_cpu_locked_tensor(total, torch.empty(0, dtype=torch.uint8))
            self.small.copy_(torch.randint(0, 256, (total,), dtype=torch.uint8,
                                           generator=torch.Generator().manual_seed(0)))
            ddir = os.path.join(setup["dir"], "ds-files")
            os.makedirs(ddir, exist_ok=True)
            self.paths = [os.path.join(ddir, f"t{i}.swp") for i in range(len(self.sizes))]
            self.packed = os.path.join(setup["dir"], "packed-ds.bin")

    def seq(self, op: str, bs: int, qd: int) -> None:
        """The sequential file written or read whole from the page-locked buffer, DeepSpeed's synchronous call."""
        h = self.handles[(bs, qd)]
        (h.sync_pwrite if op == "write" else h.sync_pread)(self.locked, self.seq_path)

    def _small_run(self, op, targets) -> None:
        # [Note: DeepSpeed's window] Its handle keeps a file open per outstanding op and does not check
        # the open (EMFILE past `ulimit -n` is printed, the op silently skipped), so it waits every
        # DS_WINDOW ops, as its swappers do per batch of tensors.
        assert self.small is not None
        for i, (p, o, s) in enumerate(zip(targets, self.offsets, self.sizes)):
            op(self.small[o:o + s], p, o if p == self.packed else 0)
            if i % DS_WINDOW == DS_WINDOW - 1:
                self.h.wait()
        self.h.wait()

    def small_case(self, name: str) -> None:
        """The small requests written then read: one file per tensor (as its swapper lays them out), or packed
        at the offsets of one file (our layout, to tell the layout's share of the difference from the engine's;
        its pread takes a path, which it opens per request)."""
        targets = self.paths if name == SMALL_CASES[1] else [self.packed] * len(self.sizes)
        self._small_run(self.h.async_pwrite, targets)
        self._small_run(self.h.async_pread, targets)

    def run(self, req: list) -> float:
        t0 = time.perf_counter()
        if req[0] == "seq":
            self.seq(req[1], int(req[2]), int(req[3]))
        elif req[0] == "small":
            self.small_case(req[1])
        else:
            raise ValueError(f"unknown request {req!r}")
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.small is not None:
            self.h.free_cpu_locked_tensor(self.small)
        self.owner.free_cpu_locked_tensor(self.locked)


def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _harness

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    setup = json.loads(sys.stdin.readline())
    mod, why = aio_module()
    if mod is None:
        _harness.say({"error": why})
        return 2
    server = Server(mod, setup)
    _harness.say({"ready": True})
    try:
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "done":
                break
            try:
                _harness.say({"seconds": server.run(json.loads(cmd))})
            except Exception as e:  # noqa: BLE001 - said to the parent, which stops the run with it
                _harness.say({"error": f"{type(e).__name__}: {e}"})
    finally:
        server.close()
    _harness.say({"done": True})
    return 0


# ---- the client (tierstore's Python, bench io) --------------------------------------------------------------

class DeepSpeedAio:
    """bench io's handle on the worker: start() it once, then each case is a call that returns the seconds
    the worker measured."""

    def __init__(self, worker):
        self.worker = worker

    @classmethod
    def start(cls, work: str, seq_path: str, size: int, pairs: list[tuple[int, int]], small_sizes: list[int],
              python: str | None = None, timeout: float = 600) -> tuple[DeepSpeedAio | None, str]:
        """The worker started in the DeepSpeed venv (python, else $TIERSTORE_DS_PYTHON, else ./.venv-ds) and
        ready, or (None, why not)."""
        from .steps import Worker, deepspeed_python

        py, why = deepspeed_python(python or os.environ.get("TIERSTORE_DS_PYTHON"))
        if py is None:
            return None, f"DeepSpeed aio reference: {why}"
        env = {**os.environ, "DS_ACCELERATOR": "cpu"}
        w = Worker("deepspeed aio", [py, os.path.abspath(__file__)], env, os.path.join(work, "ds-aio.log"))
        setup = {"seq_path": seq_path, "size": size, "pairs": pairs, "small_sizes": small_sizes, "dir": work}
        try:
            r = w.ask(json.dumps(setup), timeout)
        except RuntimeError as e:
            return None, f"DeepSpeed aio reference failed to start: {str(e)[-800:]}"
        if "error" in r:
            w.kill()
            return None, r["error"]
        return cls(w), why

    def request(self, req: list, timeout: float = 600) -> float:
        r = self.worker.ask(json.dumps(req), timeout)
        if "error" in r:
            raise RuntimeError(f"DeepSpeed aio reference: {r['error']}")
        return float(r["seconds"])

    def case(self, *req):
        """A case for _common.interleave: the request, timed in the worker."""
        return lambda: self.request(list(req))

    def small_cases(self) -> dict:
        return {name: self.case("small", name) for name in SMALL_CASES}

    def close(self) -> None:
        try:
            self.worker.finish(600)
        except RuntimeError:
            self.worker.kill()


if __name__ == "__main__":
    sys.exit(main())
