"""The worker process of a DeepSpeed case of `bench optim` / `bench train`, run with the Python of a venv where
DeepSpeed is installed (`make .venv-ds`): `.venv-ds/bin/python tierstore/bench/_ds_case.py SPEC_JSON`.

It imports no tierstore module (tierstore is not installed in that venv): the model, the batches and the timed
step come from _harness.py, loaded by path, so DeepSpeed trains exactly the model the tierstore cases train.
The run is what a user of DeepSpeed on a CPU-only machine would set up: DS_ACCELERATOR=cpu, the gloo backend,
one process, ZeRO stage 3 with DeepSpeedCPUAdam (DeepSpeed picks it for an offloaded AdamW), the model built
under deepspeed.zero.Init.

Cases:
  ds-offload        ZeRO-Offload: optimizer states (and fp32 master) on the CPU, parameters not offloaded
  ds-infinity       ZeRO-Infinity: parameters and optimizer states on NVMe (needs DeepSpeed's aio op: libaio)
  ds-infinity-bf16  the same with its bf16 section enabled: bf16 parameters and compute, fp32 master and states

[Note: DeepSpeed's fp32 dtype on the CPU accelerator]
DeepSpeed 0.19.8 picks the dtype of partitioned parameters in Init._set_dtype with
``dtype or torch.float16 if fp16_supported() else torch.bfloat16 if ...``, which Python reads as
``(dtype or fp16) if fp16_supported() else bf16``: on a CPU without fp16 support an explicit float32 becomes
bfloat16, and with parameters offloaded to NVMe the swapper then refuses the fp32 parameters. The path that
passes dtype explicitly is taken when deepspeed.initialize converts a model built outside zero.Init. Building
the model under ``deepspeed.zero.Init(config_dict_or_path=config)`` -- what DeepSpeed's docs tell ZeRO-3
users to do anyway -- takes the config's branch instead (no bf16/fp16 section: float32), so both DeepSpeed
cases run in fp32 as tierstore and torch do, without patching DeepSpeed.
"""
from __future__ import annotations

import json
import os
import socket
import sys

CASES = ("ds-offload", "ds-infinity", "ds-infinity-bf16")
AIO_MISSING = ("DeepSpeed's aio op cannot build here: {why}. ZeRO-Infinity (NVMe) needs it. Install libaio's "
               "headers, then run again: `apt-get install libaio-dev` (Debian/Ubuntu; `dnf install libaio-devel` "
               "on Fedora/RHEL)")


def ds_config(case: str, spec: dict, layers: int, largest_param: int) -> dict:
    """The DeepSpeed config of a case (a dict, as deepspeed.initialize takes it).

    layers: the model's parameter-holding modules in use order; largest_param: elements of its largest
    parameter. ZeRO-Infinity needs offload_param.buffer_count >= layers + 2 and offload_optimizer.buffer_count
    >= 8 (fewer fail with "Not enough buffers" while prefetch runs ahead, DeepSpeed issue #3062), and each
    parameter buffer must hold the largest parameter. sub_group_size is the tierstore cases' sub-group (in
    elements), so both sides step the same amount of state per sub-group."""
    if case not in CASES:
        raise ValueError(f"DeepSpeed case {case!r}: use one of {CASES}")
    if layers < 1 or largest_param < 1:
        raise ValueError(f"ds_config: layers ({layers}) and largest_param ({largest_param}) must be >= 1")
    zero: dict = {
        "stage": 3,
        "sub_group_size": max(1, spec["sub_group_bytes"] // 4),  # elements (fp32)
        "stage3_prefetch_bucket_size": largest_param,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
    }
    cfg: dict = {
        "train_micro_batch_size_per_gpu": spec["batch"],
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": spec["lr"], "weight_decay": 0.01}},
        "zero_optimization": zero,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if case.startswith("ds-infinity"):
        nvme = os.path.join(spec["dir"], case)
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "pin_memory": True,
                                     "buffer_count": 12}
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme, "pin_memory": True,
                                 "buffer_count": layers + 2,
                                 # elements per buffer: the largest parameter, rounded up to 1 MiB of fp32
                                 "buffer_size": -(-largest_param // (1 << 18)) * (1 << 18)}
        cfg["aio"] = {"block_size": 1 << 20, "queue_depth": 8, "single_submit": False, "overlap_events": True}
    if case.endswith("-bf16"):
        cfg["bf16"] = {"enabled": True}
    return cfg


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def aio_problem() -> str | None:
    """Why DeepSpeed's aio op cannot build here, or None when it can."""
    from deepspeed.ops.op_builder.cpu import AsyncIOBuilder

    b = AsyncIOBuilder()
    try:
        if b.is_compatible(verbose=False):
            return None
    except Exception as e:  # noqa: BLE001 - any failure of the probe is the reason to report
        return f"its probe failed: {e!r}"
    return "libaio (libaio.so and libaio.h) was not found by its compatibility check"


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import _harness

    _harness.setup(spec["threads"])
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port())), ("RANK", "0"),
                 ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    case = spec["case"]
    import deepspeed
    import torch

    if case.startswith("ds-infinity"):
        why = aio_problem()
        if why:
            _harness.say({"error": AIO_MISSING.format(why=why)})
            return 2
    deepspeed.init_distributed(dist_backend="gloo")
    make, data, loss_fn, _tokens = _harness.build(spec)
    with torch.device("meta"):  # shapes only: no memory, so the probe does not count in DeepSpeed's peak RSS
        probe = make()
    n_mods = sum(1 for m in probe.modules() if any(True for _ in m.parameters(recurse=False)))
    largest = max(p.numel() for p in probe.parameters())
    del probe
    cfg = ds_config(case, spec, n_mods, largest)
    with deepspeed.zero.Init(config_dict_or_path=cfg):  # [Note: DeepSpeed's fp32 dtype on the CPU accelerator]
        model = make()
    engine, _opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    if case.endswith("-bf16"):
        loss_fn = _harness.in_dtype(loss_fn, torch.bfloat16)
    n = [0]
    # the parameter swapper ZeRO-Infinity writes updated parameters through, asynchronously
    swapper = next((p.nvme_swapper for p in model.parameters() if getattr(p, "nvme_swapper", None)), None)

    def step_and_wait() -> None:
        engine.step()
        # [Note: a timed step ends when its I/O does] (tierstore/bench/_case.py), for DeepSpeed too: its
        # parameter writes still in flight would finish while the parent times the other cases. Its optimizer
        # swapper waits for its own writes already; synchronize_writes() is the parameter swapper's wait.
        if swapper is not None:
            swapper.synchronize_writes()

    def one_step() -> dict:
        x, y = data[n[0] % len(data)]
        n[0] += 1
        before = _harness.proc_io()
        out = _harness.timed_step(lambda: loss_fn(engine, x, y), engine.backward, step_and_wait)
        after = _harness.proc_io()
        out["bytes"] = {k: after[k] - before[k] for k in after}  # its disk's bytes, as /proc/self/io counts them
        return out

    info = {"optimizer": type(_opt).__name__, "inner": type(getattr(_opt, "optimizer", _opt)).__name__,
            "dtype": str(next(iter(model.parameters())).dtype), "config": cfg, "deepspeed": deepspeed.__version__,
            "torch": torch.__version__}
    return _harness.serve(_harness.with_kernel_bytes(one_step), spec["warmup"], ready_info=info)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
