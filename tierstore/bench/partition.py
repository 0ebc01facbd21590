"""`tierstore bench partition`: the partitioner's I/O layout next to one file per parameter.

For the parameter shapes of GPT-2 small, GPT-2 medium and a 7B Llama-style model (written below: nothing is
downloaded and nothing is allocated; the 7B model is metadata only) at several world sizes, compare per rank
per step: the number of I/O requests, the mean and smallest request, and the padding, against DeepSpeed's
layout (one file per parameter per rank: ceil(numel / world) elements padded to the alignment). This is
arithmetic over shapes, not a timing, so it is exact and the same on every machine; the reference is still
computed in the same run and every figure is printed as a ratio to it.

Targets: mean request >= min_io_bytes wherever the model allows it (each dtype's bytes per rank
reach min_io_bytes); padding <= 1% of the model for the 7B model at world size 64. Exit status 1 when missed.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass

import torch

from ..partition import plan
from ._common import fmt_bytes, print_table, ratio, size_arg, write_json

F32, BF16 = torch.float32, torch.bfloat16


def gpt2_shapes(d_model: int, layers: int, vocab: int = 50257, context: int = 1024) -> dict[str, tuple[int, ...]]:
    """GPT-2 (Radford et al. 2019) as HuggingFace names it; Conv1D weights are (in, out); lm_head is tied."""
    p: dict[str, tuple[int, ...]] = {"wte.weight": (vocab, d_model), "wpe.weight": (context, d_model)}
    for i in range(layers):
        for name, shape in (("ln_1.weight", (d_model,)), ("ln_1.bias", (d_model,)),
                            ("attn.c_attn.weight", (d_model, 3 * d_model)), ("attn.c_attn.bias", (3 * d_model,)),
                            ("attn.c_proj.weight", (d_model, d_model)), ("attn.c_proj.bias", (d_model,)),
                            ("ln_2.weight", (d_model,)), ("ln_2.bias", (d_model,)),
                            ("mlp.c_fc.weight", (d_model, 4 * d_model)), ("mlp.c_fc.bias", (4 * d_model,)),
                            ("mlp.c_proj.weight", (4 * d_model, d_model)), ("mlp.c_proj.bias", (d_model,))):
            p[f"h.{i}.{name}"] = shape
    p["ln_f.weight"] = (d_model,)
    p["ln_f.bias"] = (d_model,)
    return p


def llama_shapes(d_model: int = 4096, layers: int = 32, ffn: int = 11008,
                 vocab: int = 32000) -> dict[str, tuple[int, ...]]:
    """A Llama-2-7B-style decoder (Touvron et al. 2023) in HuggingFace's parameter order; untied head."""
    p: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, d_model)}
    for i in range(layers):
        for name, shape in (("self_attn.q_proj.weight", (d_model, d_model)),
                            ("self_attn.k_proj.weight", (d_model, d_model)),
                            ("self_attn.v_proj.weight", (d_model, d_model)),
                            ("self_attn.o_proj.weight", (d_model, d_model)),
                            ("mlp.gate_proj.weight", (ffn, d_model)), ("mlp.up_proj.weight", (ffn, d_model)),
                            ("mlp.down_proj.weight", (d_model, ffn)),
                            ("input_layernorm.weight", (d_model,)), ("post_attention_layernorm.weight", (d_model,))):
            p[f"model.layers.{i}.{name}"] = shape
    p["model.norm.weight"] = (d_model,)
    p["lm_head.weight"] = (vocab, d_model)
    return p


# name -> (shapes, dtype as checkpoints ship it, parameter count quoted for the model)
MODELS = {
    "gpt2": (gpt2_shapes(768, 12), F32, 124_439_808),
    "gpt2-medium": (gpt2_shapes(1024, 24), F32, 354_823_168),
    "llama-7b": (llama_shapes(), BF16, 6_738_415_616),
}


@dataclass
class Layout:
    """One layout's cost per rank per step."""

    requests: int  # per rank per step
    mean_request: float  # bytes
    min_request: int  # bytes
    padding: int  # bytes, all ranks together
    padding_pct: float  # of the model's bytes


