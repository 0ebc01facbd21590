"""A block-quantized tensor and the two calls that make and undo one: quantize() and dequantize().

[Note: determinism]
Every block is encoded from its own elements only, in fp32, with round-half-to-even and no fused
multiply-add, so the bytes depend on the input alone: not on the thread count, the SIMD width of the
machine (native/quant.c is compiled in several clones) or the backend (the torch reference in
blockwise.py / dynamic.py gives the same bytes; tests hold the two equal and golden bytes pin the format).

[Note: out= buffers]
Hot loops (an optimizer step, a collective) allocate nothing: ``quantize(x, out=q)`` writes into the codes
and absmax of an existing Quantized, ``dequantize(q, out=t)`` into an existing tensor: writing into fresh
memory pays a page fault per page, which costs more than the dequantization itself.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import TierstoreValueError
from . import _native, packed
from .layout import DEFAULT_BLOCK, check_block_size, check_buffer, check_dtype, num_blocks
from .schemes import get


@dataclass
class Quantized:
    """Codes and per-block absmax of one tensor, with what it takes to decode it."""

    scheme: str
    block_size: int  # elements
    shape: tuple[int, ...]
    dtype: torch.dtype  # of the tensor that was quantized (dequantize's default output dtype)
    codes: torch.Tensor  # uint8, packed.codes_nbytes(scheme, numel) bytes
    absmax: torch.Tensor  # float32, num_blocks(numel, block_size)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of codes and scales."""
        return self.codes.numel() + 4 * self.absmax.numel()

    @classmethod
    def packed(cls, buf: torch.Tensor, scheme: str, numel: int, block_size: int,
               dtype: torch.dtype = torch.float32, *, readonly: bool = False) -> Quantized:
        """The Quantized view (no copy) of a packed buffer of ``numel`` elements ([Note: packed layout] in
        packed.py): quantize(x, out=...) fills it, dequantize() reads it. ``dtype``: of the tensor it holds;
        ``readonly``: see packed.split."""
        absmax, codes = packed.split(buf, scheme, numel, block_size, readonly=readonly)
        return cls(get(scheme).name, block_size, (numel,), dtype, codes, absmax)

    def dequantize(self, out: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self, out=out, dtype=dtype)

    def narrow(self, start: int, length: int) -> Quantized:
        """A view of elements [start, start + length) (flat), sharing codes and absmax; ``start`` must be a
        multiple of the block size, and the view must end on a block boundary or at the end of the tensor."""
        n, bs = self.numel, self.block_size
        end = start + length
        if start < 0 or length < 0 or end > n or start % bs or (end % bs and end != n):
            raise TierstoreValueError(
                f"narrow({start}, {length}) must start on a block boundary (block_size={bs}) and end on one or "
                f"at the end ({n} elements)")
        c0, c1 = packed.code_byte(self.scheme, start), packed.codes_nbytes(self.scheme, end)
        return Quantized(self.scheme, bs, (length,), self.dtype, self.codes[c0:c1],
                         self.absmax[start // bs: num_blocks(end, bs)])


def empty_quantized(shape: tuple[int, ...] | torch.Size | int, scheme: str = "int8",
                    block_size: int = DEFAULT_BLOCK, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> Quantized:
    """Allocate the buffers once (on ``device``), to be filled by ``quantize(x, out=...)`` in a loop."""
    scheme = get(scheme).name
    check_block_size(block_size)
    check_dtype(dtype, "dtype")
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    n = 1
    for s in shape:
        n *= s
    return Quantized(scheme, block_size, shape, dtype,
                     torch.empty(packed.codes_nbytes(scheme, n), dtype=torch.uint8, device=device),
                     torch.empty(num_blocks(n, block_size), dtype=torch.float32, device=device))


def _use_native(backend: str, scheme: str | None = None, device: torch.device | None = None) -> bool:
    """Whether to run the native kernel (of ``scheme``, when given: a scheme without one runs its torch kernel)
    on tensors of ``device`` (None: the CPU). The native kernels run on CPU memory; on any other device the
    scheme's torch kernel runs, on that device."""
    has_kernel = scheme is None or get(scheme).native
    if device is not None and device.type != "cpu":
        if backend == "native":
            raise TierstoreValueError(f"backend='native' asked for tensors on {device}; the native kernels run on "
                                      "CPU tensors: pass backend='auto' or 'torch' (the torch kernel runs there)")
        return False
    if backend == "auto":
        return has_kernel and _native.available()
    if backend == "native":
        if not _native.available():
            raise TierstoreValueError("backend='native' asked for, but tierstore._native_quant is not built; "
                                      "rebuild with `pip install -e .` or pass backend='torch'")
        if not has_kernel:
            raise TierstoreValueError(f"backend='native' asked for, but scheme {scheme!r} has no native kernel; "
                                      f"pass backend='auto' or 'torch'")
        return True
    if backend == "torch":
        return False
    raise TierstoreValueError(f"backend={backend!r} is not known; use 'auto', 'native' or 'torch'")


def quantize(x: torch.Tensor, scheme: str = "int8", block_size: int = DEFAULT_BLOCK, *,
             out: Quantized | None = None, backend: str = "auto", nthreads: int | None = None) -> Quantized:
    """Block-quantize ``x`` (fp32/bf16/fp16, any shape, any length; on the CPU with the native kernel where the
    scheme has one, on any other torch device with the scheme's torch kernel, the same bytes either way).

    ``out``: a Quantized from empty_quantized() (same scheme, block size, element count, device) to write into.
    Raises TierstoreValueError on NaN/Inf input. See [Note: determinism], [Note: out= buffers]."""
    s = get(scheme)
    scheme = s.name
    check_block_size(block_size)
    if not isinstance(x, torch.Tensor):
        raise TierstoreValueError(f"x must be a torch.Tensor, not {type(x).__name__}")
    check_dtype(x.dtype, "x")
    n = x.numel()
    if out is None:
        out = empty_quantized(tuple(x.shape), scheme, block_size, x.dtype, x.device)
    else:
        if out.scheme != scheme or out.block_size != block_size:
            raise TierstoreValueError(f"out was made for scheme={out.scheme!r}, block_size={out.block_size}; "
                                      f"this call asks for {scheme!r}, {block_size}")
        check_buffer(out.codes, "out.codes", torch.uint8, s.codes_nbytes(n), x.device)
        check_buffer(out.absmax, "out.absmax", torch.float32, num_blocks(n, block_size), x.device)
        out.shape, out.dtype = tuple(x.shape), x.dtype
    if n == 0:
        return out
    xc = x.detach().contiguous()
    if _use_native(backend, scheme, x.device):
        _native.quantize(s, xc, out.codes, out.absmax, block_size, nthreads)
        return out
    # the scheme's torch kernel
    nb = num_blocks(n, block_size)
    xf = torch.zeros(nb * block_size, dtype=torch.float32, device=x.device)
    xf[:n] = xc.reshape(-1)
    xf = xf.view(nb, block_size)
    if not torch.isfinite(xf).all():
        raise TierstoreValueError("x holds NaN or Inf; a block-wise quantizer needs finite values")
    amax = xf.abs().amax(dim=1)
    out.absmax.copy_(amax)
    out.codes.copy_(packed.pack_codes(s.encode(xf, amax).reshape(-1)[:n], s.bits))
    return out


def dequantize(q: Quantized, *, out: torch.Tensor | None = None, dtype: torch.dtype | None = None,
               backend: str = "auto", nthreads: int | None = None) -> torch.Tensor:
    """Decode ``q`` into ``out`` (any contiguous fp32/bf16/fp16 tensor of q.numel elements on q's device) or a
    new tensor of q.shape and ``dtype`` (default: the dtype that was quantized) there."""
    n = q.numel
    s = get(q.scheme)
    dev = q.codes.device
    if out is None:
        out = torch.empty(q.shape, dtype=check_dtype(dtype or q.dtype, "dtype"), device=dev)
    else:
        check_dtype(out.dtype, "out")
        if out.numel() != n or not out.is_contiguous() or out.device != dev:
            raise TierstoreValueError(f"out must be a contiguous tensor of {n} elements on {dev} (where q is); got "
                                      f"{out.numel()} elements, contiguous={out.is_contiguous()}, device={out.device}")
    check_buffer(q.codes, "q.codes", torch.uint8, s.codes_nbytes(n), dev)
    check_buffer(q.absmax, "q.absmax", torch.float32, num_blocks(n, q.block_size), dev)
    if n == 0:
        return out
    if _use_native(backend, s.name, dev):
        _native.dequantize(s, q.codes, q.absmax, out, q.block_size, nthreads)
        return out
    bs = q.block_size
    nb = num_blocks(n, bs)
    padded = torch.zeros(nb * bs, dtype=torch.int32, device=dev)  # the padding's decoded values are dropped below
    padded[:n] = packed.unpack_codes(q.codes, s.bits, n)
    x = s.decode(padded.view(nb, bs), q.absmax)
    out.view(-1).copy_(x.reshape(-1)[:n])
    return out


def error_bound(scheme: str) -> float:
    """max |x - x^| / (block absmax) for ``scheme`` (documented in docs/quant.md)."""
    return get(scheme).error_bound
