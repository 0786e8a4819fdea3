"""The DeepSeek-V4 (FP8_MODEL1) kernel of `quant.mla_gather.gather_upconvert` (the public op, which
validates and dispatches here): requests' tokens from the paged cache into a bf16 [N, 512]
prefill workspace.

Token p of request b lives in block block_table[b, p // block_size], row r = p % block_size; its
576-byte record sits at r * 576 of the block and its 7 ue8m0 scale bytes at block_size * 576 +
r * 8 (quant/model1_format.py). dst[starts[b] + p] = 448 nope values bf16(fp8 * 2^(e - 127))
(exact: the product of an e4m3 value and a power of two has at most 4 significant bits) | 64 rope
bf16 copied bit for bit: `FP8_MODEL1.unpack(...).to(bf16)`, which is also FlashMLA's dequantize.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from openmla.kernels.device import arch_of

from .e4m3 import e4m3_to_f32
from .mla_gather import gather_positions
from .ue8m0 import ue8m0_to_f32


@triton.jit
def gather_upconvert_model1_kernel(
    cache_ptr, dst_ptr, block_table_ptr, seq_lens_ptr, starts_ptr,
    stride_cache_block, stride_dst_row, stride_bt_req, stride_bt_blk,
    block_size, num_blocks, max_blocks, num_dst_rows,
    NUM_TILES: tl.constexpr, TILES_P2: tl.constexpr, TILE: tl.constexpr, ROPE: tl.constexpr,
    RECORD: tl.constexpr, ROPE_OFFSET: tl.constexpr, SCALE_STRIDE: tl.constexpr,
    BLOCK_P: tl.constexpr, E4M3: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_s = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + i_b)
    start = tl.load(starts_ptr + i_b).to(tl.int64)
    NOPE: tl.constexpr = NUM_TILES * TILE
    o_tile = tl.arange(0, TILES_P2)  # 7 tiles padded to 8; the pad tile is masked
    m_tile = o_tile < NUM_TILES
    o_nope = o_tile[:, None] * TILE + tl.arange(0, TILE)[None, :]
    o_rope = tl.arange(0, ROPE)

    # Programs of one request stride over its tokens: the result does not depend on the grid.
    p0 = i_s * BLOCK_P
    while p0 < seq_len:
        b_phys, o_row_in_blk, m_read, o_row, m_write = gather_positions(
            p0, block_table_ptr, i_b, stride_bt_req, stride_bt_blk, seq_len, start,
            block_size, num_blocks, max_blocks, num_dst_rows, BLOCK_P)
        p_block = cache_ptr + b_phys * stride_cache_block
        p_rec = p_block + o_row_in_blk * RECORD
        m_nope = m_read[:, None, None] & m_tile[None, :, None]
        b_q = tl.load(p_rec[:, None, None] + o_nope[None, :, :], mask=m_nope, other=0)
        p_scale = p_block + block_size * RECORD + o_row_in_blk * SCALE_STRIDE
        b_e8 = tl.load(p_scale[:, None] + o_tile[None, :], mask=m_read[:, None] & m_tile[None, :], other=127)
        b_out = (e4m3_to_f32(b_q, E4M3) * ue8m0_to_f32(b_e8)[:, :, None]).to(tl.bfloat16)

        p_dst = dst_ptr + o_row * stride_dst_row
        tl.store(p_dst[:, None, None] + o_nope[None, :, :], b_out,
                 mask=m_write[:, None, None] & m_tile[None, :, None])
        p_rope = (p_rec + ROPE_OFFSET).to(tl.pointer_type(tl.bfloat16))
        b_rope = tl.load(p_rope[:, None] + o_rope[None, :], mask=m_read[:, None], other=0.0)
        tl.store(p_dst[:, None] + NOPE + o_rope[None, :], b_rope, mask=m_write[:, None])
        p0 += tl.num_programs(1) * BLOCK_P


def launch_gather_model1(cache, dst, block_table, seq_lens, starts, grid, fmt, block_p: int) -> None:
    """Launch the kernel for inputs gather_upconvert has validated (fmt.check_cache included)."""
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    gather_upconvert_model1_kernel[grid](
        cache, dst, block_table, seq_lens, starts,
        cache.stride(0) if num_blocks > 1 else fmt.block_bytes(block_size), dst.stride(0),
        block_table.stride(0), block_table.stride(1),
        block_size, num_blocks, block_table.shape[1], dst.shape[0],
        NUM_TILES=fmt.num_tiles, TILES_P2=triton.next_power_of_2(fmt.num_tiles), TILE=fmt.tile_size,
        ROPE=fmt.rope_dim, RECORD=fmt.record_bytes, ROPE_OFFSET=fmt.rope_offset,
        SCALE_STRIDE=fmt.scale_stride, BLOCK_P=block_p, E4M3=arch_of(cache.device).e4m3_plain,
        num_warps=4,
    )


__all__ = ["launch_gather_model1"]
