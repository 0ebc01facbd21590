"""8-bit optimizer states: which state gets which codec, and an AdamW step whose states live in 8 bits.

[Note: state policy]
Following the 8-bit optimizers paper (Dettmers et al., 2022) as bitsandbytes and torchao apply it today:
  - exp_avg (m, signed) -> dynamic 8-bit signed map; exp_avg_sq (v >= 0) -> unsigned map, which spends
    the sign bit on one more fraction bit and never maps v > 0 to code 0 ([Note: zero-point], dynamic.py),
    with bounded rounding (scheme dyn8v): v is never under-estimated by more than a factor 1 + 9/256, so
    quantization inflates no step by more than 1.7% ([Note: bounded rounding of second moments]);
  - block 256 (bitsandbytes PR #1365 and torchao PR #927 moved from the paper's 2048 to 256);
  - tensors with fewer than 4096 elements stay fp32 (bitsandbytes' min_8bit_size): they cost little and
    biases / norms are the most sensitive;
  - chosen parameters (embeddings, by the paper's "stable embedding" advice) can be kept fp32.

[Note: fused 8-bit step]
With the native library built (backend="auto"/"native"), the whole step is one call of tsq_adamw_step
(native/quant.c): per block of 256, decode m and v into fp32 scratch on the stack, run the AdamW update, take
the new absmaxes and encode m and v again, so each byte of state is read once and written once and the fp32
states never reach memory; threads take whole blocks (bytes independent of the thread count). The update
is torch's fused CPU AdamW, element by element (aten/src/ATen/native/cpu/FusedAdamKernel.cpp, ADAMW mode;
Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019, Algorithm 2):

    p <- p * (1 - lr * wd)                         decoupled weight decay, before the update
    m <- m + (1 - beta1) * (g - m)                 torch's lerp_(g, 1 - beta1) (weight < 0.5 branch)
    v <- v * beta2 + (1 - beta2) * g * g
    p <- p - step_size * m / (sqrt(v) / sqrt(1 - beta2^t) + eps),   step_size = lr / (1 - beta1^t)

with eps added after the bias-corrected sqrt, as torch does (not inside the sqrt, and not eps-hat of Adam's
paper). Constants are computed in double and rounded to fp32, as in torch. Torch's vectorised loop computes
the lerp with a fused multiply-add; ours does not (every clone must agree), so m can differ by 1 ulp from
torch's, which very rarely moves an 8-bit code across a boundary: the parity test bounds the effect.
The reference path (backend="torch") is the chunked one below.

[Note: 8-bit step]
The reference path, one step of a parameter: for each chunk of ``chunk`` elements (a multiple of the block
size, so every chunk owns whole blocks), dequantize m and v into two reused fp32 buffers, run torch's own
AdamW (the fused CPU kernel, torch.optim.adamw.adamw(fused=True)) on the chunk, requantize m and v in place.
The chunk keeps the fp32 buffers in cache between the three passes; nothing is allocated per step. The
chunk's step counter is a scratch copy: the kernel increments it, and the parameter's own counter is
incremented once at the end.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.adamw import adamw as _adamw

from ..errors import TierstoreValueError
from . import _native
from .layout import DEFAULT_BLOCK, check_block_size
from .quantized import Quantized, _use_native, dequantize, empty_quantized, quantize
from .schemes import fused_adamw_pair

if TYPE_CHECKING:
    from ..typing import Codec

STATE_SCHEMES = {"exp_avg": "dyn8s", "exp_avg_sq": "dyn8v"}
MIN_QUANT_NUMEL = 4096  # elements
# elements per pass of the 8-bit step (16 MiB of fp32 per state buffer). Large on purpose: each pass calls
# torch's fused AdamW once, and each call pays an OpenMP fork/join, dear on a loaded machine.
DEFAULT_CHUNK = 1 << 22


@dataclass(frozen=True)
class StatePolicy:
    """Which codec each optimizer state gets. See [Note: state policy]."""

    block_size: int = DEFAULT_BLOCK  # elements
    min_numel: int = MIN_QUANT_NUMEL  # elements; smaller tensors stay fp32
    keep_fp32: frozenset = field(default_factory=frozenset)  # parameter names, or id() of parameter tensors

    def __post_init__(self):
        check_block_size(self.block_size)
        if self.min_numel < 0:
            raise TierstoreValueError(f"min_numel={self.min_numel} must be >= 0")

    @classmethod
    def make(cls, block_size: int = DEFAULT_BLOCK, min_numel: int = MIN_QUANT_NUMEL,
             keep_fp32: Iterable[str | torch.Tensor] = ()) -> StatePolicy:
        """``keep_fp32``: parameter names and/or parameter tensors whose states stay fp32."""
        keys = frozenset(k if isinstance(k, str) else id(k) for k in keep_fp32)
        return cls(block_size, min_numel, keys)

    def scheme_for(self, state: str, param: torch.Tensor, name: str | None = None) -> str | None:
        """The scheme name (STATE_SCHEMES: 'dyn8s' / 'dyn8v') of a state that is kept in 8 bits, None for fp32."""
        if param.numel() < self.min_numel or id(param) in self.keep_fp32 or (name is not None and
                                                                             name in self.keep_fp32):
            return None
        return STATE_SCHEMES.get(state)

    def codec_for(self, state: str, param: torch.Tensor, name: str | None = None) -> Codec | None:
        """The numcodecs codec to store that state with (None: store fp32 as is)."""
        from .codecs import codec_for

        scheme = self.scheme_for(state, param, name)
        return None if scheme is None else codec_for(scheme, self.block_size, torch.float32)


class Workspace:
    """Reused fp32 buffers for the 8-bit step (two states x ``chunk`` elements) and a scratch step counter."""

    def __init__(self, chunk: int = DEFAULT_CHUNK):
        self.chunk = chunk  # elements
        self.m = torch.empty(chunk, dtype=torch.float32)
        self.v = torch.empty(chunk, dtype=torch.float32)
        self.step = torch.zeros((), dtype=torch.float32)


def init_state(param: torch.Tensor, policy: StatePolicy, name: str | None = None) -> dict:
    """Zeroed AdamW state for ``param``: exp_avg / exp_avg_sq as Quantized (8-bit) or fp32 tensors, and step."""
    state: dict = {"step": torch.zeros((), dtype=torch.float32)}
    for key in ("exp_avg", "exp_avg_sq"):
        scheme = policy.scheme_for(key, param, name)
        if scheme is None:
            state[key] = torch.zeros(param.shape, dtype=torch.float32)
        else:
            q = empty_quantized(param.numel(), scheme, policy.block_size)
            q.codes.zero_()
            q.absmax.zero_()
            state[key] = q
    return state


def adamw_step_8bit(param: torch.Tensor, grad: torch.Tensor, state: dict, ws: Workspace, *, lr: float,
                    beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-2,
                    maximize: bool = False, backend: str = "auto", nthreads: int | None = None) -> None:
    """One AdamW step of ``param`` (fp32, contiguous, CPU) with states from init_state().

    backend "auto" / "native": the fused kernel ([Note: fused 8-bit step]) when both states are 8-bit;
    "torch": dequantize -> torch's fused AdamW -> requantize per chunk ([Note: 8-bit step])."""
    if param.dtype != torch.float32 or not param.is_contiguous() or param.device.type != "cpu":
        raise TierstoreValueError("param must be a contiguous fp32 CPU tensor (the 8-bit step updates it in place)")
    if grad.shape != param.shape:
        raise TierstoreValueError(f"grad has shape {tuple(grad.shape)}, param {tuple(param.shape)}")
    m, v, step = state["exp_avg"], state["exp_avg_sq"], state["step"]
    p = param.detach().view(-1)
    g = grad.detach().reshape(-1).to(torch.float32)
    kw: dict[str, Any] = dict(amsgrad=False, beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps,
                              maximize=maximize, fused=True)
    if not isinstance(m, Quantized) and not isinstance(v, Quantized):
        _adamw([p], [g], [m.view(-1)], [v.view(-1)], [], [step], **kw)
        return
    if (_use_native(backend) and isinstance(m, Quantized) and isinstance(v, Quantized)
            and fused_adamw_pair(m.scheme, v.scheme) and m.block_size == v.block_size):
        if m.numel != p.numel() or v.numel != p.numel():
            raise TierstoreValueError(f"state holds {m.numel} / {v.numel} elements for a parameter of {p.numel()}; "
                                      f"make it with init_state(param, policy) for this parameter")
        g = g.contiguous()
        step += 1
        _native.adamw_step(p, g, m.codes, m.absmax, v.codes, v.absmax, m.block_size, v.scheme, step=float(step),
                           lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, maximize=maximize,
                           nthreads=nthreads, m_scheme=m.scheme)
        return
    n = p.numel()
    bs = m.block_size if isinstance(m, Quantized) else v.block_size
    chunk = max(bs, ws.chunk // bs * bs)
    for start in range(0, n, chunk):
        length = min(chunk, n - start)
        states: list[tuple[Quantized | None, torch.Tensor]] = []
        for s, buf in ((m, ws.m), (v, ws.v)):
            if isinstance(s, Quantized):
                part = s.narrow(start, length)
                dequantize(part, out=buf[:length])
                states.append((part, buf[:length]))
            else:
                states.append((None, s.view(-1)[start:start + length]))
        ws.step.copy_(step)
        _adamw([p[start:start + length]], [g[start:start + length]], [states[0][1]], [states[1][1]], [], [ws.step],
               **kw)
        for q, buf in states:
            if q is not None:
                quantize(buf, q.scheme, q.block_size, out=q)
    step += 1


class AdamW8bit(torch.optim.Optimizer):
    """torch.optim.AdamW with exp_avg / exp_avg_sq held in 8 bits per StatePolicy (a reference user of the
    codecs; the ZeRO-3 optimizer stores the same states through the Store instead)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, policy: StatePolicy | None = None, chunk: int = DEFAULT_CHUNK,
                 backend: str = "auto"):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.policy = policy or StatePolicy()
        self.backend = backend  # "auto"/"native": fused kernel; "torch": the reference path
        self._ws = Workspace(chunk)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st.update(init_state(p, self.policy))
                adamw_step_8bit(p, p.grad, st, self._ws, lr=group["lr"], beta1=group["betas"][0],
                                beta2=group["betas"][1], eps=group["eps"], weight_decay=group["weight_decay"],
                                backend=self.backend)
        return loss