def per_param_layout(specs: dict, world: int, alignment: int) -> Layout:
    """DeepSpeed's swapper layout: every parameter split over the ranks, one file (one request) per parameter
    per rank of ceil(numel / world) elements, padded up to `alignment` bytes."""
    sizes, payload = [], 0
    for shape, dtype in specs.values():
        numel = math.prod(shape)
        if numel:
            sizes.append(-(-math.ceil(numel / world) * dtype.itemsize // alignment) * alignment)
            payload += numel * dtype.itemsize
    padding = world * sum(sizes) - payload
    return Layout(len(sizes), sum(sizes) / len(sizes) if sizes else 0.0, min(sizes, default=0), padding,
                  100.0 * padding / payload if payload else 0.0)


def packed_layout(specs: dict, world: int, alignment: int, min_io_bytes: int) -> Layout:
    s = plan(specs, world, min_io_bytes=min_io_bytes, alignment=alignment).summary()
    return Layout(s.requests_per_rank, s.request_bytes_mean, s.request_bytes_min, s.padding_bytes, s.padding_pct)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--worlds", default="1,8,64", help="comma-separated world sizes (default: 1,8,64)")
    p.add_argument("--min-io", type=size_arg, default=1 << 20, help="min_io_bytes of the plan (default: 1M)")
    p.add_argument("--alignment", type=size_arg, default=4096, help="bytes (default: 4096)")
    p.add_argument("--dtype", default=None,
                   help="plan every model in this dtype (default: each model's own: fp32 GPT-2, bf16 7B)")


def run(args: argparse.Namespace) -> int:
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        print(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
        return 2
    worlds = [int(w) for w in args.worlds.split(",")]
    rows, results, missed = [], [], []
    for name in names:
        shapes, dtype, _ = MODELS[name]
        if args.dtype:
            dtype = getattr(torch, args.dtype)
        specs = {n: (s, dtype) for n, s in shapes.items()}
        model_bytes = sum(math.prod(s) for s in shapes.values()) * dtype.itemsize
        for world in worlds:
            ours = packed_layout(specs, world, args.alignment, args.min_io)
            ref = per_param_layout(specs, world, args.alignment)
            allows = model_bytes / world >= args.min_io  # one dtype per model here
            target = []
            if allows and ours.mean_request < args.min_io:
                target.append(f"mean request < {fmt_bytes(args.min_io)}")
            if name == "llama-7b" and world == 64 and ours.padding_pct > 1.0:
                target.append("padding > 1%")
            missed += [f"{name} world {world}: {t}" for t in target]
            rows.append([name, world, ours.requests, ratio(ours.requests, ref.requests),
                         fmt_bytes(ours.mean_request), ratio(ours.mean_request, ref.mean_request),
                         fmt_bytes(ours.min_request), ratio(ours.min_request, ref.min_request),
                         f"{ours.padding_pct:.3f}%", ratio(ours.padding, ref.padding) if ref.padding else "-",
                         "; ".join(target) or ("met" if allows else "met (model too small for the mean)")])
            results.append({"model": name, "world_size": world, "dtype": str(dtype).removeprefix("torch."),
                            "model_bytes": model_bytes, "packed": asdict(ours), "per_param": asdict(ref),
                            "targets_missed": target})
    print_table(
        f"Partition layout per rank per step (min_io {fmt_bytes(args.min_io)}, alignment {args.alignment} B)",
        ["model", "world", "requests", "vs per-param", "mean request", "vs per-param", "smallest", "vs per-param",
         "padding", "vs per-param", "targets"],
        rows,
        caption="'vs per-param': this layout / one file per parameter per rank (DeepSpeed's swapper), same run")
    write_json(args.json, {"benchmark": "partition", "min_io_bytes": args.min_io, "alignment": args.alignment,
                           "results": results, "targets_missed": missed})
    for m in missed:
        print(f"target missed: {m}")
    return 1 if missed else 0
