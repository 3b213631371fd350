"""Numeric emulation of Cerebras' CB16 half-precision format ("cbfloat16").

Format: 1 sign bit, 6 exponent bits, 9 fraction bits (10 significant bits with
the implicit leading one), laid out IEEE-754 style.

Encoding choices (IEEE-like; the exact hardware encoding is an assumption of
this emulation, chosen so CB16 behaves like a "float16 with a wider exponent"):

* ``BIAS = 31`` (= 2**(6-1) - 1), the IEEE convention, giving a range that is
  symmetric around 1.0. Exponent field 63 is reserved for inf/NaN and field 0
  for zero/subnormals, so normal unbiased exponents span [-30, 31].
* Range: largest finite ``MAX = (2 - 2**-9) * 2**31 ~= 4.29e9``; smallest
  normal ``TINY = 2**-30 ~= 9.3e-10``; smallest subnormal
  ``SMALLEST_SUBNORMAL = 2**-39 ~= 1.8e-12``; ``EPS = 2**-9``. The 6-bit
  exponent makes the range far wider than IEEE float16 (max 65504): values
  such as 1e6 or 1e9 stay finite in CB16 where float16 overflows.
* Rounding: round to nearest, ties to even, applied once (correctly rounded).
* Underflow: gradual, with subnormals (IEEE-like); magnitudes at or below
  ``SMALLEST_SUBNORMAL / 2`` round to (signed) zero.
* Overflow: like IEEE, magnitudes ``>= MAX + ulp(MAX)/2`` (= 2**32 - 2**21)
  round to +/-inf; anything smaller rounds to a finite value (at most MAX).
* NaN stays NaN, +/-inf stay +/-inf, the sign of zero is preserved.

All CB16 values are exactly representable in float32 (including subnormals,
which are float32 normals), so results are returned as float32 tensors. The
rounding is done with integer operations on the float32 bit pattern, uses no
data-dependent Python control flow, and is traceable by ``torch.fx``
``make_fx``. float64 input is first narrowed to float32 with round-to-odd, so
the final result is correctly rounded from the float64 value (no double
rounding).
"""

import torch

__all__ = [
    "EXPONENT_BITS", "MANTISSA_BITS", "BIAS", "MAX", "TINY", "SMALLEST_SUBNORMAL",
    "EPS", "round_to_cbfloat16", "CBFloat16Round", "cbfloat16_ste",
]

EXPONENT_BITS = 6
MANTISSA_BITS = 9
BIAS = 2 ** (EXPONENT_BITS - 1) - 1  # 31
_EMAX = (2 ** EXPONENT_BITS - 2) - BIAS  # 31: field 63 is reserved for inf/NaN
_EMIN = 1 - BIAS  # -30
MAX = (2.0 - 2.0 ** -MANTISSA_BITS) * 2.0 ** _EMAX
TINY = 2.0 ** _EMIN
SMALLEST_SUBNORMAL = 2.0 ** (_EMIN - MANTISSA_BITS)
EPS = 2.0 ** -MANTISSA_BITS

_F32_MANT = 23
_SHIFT = _F32_MANT - MANTISSA_BITS  # 14 low float32 fraction bits are dropped
_INF_BITS = 0x7F800000
_MAX_BITS = (_EMAX + 127) << _F32_MANT | ((1 << MANTISSA_BITS) - 1) << _SHIFT
_TINY_BITS = (_EMIN + 127) << _F32_MANT


def _f64_to_f32_round_odd(x: torch.Tensor) -> torch.Tensor:
    """Narrow float64 to float32 rounding to odd (truncate, set sticky LSB).

    Round-to-odd to 24 bits followed by round-to-nearest-even to 10 bits is
    equivalent to a single rounding, avoiding double-rounding errors.
    """
    y = x.to(torch.float32)
    bits = y.view(torch.int32)
    inexact = (y.to(torch.float64) != x) & ~torch.isnan(x)
    toward_zero = torch.where(y.abs().to(torch.float64) > x.abs(), bits - 1, bits)
    return torch.where(inexact, toward_zero | 1, bits).view(torch.float32)


def round_to_cbfloat16(x: torch.Tensor) -> torch.Tensor:
    """Round ``x`` to the nearest CB16 value (ties to even), as float32.

    Accepts float32/float64/float16/bfloat16 tensors of any shape (including
    0-dim) and returns a float32 tensor of the same shape whose values are
    exactly representable in CB16. Not differentiable (the result carries no
    gradient); use :func:`cbfloat16_ste` for a straight-through estimator.
    """
    if not x.is_floating_point():
        raise TypeError(f"round_to_cbfloat16 expects a floating tensor, got {x.dtype}")
    x = x.detach()
    if x.dtype == torch.float64:
        x = _f64_to_f32_round_odd(x)
    else:
        x = x.to(torch.float32)
    bits = x.view(torch.int32)
    sign = bits & ~0x7FFFFFFF  # 0x80000000 as int32
    mag = torch.clamp(bits & 0x7FFFFFFF, max=_INF_BITS)  # NaN -> inf (restored later)

    # Normal range: RNE on the bit pattern; a mantissa carry correctly bumps the
    # exponent, and anything rounding past MAX lands on >= 2**32 -> inf.
    half = (1 << (_SHIFT - 1)) - 1
    rnd = (mag + half + ((mag >> _SHIFT) & 1)) & ~((1 << _SHIFT) - 1)
    normal = torch.where(rnd > _MAX_BITS, torch.full_like(rnd, _INF_BITS), rnd)

    # Subnormal range (|x| < TINY): RNE of the 24-bit significand to a multiple
    # of SMALLEST_SUBNORMAL; q is an integer in [0, 2**9] so the rescale is exact.
    exp = mag >> _F32_MANT
    sig = (mag & ((1 << _F32_MANT) - 1)) | (1 << _F32_MANT)
    shift = torch.clamp(_SHIFT + (_EMIN + 127) - exp, min=_SHIFT, max=_F32_MANT + 2)
    one = torch.ones_like(shift)
    q = (sig + (one << (shift - 1)) - 1 + ((sig >> shift) & 1)) >> shift
    sub = (q.to(torch.float32) * SMALLEST_SUBNORMAL).view(torch.int32)

    out = (torch.where(mag < _TINY_BITS, sub, normal) | sign).view(torch.float32)
    return torch.where(torch.isnan(x), x, out)


class CBFloat16Round(torch.autograd.Function):
    """Straight-through CB16 rounding: forward rounds, backward is identity."""

    @staticmethod
    def forward(ctx, x):
        ctx.in_dtype = x.dtype
        return round_to_cbfloat16(x)

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out.to(ctx.in_dtype)


def cbfloat16_ste(x: torch.Tensor) -> torch.Tensor:
    """Round to CB16 in the forward pass; pass the gradient through unchanged."""
    return CBFloat16Round.apply(x)
