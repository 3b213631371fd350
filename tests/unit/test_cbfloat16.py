"""``csframework.backends.csx.cbfloat16``: the CB16 (cbfloat16) numeric emulation."""

import importlib.util
import math
import pathlib

import pytest
import torch

try:
    from csframework.backends.csx import cbfloat16 as cb
except Exception:  # package half-written elsewhere: load the module by path
    _path = pathlib.Path(__file__).resolve().parents[2] / "csframework/backends/csx/cbfloat16.py"
    _spec = importlib.util.spec_from_file_location("_cbfloat16_under_test", _path)
    cb = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(cb)

round_to_cbfloat16 = cb.round_to_cbfloat16

# Independent description of the format (bias 31, IEEE-like, gradual underflow).
EMIN, EMAX, MBITS = -30, 31, 9
REF_MAX = (2 - 2.0**-MBITS) * 2.0**EMAX
REF_SUB = 2.0 ** (EMIN - MBITS)


def ref_round(v: float) -> float:
    """Reference CB16 rounding with Python floats (exact for float32/float64 input)."""
    if math.isnan(v) or math.isinf(v) or v == 0.0:
        return v
    _, e = math.frexp(abs(v))  # |v| = m * 2**e, m in [0.5, 1)
    qexp = max(e - 1, EMIN) - MBITS  # exponent of one ulp at |v|
    r = round(math.ldexp(abs(v), -qexp)) * 2.0**qexp  # round(): ties to even
    r = math.inf if r > REF_MAX else r
    return math.copysign(r, v)


def rt(v, dtype=torch.float32):
    return round_to_cbfloat16(torch.tensor(v, dtype=dtype)).item()


def test_constants():
    assert (cb.EXPONENT_BITS, cb.MANTISSA_BITS, cb.BIAS) == (6, 9, 31)
    assert cb.MAX == REF_MAX == 2.0**32 - 2.0**22 == 4290772992.0
    assert cb.TINY == 2.0**-30 and cb.SMALLEST_SUBNORMAL == REF_SUB and cb.EPS == 2.0**-9


def test_rounding_near_one():
    assert rt(1 + 2**-9) == 1 + 2**-9  # representable
    assert rt(1 + 2**-10) == 1.0  # tie -> even (down)
    assert rt(1 + 3 * 2**-10) == 1 + 2**-8  # tie -> even (up)
    assert rt(1 + 2**-10 + 2**-20) == 1 + 2**-9  # just above tie -> up
    assert rt(-(1 + 2**-10)) == -1.0
    assert rt(2 - 2**-11) == 2.0  # carry into the exponent


