"""nn.Linear's forward under the ZeRO-3 hooks: F.linear in an autograd Function whose backward reads the
Parameter objects themselves, not views of the gathered bucket, so that a released bucket's memory is free
between forward and backward.

[Note: linear keeps its parameters]
nn.Linear's forward (F.linear -> addmm / matmul on ``weight.t()``) makes autograd save a transposed *view*
of the weight for backward: a view of the gathered bucket, which keeps the bucket's storage alive until
backward however early the hooks release it. On a stack of Linear layers that is nearly the whole model
held at the end of forward, which is what ZeRO-3 exists to avoid. So the coordinator
points the forward of every hooked module whose class uses nn.Linear's own forward (nn.Linear, TiledLinear's
tiles, subclasses that do not override forward) at ``_LinearKeepingParams``: F.linear inside an autograd
Function that saves the input and the Parameter objects themselves -- not their data -- and computes the
three gradients from them in backward, after the backward gather put the values back. Same products as
torch's Linear backward (grad @ W, grad^T @ x, sum of grad); under torch.autocast the products run in the
autocast dtype, as nn.Linear's do. ``remove()`` restores the class's forward.
"""
from __future__ import annotations

import functools
import types

import torch


def keep_linear_params(module: torch.nn.Module, grad_out) -> _InstanceForward | None:
    """Point `module`'s forward at the Linear of [Note: linear keeps its parameters] when its class uses
    nn.Linear's own forward; returns the handle whose ``remove()`` takes it back (None: left alone).
    `grad_out(param)`: see _LinearKeepingParams."""
    if type(module).forward is not torch.nn.Linear.forward or "forward" in module.__dict__:
        return None
    module.forward = types.MethodType(functools.partial(_linear_keeping_params, grad_out=grad_out), module)
    return _InstanceForward(module)


class _LinearKeepingParams(torch.autograd.Function):
    """F.linear whose backward reads the parameters themselves. See [Note: linear keeps its parameters].
    Under torch.autocast the product runs in the autocast dtype, as nn.Linear's would, and each gradient
    comes back in its tensor's own dtype. `grad_out(param)`: where that parameter's gradient may be computed
    (a tensor of its shape and dtype) or None ([Note: gradients computed in their partition] in grad_partitions.py)."""

    @staticmethod
    def forward(ctx, x, weight, bias, grad_out=None):
        dev = x.device.type
        ctx.cast = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        ctx.grad_out = grad_out
        ctx.save_for_backward(x, weight, bias)
        if ctx.cast is None:
            return torch.nn.functional.linear(x, weight, bias)
        c = ctx.cast
        with torch.autocast(dev, enabled=False):
            return torch.nn.functional.linear(x.to(c), weight.to(c), None if bias is None else bias.to(c))

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias = ctx.saved_tensors
        if ctx.cast is not None:
            grad = grad.to(ctx.cast)
        w = weight if ctx.cast is None else weight.to(ctx.cast)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = grad.matmul(w).to(x.dtype)
        g2 = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            out = _grad_target(ctx, 1, weight, g2.dtype)
            if out is not None:
                gw = torch.matmul(g2.t(), x2, out=out)
            else:
                gw = g2.t().matmul(x2 if ctx.cast is None else x2.to(ctx.cast)).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            out = _grad_target(ctx, 2, bias, g2.dtype)
            gb = torch.sum(g2, 0, out=out) if out is not None else g2.sum(0).to(bias.dtype)
        return gx, gw, gb, None


def _grad_target(ctx, i: int, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """Where the gradient of input `i` (a parameter), computed in `dtype`, may be computed: the coordinator's
    run of its gradient partition, when autograd will accumulate it into ``param.grad`` as it is. Not when the
    product is cast (autocast) or in another dtype than the parameter's, when backward records a graph
    (create_graph), when the parameter has hooks of its own (they could keep or replace the tensor), nor when
    ``torch.autograd.grad`` captures it instead of accumulating it (the caller would get memory the next
    backward overwrites). [Note: gradients computed in their partition] in grad_partitions.py."""
    if ctx.grad_out is None or ctx.cast is not None or dtype != param.dtype or torch.is_grad_enabled() or \
            param._backward_hooks:
        return None
    node = ctx.next_functions[i][0]
    try:  # raises for a leaf that autograd.grad captures
        if node is None or not torch._C._will_engine_execute_node(node):
            return None
    except RuntimeError:
        return None
    return ctx.grad_out(param)


@torch.compiler.disable  # [Note: compiled models]
def _linear_keeping_params(module: torch.nn.Linear, x: torch.Tensor, *, grad_out=None) -> torch.Tensor:
    return _LinearKeepingParams.apply(x, module.weight, module.bias, grad_out)


class _InstanceForward:
    """Handle that takes back an instance-level forward set by the coordinator."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def remove(self) -> None:
        self.module.__dict__.pop("forward", None)
