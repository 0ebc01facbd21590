"""Generate from a GPT-2 whose weights are larger than this machine's RAM: built under tierstore.zero.Init (each
module's weights go to the nvme tier as it is built, so the model is never in memory), then run with
offload_for_inference, its weights read from the disk layer by layer for every token.

    python examples/generate_big.py --dir /mnt/nvme/big --size 28G --tokens 4

--size is the bytes of the weights in fp32 (the model's shape follows the demo's GPT family: 1024 wide, as many
layers as it takes). Building writes the weights once under Init; the offload then moves them into its own store
(the Init store's chunks are deleted as they are taken), so the disk needs about twice --size while that runs
and --size after. Prints tokens/s, peak RSS (while building and offloading, and while generating) and bytes on
disk.
--check builds the same model in memory as well and compares the tokens (small sizes only).
"""
from __future__ import annotations

import argparse
import os
import shutil
import time

import torch
import transformers

from tierstore.bench._common import fmt_bytes, parse_size, proc_status
from tierstore.gpt import HEAD, dir_bytes, ram_bytes, reset_peak_rss, shape_for
from tierstore.zero import Init, OffloadConfig, offload_for_inference


def config_for(weight_bytes: int) -> transformers.GPT2Config:
    width, layers = shape_for(weight_bytes / 4)
    return transformers.GPT2Config(vocab_size=256, n_embd=width, n_layer=layers, n_head=width // HEAD,
                                   n_positions=256, bos_token_id=None, eos_token_id=None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="ts-data/generate-big", help="directory on the NVMe drive")
    p.add_argument("--size", default="28G", help="bytes of weights in fp32 (default 28G)")
    p.add_argument("--tokens", type=int, default=4, help="tokens to generate (default 4)")
    p.add_argument("--budget", default="1G", help="budget_bytes: weights in memory at once (default 1G)")
    p.add_argument("--weights", choices=["fp32", "bf16", "int8"], default="fp32", help="how the weights are stored")
    p.add_argument("--check", action="store_true", help="also build the model in memory and compare the tokens")
    a = p.parse_args()
    size, budget = parse_size(a.size), parse_size(a.budget)
    transformers.logging.set_verbosity_error()
    config = config_for(size)
    os.makedirs(a.dir, exist_ok=True)
    free = shutil.disk_usage(a.dir).free
    if free < 2.1 * size:
        raise SystemExit(f"{a.dir} has {fmt_bytes(free)} free; building and offloading {fmt_bytes(size)} of weights "
                         f"needs about {fmt_bytes(int(2.1 * size))}")
    print(f"GPT-2 {config.n_layer} layers x {config.n_embd} wide; this machine has {fmt_bytes(ram_bytes())} of RAM",
          flush=True)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with Init(OffloadConfig(params="nvme", nvme_paths=[os.path.join(a.dir, "init")])):
        model = transformers.GPT2LMHeadModel(config).eval()
    built = time.perf_counter() - t0
    nparams = sum(p.numel() for p in model.parameters())
    weights = {"fp32": None, "bf16": torch.bfloat16, "int8": "int8"}[a.weights]
    t0 = time.perf_counter()
    off = offload_for_inference(model, tier="nvme", nvme_path=os.path.join(a.dir, "weights"), budget_bytes=budget,
                                weights_dtype=weights)
    moved = time.perf_counter() - t0
    on_disk = dir_bytes(a.dir)
    print(f"{nparams / 1e9:.2f}B parameters ({fmt_bytes(nparams * 4)} in fp32) built under Init in {built:.0f} s, "
          f"offloaded in {moved:.0f} s; {fmt_bytes(on_disk)} on disk ({a.weights})", flush=True)
    print(f"peak RSS while building and offloading: {fmt_bytes(proc_status('VmHWM'))}", flush=True)
    prompt = torch.tensor([list(b"def main():\n    ")], dtype=torch.long)
    reset_peak_rss()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=a.tokens, min_new_tokens=a.tokens, do_sample=False,
                             pad_token_id=0)
    dt = time.perf_counter() - t0
    tokens = out[0, prompt.shape[1]:].tolist()
    st = off.stats()
    print(f"generated {a.tokens} tokens in {dt:.1f} s: {a.tokens / dt:.3f} tokens/s; peak RSS while generating "
          f"{fmt_bytes(proc_status('VmHWM'))}; weights resident at most {fmt_bytes(st.peak_resident_bytes)} "
          f"(budget {fmt_bytes(budget)}); weights {fmt_bytes(st.weight_bytes)} vs RAM {fmt_bytes(ram_bytes())}: "
          f"{'larger' if st.weight_bytes > ram_bytes() else 'smaller'}; tokens {tokens}")
    off.close()
    if a.check:
        torch.manual_seed(0)
        ref = transformers.GPT2LMHeadModel(config).eval()
        with torch.no_grad():
            want = ref.generate(prompt, max_new_tokens=a.tokens, min_new_tokens=a.tokens, do_sample=False,
                                pad_token_id=0)[0, prompt.shape[1]:].tolist()
        print(f"same tokens as the model built in memory: {want == tokens}")
        if want != tokens:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
