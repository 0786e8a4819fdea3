"""ue8m0 (float8_e8m0fnu) scale bytes inside Triton kernels: the DeepSeek-V4 cache's tile scales.

A ue8m0 byte is an unsigned biased exponent: byte e means 2^(e - 127); 0 is 2^-127 (an fp32
subnormal), 255 is NaN. Both directions are exact bit manipulation, equal to torch's casts for
the values the pow2 scale rule produces (powers of two, +inf, NaN)."""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["ue8m0_to_f32", "f32_pow2_to_ue8m0"]


@triton.jit
def ue8m0_to_f32(b):
    """b: uint8 (or wider integer) ue8m0 bytes -> fp32 2^(b - 127); 0 -> 2^-127, 255 -> NaN."""
    e = b.to(tl.uint32) & 0xFF
    bits = tl.where(e == 0, 0x400000, e << 23)  # 2^-127 has no exponent field: mantissa bit 22
    y = bits.to(tl.float32, bitcast=True)
    return tl.where(e == 255, float("nan"), y)


@triton.jit
def f32_pow2_to_ue8m0(s):
    """s: fp32 powers of two >= 2^-126 (or +inf / NaN, of either sign) -> their ue8m0 bytes:
    the biased exponent field; +inf and NaN give 255 (NaN), as torch's cast does."""
    return ((s.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.uint8)
