"""OffloadConfig's knobs explain themselves: every field carries its group, a one-line doc and (memory knobs)
the memory bound it sets; each bound is stated once; docs/zero.md's reference is generated from them; the
flat way of building and reading a config is unchanged."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tierstore.zero import OffloadConfig
from tierstore.zero.config import GROUPS, MEMORY_BOUNDS
from tierstore.zero.config_docs import BEGIN, END, REGENERATE, main, reference_table, region, with_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIELDS = dataclasses.fields(OffloadConfig)


def test_docs_table_is_generated_from_the_fields():
    with open(os.path.join(ROOT, "docs", "zero.md"), encoding="utf-8") as f:
        text = f.read()
    assert text.count(BEGIN) == 1 and text.count(END) == 1
    assert region(text) == reference_table(), (
        f"docs/zero.md's OffloadConfig reference differs from the fields' metadata; regenerate it with `{REGENERATE}`")


def test_every_field_has_a_group_a_one_line_doc_and_a_known_bound():
    for f in FIELDS:
        m = f.metadata
        assert m["group"] in GROUPS, f.name
        assert m["doc"] and "\n" not in m["doc"] and not m["doc"].endswith("."), f.name
        assert m["bound"] is None or m["bound"] in MEMORY_BOUNDS, f.name
    assert {f.metadata["group"] for f in FIELDS} == set(GROUPS)  # no group left empty


def test_a_first_run_needs_only_the_tiers_and_nvme_paths():
    assert [f.name for f in FIELDS if f.metadata["group"] == "tiers"] == [
        "params", "optimizer_states", "gradients", "nvme_paths"]
    OffloadConfig(params="nvme", optimizer_states="nvme", gradients="nvme", nvme_paths=["/tmp/x"])


def test_each_memory_bound_is_stated_once_and_set_by_its_knobs():
    setters = {name: [f.name for f in FIELDS if f.metadata["bound"] == name] for name in MEMORY_BOUNDS}
    assert setters == {"reuse": ["reuse_bytes"], "step": ["sub_group_bytes", "pipeline_depth"],
                       "read_ahead": ["prefetch_depth", "prefetch_bytes"], "pinned": ["pinned_bytes"],
                       "activations": ["activation_budget_bytes"]}
    for name, b in MEMORY_BOUNDS.items():
        assert all(k in b.sets for k in setters[name]), name  # the formula names its knobs
        assert b.covers, name
    # the two bounds that cover several mechanisms cover each of them
    assert len(MEMORY_BOUNDS["reuse"].covers) == 3 and len(MEMORY_BOUNDS["step"].covers) == 4


def test_the_memory_knobs_set_what_their_bounds_say(tmp_path):
    from tierstore.zero import Zero3Optimizer
    cfg = OffloadConfig(params="host", optimizer_states="host", gradients="host", sub_group_bytes=1 << 20,
                        pipeline_depth=4, reuse_bytes=3 << 20, overlap_step=True)
    opt = Zero3Optimizer(torch.nn.Linear(8, 8), torch.optim.SGD, config=cfg, lr=0.1)
    try:
        assert opt.coordinator.turn.reuse_bytes == cfg.reuse_budget == 3 << 20  # reuse: kept at the turn
        step = cfg.pipeline_depth * cfg.sub_group_bytes
        assert opt.overlap is not None and opt.overlap.stream.queue_bytes == step  # step: the overlapped step's queue
        # private: the stepper's buffer pool has no public view
        assert opt._stepper.buffers.lend_bytes == 2 * step  # step: buffers lent to writes
    finally:
        opt.close()


def test_flat_construction_and_reading_are_unchanged():
    # positional order is the declaration order (known_fields accepts positions): pinned here
    assert [f.name for f in FIELDS][:12] == [
        "params", "optimizer_states", "gradients", "nvme_paths", "state_codec", "quantized_weights",
        "quantized_gradients", "compute_dtype", "gradient_dtype", "prefetch_depth", "prefetch_bytes", "reuse_bytes"]
    c = OffloadConfig("host", "host", "host", None, None, False, False, torch.bfloat16)
    assert (c.params, c.compute_dtype, c.sub_group_bytes, c.reuse_budget) == ("host", torch.bfloat16, 64 << 20,
                                                                             128 << 20)
    assert c.replace(pipeline_depth=5).pipeline_depth == 5
    assert OffloadConfig.coerce({"params": "host"}) == OffloadConfig(params="host")
    assert c.to_dict()["compute_dtype"] == "bfloat16"
    assert repr(c).startswith("OffloadConfig(params='host', optimizer_states='host'")


def test_describe_shows_every_field_by_group_and_marks_what_differs():
    text = OffloadConfig(params="host", pipeline_depth=5).describe()
    lines = text.splitlines()
    for title in GROUPS.values():
        assert any(ln.strip().startswith(title + ":") for ln in lines), title
    for f in FIELDS:
        assert f"{f.name}=" in text, f.name
    assert "params='host'*" in text and "pipeline_depth=5*" in text and "gradients='host'," in text
    assert "step 320 MiB" in text and "reuse 128 MiB" in text


def test_the_command_rewrites_only_the_region(tmp_path, capsys):
    doc = tmp_path / "zero.md"
    doc.write_text(f"# title\n\nbefore\n{BEGIN}\nstale\n{END}\nafter\n", encoding="utf-8")
    assert main(["--write", str(doc)]) == 0
    text = doc.read_text(encoding="utf-8")
    assert text.startswith("# title\n\nbefore\n" + BEGIN + "\n") and text.endswith(END + "\nafter\n")
    assert region(text) == reference_table() and with_table(text) == text
    capsys.readouterr()
    assert main([]) == 0 and capsys.readouterr().out == reference_table()
    with pytest.raises(ValueError, match="markers"):
        with_table("no markers")
