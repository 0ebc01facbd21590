"""ZeRO-3 used in ways it must refuse: a scratch directory that is not its own ([Note: scratch directories are
marked]), a second optimizer on one model ([Note: one optimizer per model]), and bad arguments, each refused
with a tierstore error naming what was wrong, before anything is written."""
from __future__ import annotations

import gc
import json
import os
import pathlib
import weakref

import pytest
import torch

import tierstore
from tests.support import Net, batches, cfg, loss_fn, make_pair
from tierstore.errors import MisuseError, TierstoreValueError
from tierstore.zero import Init, OffloadConfig, Zero3Optimizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _opt(tmp_path, model=None, **kw):
    m = model if model is not None else make_pair()[1]
    return Zero3Optimizer(m, torch.optim.AdamW, config=cfg(tmp_path, params="nvme", states="nvme", grads="nvme", **kw),
                          lr=1e-2)


def _users_store(path) -> None:
    s = tierstore.Store(str(path))
    s.put("w", torch.arange(6.0))
    s.flush()
    s.close()


# -- scratch directories -----------------------------------------------------------------------------------
def test_a_users_store_at_rank_r_is_refused_and_kept(tmp_path):
    """A tierstore.Store of the user's at <nvme_path>/rank0: refused naming the path and what to do; the store
    and its tensor are as they were (not started empty)."""
    _users_store(tmp_path / "nvme" / "rank0")
    with pytest.raises(MisuseError) as ei:
        _opt(tmp_path)
    msg = str(ei.value)
    assert str(tmp_path / "nvme" / "rank0") in msg and "tierstore.Store" in msg and "another nvme_path" in msg
    s = tierstore.Store.open(str(tmp_path / "nvme" / "rank0"), mode="r")
    try:
        assert torch.equal(s.get("w"), torch.arange(6.0))
    finally:
        s.close()


def test_a_users_files_at_rank_r_or_init_rank_r_are_refused_and_kept(tmp_path):
    """Plain files of the user's where the optimizer (rank0) or zero.Init (init-rank0) keep scratch: refused,
    the files untouched (zero.Init removes only its own directory when it is done)."""
    for name in ("rank0", "init-rank0"):
        (tmp_path / "nvme" / name).mkdir(parents=True)
        (tmp_path / "nvme" / name / "notes.txt").write_text("mine")
    with pytest.raises(MisuseError, match="notes.txt"):
        _opt(tmp_path)
    with pytest.raises(MisuseError, match="init-rank0"):
        with Init(cfg(tmp_path, params="nvme")):
            Net()
    for name in ("rank0", "init-rank0"):
        assert (tmp_path / "nvme" / name / "notes.txt").read_text() == "mine"
        assert sorted(os.listdir(tmp_path / "nvme" / name)) == ["notes.txt"]


