"""The memory `from_pretrained` takes, plain and under `zero.Init` (parameters on the nvme tier): a GPT-2 of
about --params parameters is saved once (safetensors), then loaded in fresh processes, alternately, the
file's pages dropped from the page cache before each; each prints its peak anonymous and file-backed RSS
above what it had before the load (/proc/self/status, sampled every 5 ms) and the seconds.

    python -m tierstore.bench.load_memory --params 380e6 --dir /path/on/the/disk

Anonymous memory is what a load really holds; file-backed RSS is the safetensors file's pages while they are
mapped, page cache the kernel takes back under pressure (but VmRSS and VmHWM count it). Needs transformers.
Linux only.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time

from ._common import drop_page_cache, proc_status

FIELDS = ("RssAnon", "RssFile")


def _status() -> dict[str, int]:  # bytes
    return {k: proc_status(k) for k in FIELDS}


def _load(mode: str, model_dir: str, store_dir: str) -> dict:
    """In this (fresh) process: load the model `mode` ("plain" or "init"); the peaks above the start."""
    import transformers

    base = _status()
    peak = dict(base)
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            for k, v in _status().items():
                peak[k] = max(peak[k], v)
            done.wait(0.005)
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t0 = time.perf_counter()
    if mode == "plain":
        model = transformers.GPT2LMHeadModel.from_pretrained(model_dir)
    else:
        from .. import zero
        cfg = zero.OffloadConfig(params="nvme", optimizer_states="nvme", gradients="nvme", nvme_paths=[store_dir])
        with zero.Init(cfg):
            model = transformers.GPT2LMHeadModel.from_pretrained(model_dir)
    seconds = time.perf_counter() - t0
    done.set()
    th.join()
    for k, v in _status().items():
        peak[k] = max(peak[k], v)
    del model
    return {"mode": mode, "seconds": seconds, **{f"{k}_peak_over_start": peak[k] - base[k] for k in FIELDS}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tierstore.bench.load_memory", description=__doc__.split("\n")[0])
    p.add_argument("--params", type=float, default=380e6, help="about this many parameters (GPT-2, width 1280)")
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--rounds", type=int, default=2, help="loads of each kind, alternated")
    p.add_argument("--dir", default=".", help="directory on the disk under test (the model file and the store)")
    p.add_argument("--json", default=None, help="write every sample here")
    p.add_argument("--worker", nargs=3, metavar=("MODE", "MODEL_DIR", "STORE_DIR"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(_load(*a.worker)))
        return 0
    import torch
    import transformers

    root = os.path.join(os.path.abspath(a.dir), f"load-memory-{os.getpid()}")
    model_dir, store_dir = os.path.join(root, "model"), os.path.join(root, "store")
    vocab, ctx = 50257, 1024
    per_layer = 12 * a.width * a.width
    layers = max(1, round((a.params - (vocab + ctx) * a.width) / per_layer))
    cfg = transformers.GPT2Config(n_layer=layers, n_head=max(1, a.width // 80), n_embd=a.width, vocab_size=vocab,
                                  n_positions=ctx)
    samples: list[dict] = []
    try:
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg)
        n = sum(t.numel() for t in model.parameters())
        model.save_pretrained(model_dir)
        del model
        files = [os.path.join(model_dir, f) for f in os.listdir(model_dir)]
        file_bytes = sum(os.path.getsize(f) for f in files)
        for _ in range(a.rounds):
            for mode in ("plain", "init"):
                shutil.rmtree(store_dir, ignore_errors=True)
                drop_page_cache(files)
                out = subprocess.run([sys.executable, "-m", "tierstore.bench.load_memory", "--worker", mode,
                                      model_dir, store_dir], capture_output=True, text=True, check=True)
                samples.append(json.loads(out.stdout.strip().splitlines()[-1]))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mib = 1 << 20
    print(f"from_pretrained of a GPT-2 of {n / 1e6:.0f}M parameters ({layers} x {a.width}), {a.rounds} rounds "
          f"alternated, the file's pages dropped from the page cache before each; load "
          f"average {os.getloadavg()[0]:.2f}")
    for mode in ("plain", "init"):
        ss = [s for s in samples if s["mode"] == mode]
        print(f"  {mode:5s}  anonymous RSS +{max(s['RssAnon_peak_over_start'] for s in ss) / mib:.0f} MiB, "
              f"file-backed +{max(s['RssFile_peak_over_start'] for s in ss) / mib:.0f} MiB (the most of "
              f"{len(ss)}), seconds " + ", ".join(f"{s['seconds']:.1f}" for s in ss))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"parameters": n, "layers": layers, "width": a.width, "file_bytes": file_bytes,
                       "samples": samples}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
