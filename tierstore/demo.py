"""`tierstore demo`: the main job on an embedded default -- train a small language model with its parameters
and optimizer states on the NVMe tier (a local directory), next to plain torch AdamW on the same model.

The model is a character-level transformer (causal attention, an MLP whose first layer is a TiledLinear, a
head tied to the embedding) built under ``zero.Init``; the text is embedded below. Three runs from the same
seed, step by step on the same batches:
  torch      the model in memory, torch.optim.AdamW (the reference)
  zero3      Zero3Optimizer(AdamW), parameters and fp32 states on nvme, gradients on host
  zero3-8bit the same with state_codec="dynamic8"
then a checkpoint of the zero3 run is loaded into a fresh model whose states are on the host tier, and both
continue a few steps. The demo checks what it shows and exits non-zero when a check fails: zero3's losses
equal torch's (fp32; the update is the same arithmetic), the 8-bit run ends within 2% of them, the loss
falls by at least 15%, and the resumed run continues exactly.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

TEXT = (
    "A model whose weights and optimizer states do not fit in memory can still be trained when the states "
    "live on three tiers: the accelerator holds what the current layer needs, page-locked host memory holds "
    "what moves next, and files on fast disks hold everything else. Each rank keeps one slice of every "
    "parameter. Before a layer runs, the slices are read up and gathered; after it runs, they are released. "
    "Gradients are reduced to the rank that owns them and added to its partition. The optimizer then walks "
    "its partition one sub-group at a time, reading the next while it steps the current one and writes the "
    "previous one, so the disk and the cores stay busy together. Nothing is lost when a machine stops: a "
    "checkpoint is complete or it is not named at all. "
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default="demo-data", help="directory standing in for the NVMe tier (default: demo-data)")
    p.add_argument("--steps", type=int, default=60, help="training steps per run (default 60)")
    p.add_argument("--resume-steps", type=int, default=5, help="steps after reloading the checkpoint (default 5)")
    p.add_argument("--width", type=int, default=96, help="model width, a multiple of 4 (default 96)")
    p.add_argument("--layers", type=int, default=3, help="transformer blocks (default 3)")


def _model(vocab: int, width: int, layers: int, context: int):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from .zero import TiledLinear

    class Embedding(nn.Embedding):
        def reset_parameters(self):  # GPT-2's N(0, 0.02): the head shares this weight, N(0, 1) logits are huge
            nn.init.normal_(self.weight, std=0.02)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(width)
            self.qkv = nn.Linear(width, 3 * width)
            self.proj = nn.Linear(width, width)
            self.ln2 = nn.LayerNorm(width)
            self.up = TiledLinear(width, 4 * width, out_splits=2)  # gathered one tile at a time
            self.down = nn.Linear(4 * width, width)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.down(F.gelu(self.up(self.ln2(x))))

    class CharLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = Embedding(vocab, width)
            self.pos = nn.Parameter(torch.randn(context, width) * 0.02)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)
            self.head.weight = self.embed.weight  # tied: one parameter, two modules

        def forward(self, idx):
            x = self.embed(idx) + self.pos[: idx.shape[1]]
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln(x))

    return CharLM()


def run(args) -> int:
    import torch
    import torch.nn.functional as F

    from . import zero
    from .bench._common import fmt_bytes, print_table, write_json

    torch.set_num_threads(min(4, os.cpu_count() or 1))
    context, batch = 64, 16
    chars = sorted(set(TEXT))
    data = torch.tensor([chars.index(c) for c in TEXT])
    g = torch.Generator().manual_seed(1)
    total = args.steps + args.resume_steps
    starts = [torch.randint(0, len(data) - context - 1, (batch,), generator=g) for _ in range(total)]
    batches = [(torch.stack([data[s:s + context] for s in st]), torch.stack([data[s + 1:s + 1 + context] for s in st]))
               for st in starts]

    def build(cfg=None):
        torch.manual_seed(0)
        if cfg is None:
            return _model(len(chars), args.width, args.layers, context)
        with zero.Init(cfg):
            return _model(len(chars), args.width, args.layers, context)

    def loss_of(model, x, y):
        return F.cross_entropy(model(x).view(-1, len(chars)), y.view(-1))

    os.makedirs(args.dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="demo-", dir=args.dir)
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    try:
        def cfg(name, **kw):
            kw.setdefault("params", "nvme")
            kw.setdefault("optimizer_states", "nvme")
            return zero.OffloadConfig(gradients="host", nvme_paths=[os.path.join(root, name)],
                                      sub_group_bytes=1 << 20, min_io_bytes=256 << 10, pinned_bytes=16 << 20,
                                      prefetch_depth=2, **kw)

        ref_model = build()
        n_params = sum(p.numel() for p in ref_model.parameters())
        runs = {"torch": (ref_model, torch.optim.AdamW(ref_model.parameters(), **hyper))}
        for name, codec in (("zero3", None), ("zero3-8bit", "dynamic8")):
            c = cfg(name, state_codec=codec)
            m = build(c)
            runs[name] = (m, zero.Zero3Optimizer(m, torch.optim.AdamW, config=c, **hyper))
        losses = {k: [] for k in runs}
        seconds = {k: 0.0 for k in runs}
        for x, y in batches[:args.steps]:
            for name, (m, opt) in runs.items():  # the runs alternate step by step: the same machine noise
                t0 = time.perf_counter()
                loss = loss_of(m, x, y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                seconds[name] += time.perf_counter() - t0
                losses[name].append(loss.item())
        z = runs["zero3"][1]
        on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(os.path.join(root, "zero3"))
                      for f in fs)
        every = max(1, args.steps // 8)
        rows = [[str(i + 1)] + [f"{losses[k][i]:.4f}" for k in runs]
                for i in range(args.steps) if i % every == 0 or i == args.steps - 1]
        print_table(f"tierstore demo: {n_params:,}-parameter character transformer, {args.steps} steps of AdamW",
                    ["step"] + [f"{k} loss" for k in runs], rows,
                    caption=f"ms per step: " + ", ".join(f"{k} {seconds[k] / args.steps * 1e3:.0f}" for k in runs)
                    + f"; zero3 keeps {fmt_bytes(on_disk)} in {os.path.join(root, 'zero3')}")
        ok = True
        worst = max(abs(a - b) / b for a, b in zip(losses["zero3"], losses["torch"]))
        ok &= _check(worst <= 1e-5, f"zero3 (parameters and states on nvme) vs torch AdamW: largest relative loss "
                                    f"difference over {args.steps} steps {worst:.1e} (same arithmetic; <= 1e-5)")
        drift = losses["zero3-8bit"][-1] / losses["torch"][-1] - 1
        ok &= _check(abs(drift) <= 0.02, f"8-bit states: final loss {100 * drift:+.2f}% vs torch (<= 2%)")
        ok &= _check(losses["torch"][-1] < 0.85 * losses["torch"][0],
                     f"the model learns: loss {losses['torch'][0]:.3f} -> {losses['torch'][-1]:.3f}")
        # resume: checkpoint the nvme run, load it into a fresh model with states on host, continue both
        ckpt = os.path.join(root, "ckpt")
        z.save_checkpoint(ckpt)
        hc = cfg("resumed", params="host", optimizer_states="host")
        m2 = build(hc)
        z2 = zero.Zero3Optimizer(m2, torch.optim.AdamW, config=hc, **hyper)
        z2.load_checkpoint(ckpt)
        cont = {"zero3": runs["zero3"], "resumed": (m2, z2)}
        after = {k: [] for k in cont}
        for x, y in batches[args.steps:]:
            for name, (m, opt) in cont.items():
                loss = loss_of(m, x, y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                after[name].append(loss.item())
        ok &= _check(after["zero3"] == after["resumed"],
                     f"checkpoint (nvme tiers) loaded on host tiers continues exactly for {args.resume_steps} steps")
        for _m, opt in list(runs.values())[1:] + [(m2, z2)]:
            opt.close()
        write_json(args.json, {"parameters": n_params, "losses": losses, "seconds": seconds, "resumed": after,
                               "nvme_bytes": on_disk, "ok": ok})
        return 0 if ok else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _check(passed: bool, what: str) -> bool:
    print(("ok    " if passed else "FAIL  ") + what)
    return passed
