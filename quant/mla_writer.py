"""Triton MLA cache writer: new tokens' latent and rope into a paged fp8_ds_mla or bf16 cache.

The bytes it writes equal `fmt.pack(kv_c, k_pe)` (quant/mla_formats.py, the byte-level truth)
exactly, for both fp8 scale rules. How the kernel stays byte-identical to pack and to FlashMLA's
reference quantizer:
  - amax is taken in fp32 over the tile (exact: widening bf16/fp16 is exact), NaN-propagating like
    torch's amax, so a NaN anywhere in a tile poisons that tile's scale as it does in pack;
  - amax / 448 and x / s are correctly rounded divisions (`div_rn`: Triton's `/` on fp32 lowers to
    the approximate `div.full.f32` on NVIDIA);
  - pow2: ceil(log2(.)) uses the fp32 log2 that torch uses on the same device: `libdevice.log2`
    is `__nv_log2f`, the accurate CUDA log2f that torch's CUDA log2 calls (not `lg2.approx`; in
    Triton 3.6 fp32 `tl.log2` happens to lower to the same call, which the name makes explicit).
    Under the interpreter tests/conftest.py maps it to a correctly rounded log2, which agrees with
    torch's CPU log2 in ceil around every power of two tested. The fp32 rounding of log2 just above
    2^k (log2(2^-13 * (1 + 2^-23)) == -13.0) is therefore reproduced, not "fixed": the scale stays
    2^-13 there and the largest element saturates to 448, as in FlashMLA's reference quantizer.
  - 2^e is built from its exponent bits, exact for every e the rule can produce (-13..127);
  - fp32 -> e4m3 is round-to-nearest-even, saturating (cvt.rn.satfinite), as torch's cast
    (quant/e4m3.py: the same bits by integer arithmetic on GPUs without float8e4nv).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from openmla.kernels.device import arch_of

from .e4m3 import f32_to_e4m3
from .validate import check_same_device, check_tensor, fail
from .mla_cache_format import check_mla_format
from .mla_formats import FP8_E4M3_MAX


@triton.jit
def _max_nan(a, b):
    # torch.amax propagates NaN; tl.max's default combine (max.f32) would drop it.
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def tile_scale(b_amax, POW2: tl.constexpr, FP8_MAX: tl.constexpr, SCALE_FLOOR: tl.constexpr):
    """fp32 tile abs-maxes -> the tiles' scales by the format's rule (module docstring): pow2
    2^ceil(log2(max(amax / 448, floor))), else max(amax / 448, floor). NaN stays NaN."""
    b_s = tl.math.div_rn(b_amax, FP8_MAX)
    if POW2:
        b_v = tl.maximum(b_s, SCALE_FLOOR, propagate_nan=tl.PropagateNan.ALL)
        b_e = tl.math.ceil(libdevice.log2(b_v))
        m_finite = b_v < float("inf")  # false for +inf and NaN: 2**inf = inf, 2**NaN = NaN
        b_e = tl.where(m_finite, b_e, 0.0).to(tl.int32)
        b_pow = ((b_e + 127) << 23).to(tl.float32, bitcast=True)  # e <= 127 (amax <= FLT_MAX)
        b_scale = tl.where(m_finite, b_pow, b_v)
    else:
        b_scale = tl.maximum(b_s, SCALE_FLOOR, propagate_nan=tl.PropagateNan.ALL)
    return b_scale


@triton.jit
def write_mla_cache_fp8_kernel(
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr,
    stride_kv_t, stride_pe_t, stride_cache_block, stride_cache_row,
    block_size, num_slots,
    NUM_TILES: tl.constexpr, TILE: tl.constexpr, ROPE: tl.constexpr,
    SCALE_OFFSET: tl.constexpr, ROPE_OFFSET: tl.constexpr,
    POW2: tl.constexpr, FP8_MAX: tl.constexpr, SCALE_FLOOR: tl.constexpr, E4M3: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + i_t).to(tl.int64)
    # Skipped (< 0) and out-of-range slots write nothing: never a wild write, even unchecked.
    m_slot = (slot >= 0) & (slot < num_slots)
    p_row = cache_ptr + (slot // block_size) * stride_cache_block + (slot % block_size) * stride_cache_row

    o_lat = tl.arange(0, NUM_TILES)[:, None] * TILE + tl.arange(0, TILE)[None, :]
    b_x = tl.load(kv_c_ptr + i_t * stride_kv_t + o_lat, mask=m_slot).to(tl.float32)
    b_scale = tile_scale(tl.reduce(tl.abs(b_x), 1, _max_nan), POW2, FP8_MAX, SCALE_FLOOR)
    b_q = f32_to_e4m3(tl.math.div_rn(b_x, b_scale[:, None]), E4M3)
    tl.store(p_row + o_lat, b_q, mask=m_slot)

    p_scale = (p_row + SCALE_OFFSET).to(tl.pointer_type(tl.float32))
    tl.store(p_scale + tl.arange(0, NUM_TILES), b_scale, mask=m_slot)

    o_rope = tl.arange(0, ROPE)
    b_pe = tl.load(k_pe_ptr + i_t * stride_pe_t + o_rope, mask=m_slot)
    p_rope = (p_row + ROPE_OFFSET).to(tl.pointer_type(tl.bfloat16))
    tl.store(p_rope + o_rope, b_pe.to(tl.bfloat16), mask=m_slot)  # bf16 in: bits verbatim


@triton.jit
def write_mla_cache_bf16_kernel(
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr,
    stride_kv_t, stride_pe_t, stride_cache_block, stride_cache_row,
    block_size, num_slots,
    LATENT: tl.constexpr, ROPE: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + i_t).to(tl.int64)
    m_slot = (slot >= 0) & (slot < num_slots)
    p_row = cache_ptr + (slot // block_size) * stride_cache_block + (slot % block_size) * stride_cache_row
    o_lat = tl.arange(0, LATENT)
    b_x = tl.load(kv_c_ptr + i_t * stride_kv_t + o_lat, mask=m_slot)
    tl.store(p_row + o_lat, b_x.to(tl.bfloat16), mask=m_slot)
    o_rope = tl.arange(0, ROPE)
    b_pe = tl.load(k_pe_ptr + i_t * stride_pe_t + o_rope, mask=m_slot)
    tl.store(p_row + LATENT + o_rope, b_pe.to(tl.bfloat16), mask=m_slot)


def check_fp32_aligned_rows(cache: torch.Tensor, name: str = "cache") -> None:
    """fp8_ds_mla rows hold fp32 scales at byte 512: every row must start 4-byte aligned."""
    if cache.data_ptr() % 4 or cache.stride(0) % 4 or cache.stride(1) % 4:
        fail(name, "rows starting at 4-byte aligned addresses (data_ptr and strides multiples of 4; the "
             "fp32 scales sit at byte 512 of a row)",
             f"data_ptr % 4 = {cache.data_ptr() % 4}, strides {cache.stride()}")


def check_slot_range(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """ValueError unless every slot < num_slots (a device sync: reads slot_mapping.max())."""
    top = int(slot_mapping.max())
    if top >= num_slots:
        fail("slot_mapping", f"values < num_blocks * block_size = {num_slots} (or < 0 to skip)", f"max {top}")


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def write_mla_cache(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
                    slot_mapping: torch.Tensor, *, fmt=None, check_slots: bool = True) -> None:
    """Write T new tokens into a paged MLA cache, in place (vLLM's concat_and_cache_mla).

    Args:
        kv_c: [T, 512] bf16 (fp16 / fp32 accepted), the compressed latent; last dim contiguous,
            any token stride (a slice of a wider tensor is fine).
        k_pe: [T, 64] bf16 (fp16 / fp32 accepted; converted to bf16 round-to-nearest-even), rope.
        cache: [num_blocks, block_size, 656] uint8 (fp8_ds_mla) or [num_blocks, block_size, 576]
            bf16. Strided views are fine (block stride may exceed block_size rows); rows must be
            contiguous (stride(-1) == 1).
        slot_mapping: [T] int32 or int64, slot = block * block_size + offset. slot < 0 means
            "skip this token" (padding); nothing is written for it. Slots should be distinct
            (with duplicates, which token's bytes land is unspecified).
        fmt: the format to write (a sparse MLA descriptor: quant.FP8_DS_MLA, FP8_DS_MLA_RAW for
            the older vLLM rule, BF16_MLA, or a layer's); must match the cache. Default
            `mla_format_of(cache)` (the pow2 scale rule for a uint8 cache).
        check_slots: if True (default), raise ValueError when some slot >= num_blocks *
            block_size. This reads `slot_mapping.max()` back to the host: a device sync, so pass
            False in a CUDA-graph-captured or latency-critical path. Either way the kernel never
            writes out of bounds: out-of-range slots are skipped like negative ones.

    The bytes written equal `fmt.pack(kv_c, k_pe)` exactly (see the module docstring). A tile of
    kv_c holding NaN gets a NaN scale and fp8 NaN bytes (sign unspecified), as pack gives.
    """
    check_tensor("kv_c", kv_c, dtype=(torch.bfloat16, torch.float16, torch.float32), ndim=2,
                 last_dim_contiguous=True)
    num_tokens = kv_c.shape[0]
    check_tensor("k_pe", k_pe, dtype=(torch.bfloat16, torch.float16, torch.float32),
                 shape=(num_tokens, None), last_dim_contiguous=True)
    check_tensor("slot_mapping", slot_mapping, dtype=(torch.int32, torch.int64), shape=(num_tokens,))
    check_tensor("cache", cache, ndim=3, last_dim_contiguous=True)
    fmt = check_mla_format(cache, fmt)
    if fmt.blocked:
        raise NotImplementedError(f"write_mla_cache: {fmt} caches are laid out per block; write them "
                                  "with quant.model1_writer.write_model1_cache")
    if kv_c.shape[1] != fmt.latent_dim:
        fail("kv_c.shape", f"(T, {fmt.latent_dim})", tuple(kv_c.shape))
    if k_pe.shape[1] != fmt.rope_dim:
        fail("k_pe.shape", f"(T, {fmt.rope_dim})", tuple(k_pe.shape))
    dims = (fmt.num_tiles, fmt.tile_size, fmt.rope_dim) if fmt.quantized else (fmt.latent_dim, fmt.rope_dim)
    if not all(_is_pow2(d) for d in dims):
        raise NotImplementedError(f"write_mla_cache: format {fmt} has a tile count, tile size or rope "
                                  "width that is not a power of two (the kernel's block shapes)")
    check_same_device(kv_c=kv_c, k_pe=k_pe, cache=cache, slot_mapping=slot_mapping)
    if fmt.quantized:
        check_fp32_aligned_rows(cache)

    num_blocks, block_size = cache.shape[0], cache.shape[1]
    num_slots = num_blocks * block_size
    if num_tokens == 0:
        return
    if check_slots:
        check_slot_range(slot_mapping, num_slots)
    if slot_mapping.stride(0) != 1:
        slot_mapping = slot_mapping.contiguous()

    grid = (num_tokens,)
    common = (kv_c, k_pe, cache, slot_mapping, kv_c.stride(0), k_pe.stride(0),
              cache.stride(0), cache.stride(1), block_size, num_slots)
    if fmt.quantized:
        write_mla_cache_fp8_kernel[grid](
            *common,
            NUM_TILES=fmt.num_tiles, TILE=fmt.tile_size, ROPE=fmt.rope_dim,
            SCALE_OFFSET=fmt.scale_offset, ROPE_OFFSET=fmt.rope_offset,
            POW2=fmt.pow2, FP8_MAX=FP8_E4M3_MAX, SCALE_FLOOR=fmt.scale_floor,
            E4M3=arch_of(cache.device).e4m3_plain, num_warps=4,
        )
    else:
        write_mla_cache_bf16_kernel[grid](*common, LATENT=fmt.latent_dim, ROPE=fmt.rope_dim, num_warps=4)
