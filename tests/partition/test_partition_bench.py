"""`tierstore bench partition`: the model shapes written in code, and the targets it checks (exact arithmetic)."""
from __future__ import annotations

import json
import math

import torch

from tierstore.bench.partition import MODELS, packed_layout, per_param_layout
from tierstore.cli import main


def test_model_shapes_match_the_published_parameter_counts():
    for name, (shapes, _dtype, count) in MODELS.items():
        assert sum(math.prod(s) for s in shapes.values()) == count, name


def test_per_param_reference_layout():
    # 768 fp32 over 64 ranks: 12 floats = 48 B per rank, padded to 4 KiB; 4096x4096 bf16: 512 KiB per rank.
    specs = {"bias": ((768,), torch.float32), "w": ((4096, 4096), torch.bfloat16)}
    ref = per_param_layout(specs, 64, 4096)
    assert ref.requests == 2 and ref.min_request == 4096
    assert ref.mean_request == (4096 + (512 << 10)) / 2
    assert ref.padding == 64 * 4096 - 768 * 4
    ours = packed_layout(specs, 64, 4096, 1 << 20)
    assert ours.requests == 2  # two dtypes: two buckets (too small to reach 1 MiB per rank)


def test_bench_meets_the_targets(tmp_path, capsys):
    out = tmp_path / "partition.json"
    assert main(["bench", "partition", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "vs per-param" in text and "llama-7b" in text
    results = json.loads(out.read_text())
    assert results["targets_missed"] == []
    rows = {(r["model"], r["world_size"]): r for r in results["results"]}
    assert set(rows) == {(m, w) for m in MODELS for w in (1, 8, 64)}
    for r in rows.values():
        assert r["packed"]["min_request"] >= 1 << 20  # every model here is big enough for 1 MiB requests
        assert r["packed"]["requests"] <= r["per_param"]["requests"]
    assert rows["llama-7b", 64]["packed"]["padding_pct"] <= 1.0


def test_bench_reports_a_missed_target(capsys):
    # 1 MiB alignment at 64 ranks: every bucket is a multiple of 64 MiB, far too coarse for 1% padding.
    assert main(["bench", "partition", "--models", "llama-7b", "--worlds", "64", "--alignment", "1M"]) == 1
    assert "target missed: llama-7b world 64: padding > 1%" in capsys.readouterr().out
    # 64 MiB requests cannot be had from GPT-2 at 64 ranks (7.4 MiB per rank in all): not counted as missed.
    assert main(["bench", "partition", "--models", "gpt2", "--worlds", "64", "--min-io", "64M"]) == 0
    assert "model too small" in capsys.readouterr().out
