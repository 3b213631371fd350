"""Precision on CSX: ``GraphPrecision`` (autocast and loss scaling inside the traced step,
``csframework.graph.precision``) plus Cerebras' own half precision, ``cbfloat16``: every matrix product,
convolution and attention (the operations the wafer runs in half precision) takes CB16-rounded inputs and gives
a CB16-rounded result; in the backward pass the gradient flowing through the same boundary is CB16-rounded too.
Master weights and optimizer state stay float32.
"""
from __future__ import annotations

from contextlib import AbstractContextManager

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ...graph.compiler import numerics_key
from ...graph.precision import GraphPrecision
from . import cbfloat16
from .cbfloat16 import round_to_cbfloat16


class _CB16Compute(torch.autograd.Function):
    """CB16 rounding at a compute boundary: the value forward, the gradient backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.dtype = x.dtype
        return round_to_cbfloat16(x).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return round_to_cbfloat16(grad).to(ctx.dtype)


def cb16(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return _CB16Compute.apply(x)
    if isinstance(x, (list, tuple)):
        return type(x)(cb16(v) for v in x)
    return x


_CB16_OPS = {F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
             torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.addmm, torch.Tensor.addmm,
             torch.baddbmm, torch.Tensor.baddbmm, torch.einsum, F.conv1d, F.conv2d, F.conv3d,
             F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d, F.scaled_dot_product_attention,
             F.bilinear}


class CB16ComputeMode(TorchFunctionMode):
    """Rounds the inputs and outputs of the half-precision compute operations to CB16."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _CB16_OPS:
            args = tuple(cb16(a) for a in args)
            kwargs = {k: cb16(v) for k, v in kwargs.items()}
            return cb16(func(*args, **kwargs))
        return func(*args, **kwargs)


class CsxPrecision(GraphPrecision):
    """The precision policy of a CSX run: ``GraphPrecision``'s, with cbfloat16 compute."""

    def autocast(self) -> AbstractContextManager:
        """The context the forward pass is traced in."""
        if self.name == "cbfloat16":
            return CB16ComputeMode()
        return super().autocast()


def csx_numerics_key(precision) -> dict:
    """``numerics_key`` of a CSX graph: the precision config and the cbfloat16 emulation's format."""
    return numerics_key(precision, {"cbfloat16": [cbfloat16.EXPONENT_BITS, cbfloat16.MANTISSA_BITS,
                                                  cbfloat16.BIAS]})
