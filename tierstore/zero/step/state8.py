"""Zero3Optimizer's optimizer states in 8 bits: which states are packed, packing and unpacking them, and the
fused 8-bit AdamW step over the packed buffers.

[Note: 8-bit states]
With state_codec="dynamic8" and states on nvme, exp_avg / exp_avg_sq of a sub-group (per
quant.states.StatePolicy: block 256, signed / unsigned dynamic maps, tiny tensors kept fp32) are stored
as one uint8 tensor in the packed layout ([Note: packed layout] in quant/packed.py: the fp32 absmax of
each block, then the codes).
The optimizer quantizes and dequantizes itself, into recycled buffers, on the reader / writer threads:
the store moves 1/4 of the bytes and no codec copies. Checkpoints and state_dict() hold fp32 states.
The step runs on the compute device, so with the model on an accelerator the states are packed and unpacked
there, by the quantizers' torch kernels (the same bytes as the C kernels; tests/test_accelerator.py).

[Note: fused 8-bit step in ZeRO-3]
With AdamW over 8-bit states on nvme, unpacking exp_avg / exp_avg_sq to fp32 on the reader thread,
stepping, and packing them again on the writer thread takes three passes and about twice the CPU of the
fused native kernel of quant.states ([Note: fused 8-bit step] there: decode, update, encode per block of
256 in one pass). So, when the inner optimizer is AdamW in a form that kernel
computes (see fused8_capable) and a sub-group's two moments are both 8-bit, the packed buffers read from
the store are stepped in place and written back as they are. The arithmetic is torch's fused CPU AdamW
element by element (up to the 1-ulp lerp difference documented there), whichever AdamW implementation the
user picked; the unfused path (stepper.py) stays for every other case (the first step, which creates the
states; fp32 states of small sub-groups; any other optimizer).
"""
from __future__ import annotations

import torch

from ...tiers import tier_info
from .. import keys


def fused8_capable(cls, groups: list[dict], device: torch.device) -> bool:
    """Whether every group of the inner optimizer computes what the native fused 8-bit AdamW kernel computes
    ([Note: fused 8-bit step in ZeRO-3]): torch.optim.AdamW itself (a subclass may change the update),
    without amsgrad (a third state), capturable or differentiable, on the CPU."""
    from ...quant import _native
    if cls is not torch.optim.AdamW or device.type != "cpu" or not _native.available():
        return False
    return all(not g.get("amsgrad") and not g.get("capturable") and not g.get("differentiable") for g in groups)


class EightBitStates:
    """Writes a sub-group's states to the store -- packed in 8 bits where [Note: 8-bit states] says so, fp32
    otherwise -- and remembers which are packed. `policy`: a quant.states.StatePolicy, or None (every state
    fp32); `buffers`: the stepper's BufferPool; `nthreads`: threads of the (de)quantization kernels (None:
    the kernel's default, all cores)."""

    def __init__(self, store, tier: str, policy, buffers, nthreads: int | None = None):
        self.store = store
        self.tier = tier
        self.policy = policy
        self.buffers = buffers
        self.nthreads = nthreads
        self.packed: dict[tuple[int, str], tuple[str, int]] = {}  # (gid, state) -> (scheme, elements)

    def is_packed(self, gid: int, key: str) -> bool:
        return (gid, key) in self.packed

    def scheme(self, key: str, t: torch.Tensor) -> str | None:
        if self.policy is None or not tier_info(self.tier).holds_encoded_bytes or t.dim() != 1:
            return None
        return self.policy.scheme_for(key, t)

    def view(self, buf: torch.Tensor, gid: int, key: str):
        """The packed buffer `buf` of state `key` as a Quantized (codes and absmax are views of it)."""
        from ...quant.quantized import Quantized
        scheme, n = self.packed[(gid, key)]
        return Quantized.packed(buf, scheme, n, self.policy.block_size)

    def put(self, gid: int, key: str, v: torch.Tensor, lend=None) -> None:
        """Store state `key` of sub-group `gid` (fp32 value `v`), packing it when its scheme says so. `lend`:
        see Store.put (`v` is lent only when it is stored as it is)."""
        name = keys.state(gid, key)
        scheme = self.scheme(key, v)
        if scheme is None:
            self.packed.pop((gid, key), None)
            self.store.put(name, v, tier=self.tier, lend=lend)
            return
        if lend is not None:
            lend()  # packed into a buffer of our own: `v` is not needed
        from ...quant import packed
        from ...quant.quantized import Quantized, quantize
        n = v.numel()
        buf = self.buffers.take(packed.nbytes(scheme, n, self.policy.block_size), torch.uint8)  # bytes
        with torch.profiler.record_function("tierstore::quantize_state"):
            quantize(v, scheme, self.policy.block_size, out=Quantized.packed(buf, scheme, n, self.policy.block_size),
                     nthreads=self.nthreads)
        # counted, not waited for: the step's save that calls this holds its own loans until it returns
        self.buffers.lent([buf], wait=False)  # ([Note: lent buffers are bounded] in stepper.py)
        self.store.put(name, buf, tier=self.tier, lend=lambda: self.buffers.give(buf))
        self.packed[(gid, key)] = (scheme, n)

    def put_packed(self, gid: int, key: str, buf: torch.Tensor, lend=None) -> None:
        """Store the packed buffer of an 8-bit state as it is (the fused step updated its codes in place);
        `lend`: see Store.put."""
        self.store.put(keys.state(gid, key), buf, tier=self.tier, lend=lend)

    def unpack(self, gid: int, key: str, buf: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 value of the packed state `key` held in `buf` (into `out`, or a recycled buffer)."""
        from ...quant.quantized import dequantize
        if out is None:
            out = self.buffers.take(self.packed[(gid, key)][1], torch.float32)
        with torch.profiler.record_function("tierstore::dequantize_state"):
            return dequantize(self.view(buf, gid, key), out=out, nthreads=self.nthreads)

    def forget(self, gid: int, key: str) -> None:
        self.packed.pop((gid, key), None)

    def fused_pair(self, gid: int) -> bool:
        """Whether both AdamW moments of `gid` are packed in schemes the fused kernel steps."""
        from ...quant.schemes import fused_adamw_pair
        m, v = self.packed.get((gid, "exp_avg")), self.packed.get((gid, "exp_avg_sq"))
        return m is not None and v is not None and fused_adamw_pair(m[0], v[0])

    def adamw_step(self, gid: int, got: dict[str, torch.Tensor], master: torch.Tensor, grad: torch.Tensor,
                   group: dict) -> None:
        """One AdamW step of sub-group `gid` over its packed moments in `got`, in place: the master, the codes
        and absmax of both moments, and got["step"] ([Note: fused 8-bit step in ZeRO-3])."""
        from ...quant import _native
        m = self.view(got["exp_avg"], gid, "exp_avg")
        v = self.view(got["exp_avg_sq"], gid, "exp_avg_sq")
        step = got["step"]
        step += 1
        beta1, beta2 = group["betas"]
        with torch.profiler.record_function("tierstore::adamw_step_8bit"):
            _native.adamw_step(master, grad.contiguous(), m.codes, m.absmax, v.codes, v.absmax, m.block_size,
                               v.scheme, step=float(step), lr=float(group["lr"]), beta1=float(beta1),
                               beta2=float(beta2), eps=float(group["eps"]),
                               weight_decay=float(group["weight_decay"]), maximize=bool(group["maximize"]),
                               nthreads=self.nthreads, m_scheme=m.scheme)
