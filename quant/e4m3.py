"""float8 e4m3fn conversions inside Triton kernels, one way per GPU generation.

`kernels.device.Arch.e4m3` picks the MODE for a device (the kernels take it as a constexpr):
  - E4M3_PTX (NVIDIA sm_89+): `cvt.rn.f16x2.e4m3x2`, two bytes an instruction;
  - E4M3_CAST (AMD, the interpreter): Triton's float8e4nv type;
  - E4M3_BITS (NVIDIA before sm_89): Triton 3.6 has no float8e4nv type there (not even for a
    pointer), so caches travel as uint8 and the conversions are integer arithmetic.
Every mode gives the same bits: decoding is exact (every e4m3fn value is an fp16 value, NaN stays
NaN), encoding rounds to nearest even and saturates to +-448 (PTX `cvt.rn.satfinite`), NaN
stays NaN. tests/quant/test_e4m3.py checks the BITS mode against torch's casts in the interpreter.
"""
from __future__ import annotations

import triton
import triton.language as tl

from openmla.kernels.device import E4M3_BITS, E4M3_CAST, E4M3_PTX

__all__ = ["E4M3_BITS", "E4M3_CAST", "E4M3_PTX", "e4m3_to_f16", "e4m3_to_f32", "f32_to_e4m3"]

_PTX = tl.constexpr(E4M3_PTX)  # what a @triton.jit function may read of module globals
_BITS = tl.constexpr(E4M3_BITS)


@triton.jit
def e4m3_to_f16(b, MODE: tl.constexpr):
    """b: uint8 tensor of e4m3fn bytes -> the same values in fp16, exactly.

    PTX: the asm is not an arith op, so Triton keeps a later layout change (to a dot operand) on
    the 16-bit result (ldmatrix) instead of moving it onto the bytes. BITS: the 7 magnitude bits
    shifted into place are an fp16 with the exponent bias 15 instead of 7; one exact multiply by
    2^8 rebiases normals and subnormals alike (e4m3 subnormals are fp16 normals)."""
    if MODE == _PTX:
        y = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [b], dtype=tl.float16, is_pure=False, pack=4)
    elif MODE == _BITS:
        u = b.to(tl.uint16)
        mag = ((u & 0x7F) << 7).to(tl.float16, bitcast=True) * 256.0
        y = (mag.to(tl.uint16, bitcast=True) | ((u & 0x80) << 8)).to(tl.float16, bitcast=True)
        y = tl.where((u & 0x7F) == 0x7F, float("nan"), y)  # S.1111.111: e4m3fn's only NaN
    else:
        y = b.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return y


@triton.jit
def e4m3_to_f32(b, MODE: tl.constexpr):
    """b: uint8 tensor of e4m3fn bytes -> fp32, exactly (for code that feeds no dot)."""
    if MODE == _BITS:
        y = e4m3_to_f16(b, MODE).to(tl.float32)
    else:
        y = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return y


@triton.jit
def f32_to_e4m3(x, MODE: tl.constexpr):
    """x: fp32 tensor -> uint8 e4m3fn bytes: round to nearest even, |x| > 448 saturates to 448,
    NaN stays NaN (0x7F with x's sign, as torch's cast writes it).

    BITS is torch's own conversion (c10 fp8e4m3fn_from_fp32_value) on the saturated magnitude:
    below 2^-6 an fp32 add of 2^14 rounds to the 2^-9 subnormal step; above, the mantissa is
    rounded at bit 20 with the even-rounding bias and the exponent rebased from 127 to 7."""
    if MODE == _BITS:
        u = x.to(tl.uint32, bitcast=True)
        a = u & 0x7FFFFFFF
        m_nan = a > 0x7F800000
        a = tl.minimum(a, 0x43E00000)  # 448.0; for non-negative floats the bits order as values
        r_sub = (a.to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True) - (141 << 23)
        r_norm = (a - (120 << 23) + 0x7FFFF + ((a >> 20) & 1)) >> 20
        r = tl.where(a < (121 << 23), r_sub, r_norm)
        r = tl.where(m_nan, 0x7F, r) | ((u >> 24) & 0x80)
        y = r.to(tl.uint8)
    else:
        y = x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return y