def _random_values(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    exps = torch.randint(-45, 34, (n,), generator=g).to(torch.float64)
    mant = 1 + torch.rand(n, generator=g, dtype=torch.float64)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    vals = sign * mant * torch.pow(2.0, exps)
    # Exact ties: a random CB16 grid value plus half an ulp.
    ties = torch.randint(512, 1024, (n // 4,), generator=g).to(torch.float64) + 0.5
    ties = ties * torch.pow(2.0, torch.randint(-40, 22, (n // 4,), generator=g).to(torch.float64))
    return torch.cat([vals, ties, -ties]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_random_against_reference(dtype):
    x = _random_values(10_000, dtype)
    got = round_to_cbfloat16(x)
    assert got.dtype == torch.float32
    want = [ref_round(v) for v in x.tolist()]
    assert got.tolist() == want


def test_float64_no_double_rounding():
    # Just above a CB16 tie, but float32 would round it onto the tie itself.
    v = 1 + 2**-10 + 2**-40
    assert rt(v, torch.float64) == 1 + 2**-9
    assert rt(v, torch.float32) == 1.0  # float32 input already sits on the tie


def test_large_values_stay_finite():
    y = rt(1e6)
    assert math.isfinite(y) and abs(y - 1e6) / 1e6 <= 2**-10
    y = rt(65504 * 4)  # 65504 needs 11 significant bits: rounds to 2**18 in CB16
    assert math.isfinite(y) and y == 2.0**18 and abs(y - 65504 * 4) / (65504 * 4) <= 2**-10
    assert math.isinf(torch.tensor(65504 * 4, dtype=torch.float16).item())  # float16 would
    assert math.isfinite(rt(1e9))


def test_overflow():
    half_ulp = 2.0 ** (EMAX - MBITS - 1)
    assert rt(REF_MAX) == REF_MAX
    assert rt(-REF_MAX) == -REF_MAX
    assert rt(REF_MAX * (1 + 2**-11)) == REF_MAX
    assert rt(REF_MAX + half_ulp - 256) == REF_MAX  # just below the tie
    assert rt(REF_MAX + half_ulp) == math.inf  # tie rounds to even -> inf
    assert rt(REF_MAX + half_ulp + 256) == math.inf
    assert rt(-(REF_MAX + half_ulp)) == -math.inf
    assert rt(3e38) == math.inf and rt(math.inf) == math.inf and rt(-math.inf) == -math.inf


def test_underflow_and_signed_zero():
    assert rt(REF_SUB) == REF_SUB
    assert rt(-REF_SUB) == -REF_SUB
    assert rt(3 * REF_SUB) == 3 * REF_SUB
    assert rt(2.0**-30) == 2.0**-30 and rt(2.0**-30 - REF_SUB) == 2.0**-30 - REF_SUB
    assert rt(2.0**-30 - REF_SUB / 2) == 2.0**-30  # tie at the normal boundary -> even
    assert rt(1.5 * REF_SUB) == 2 * REF_SUB  # tie -> even (up)
    assert rt(1.25 * REF_SUB) == REF_SUB
    for v in (REF_SUB / 2, -REF_SUB / 2, 1e-40, -1e-40, 0.0, -0.0):  # half of it -> 0
        y = rt(v)
        assert y == 0.0 and math.copysign(1.0, y) == math.copysign(1.0, v)
    assert rt(REF_SUB / 2 * (1 + 2**-20)) == REF_SUB


def test_nan_dtype_shape():
    assert math.isnan(rt(math.nan))
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        x = torch.randn(3, 4, 5).to(dtype)
        y = round_to_cbfloat16(x)
        assert y.dtype == torch.float32 and y.shape == x.shape
        assert y.tolist() == [[[ref_round(v) for v in r] for r in m] for m in x.float().tolist()]
    z = round_to_cbfloat16(torch.tensor(1 + 2**-10))
    assert z.dim() == 0 and z.item() == 1.0
    assert round_to_cbfloat16(torch.empty(0, 3)).shape == (0, 3)
    with pytest.raises(TypeError):
        round_to_cbfloat16(torch.arange(3))


def test_make_fx_matches_eager():
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(round_to_cbfloat16)(torch.randn(8))
    x = torch.tensor([1 + 2**-10, -(REF_MAX + 2**21), 1e6, REF_SUB / 2, -0.0, math.nan, 3e-12, 7.5])
    eager, traced = round_to_cbfloat16(x), gm(x)
    assert torch.equal(eager.view(torch.int32), traced.view(torch.int32))
    r = torch.randn(8) * 1e4
    assert torch.equal(gm(r), round_to_cbfloat16(r))


def test_straight_through_gradient():
    x = torch.tensor([1 + 2**-10, 3.3, -1e6, 0.0], requires_grad=True)
    y = cb.cbfloat16_ste(x)
    assert y.tolist() == [ref_round(v) for v in x.tolist()]
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones(4))
    xd = torch.randn(5, dtype=torch.float64, requires_grad=True)
    (cb.cbfloat16_ste(xd) * 2).sum().backward()
    assert xd.grad.dtype == torch.float64 and torch.equal(xd.grad, torch.full((5,), 2.0, dtype=torch.float64))
