"""Triton cache writer for the DeepSeek-V4 ("MODEL1") fp8 sparse cache: new tokens into their slots.

The bytes it writes equal `FP8_MODEL1.pack` (quant/model1_format.py) exactly: the tile scale is
quant/mla_writer.py's `tile_scale` (the pow2 rule, correctly rounded divisions and the fp32 log2
torch uses, so byte-identical to FlashMLA's quantizer as that module explains), stored as its ue8m0
exponent byte; x / s is a correctly rounded division and fp32 -> e4m3 rounds to nearest even,
saturating (quant/e4m3.py). A token's bytes are split over its block (quant/model1_format.py):
its 576-byte record at row * 576 (448 e4m3 nope | 64 bf16 rope) and its 8 scale bytes at
block_size * 576 + row * 8 (7 ue8m0 + a 0 pad byte). Offsets come from the descriptor.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from openmla.kernels.device import arch_of

from .e4m3 import f32_to_e4m3
from .mla_cache_format import check_mla_format
from .mla_formats import FP8_E4M3_MAX
from .mla_writer import _max_nan, check_slot_range, tile_scale
from .ue8m0 import f32_pow2_to_ue8m0
from .validate import check_same_device, check_tensor, fail


@triton.jit
def write_model1_cache_kernel(
    k_ptr, cache_ptr, slot_ptr,
    stride_k_t, stride_cache_block, block_size, num_slots,
    NUM_TILES: tl.constexpr, TILES_P2: tl.constexpr, TILE: tl.constexpr, ROPE: tl.constexpr,
    RECORD: tl.constexpr, ROPE_OFFSET: tl.constexpr, SCALE_STRIDE: tl.constexpr,
    FP8_MAX: tl.constexpr, SCALE_FLOOR: tl.constexpr, E4M3: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + i_t).to(tl.int64)
    # Skipped (< 0) and out-of-range slots write nothing: never a wild write, even unchecked.
    m_slot = (slot >= 0) & (slot < num_slots)
    row = slot % block_size
    p_block = cache_ptr + (slot // block_size) * stride_cache_block
    p_rec = p_block + row * RECORD
    p_scale = p_block + block_size * RECORD + row * SCALE_STRIDE

    # 7 tiles padded to 8 (block shapes are powers of two); the pad tile is masked everywhere.
    o_tile = tl.arange(0, TILES_P2)
    m_tile = o_tile < NUM_TILES
    o_nope = o_tile[:, None] * TILE + tl.arange(0, TILE)[None, :]
    m_nope = m_slot & m_tile[:, None]
    b_x = tl.load(k_ptr + i_t * stride_k_t + o_nope, mask=m_nope, other=0.0).to(tl.float32)
    b_scale = tile_scale(tl.reduce(tl.abs(b_x), 1, _max_nan), True, FP8_MAX, SCALE_FLOOR)
    b_q = f32_to_e4m3(tl.math.div_rn(b_x, b_scale[:, None]), E4M3)
    tl.store(p_rec + o_nope, b_q, mask=m_nope)
    # the scale bytes and, at index NUM_TILES, the pad byte 0 (as pack writes it)
    b_e8 = tl.where(m_tile, f32_pow2_to_ue8m0(b_scale), 0).to(tl.uint8)
    tl.store(p_scale + o_tile, b_e8, mask=m_slot & (o_tile < SCALE_STRIDE))

    o_rope = tl.arange(0, ROPE)
    b_pe = tl.load(k_ptr + i_t * stride_k_t + NUM_TILES * TILE + o_rope, mask=m_slot)
    p_rope = (p_rec + ROPE_OFFSET).to(tl.pointer_type(tl.bfloat16))
    tl.store(p_rope + o_rope, b_pe.to(tl.bfloat16), mask=m_slot)  # bf16 in: bits verbatim


def write_model1_cache(k: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, *, fmt=None,
                       check_slots: bool = True) -> None:
    """Write T new tokens into a paged DeepSeek-V4 (FP8_MODEL1) cache, in place.

    Args:
        k: [T, 512] bf16 (fp16 / fp32 accepted): nope 448 | rope 64 of each token; last dim
            contiguous, any token stride. The rope is stored as bf16 (round to nearest even).
        cache: FlashMLA's [num_blocks, block_size, 1, 584] uint8 view (or [num_blocks,
            block_size, 584]); any block stride >= block_size * 584 (FlashMLA pads blocks to a
            multiple of 576 bytes), row stride 584.
        slot_mapping: [T] int32 or int64, slot = block * block_size + row. slot < 0: skip the
            token (padding), nothing written. Slots should be distinct (with duplicates, which
            token's bytes land is unspecified).
        fmt: FP8_MODEL1 (or None: `mla_format_of(cache)`); must match the cache.
        check_slots: True (default): ValueError when some slot >= num_blocks * block_size, read
            with `slot_mapping.max()` (a device sync; pass False under CUDA-graph capture).
            Either way out-of-range slots are skipped, never written.

    The bytes written equal `FP8_MODEL1.pack` of the same tokens at the same positions (record,
    7 scale bytes, pad byte 0); nothing else in the cache changes. A tile holding NaN gets the
    NaN scale byte 0xFF and fp8 NaN bytes (sign unspecified), as pack gives.
    """
    check_tensor("k", k, dtype=(torch.bfloat16, torch.float16, torch.float32), ndim=2, last_dim_contiguous=True)
    num_tokens = k.shape[0]
    check_tensor("slot_mapping", slot_mapping, dtype=(torch.int32, torch.int64), shape=(num_tokens,))
    check_tensor("cache", cache)
    fmt = check_mla_format(cache, fmt)
    if not fmt.blocked:
        raise NotImplementedError(f"write_model1_cache: writes DeepSeek-V4 (FP8_MODEL1) caches, not {fmt}; "
                                  "use quant.write_mla_cache")
    fmt.check_cache(cache)
    if k.shape[1] != fmt.head_dim:
        fail("k.shape", f"(T, {fmt.head_dim})", tuple(k.shape))
    check_same_device(k=k, cache=cache, slot_mapping=slot_mapping)
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    num_slots = num_blocks * block_size
    if num_tokens == 0 or num_slots == 0:
        return
    if check_slots:
        check_slot_range(slot_mapping, num_slots)
    if slot_mapping.stride(0) != 1:
        slot_mapping = slot_mapping.contiguous()
    assert triton.next_power_of_2(fmt.num_tiles) >= fmt.scale_stride, "one store covers scales and pad"
    write_model1_cache_kernel[(num_tokens,)](
        k, cache, slot_mapping, k.stride(0), cache.stride(0) if num_blocks > 1 else fmt.block_bytes(block_size),
        block_size, num_slots,
        NUM_TILES=fmt.num_tiles, TILES_P2=triton.next_power_of_2(fmt.num_tiles), TILE=fmt.tile_size,
        ROPE=fmt.rope_dim, RECORD=fmt.record_bytes, ROPE_OFFSET=fmt.rope_offset,
        SCALE_STRIDE=fmt.scale_stride, FP8_MAX=FP8_E4M3_MAX, SCALE_FLOOR=fmt.scale_floor,
        E4M3=arch_of(cache.device).e4m3_plain, num_warps=4,
    )
