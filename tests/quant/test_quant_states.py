"""8-bit optimizer states: policy, training parity with fp32 AdamW, drift, and the zero-point problem."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from torch.optim.adamw import adamw

from tierstore.quant import Quantized, _native, build_tables, dequantize, quantize
from tierstore.quant.states import AdamW8bit, StatePolicy, Workspace, adamw_step_8bit, init_state

LR = 1e-3


def test_policy():
    pol = StatePolicy.make(keep_fp32=["embed.weight"])
    big, small = torch.zeros(4096), torch.zeros(4095)
    assert pol.scheme_for("exp_avg", big) == "dyn8s" and pol.scheme_for("exp_avg_sq", big) == "dyn8v"
    assert pol.scheme_for("exp_avg", small) is None and pol.scheme_for("step", big) is None
    assert pol.scheme_for("exp_avg", big, "embed.weight") is None
    assert StatePolicy.make(keep_fp32=[big]).scheme_for("exp_avg", big) is None
    assert pol.block_size == 256
    codec = pol.codec_for("exp_avg_sq", big)
    assert codec.get_config() == {"id": "tierstore.dynamic8", "block_size": 256, "dtype": "float32", "signed": False,
                                  "rounding": "bounded"}
    st = init_state(big, pol)
    assert isinstance(st["exp_avg"], Quantized) and st["exp_avg"].nbytes == 4096 + 16 * 4


def _fp32_step(p, g, m, v, s, wd):
    adamw([p], [g], [m], [v], [], [s], amsgrad=False, beta1=0.9, beta2=0.999, lr=LR, weight_decay=wd, eps=1e-8,
          maximize=False, fused=True)


def _run(scale: torch.Tensor, steps: int, *, exact_zero: bool = False, n: int = 1 << 16, seed: int = 1,
         backend: str = "auto"):
    """Adam on one tensor with gradients randn * scale, 8-bit states vs fp32 states; returns (p0, p8, pf)."""
    g0 = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=g0)
    p8, pf = p0.clone(), p0.clone()
    st = init_state(p8, StatePolicy())
    ws = Workspace(1 << 14)
    m, v, s = torch.zeros(n), torch.zeros(n), torch.zeros(())
    for _ in range(steps):
        g = torch.randn(n, generator=g0) * scale
        if exact_zero:  # control: textbook nearest rounding of v, which sends tiny v to code 0
            mm, vv = dequantize(st["exp_avg"]), dequantize(st["exp_avg_sq"])
            _fp32_step(p8, g, mm, vv, st["step"], 0.0)
            quantize(mm, "dyn8s", 256, out=st["exp_avg"])
            q = st["exp_avg_sq"]
            q.scheme = "dyn8u"  # nearest rounding, then the zero-point rule undone below
            quantize(vv, "dyn8u", 256, out=q)
            r = vv.view(-1, 256) / q.absmax[:, None]
            zero = (q.codes.view(-1, 256) == 1) & (r < float(build_tables(False).mids[0]))
            q.codes.view(-1, 256)[zero] = 0
        else:
            adamw_step_8bit(p8, g, st, ws, lr=LR, weight_decay=0.0, backend=backend)
        _fp32_step(pf, g, m, v, s, 0.0)
    return p0, p8, pf


def test_drift_iid_gradients():
    steps = 20
    p0, p8, pf = _run(torch.ones(1 << 16), steps)
    drift = ((p8 - pf).norm() / (pf - p0).norm()).item()
    print(f"\niid gradients, {steps} steps: 8-bit vs fp32 AdamW drift {drift:.4f} (relative to the fp32 update)")
    assert drift <= 2e-2


def test_zero_point_wide_range_gradients():
    """Gradient scale varies 1e4x within every block (v: 1e8x). With exact nearest rounding of v (the control),
    elements whose v lands on code 0 take steps of m / eps. Our second moments use bounded rounding (dyn8v:
    never under-estimated by more than 1 + 9/256, [Note: bounded rounding of second moments]), so the
    bound holds as stated: no element moves more than lr x steps. No float tolerance is needed or given: the
    largest change measured is ~0.79 lr x steps (fp32 AdamW: 0.83); with nearest rounding (dyn8u, no code 0)
    it was 1.34 (15 elements past 1)."""
    steps = 20
    scale = 10 ** (-4 * torch.rand(1 << 16, generator=torch.Generator().manual_seed(7)))
    p0, p8, pf = _run(scale, steps)
    _, pz, _ = _run(scale, steps, exact_zero=True)
    ours = ((p8 - p0).abs().max() / (LR * steps)).item()
    control = ((pz - p0).abs().max() / (LR * steps)).item()
    fp32 = ((pf - p0).abs().max() / (LR * steps)).item()
    over = int(((p8 - p0).abs() > LR * steps).sum())
    drift = ((p8 - pf).norm() / (pf - p0).norm()).item()
    drift_z = ((pz - pf).norm() / (pf - p0).norm()).item()
    print(f"\nwide-range gradients, {steps} steps: max |change| / (lr x steps): fp32 {fp32:.3f}, ours {ours:.3f} "
          f"({over} of {p0.numel()} elements past 1), exact-nearest control {control:.1f}; drift vs fp32: ours "
          f"{drift:.3f}, control {drift_z:.3f}")
    assert control >= 10
    assert over == 0 and bool(((p8 - p0).abs() <= LR * steps).all())
    assert drift <= 0.35 and drift_z > 3 * drift
    _, pr, _ = _run(scale, steps, backend="torch")  # the reference path (torch's AdamW between dequant/requant)
    assert bool(((pr - p0).abs() <= LR * steps).all())


@pytest.fixture
def one_thread():
    """A model this small gains nothing from intra-op threads, and on a shared 2-core machine OpenMP's
    fork/join under oversubscription made this test take ~30 s instead of ~2 s (measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_training_parity_small_mlp(one_thread):
    """A 2-hidden-layer MLP on a noisy regression task it cannot memorise (8192 samples, 10% label noise),
    mini-batches; the held-out loss after 200 steps, 8-bit states vs fp32 AdamW."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8192 + 1024, 32, generator=g)
    w1, w2 = torch.randn(32, 16, generator=g), torch.randn(16, 1, generator=g)
    y = torch.tanh(x @ w1) @ w2 / 4 + 0.1 * torch.randn(x.shape[0], 1, generator=g)
    xt, yt, xv, yv = x[:8192], y[:8192], x[8192:], y[8192:]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 128),
                                torch.nn.GELU(), torch.nn.Linear(128, 1))
    m8 = copy.deepcopy(model)
    with torch.no_grad():
        l0 = torch.nn.functional.mse_loss(model(xv), yv).item()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, fused=True)
    opt8 = AdamW8bit(m8.parameters(), lr=2e-3)
    order = torch.randperm(8192, generator=g)
    for step in range(200):
        idx = order[(step * 256) % 8192:(step * 256) % 8192 + 256]
        for mod, o in ((model, opt), (m8, opt8)):
            o.zero_grad()
            torch.nn.functional.mse_loss(mod(xt[idx]), yt[idx]).backward()
            o.step()
    with torch.no_grad():
        lf = torch.nn.functional.mse_loss(model(xv), yv).item()
        l8 = torch.nn.functional.mse_loss(m8(xv), yv).item()
    quantized = sum(isinstance(s["exp_avg"], Quantized) for s in opt8.state.values())
    print(f"\nMLP 200 steps: held-out loss {l0:.4f} -> fp32 AdamW {lf:.5f}, 8-bit states {l8:.5f} "
          f"({(l8 - lf) / lf * 100:+.2f}%)")
    assert quantized == 2  # the two large weights; biases and the 128x1 head stay fp32 (< 4096 elements)
    assert lf < 0.5 * l0  # it learned something
    assert abs(l8 - lf) <= 0.02 * lf


def test_fp32_fallback_path_equals_torch():
    p = torch.randn(100)
    st = init_state(p, StatePolicy())  # < 4096 elements: fp32 states
    pf, m, v, s = p.clone(), torch.zeros(100), torch.zeros(100), torch.zeros(())
    for _ in range(3):
        g = torch.randn(100)
        adamw_step_8bit(p, g, st, Workspace(1024), lr=LR, weight_decay=0.0)
        _fp32_step(pf, g, m, v, s, 0.0)
    assert torch.equal(p, pf)


def test_chunking_does_not_change_the_result():
    n = 10_000  # not a multiple of the block: last partial block
    outs = []
    for chunk in (256, 1024, 1 << 20):
        torch.manual_seed(3)
        p = torch.randn(n)
        st = init_state(p, StatePolicy())
        ws = Workspace(chunk)
        for _ in range(3):
            adamw_step_8bit(p, torch.randn(n), st, ws, lr=LR)
        outs.append((p, st["exp_avg"].codes.clone(), st["step"].item()))
    for p, codes, step in outs[1:]:
        assert torch.equal(p, outs[0][0]) and torch.equal(codes, outs[0][1]) and step == 3


@pytest.mark.parametrize("bad", ["dtype", "shape"])
def test_step_rejects_bad_params(bad):
    from tierstore.errors import TierstoreValueError

    p = torch.randn(5000, dtype=torch.float64 if bad == "dtype" else torch.float32)
    g = torch.randn(4999 if bad == "shape" else 5000)
    with pytest.raises(TierstoreValueError):
        adamw_step_8bit(p, g, init_state(p.float(), StatePolicy()), Workspace(), lr=LR)


def _spec_step(p, g, st, *, lr, beta1=0.9, beta2=0.999, eps=1e-8, wd=1e-2, maximize=False, bs=256):
    """The fused kernel's arithmetic written with elementwise torch ops (no FMA), numpy's correctly rounded sqrt
    (torch.sqrt on CPU is not always), and the codecs: [Note: fused 8-bit step]."""
    t = st["step"].item() + 1
    f = lambda x: float(np.float32(x))  # noqa: E731 - constants computed in double, rounded to fp32 as torch does
    m, v = dequantize(st["exp_avg"]), dequantize(st["exp_avg_sq"])
    g = -g if maximize else g
    p = p * f(1 - lr * wd)
    m = m + f(1 - beta1) * (g - m) if abs(f(1 - beta1)) < 0.5 else g - (g - m) * (1 - np.float32(1 - beta1)).item()
    v = v * f(beta2)
    v = v + f(1 - beta2) * g * g
    denom = torch.from_numpy(np.sqrt(v.numpy())) / f(math.sqrt(1 - beta2 ** t)) + f(eps)
    p = p - f(lr / (1 - beta1 ** t)) * m / denom
    return p, quantize(m, "dyn8s", bs), quantize(v, "dyn8v", bs)


@pytest.mark.parametrize("beta1,wd,maximize,bs", [(0.9, 1e-2, False, 256), (0.3, 0.0, True, 64),
                                                  (0.9, 1e-2, False, 8192)])
def test_fused_step_is_the_specified_arithmetic(beta1, wd, maximize, bs):
    """The native fused step gives, bit for bit, the spec above (param, codes and absmax), from a state that has
    been through a few steps, over a last partial block (of 7 elements: a SIMD tail too); and the same bytes
    on 1 and 3 threads."""
    if not _native.available():
        pytest.skip("native kernel not built")
    n = 10 * 8192 + 7
    g0 = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=g0)
    st, ws = init_state(p, StatePolicy(block_size=bs)), Workspace(1 << 14)
    for _ in range(3):
        adamw_step_8bit(p, torch.randn(n, generator=g0), st, ws, lr=LR, beta1=beta1, weight_decay=wd,
                        maximize=maximize)
    g = torch.randn(n, generator=g0)
    ps, ms, vs = _spec_step(p.clone(), g, st, lr=LR, beta1=beta1, wd=wd, maximize=maximize, bs=bs)
    other = {k: (copy.deepcopy(v) if k != "step" else v.clone()) for k, v in st.items()}
    p3 = p.clone()
    adamw_step_8bit(p, g, st, ws, lr=LR, beta1=beta1, weight_decay=wd, maximize=maximize, nthreads=1)
    adamw_step_8bit(p3, g, other, ws, lr=LR, beta1=beta1, weight_decay=wd, maximize=maximize, nthreads=3)
    assert torch.equal(p, ps) and torch.equal(p3, ps) and st["step"].item() == 4
    for key, want in (("exp_avg", ms), ("exp_avg_sq", vs)):
        for s_ in (st, other):
            assert torch.equal(s_[key].codes, want.codes) and torch.equal(s_[key].absmax, want.absmax), key


@pytest.mark.parametrize("kind", ["iid", "wide"])
def test_fused_step_matches_torch_adamw_reference_path(kind):
    """20 steps: the fused kernel vs the reference path (dequantize -> torch's fused AdamW -> requantize).
    They differ only by float rounding: torch computes exp_avg.lerp_ with a fused multiply-add, we do not (every
    SIMD clone must give the same bytes), so m can differ by 1 ulp, which once in a while moves an 8-bit code
    across a boundary. Measured: >= 98% of parameters bit-identical, max difference ~1e-3 lr x steps."""
    steps, n = 20, 1 << 16
    g0 = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=g0)
    pa, pb = p.clone(), p.clone()
    sa, sb = init_state(pa, StatePolicy()), init_state(pb, StatePolicy())
    ws = Workspace(1 << 14)
    scale = torch.ones(n) if kind == "iid" else 10 ** (-4 * torch.rand(n, generator=g0))
    for _ in range(steps):
        g = torch.randn(n, generator=g0) * scale
        adamw_step_8bit(pa, g, sa, ws, lr=LR, weight_decay=1e-2)
        adamw_step_8bit(pb, g, sb, ws, lr=LR, weight_decay=1e-2, backend="torch")
    d = (pa - pb).abs()
    same = (d == 0).float().mean().item()
    codes = sum(int((sa[k].codes != sb[k].codes).sum()) for k in ("exp_avg", "exp_avg_sq"))
    print(f"\nfused vs reference path, {kind} gradients, {steps} steps: {same:.2%} of params identical, max |diff| "
          f"{d.max().item() / (LR * steps):.1e} lr x steps, {codes} of {2 * n} state codes differ")
    assert sa["step"].item() == sb["step"].item() == steps
    assert same >= 0.95 and d.max().item() <= 0.01 * LR * steps and codes <= n // 1000


def test_fused_step_rejects_nan_gradients():
    from tierstore.errors import TierstoreValueError

    p = torch.randn(5000)
    g = torch.randn(5000)
    g[17] = float("nan")
    with pytest.raises(TierstoreValueError, match="NaN"):
        adamw_step_8bit(p, g, init_state(p, StatePolicy()), Workspace(), lr=LR)


def _has_avx512f() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " avx512f" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not (_native.available() and _has_avx512f()), reason="needs the native kernel and AVX-512F")
@pytest.mark.parametrize("beta1,wd,maximize,block", [(0.9, 1e-2, False, 256), (0.3, 0.0, True, 256),
                                                     (0.9, 1e-2, False, 200)])
def test_fused_step_avx512_and_portable_loops_agree(beta1, wd, maximize, block):
    """[Note: AVX-512 loops] and [Note: byte-plane decode] (native/quant.c): the intrinsic loops (gathers; VBMI byte
    planes where the CPU has them) and the portable C loops give the same bytes, on wide-range values (codes in
    every decade, zero-point cases) and a last partial block; block 200 also leaves each block a tail the 64-wide
    loop does not take (3 x 64 + 8)."""
    n = 100_003
    g0 = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=g0) * 10 ** (-4 * torch.rand(n, generator=g0))
    st = init_state(p, StatePolicy(block_size=block))
    for _ in range(3):
        adamw_step_8bit(p, torch.randn(n, generator=g0), st, Workspace(), lr=LR)
    grads = [torch.randn(n, generator=g0) * 10 ** (-4 * torch.rand(n, generator=g0)) for _ in range(3)]
    outs = []
    for isa in (2, 1, 0):
        pp, ss = p.clone(), copy.deepcopy(st)
        for g in grads:
            ss["step"] += 1
            m, v = ss["exp_avg"], ss["exp_avg_sq"]
            _native.adamw_step(pp, g, m.codes, m.absmax, v.codes, v.absmax, block, v.scheme, step=ss["step"].item(),
                               lr=LR, beta1=beta1, beta2=0.999, eps=1e-8, weight_decay=wd, maximize=maximize,
                               isa=isa)
        outs.append((pp, ss))
    (pa, sa) = outs[-1]
    for pb, sb in outs[:-1]:
        assert torch.equal(pa, pb)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[key].codes, sb[key].codes) and torch.equal(sa[key].absmax, sb[key].absmax), key
