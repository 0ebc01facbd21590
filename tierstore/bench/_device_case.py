"""The worker process of one case of the accelerator benchmark (tierstore/bench/device.py):
`python -m tierstore.bench._device_case SPEC_JSON`. It trains the GPT of bench train (tierstore/gpt.py, batches of the
standard library's bytes) with the model on the accelerator -- or on the CPU standing in for it in a dry run --
and answers the parent one timed step at a time over _harness's line protocol ([Note: one worker process per
case] in _harness.py), so /proc/self/io and the accelerator's memory are this case's alone.

Cases (CASES): torch AdamW(fused=True) in accelerator memory, fp32 or under bf16 autocast; Zero3Optimizer with
the parameters on the accelerator and master, states and gradients on the host tier (ZeRO-Offload's placement);
everything on the nvme tier with overlap_step, in fp32, with bf16 compute, and with bf16 compute and 8-bit
states (ZeRO-Infinity's placement); DeepSpeed ZeRO-3 ZeRO-Offload / ZeRO-Infinity where deepspeed is importable.
"""
from __future__ import annotations

import json
import os
import sys

# case -> what it runs. kind: "torch" (torch.optim.AdamW in memory), "zero" (Zero3Optimizer over AdamW(fused=True)),
# "ds" (DeepSpeed); dtype: the compute dtype (torch: autocast); params / tier: OffloadConfig's params tier and the
# tier of master, states and gradients; codec: state_codec.
CASES: dict[str, dict] = {
    "torch": {"kind": "torch", "dtype": "float32"},
    "torch-bf16": {"kind": "torch", "dtype": "bfloat16"},
    "host": {"kind": "zero", "dtype": "float32", "params": "device", "tier": "host", "overlap": False, "codec": None},
    "nvme-overlap": {"kind": "zero", "dtype": "float32", "params": "nvme", "tier": "nvme", "overlap": True,
                     "codec": None},
    "nvme-overlap-bf16": {"kind": "zero", "dtype": "bfloat16", "params": "nvme", "tier": "nvme", "overlap": True,
                          "codec": None},
    "nvme8-overlap-bf16": {"kind": "zero", "dtype": "bfloat16", "params": "nvme", "tier": "nvme", "overlap": True,
                           "codec": "dynamic8"},
    "ds-offload": {"kind": "ds", "dtype": "float32"},
    "ds-infinity": {"kind": "ds", "dtype": "float32"},
}


def device_of(spec: dict):
    """The accelerator (torch.accelerator's current one), or the CPU in a dry run or where there is none."""
    import torch

    if spec.get("dry_run") or not torch.accelerator.is_available():
        return torch.device("cpu")
    acc = torch.accelerator.current_accelerator()
    assert acc is not None
    return torch.device(acc.type, torch.accelerator.current_device_index())


def sync(dev) -> None:
    """Wait for the accelerator's queued work (nothing to wait for on the CPU)."""
    import torch

    if dev.type != "cpu":
        torch.accelerator.synchronize()


def synced(fn, dev):
    """fn(*args), then wait for the accelerator: the time of a phase includes its kernels."""
    def run(*args) -> None:
        fn(*args)
        sync(dev)
    return run


def device_memory(dev) -> dict[str, int]:  # bytes
    """The accelerator memory this process allocated at most and holds reserved now (empty on the CPU or where
    torch.accelerator has no memory counters)."""
    import torch

    acc = torch.accelerator
    got = {}
    for key, fn in (("max_allocated", "max_memory_allocated"), ("reserved", "memory_reserved")):
        if dev.type != "cpu" and hasattr(acc, fn):
            got[key] = int(getattr(acc, fn)())
    return got


def _zero_step(spec: dict, dev, model, data, xent, tier_bytes, proc_io, timed_step):
    import torch

    from .. import zero

    c = CASES[spec["case"]]
    cfg = zero.OffloadConfig(
        params=c["params"], optimizer_states=c["tier"], gradients=c["tier"], overlap_step=c["overlap"],
        state_codec=c["codec"], compute_dtype=getattr(torch, c["dtype"]), sub_group_bytes=spec["sub_group_bytes"],
        nvme_paths=[os.path.join(spec["dir"], spec["case"])] if "nvme" in (c["params"], c["tier"]) else None)
    # fused=True as torch's: host-tier states step on the CPU, where torch's default is its for-loop ([Note: the
    # inner step's implementation on the CPU] in tierstore/zero/step/stepper.py)
    opt = zero.Zero3Optimizer(model, torch.optim.AdamW, lr=spec["lr"], config=cfg, fused=True)
    n = [0]

    def step_and_wait() -> None:
        opt.step()
        opt.zero_grad()
        opt.synchronize()  # [Note: a timed step ends when its I/O does] in tierstore/bench/_case.py
        sync(dev)

    def one_step() -> dict:
        x, y = data[n[0] % len(data)]
        n[0] += 1
        before, io0 = tier_bytes(opt), proc_io()
        out = timed_step(lambda: xent(model, x, y), synced(lambda loss: loss.backward(), dev), step_and_wait)
        after, io1 = tier_bytes(opt), proc_io()
        out["bytes"] = {k: after[k] - before.get(k, 0) for k in after}
        out["proc_io"] = {k: io1[k] - io0[k] for k in io1}
        return out

    return one_step, opt.close


