"""Each correction tests/conftest.py makes to Triton's interpreter, proven against torch.

Under TRITON_INTERPRET=1 these tests check the patched interpreter; with OPENMLA_NO_INTERP_FIX=1
as well (the interpreter as shipped) every test here fails except the four marked "guard", which
hold as shipped and pin behaviour the corrections (and the speed-ups) must keep. On a GPU (TRITON_INTERPRET unset)
the same tests check the real compiler against the same oracles: that is what makes them the
reference for what the interpreter must compute.

Oracles are torch's CPU conversions. fp8 destinations are clamped to +-max first because sm_90
converts with cvt.rn.satfinite (|x| > max -> max, NaN stays NaN), which older torch does not.
"""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import libdevice as cuda_libdevice

from openmla.quant import int8 as _int8
from openmla.quant import mla_writer as _mla_writer
from tests.helpers import DEVICE, INTERPRET, assert_close

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SATFINITE = {E4M3: 448.0, E5M2: 57344.0}
_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@triton.jit
def _cast_kernel(x_ptr, y_ptr, n, RTZ: tl.constexpr, BLOCK: tl.constexpr):
    o_x = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m_x = o_x < n
    b_x = tl.load(x_ptr + o_x, mask=m_x)
    if RTZ:
        b_y = b_x.to(y_ptr.dtype.element_ty, fp_downcast_rounding="rtz")
    else:
        b_y = b_x.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + o_x, b_y, mask=m_x)


@triton.jit
def _dot_kernel(a_ptr, bt_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    # B comes K-major ([N, K] in memory), the layout Hopper's fp8 wgmma wants for its B operand.
    o_m, o_n, o_k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    b_a = tl.load(a_ptr + o_m[:, None] * K + o_k[None, :])
    b_b = tl.load(bt_ptr + o_n[None, :] * K + o_k[:, None])
    tl.store(c_ptr + o_m[:, None] * N + o_n[None, :], tl.dot(b_a, b_b))


@triton.jit
def _bf16_math_kernel(a_ptr, b_ptr, c_ptr, y_ptr, cmp_ptr, red_ptr, N: tl.constexpr, R: tl.constexpr):
    # y rows: a+b, a-b, a*b, -a, fma(a,b,c), a+1.5 ; cmp rows: a<b, a==b ; red: cumsum, sum of c[:R]
    o = tl.arange(0, N)
    b_a, b_b, b_c = tl.load(a_ptr + o), tl.load(b_ptr + o), tl.load(c_ptr + o)
    tl.store(y_ptr + o, b_a + b_b)
    tl.store(y_ptr + N + o, b_a - b_b)
    tl.store(y_ptr + 2 * N + o, b_a * b_b)
    tl.store(y_ptr + 3 * N + o, -b_a)
    tl.store(y_ptr + 4 * N + o, tl.fma(b_a, b_b, b_c))
    tl.store(y_ptr + 5 * N + o, b_a + 1.5)
    tl.store(cmp_ptr + o, (b_a < b_b).to(tl.int8))
    tl.store(cmp_ptr + N + o, (b_a == b_b).to(tl.int8))
    o_r = tl.arange(0, R)
    b_r = tl.load(c_ptr + o_r)
    tl.store(red_ptr + o_r, tl.cumsum(b_r, 0))
    tl.store(red_ptr + R + o_r, tl.zeros([R], tl.bfloat16) + tl.sum(b_r, 0))


@triton.jit
def _libdevice_kernel(x_ptr, z_ptr, y_ptr, n, OP: tl.constexpr, BLOCK: tl.constexpr):
    o_x = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m_x = o_x < n
    x = tl.load(x_ptr + o_x, mask=m_x, other=1.0)
    z = tl.load(z_ptr + o_x, mask=m_x, other=1.0)
    if OP == "tanh":
        y = libdevice.tanh(x)
    elif OP == "tanh_cuda_module":
        y = cuda_libdevice.tanh(x)
    elif OP == "rint":
        y = libdevice.rint(x)
    elif OP == "round":
        y = libdevice.round(x)
    elif OP == "floor":
        y = libdevice.floor(x)
    elif OP == "ceil":
        y = libdevice.ceil(x)
    elif OP == "fabs":
        y = libdevice.abs(x)
    elif OP == "exp":
        y = libdevice.exp(x)
    elif OP == "exp2":
        y = libdevice.exp2(x)
    elif OP == "log":
        y = libdevice.log(tl.abs(x))
    elif OP == "log2":
        y = libdevice.log2(tl.abs(x))
    elif OP == "sqrt":
        y = libdevice.sqrt(tl.abs(x))
    elif OP == "rsqrt":
        y = libdevice.rsqrt(tl.abs(x))
    elif OP == "erf":
        y = libdevice.erf(x)
    elif OP == "pow":
        y = libdevice.pow(tl.abs(x), z)
    elif OP == "atan2":
        y = libdevice.atan2(x, z)
    elif OP == "fmod":
        y = libdevice.fmod(x, z)
    else:
        y = libdevice.copysign(x, z)
    tl.store(y_ptr + o_x, y, mask=m_x)


def _prune_reversed(configs, named_args, **kwargs):
    """Keeps every config but reverses them, so the run shows whose order the interpreter used."""
    _prune_reversed.calls.append(sorted(c.kwargs["BLOCK"] for c in configs))
    return configs[::-1]


_prune_reversed.calls = []


@triton.autotune(configs=[triton.Config({"BLOCK": 64}), triton.Config({"BLOCK": 128})], key=["n"],
                 prune_configs_by={"early_config_prune": _prune_reversed})
@triton.jit
def _autotuned_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    o_x = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m_x = o_x < n
    tl.store(y_ptr + o_x, tl.load(x_ptr + o_x, mask=m_x) * 2.0 + 1.0, mask=m_x)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _cast(x: torch.Tensor, dtype: torch.dtype, rtz: bool = False) -> torch.Tensor:
    x = x.to(DEVICE)
    y = torch.empty(x.shape, dtype=dtype, device=DEVICE)
    block = 1024
    _cast_kernel[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), RTZ=rtz, BLOCK=block)
    return y.cpu()