def test_a_symlink_at_rank_r_is_not_followed(tmp_path):
    """A symlink at <nvme_path>/rank0 (or init-rank0, activations-rank0): a MisuseError naming it; nothing is
    written where it points (no store file is created there)."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    for name in ("rank0", "init-rank0", "activations-rank0"):
        link = tmp_path / name / "nvme" / name
        link.parent.mkdir(parents=True)
        os.symlink(target, link)
        with pytest.raises(MisuseError, match="symlink") as ei:
            if name == "init-rank0":
                with Init(cfg(tmp_path / name, params="nvme")):
                    Net()
            else:
                _opt(tmp_path / name, activation_offload="nvme")
        assert str(link) in str(ei.value)
        assert os.listdir(target) == []
        os.unlink(link)


def test_the_optimizer_reuses_its_own_scratch_directory_and_checks_the_marker(tmp_path):
    """The directory the optimizer made is marked and reused by the next run (started empty); a marker that is
    not tierstore's (garbage, another owner's, a symlink) is refused."""
    opt = _opt(tmp_path)
    opt.close()
    d = tmp_path / "nvme" / "rank0"
    marker = d / "tierstore-scratch.json"
    assert json.loads(marker.read_text())["owner"] == "Zero3Optimizer"
    _, m = make_pair()
    opt = _opt(tmp_path, m)  # the second run on the same directory
    x, y = batches(1)[0]
    loss_fn(m, x, y).backward()
    opt.step()
    opt.close()
    body = marker.read_text()
    for bad in ("not json", json.dumps({"format": "tierstore.zero.scratch/1", "owner": "zero.Init"})):
        marker.write_text(bad)
        with pytest.raises(MisuseError, match="tierstore-scratch.json|zero.Init"):
            _opt(tmp_path)
    marker.unlink()
    (tmp_path / "fake").write_text(body)
    os.symlink(tmp_path / "fake", marker)
    with pytest.raises(MisuseError, match="tierstore-scratch.json"):
        _opt(tmp_path)


# -- one optimizer per model -------------------------------------------------------------------------------
def _losses(opt, m, steps=3):
    out = []
    for x, y in batches(steps):
        loss = loss_fn(m, x, y)
        out.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return out


def test_a_second_optimizer_on_the_same_model_is_refused_and_the_first_trains_on(tmp_path):
    """The second Zero3Optimizer on a model is a MisuseError naming the first (if accepted, both sets
    of hooks would make training follow neither); the first then trains exactly as without the attempt."""
    _, m_ref = make_pair()
    want = _losses(Zero3Optimizer(m_ref, torch.optim.AdamW, config=cfg(tmp_path / "ref"), lr=1e-2), m_ref)
    _, m = make_pair()
    first = Zero3Optimizer(m, torch.optim.AdamW, config=cfg(tmp_path / "a"), lr=1e-2)
    with pytest.raises(MisuseError) as ei:
        Zero3Optimizer(m, torch.optim.AdamW, config=cfg(tmp_path / "b"), lr=1e-2)
    assert repr(first) in str(ei.value) and "close" in str(ei.value)
    with pytest.raises(MisuseError):  # a submodule of it is the same parameters
        Zero3Optimizer(m.fc1, torch.optim.AdamW, config=cfg(tmp_path / "c"), lr=1e-2)
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
    assert _losses(first, m) == want
    first.close()


def test_a_closed_optimizers_model_is_refused_until_it_holds_values(tmp_path):
    """After close() the parameters are empty: a new optimizer on them is refused saying how to keep the
    values (rather than build on shape-[0] parameters and fail in the forward). optimizer_of(model) finds an
    optimizer dropped without close()."""
    from tierstore.zero import optimizer_of
    _, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, config=cfg(tmp_path / "a"), lr=1e-2)
    _losses(opt, m, 2)
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert optimizer_of(m) is ref() is not None  # the model's hooks keep it: still the owner
    optimizer_of(m).close()
    assert optimizer_of(m) is None
    with pytest.raises(MisuseError, match="release_model"):
        Zero3Optimizer(m, torch.optim.AdamW, config=cfg(tmp_path / "b"), lr=1e-2)
    assert not (tmp_path / "b").exists()


def test_a_failed_construction_leaves_the_model_and_the_directory_free(tmp_path, monkeypatch):
    """A constructor that raises after its hooks are on the model (here hpZ's attach) takes them back, with
    its registration and its store: the model keeps its values and no hook, and the next optimizer takes it
    on the same directory (no store left open, no directory locked, no hook on the model)."""
    from tierstore.zero.hooks import hpz
    ref, m = make_pair()
    real = hpz.Hpz.attach

    def boom(*a, **k):
        raise RuntimeError("attach failed")

    monkeypatch.setattr(hpz.Hpz, "attach", boom)
    with pytest.raises(RuntimeError, match="attach failed"):
        _opt(tmp_path, model=m)
    monkeypatch.setattr(hpz.Hpz, "attach", real)
    assert "zero_grad" not in m.__dict__
    # torch keeps a module's hooks in these private dicts; it has no public view of them
    assert all(not (mod._forward_pre_hooks or mod._forward_hooks) for mod in m.modules())
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), ref.parameters(), strict=True))
    want = _losses(Zero3Optimizer(ref, torch.optim.AdamW, config=cfg(tmp_path / "ref"), lr=1e-2), ref)
    opt = _opt(tmp_path, model=m)
    assert _losses(opt, m) == pytest.approx(want, rel=1e-5)
    opt.close()
    from tierstore.zero.params import registry
    assert all(o is not None and o.store is not None for o in registry.open_optimizers())


def test_release_model_hands_the_trained_values_back_for_a_new_optimizer(tmp_path):
    """release_model(opt): the model holds the values opt stepped to (fp32 masters: torch's AdamW run, within
    parity), is a plain model again, and a new optimizer takes it and trains on."""
    from tests.support import max_rel, reference
    from tierstore.zero import optimizer_of, release_model
    _, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, config=cfg(tmp_path / "a"), lr=1e-2)
    _losses(opt, m, 3)
    masters = opt.full_state_dict()
    assert release_model(opt) is m and opt.store is None and optimizer_of(m) is None
    got = dict(m.named_parameters())
    for n, v in masters.items():
        assert got[n].dtype == torch.float32 and torch.equal(got[n].detach(), v.float())
    assert max_rel({n: p.detach() for n, p in got.items()}, reference(torch.optim.AdamW, {"lr": 1e-2}, 3)) < 1e-5
    x, y = batches(1, seed=7)[0]
    plain = loss_fn(m, x, y).item()  # no hooks: the model's own forward
    opt2 = Zero3Optimizer(m, torch.optim.AdamW, config=cfg(tmp_path / "b"), lr=1e-2)
    loss = loss_fn(m, x, y)
    assert loss.item() == pytest.approx(plain, rel=1e-6)
    loss.backward()
    opt2.step()
    opt2.close()


# -- arguments ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("paths", [5, [None], [""], b"/tmp/x", [b"/tmp/x"], ["/tmp/a\0b"], {"a": 1}])
def test_bad_nvme_paths_are_refused_naming_the_argument(paths):
    with pytest.raises(TierstoreValueError, match="nvme_paths"):
        OffloadConfig(nvme_paths=paths)


def test_config_fields_are_checked_by_name():
    from tierstore.errors import TierstoreTypeError
    with pytest.raises(TierstoreValueError, match="unknown_field"):
        OffloadConfig(unknown_field=1)
    with pytest.raises(TypeError):  # still what Python's own refusal was
        OffloadConfig(unknown_field=1)
    with pytest.raises(TierstoreTypeError, match="positional"):
        OffloadConfig(*["host"] * 40)
    with pytest.raises(TierstoreValueError, match="did you mean nvme_paths"):
        OffloadConfig(nvme_path="/x")
    with pytest.raises(TierstoreValueError, match="pinned_bytes"):
        OffloadConfig().replace(pinned_byte=1)
    nvme = {"activation_offload": "nvme", "nvme_paths": ["/x"]}
    for name, kw in (("activation_compress", {"activation_compress": "int8"}),  # host activations
                     ("activation_compress", {"activation_compress": "bogus", **nvme}),
                     ("quantized_weights", {"quantized_weights": 1}),
                     ("initial_loss_scale", {"initial_loss_scale": "big"}), ("intra_node_size", {"intra_node_size": 0}),
                     ("activation_budget_bytes", {"activation_budget_bytes": -1}),
                     ("min_loss_scale", {"min_loss_scale": float("nan")})):
        with pytest.raises(TierstoreValueError, match=name):
            OffloadConfig(**kw)
    assert OffloadConfig(nvme_paths=os.path.join("a", "b")).nvme_paths == [os.path.join("a", "b")]


def test_config_as_a_dict_is_built_or_refused_naming_the_key(tmp_path):
    _, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, config={"optimizer_states": "host", "sub_group_bytes": 8192}, lr=1e-2)
    assert isinstance(opt.config, OffloadConfig) and opt.config.sub_group_bytes == 8192
    opt.close()
    for bad, word in (({"params": "host", "bogus": 1}, "bogus"), ({"zero_optimization": {}}, "from_deepspeed"),
                      ("fast", "config=")):
        with pytest.raises(TierstoreValueError, match=word):
            Zero3Optimizer(make_pair()[1], torch.optim.AdamW, config=bad, lr=1e-2)


@pytest.mark.parametrize("kw, name", [({"lr": "fast"}, "lr"), ({"lr": -1}, "lr"), ({"betas": (2, 3)}, "betas"),
                                      ({"lr": float("nan")}, "lr"), ({"momentum": 0.9}, "momentum"),
                                      ({"weight_decay": -0.1}, "weight_decay")])
def test_bad_optimizer_arguments_are_refused_before_anything_is_written(tmp_path, kw, name):
    """lr='fast', lr=-1, betas=(2,3) ... (and AdamW's unknown momentum=): a TierstoreValueError naming the
    argument, and no scratch directory made."""
    with pytest.raises(TierstoreValueError, match=name):
        Zero3Optimizer(make_pair()[1], torch.optim.AdamW, config=cfg(tmp_path, params="nvme"), **kw)
    assert not (tmp_path / "nvme").exists()
    with pytest.raises(TierstoreValueError, match=r"param_groups\[0\] lr"):
        _, m = make_pair()
        Zero3Optimizer(m, torch.optim.AdamW, config=cfg(tmp_path, params="nvme"), lr=1e-2,
                       param_groups=[{"params": [n for n, _ in m.named_parameters()], "lr": -1}])


def test_a_deeply_nested_deepspeed_file_is_refused(tmp_path):
    from tierstore.zero import from_deepspeed
    p = tmp_path / "ds.json"
    p.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(TierstoreValueError, match="nested too deeply"):
        OffloadConfig.from_deepspeed(str(p))
    with pytest.raises(TierstoreValueError, match="nested too deeply"):
        from_deepspeed(str(p), lr=1e-3)


@pytest.mark.parametrize("path", [5, ["/x"], True])
def test_a_deepspeed_nvme_path_that_is_not_a_string_is_refused_naming_the_key(path):
    """Not turned into str(path), which would write nvme_path=5 into a directory "5" under the current one."""
    ds = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": path}}}
    with pytest.raises(TierstoreValueError, match="offload_param.nvme_path"):
        OffloadConfig.from_deepspeed(ds)


def _rank_release(rank, world, root):
    from tierstore.zero import release_model
    torch.manual_seed(0)
    _, m = make_pair()
    c = cfg(pathlib.Path(root), params="nvme", states="nvme", grads="host")  # one nvme_path: rank0/, rank1/
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=c)
    for x, y in batches(2, bs=24):
        half = x.shape[0] // world
        loss_fn(m, x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]).backward()
        opt.step()
        opt.zero_grad()
    release_model(opt)  # a collective
    full = {n: p.detach().clone() for n, p in m.named_parameters()}
    opt2 = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=c)  # takes the model over, same directories
    x, y = batches(1, seed=5)[0]
    loss = loss_fn(m, x, y)
    loss.backward()
    opt2.step()
    opt2.close()
    return full, loss.item()


def test_release_model_at_world_2(tmp_path):
    """Every rank gets the whole trained model (torch's AdamW on the full batch, within parity) from
    release_model, and a new optimizer takes it over on the same scratch directories, one per rank."""
    from tests.support import max_rel, reference, run_ranks
    out = run_ranks(_rank_release, 2, str(tmp_path))
    ref = reference(torch.optim.AdamW, {"lr": 1e-2}, 2)
    for full, loss in out:
        assert max_rel(full, ref) <= 1e-5 and loss == out[0][1]
    for r in (0, 1):
        assert (tmp_path / "nvme" / f"rank{r}" / "tierstore-scratch.json").exists()
