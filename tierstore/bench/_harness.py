"""What every worker process of `bench optim` and `bench train` runs: the two models, one timed training step,
and the line protocol with the parent (tierstore/bench/steps.py).

This module imports torch and the standard library only -- never tierstore -- so the DeepSpeed worker
(_ds_case.py) loads it by path from its own venv, where tierstore is not installed, and both sides train the
very same model on the very same batches.

[Note: one worker process per case]
Each case (torch in memory, a tierstore tier, a DeepSpeed configuration) lives in its own fresh process for the
whole run, so its peak RSS (VmHWM) is its own and nothing one case allocated or cached is counted against
another. The parent alternates the cases A B A B by asking each worker for one step at a time over a pipe;
a worker builds its model and takes its warm-up steps before the first round, so set-up is never timed.
"""
from __future__ import annotations

import json
import os
import sys
import time

MARK = "@@bench "  # protocol lines start with this; anything else a library prints on stdout is passed over


def linear_shape(params: float, width: int) -> tuple[int, int]:
    """(width, layers) of the Linear stack with about `params` parameters (width^2 + width per layer)."""
    return width, max(1, round(params / (width * width + width)))


def build(spec: dict):
    """(make_model, batches, loss_fn, tokens_per_step) for spec["model"]:

    "linear": a stack of nn.Linear(width, width) with ReLU between, batch spec["batch"] of random inputs
              regressed onto random targets (`bench optim`);
    "gpt":    the demo's GPT family (gpt.py) on byte tokens of the Python standard library's sources.
    make_model() builds the module (call it inside zero.Init to build it partitioned); batches is a short
    list of (inputs, targets) cycled through the steps, the same for every case of a run."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    if spec["model"] == "linear":
        width, layers = linear_shape(spec["params"], spec["width"])

        def make_linear():
            torch.manual_seed(spec.get("seed", 0))
            mods: list[nn.Module] = []
            for i in range(layers):
                mods.append(nn.Linear(width, width))
                if i < layers - 1:
                    mods.append(nn.ReLU())
            return nn.Sequential(*mods)

        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(spec["batch"], width, generator=g), torch.randn(spec["batch"], width, generator=g))
                for _ in range(4)]

        def mse(model, x, y):
            return F.mse_loss(model(x), y)

        return make_linear, data, mse, 0
    if spec["model"] == "gpt":
        gpt = _gpt_module()
        width, layers = gpt.shape_for(spec["params"])

        def make_gpt():
            torch.manual_seed(spec.get("seed", 0))
            return gpt.build_model(width, layers, spec["context"], checkpoint=spec.get("checkpoint", False))

        text = gpt.stdlib_text(1 << 20)[0]
        data = gpt.batches(text, 4, spec["batch"], spec["context"])

        def xent(model, x, y):
            return F.cross_entropy(model(x).view(-1, gpt.VOCAB), y.view(-1))

        return make_gpt, data, xent, spec["batch"] * spec["context"]
    raise ValueError(f"model {spec['model']!r}: use 'linear' or 'gpt'")


def in_dtype(loss_fn, dtype):
    """loss_fn with its floating-point inputs and targets in `dtype` (the model computes in it: bf16 compute,
    as with model.bfloat16()); token ids stay integers."""
    import torch

    if dtype == torch.float32:
        return loss_fn

    def cast(model, x, y):
        return loss_fn(model, *(t.to(dtype) if t.is_floating_point() else t for t in (x, y)))
    return cast


def shape_of(spec: dict) -> tuple[int, int, int]:
    """(width, layers, parameters) of spec's model, without building it."""
    if spec["model"] == "linear":
        width, layers = linear_shape(spec["params"], spec["width"])
        return width, layers, layers * (width * width + width)
    gpt = _gpt_module()
    width, layers = gpt.shape_for(spec["params"])
    return width, layers, gpt.count_params(width, layers, spec["context"])


def _gpt_module():
    try:
        from .. import gpt  # inside the tierstore package
    except ImportError:  # loaded by path (the DeepSpeed worker): tierstore/gpt.py, one directory up, by path too
        import importlib.util

        loaded = sys.modules.get("gpt")
        if loaded is None:
            path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpt.py")
            spec = importlib.util.spec_from_file_location("gpt", path)
            assert spec is not None and spec.loader is not None, path
            loaded = sys.modules["gpt"] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(loaded)
        return loaded
    return gpt


def proc_status(field: str) -> int:  # bytes
    """A size from /proc/self/status: gpt.proc_status (see there), reached as the worker reaches gpt.py."""
    return _gpt_module().proc_status(field)


def timed_step(run_loss, backward, step) -> dict:
    """One training step split in forward + backward and optimizer step (seconds); `step` also zeroes the
    gradients, as a training loop does."""
    t0 = time.perf_counter()
    loss = run_loss()
    backward(loss)
    t1 = time.perf_counter()
    step()
    t2 = time.perf_counter()
    return {"fwd_bwd": t1 - t0, "step": t2 - t1, "full": t2 - t0, "loss": float(loss.detach())}


def proc_io() -> dict[str, int]:  # bytes
    """Bytes this process caused to be read from and written to storage so far (/proc/self/io's read_bytes and
    write_bytes: the device's bytes, page-cache hits not counted), for workers whose store keeps no count."""
    with open("/proc/self/io") as f:
        got = dict(line.split(": ") for line in f.read().splitlines())
    return {"nvme_read": int(got["read_bytes"]), "nvme_written": int(got["write_bytes"])}


def kernel_io() -> dict[str, int]:  # bytes
    """proc_io() as {kernel_read, kernel_written}: the kernel's count, set beside a store's own; {} where the
    kernel keeps none (no /proc/self/io)."""
    try:
        got = proc_io()
    except (OSError, KeyError, ValueError):
        return {}
    return {"kernel_read": got["nvme_read"], "kernel_written": got["nvme_written"]}


def with_kernel_bytes(one_step):
    """one_step, its figures with the kernel's bytes of the step added to (or put in) figures["bytes"]."""
    def step() -> dict:
        before = kernel_io()
        out = one_step()
        after = kernel_io()
        out.setdefault("bytes", {}).update({k: after[k] - before[k] for k in after if k in before})
        return out
    return step


def say(payload: dict) -> None:
    sys.stdout.write(MARK + json.dumps(payload) + "\n")
    sys.stdout.flush()


def serve(one_step, warmup: int, final=None, ready_info: dict | None = None) -> int:
    """Take `warmup` untimed steps, say ready (with the last warm-up step's figures), then answer the parent:
    'step' -> one timed step's figures; 'done' -> peak RSS and `final()`'s figures, then exit."""
    last: dict = {}
    t0 = time.perf_counter()
    for _ in range(warmup):
        last = one_step()
    say({"ready": True, "warmup_s": time.perf_counter() - t0, "last": last, **(ready_info or {})})
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "step":
            say(one_step())
        elif cmd == "done":
            out = dict(final() if final else {})
            out["peak_rss"] = proc_status("VmHWM")
            out["rss"] = proc_status("VmRSS")
            say(out)
            return 0
        else:
            say({"error": f"unknown command {cmd!r}"})
    return 0


def setup(n: int) -> None:
    """What every case's process does first, whichever library it runs: `n` torch threads, and the same heap
    policy (gpt.keep_heap_small, [Note: resident memory follows live memory]) -- the allocator decides how
    much each large allocation costs and how much freed memory stays resident, so a case with another policy
    would measure the allocator, not the library."""
    import torch

    torch.set_num_threads(n)
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    _gpt_module().keep_heap_small()
