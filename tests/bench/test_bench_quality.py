"""`tierstore bench quality` at a tiny size: every row is produced, the tierstore rows measure what they name
(8-bit states; fused steps only in the fused row), and the JSON and PNG are written."""
from __future__ import annotations

import json
import math

from tierstore.bench import quality
from tierstore.cli import main


def test_bench_quality_tiny(tmp_path, capsys):
    out = tmp_path / "q.json"
    rc = main(["bench", "quality", "--steps", "3", "--evals", "1", "--width", "64", "--layers", "1", "--context",
               "16", "--batch", "2", "--eval-batches", "1", "--text", "256K", "--lrs", "1e-3",
               "--dir", str(tmp_path), "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())["results"]["0.001"]
    assert set(r) == set(quality.VARIANTS)
    for name in (quality.FP32, quality.TS_FUSED, quality.TS_UNFUSED, quality.TS_OVERLAP):
        assert math.isfinite(r[name]["eval_loss"]) and len(r[name]["curve"]) == 1
    assert r[quality.FP32]["gap_pct"] == 0
    for name in (quality.TS_FUSED, quality.TS_UNFUSED, quality.TS_OVERLAP):
        assert r[name]["quantized_states"] > 0 and abs(r[name]["gap_pct"]) < 5
    assert r[quality.TS_FUSED]["fused_steps"] > 0 and r[quality.TS_UNFUSED]["fused_steps"] == 0
    assert r[quality.TS_OVERLAP]["overlapped"] > 0 and r[quality.TS_FUSED]["overlapped"] == 0
    for name in (quality.BNB, quality.TORCHAO):  # optional references: measured, or said to be missing
        assert "eval_loss" in r[name] or r[name]["skipped"].startswith("not installed")
    printed = capsys.readouterr().out
    assert "gap to fp32" in printed and quality.TS_FUSED.split(" (")[0] in printed
    assert (tmp_path / "q.png").exists() or "no PNG" in printed