def _assert_same_bits(name: str, got: torch.Tensor, want: torch.Tensor, x: torch.Tensor | None = None):
    """Bit-exact equality (signed zeros included); NaNs only have to be NaN in the same places."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape)
    gf, wf = got.float(), want.float()
    gi, wi = got.view(_INT_OF[got.element_size()]), want.view(_INT_OF[want.element_size()])
    bad = (gf.isnan() != wf.isnan()) | (~wf.isnan() & (gi != wi))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        src = f" from {x.flatten()[i].item()!r}" if x is not None else ""
        mask = (1 << 8 * got.element_size()) - 1
        raise AssertionError(f"{name}: {int(bad.sum())}/{bad.numel()} differ; first at {i}{src}: got "
                             f"{gf[i].item()!r} ({int(gi[i]) & mask:#x}), want {wf[i].item()!r} "
                             f"({int(wi[i]) & mask:#x})")


def _fp32(bits) -> torch.Tensor:
    return torch.as_tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _all_finite_positive(dtype: torch.dtype) -> torch.Tensor:
    """Every finite positive value of a 1- or 2-byte float format, ascending, as fp32."""
    size = torch.finfo(dtype).bits // 8
    half = torch.arange(1, 2 ** (8 * size - 1), dtype=torch.int32).to(_INT_OF[size]).view(dtype).float()
    return half[torch.isfinite(half)]


def _rounding_inputs(dtype: torch.dtype, n_random: int = 2048) -> torch.Tensor:
    """fp32 inputs that exercise rounding into `dtype`: every midpoint between neighbours (exact ties,
    including the ones whose rounding carries into the exponent), one fp32 ulp either side of them,
    random values over the whole range, beyond it, subnormals, +-inf and NaN. Never zero."""
    vals = _all_finite_positive(dtype)
    mids = (vals[:-1].double() + vals[1:].double()).div(2).float()  # exact in fp32
    near = torch.cat([torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(1e30))])
    top = torch.finfo(dtype).max
    spread = torch.randn(n_random) * torch.pow(2.0, torch.randint(-26, 18, (n_random,)).float())
    special = torch.tensor([top * 1.03125, top * 2, 1e6, 3e38, float("inf"), float("nan"),
                            float(vals[0]) / 2, float(vals[0]) * 1.5, float(vals[0]) / 3])
    x = torch.cat([mids, near, vals, spread, special])
    x = torch.cat([x, -x])
    return x[x != 0]


# ---------------------------------------------------------------------------------------------
# conversions
# ---------------------------------------------------------------------------------------------
def test_fp32_to_bf16_rounds_to_nearest_even():
    # Random fp32 bit patterns whose low 16 bits are an exact tie (0x8000) or one off it, over all
    # exponents (subnormals included), plus specials. Shipped: truncation.
    hi = torch.randint(0, 0x10000, (4096,))
    hi = hi[(hi & 0x7F80) != 0x7F80]  # keep inf/NaN exponents for the specials
    lo = torch.tensor([0x8000, 0x7FFF, 0x8001, 0x1234])[torch.randint(0, 4, hi.shape)]
    x = torch.cat([_fp32((hi << 16) | lo), torch.randn(4096) * 100,
                   torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.3961e38, 3.4e38,
                                 float("inf"), -float("inf"), float("nan")])])
    y = _cast(x, torch.bfloat16)
    _assert_same_bits("fp32->bf16", y, x.to(torch.bfloat16), x)
    assert y[-8:-5].float().tolist() == [1.0, 1 + 4 * 2**-8, -1.0]  # ties go to even


@pytest.mark.parametrize("dst", [pytest.param(E4M3, id="e4m3"), pytest.param(E5M2, id="e5m2")])
@pytest.mark.parametrize("src", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16"),
                                 pytest.param(torch.float16, id="fp16")])
def test_to_fp8_rounds_to_nearest_even_and_saturates(src, dst):
    # Shipped: the carry into the exponent is lost, ties go away from zero, overflow gives NaN/inf.
    x = _rounding_inputs(dst).to(src)
    y = _cast(x, dst)
    lim = SATFINITE[dst]
    _assert_same_bits(f"{src}->{dst}", y, x.float().clamp(-lim, lim).to(dst), x)
    if dst == E4M3:
        probe = torch.tensor([464.0, -1e6, 1000.0, 15.5, 17.0, 2**-10, 3 * 2**-10, float("nan")], dtype=src)
        got = _cast(probe, dst).float()
        assert got[:-1].tolist() == [448.0, -448.0, 448.0, 16.0, 16.0, 0.0, 2**-8], got
        assert got[-1].isnan()


@pytest.mark.parametrize("fmt", [pytest.param(E4M3, id="e4m3"), pytest.param(E5M2, id="e5m2")])
@pytest.mark.parametrize("dst", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
                                 pytest.param(torch.bfloat16, id="bf16")])
def test_fp8_decodes_every_byte(fmt, dst):
    # Shipped: e4m3 0x7f/0xff decode to +-480, e5m2 inf/NaN to finite values, e5m2 subnormals to 0.
    x = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt)
    y = _cast(x, dst)
    want = x.to(dst)
    if not INTERPRET and fmt == E5M2 and dst == torch.bfloat16:
        # Measured on the H200 (Triton 3.6, sm_90): the compiled e5m2 -> bf16 conversion decodes the
        # 8 inf/NaN bytes as finite (0x7c -> 65536), unlike torch. No openmla kernel reads e5m2; the
        # interpreter follows torch. Pin the compiler's behaviour so a change shows up here.
        special = x.float().isinf() | x.float().isnan()
        assert int(special.sum()) == 8 and not y.cpu()[special].isinf().any()
        y, want, x = y[~special.to(y.device)], want[~special], x[~special]
    _assert_same_bits(f"{fmt}->{dst}", y, want, x.view(torch.uint8))
    if fmt == E4M3:
        assert y[0x7F].isnan() and y[0xFF].isnan()


@pytest.mark.parametrize("src", [pytest.param(torch.bfloat16, id="bf16"),
                                 pytest.param(torch.float16, id="fp16-guard")])
def test_16bit_to_fp32_is_exact_for_every_pattern(src):
    # Shipped: bf16 subnormals become 0. (fp16 -> fp32 is right as shipped: a guard.)
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(src)
    _assert_same_bits(f"{src}->fp32", _cast(x, torch.float32), x.float(), x)


def test_fp32_to_fp16_rounds_to_nearest_even_guard():
    # Right as shipped (numpy does it): a guard that the torch routing keeps RNE, overflow to inf
    # from the midpoint 65520 on, subnormal ties.
    x = _rounding_inputs(torch.float16)
    _assert_same_bits("fp32->fp16", _cast(x, torch.float16), x.to(torch.float16), x)


def test_fp32_to_fp16_rounds_toward_zero():
    # fp_downcast_rounding="rtz". Oracle: the largest-magnitude fp16 not above |x| (inf stays inf).
    # Shipped: overflow gives NaN, subnormals go wrong.
    x = _rounding_inputs(torch.float16)
    vals = torch.cat([torch.zeros(1), _all_finite_positive(torch.float16)]).double()
    idx = torch.searchsorted(vals, x.abs().double(), right=True) - 1
    want = (vals[idx.clamp(max=len(vals) - 1)] * x.sign().double()).to(torch.float16)
    want = torch.where(x.isinf() | x.isnan(), x.to(torch.float16), want)
    _assert_same_bits("fp32->fp16 rtz", _cast(x, torch.float16, rtz=True), want, x)


def test_int32_to_bf16_rounds_to_nearest_even():
    # Shipped: the integer's low 16 bits are stored as the bf16 pattern. |i| < 2^24 keeps the
    # GPU's int->fp32->bf16 path single-rounded; 257 and 259 are ties (to 256 and 260).
    x = torch.cat([torch.randint(-2**24, 2**24, (4096,), dtype=torch.int32),
                   torch.tensor([257, 259, -257, 2**24 - 1, 1, -1], dtype=torch.int32)])
    x = x[x != 0]
    y = _cast(x, torch.bfloat16)
    _assert_same_bits("int32->bf16", y, x.to(torch.bfloat16), x)
    assert y[-6:-3].float().tolist() == [256.0, 260.0, -256.0]


# ---------------------------------------------------------------------------------------------
# bf16 arithmetic
# ---------------------------------------------------------------------------------------------
def test_bf16_elementwise_math_and_sums():
    # Shipped: +, -, *, neg, fma, compares, sum and cumsum work on the raw uint16 patterns.
    # |values| in [0.5, 4): every fp32 intermediate is exact, so the GPU's single bf16 rounding
    # and torch's (fp32, then RNE) agree bit for bit. Sums use small integers: every partial sum is
    # exact in bf16 whatever order the GPU adds in (32 terms of at most 7: below 256).
    n, r = 256, 32
    sign = lambda: torch.randint(0, 2, (n,)) * 2 - 1  # noqa: E731
    a = (sign() * (0.5 + 3.5 * torch.rand(n))).to(torch.bfloat16)
    b = (sign() * (0.5 + 3.5 * torch.rand(n))).to(torch.bfloat16)
    b[::7] = a[::7]  # some equal pairs for ==
    c = (sign() * torch.randint(1, 8, (n,))).to(torch.bfloat16)
    y = torch.empty(6 * n, dtype=torch.bfloat16, device=DEVICE)
    cmp = torch.empty(2 * n, dtype=torch.int8, device=DEVICE)
    red = torch.empty(2 * r, dtype=torch.bfloat16, device=DEVICE)
    _bf16_math_kernel[(1,)](a.to(DEVICE), b.to(DEVICE), c.to(DEVICE), y, cmp, red, N=n, R=r)
    y, cmp, red = y.cpu().view(6, n), cmp.cpu().view(2, n), red.cpu().view(2, r)
    fma = (a.float() * b.float() + c.float()).to(torch.bfloat16)  # exact in fp32, one rounding
    for name, got, want in [("a+b", y[0], a + b), ("a-b", y[1], a - b), ("a*b", y[2], a * b), ("-a", y[3], -a),
                            ("fma", y[4], fma), ("a+1.5", y[5], a + 1.5),
                            ("a<b", cmp[0], (a < b).to(torch.int8)), ("a==b", cmp[1], (a == b).to(torch.int8)),
                            ("cumsum", red[0], c[:r].float().cumsum(0).to(torch.bfloat16)),
                            ("sum", red[1], c[:r].float().sum().expand(r).to(torch.bfloat16))]:
        _assert_same_bits(f"bf16 {name}", got, want)


# ---------------------------------------------------------------------------------------------
# dot
# ---------------------------------------------------------------------------------------------
def _fp8_lattice(fmt: torch.dtype, shape) -> torch.Tensor:
    """Random nonzero fp8 values on a coarse grid: every product and partial sum of a K=32 dot is
    exact in fp32 and within the 14 bits Hopper's fp8 accumulator keeps, so any fp32-accumulating
    dot must agree bit for bit."""
    if fmt == E4M3:  # +-k/8, k = 1..15
        v = torch.randint(1, 16, shape).float() / 8
    else:  # +-{1, 1.25, 1.5, 1.75} * 2^{-2..1}
        v = torch.randint(4, 8, shape).float() / 4 * torch.pow(2.0, torch.randint(-2, 2, shape).float())
    return (v * (torch.randint(0, 2, shape) * 2 - 1)).to(fmt)


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    (m, k), n = a.shape, b.shape[1]
    c = torch.empty(m, n, dtype=torch.float32, device=DEVICE)
    _dot_kernel[(1,)](a.to(DEVICE), b.t().contiguous().to(DEVICE), c, M=m, N=n, K=k)
    return c.cpu()


def test_dot_bf16_accumulates_in_fp32():
    # Shipped: the uint16 patterns are multiplied as integers.
    a = torch.randn(64, 32).to(torch.bfloat16)
    b = torch.randn(32, 32).to(torch.bfloat16)
    assert_close("dot bf16", _dot(a, b), a.float() @ b.float(), "fp32")


@pytest.mark.parametrize("fmt", [pytest.param(E4M3, id="e4m3-nan-rows"), pytest.param(E5M2, id="e5m2-subnormal-row")])
def test_dot_fp8_upcasts_exactly(fmt):
    # Shipped: operands go through the broken fp8 decoder (0x7f -> 480, e5m2 subnormals -> 0).
    a, b = _fp8_lattice(fmt, (64, 32)), _fp8_lattice(fmt, (32, 32))
    a8 = a.view(torch.uint8)
    if fmt == E4M3:
        a8[3, 5], a8[7, 30] = 0x7F, 0xFF  # NaN -> the whole output row is NaN
    else:
        a8[5] = torch.randint(1, 4, (32,), dtype=torch.uint8) | (torch.randint(0, 2, (32,), dtype=torch.uint8) << 7)
        a8[9, 2] = 0x7F  # e5m2 NaN
    want = a.float() @ b.float()
    assert_close(f"dot {fmt}", _dot(a, b), want, "exact")
    if fmt == E4M3:
        assert want[3].isnan().all() and want[7].isnan().all()
    else:
        assert (want[5] != 0).any() and (want[5].abs() < 2**-7).all()  # tiny, not flushed


# ---------------------------------------------------------------------------------------------
# libdevice
# ---------------------------------------------------------------------------------------------
_TIES = [0.5, 1.5, 2.5, 3.5, 2.0**22 + 0.5, 2.0**22 + 1.5, 0.49999997]  # and their negatives


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    xd = x.double()
    return (xd.sign() * (xd.abs() + 0.5).floor()).float()


LIBDEVICE_CASES = [  # op, torch oracle (fp32 in, fp32 out), tolerance
    pytest.param("tanh", torch.tanh, "fp32", id="tanh"),
    pytest.param("tanh_cuda_module", torch.tanh, "fp32", id="tanh-cuda-module"),
    pytest.param("rint", torch.round, "exact", id="rint"),  # torch.round is half-to-even
    pytest.param("round", _round_half_away, "exact", id="round"),
    pytest.param("floor", torch.floor, "exact", id="floor"),
    pytest.param("ceil", torch.ceil, "exact", id="ceil"),
    pytest.param("fabs", torch.abs, "exact", id="fabs"),
    pytest.param("exp", torch.exp, "fp32", id="exp"),
    pytest.param("exp2", torch.exp2, "fp32", id="exp2"),
    pytest.param("log", lambda x: torch.log(x.abs()), "fp32", id="log"),
    pytest.param("log2", lambda x: torch.log2(x.abs()), "fp32", id="log2"),
    pytest.param("sqrt", lambda x: torch.sqrt(x.abs()), "fp32", id="sqrt"),
    pytest.param("rsqrt", lambda x: torch.rsqrt(x.abs()), "fp32", id="rsqrt"),
    pytest.param("erf", torch.erf, "fp32", id="erf"),
]
LIBDEVICE_BINARY_CASES = [
    pytest.param("pow", lambda x, z: torch.pow(x.abs(), z), "fp32", id="pow"),
    pytest.param("atan2", torch.atan2, "fp32", id="atan2"),
    pytest.param("fmod", torch.fmod, "exact", id="fmod"),
    pytest.param("copysign", torch.copysign, "exact", id="copysign"),
]


def _libdevice(op: str, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x, device=DEVICE)
    block = 256
    _libdevice_kernel[(triton.cdiv(x.numel(), block),)](x.to(DEVICE), z.to(DEVICE), y, x.numel(), OP=op,
                                                         BLOCK=block)
    return y.cpu()


@pytest.mark.parametrize("op, oracle, tol", LIBDEVICE_CASES)
def test_libdevice_unary_matches_torch(op, oracle, tol):
    # Shipped: the libdevice stubs return None / extern_elementwise raises NotImplementedError.
    x = torch.cat([torch.randn(500) * 4, torch.tensor(_TIES), torch.tensor([-_t for _t in _TIES])])
    x = x[x != 0]
    assert_close(f"libdevice.{op}", _libdevice(op, x, x), oracle(x), tol)


@pytest.mark.parametrize("op, oracle, tol", LIBDEVICE_BINARY_CASES)
def test_libdevice_binary_matches_torch(op, oracle, tol):
    x, z = torch.randn(500) * 4, torch.randn(500) * 2
    keep = (x != 0) & (z != 0)
    x, z = x[keep], z[keep]
    assert_close(f"libdevice.{op}", _libdevice(op, x, z), oracle(x, z), tol)


# ---------------------------------------------------------------------------------------------
# autotune
# ---------------------------------------------------------------------------------------------
def test_autotune_with_two_configs_runs_and_prunes():
    # Shipped: benchmarking the two configs asks for a GPU driver.
    _autotuned_kernel.cache.clear()
    _prune_reversed.calls.clear()
    n = 300
    x = torch.randn(n)
    y = torch.empty(n, device=DEVICE)
    _autotuned_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x.to(DEVICE), y, n)
    _assert_same_bits("autotuned x*2+1", y.cpu(), x * 2.0 + 1.0)
    assert _prune_reversed.calls == [[64, 128]]
    if INTERPRET:  # the interpreter takes the first config left by the prune function
        assert _autotuned_kernel.best_config.kwargs == {"BLOCK": 128}


# ---------------------------------------------------------------------------------------------
# speed-ups (tests/conftest.py, _install_interpreter_speedups): guards, right as shipped too
# ---------------------------------------------------------------------------------------------
def _nan_max_inputs():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, 64, generator=g) * 3
    x[1, 5] = float("nan")
    x[2, 0], x[2, 63] = float("inf"), float("-inf")
    x[3] = -x[3].abs()  # an all-negative row
    x[4] = 0.0
    x[4, ::2] = -0.0  # signed zeros: the fold order decides which one is kept
    x[5, :] = float("nan")
    x[:, 9] = float("nan")
    x[6, 9] = 1.0
    return x


def test_nan_max_reduce_is_the_elementwise_fold_guard():
    """quant's NaN-propagating tl.reduce combine (_max_nan), which conftest folds a slice at a
    time: the same bits as the interpreter's per-element fold (generic_reduce), on rows and
    columns, with NaN, +-inf, all-negative and signed-zero data; and it is torch.amax."""
    from openmla.quant import int8, mla_writer
    x = _nan_max_inputs()
    for combine in (int8._max_nan, mla_writer._max_nan):
        for axis, want in ((1, x.amax(1)), (0, x.amax(0))):
            got = _reduce_max(x, axis, combine)
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
            if INTERPRET:
                from triton.runtime import interpreter as interp
                t = tl.core.tensor(interp.TensorHandle(x.numpy(), tl.float32), tl.block_type(tl.float32, list(x.shape)))
                scope = interp._patch_lang(combine.fn)  # as a launch does
                try:
                    pairs = [(op.apply_impl((t,))[0], op.generic_reduce((t,))[0])
                             for op in (interp.ReduceOps(axis, combine, keep) for keep in (False, True))]
                finally:
                    scope.restore()
                for fast, slow in pairs:
                    assert fast.handle.data.dtype == slow.handle.data.dtype
                    assert fast.handle.data.tobytes() == slow.handle.data.tobytes(), axis


@triton.jit
def _reduce_max_kernel(x_ptr, y_ptr, WRITER: tl.constexpr, R: tl.constexpr, C: tl.constexpr,
                       AXIS: tl.constexpr):
    # the combine function named in the body (the compiler takes no function as a constexpr
    # argument): mla_writer's or int8's _max_nan
    o_r, o_c = tl.arange(0, R), tl.arange(0, C)
    b_x = tl.load(x_ptr + o_r[:, None] * C + o_c[None, :])
    if WRITER:
        b_y = tl.reduce(b_x, AXIS, _mla_writer._max_nan)
    else:
        b_y = tl.reduce(b_x, AXIS, _int8._max_nan)
    if AXIS == 1:
        tl.store(y_ptr + o_r, b_y)
    else:
        tl.store(y_ptr + o_c, b_y)


def _reduce_max(x, axis, combine):
    y = torch.empty(x.shape[1 - axis], device=DEVICE)
    assert combine in (_int8._max_nan, _mla_writer._max_nan)
    _reduce_max_kernel[(1,)](x.to(DEVICE), y, combine is _mla_writer._max_nan, x.shape[0], x.shape[1], axis)
    return y.cpu()


@triton.jit
def _int_math_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    b_x = tl.load(x_ptr + o)
    tl.store(y_ptr + o, (b_x * 3 + 7) - b_x)


def test_int32_arithmetic_wraps_without_an_overflow_check_guard():
    """Integer +, -, * past int32's range wrap (two's complement), as compiled code does without
    debug, with the interpreter's overflow check (an assert that is off unless debug is set, which
    the interpreter never sets) as shipped and with conftest skipping it."""
    x = torch.tensor([2 ** 30, -2 ** 31, 5, 2 ** 31 - 1, -7, 0, 123456789, -987654321], dtype=torch.int32)
    y_dev = torch.empty_like(x, device=DEVICE)
    _int_math_kernel[(1,)](x.to(DEVICE), y_dev, BLOCK=8)
    want = (x.long() * 3 + 7 - x.long() + 2 ** 31) % 2 ** 32 - 2 ** 31
    assert torch.equal(y_dev.cpu().long(), want)