def _torch_step(spec: dict, dev, model, data, xent, proc_io, timed_step):
    import contextlib

    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], fused=True)
    bf16 = CASES[spec["case"]]["dtype"] == "bfloat16"
    n = [0]

    def step_and_zero() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    def run_loss():
        x, y = data[n[0] % len(data)]
        n[0] += 1
        with torch.autocast(dev.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            return xent(model, x, y)

    def one_step() -> dict:
        io0 = proc_io()
        out = timed_step(run_loss, synced(lambda loss: loss.backward(), dev), synced(step_and_zero, dev))
        io1 = proc_io()
        out["proc_io"] = {k: io1[k] - io0[k] for k in io1}
        return out

    return one_step, lambda: None


def _ds_step(spec: dict, dev, make, data, xent, proc_io, timed_step):
    """DeepSpeed ZeRO-3 on the accelerator, one process (nccl), configured as bench train's DeepSpeed cases
    (_ds_case.ds_config), the model built under deepspeed.zero.Init."""
    import socket

    import deepspeed
    import torch

    from ._ds_case import AIO_MISSING, ds_config

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"), ("LOCAL_RANK", "0"),
                 ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    if spec["case"] == "ds-infinity":  # its NVMe swapper needs DeepSpeed's aio op (libaio)
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if not AsyncIOBuilder().is_compatible(verbose=False):
            return None, None, {"error": AIO_MISSING.format(why="its compatibility check failed (libaio)")}
    deepspeed.init_distributed(dist_backend="gloo" if dev.type == "cpu" else None)
    with torch.device("meta"):
        probe = make()
    n_mods = sum(1 for m in probe.modules() if any(True for _ in m.parameters(recurse=False)))
    largest = max(p.numel() for p in probe.parameters())
    del probe
    cfg = ds_config(spec["case"], spec, n_mods, largest)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = make()
    engine, _opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    swapper = next((p.nvme_swapper for p in model.parameters() if getattr(p, "nvme_swapper", None)), None)
    n = [0]

    def step_and_wait() -> None:
        engine.step()
        if swapper is not None:  # its parameter writes still in flight: counted in this step, as tierstore's
            swapper.synchronize_writes()
        sync(dev)

    def one_step() -> dict:
        x, y = data[n[0] % len(data)]
        n[0] += 1
        io0 = proc_io()
        out = timed_step(lambda: xent(engine, x, y), synced(engine.backward, dev),
                         step_and_wait)
        io1 = proc_io()
        out["proc_io"] = {k: io1[k] - io0[k] for k in io1}
        return out

    return one_step, lambda: None, {"deepspeed": deepspeed.__version__, "inner": type(_opt).__name__}


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    from . import _harness
    from ._case import tier_bytes

    _harness.setup(spec["threads"])
    import torch

    torch.set_float32_matmul_precision("high")  # TF32 matmuls where the accelerator has them, for every case
    dev = device_of(spec)
    case = spec["case"]
    c = CASES[case]
    make, data, xent, _tokens = _harness.build({**spec, "model": "gpt"})
    data = [(x.to(dev), y.to(dev)) for x, y in data]

    def loss(model, x, y):
        return xent(model, x, y).float()

    info: dict = {"device": str(dev), "torch": torch.__version__}
    if c["kind"] == "ds":
        one_step, close, more = _ds_step(spec, dev, make, data, loss, _harness.proc_io, _harness.timed_step)
        if "error" in more:  # the parent records it as the reason the case was skipped
            _harness.say(more)
            return 2
        info.update(more)
    else:
        model = make().to(dev)
        if c["kind"] == "torch":
            one_step, close = _torch_step(spec, dev, model, data, loss, _harness.proc_io, _harness.timed_step)
        else:
            one_step, close = _zero_step(spec, dev, model, data, loss, tier_bytes, _harness.proc_io,
                                         _harness.timed_step)
    calls = [0]

    def step_then_trim() -> dict:
        out = one_step()
        calls[0] += 1
        if calls[0] == 1 and dev.type != "cpu" and hasattr(torch.accelerator, "empty_cache"):
            torch.accelerator.empty_cache()  # the first step's passing allocations, not kept by this process
        return out

    try:
        return _harness.serve(step_then_trim, spec["warmup"], final=lambda: {"device_memory": device_memory(dev)},
                              ready_info=info)
    finally:
        close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
