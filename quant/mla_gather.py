"""Chunked prefill over an fp8 cache: gather requests' tokens from the paged fp8_ds_mla cache into a
contiguous bf16 workspace (DESIGN.md "Chunked prefill over an fp8 cache"; vLLM's
cp_gather_and_upconvert_fp8_kv_cache).

Token p of request b lives in cache slot block_table[b, p // block_size] * block_size +
p % block_size and goes to dst[starts[b] + p] as 576 bf16: the latent dequantized
(fp32 fp8 * scale, rounded to nearest even to bf16; equal to `FP8_DS_MLA.unpack(...).to(bf16)`)
and the rope bits copied. DeepSeek-V4 (FP8_MODEL1) caches go to dst rows of 512 the same way,
through their own kernel (quant/model1_gather.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from openmla.kernels.device import arch_of

from .e4m3 import e4m3_to_f32
from .validate import check_same_device, check_tensor, fail
from .mla_cache_format import check_mla_format
from .mla_writer import check_fp32_aligned_rows

# Tokens per loop step of one program: 16 x 656 bytes read, 16 x 1152 bytes written.
_BLOCK_P = 16
# Grid cap: enough programs to fill any current GPU several times over; a program strides over its
# request, so a smaller grid is still complete, only less parallel.
_MAX_PROGRAMS = 8192


@triton.jit
def gather_positions(p0, block_table_ptr, i_b, stride_bt_req, stride_bt_blk, seq_len, start,
                     block_size, num_blocks, max_blocks, num_dst_rows, BLOCK_P: tl.constexpr):
    """Positions p0 .. p0 + BLOCK_P of request i_b -> (physical block [BLOCK_P] int64, row in
    its block, m_read: the block exists so the cache may be read, dst row, m_write: the dst row
    is in range). A position whose block is missing (entry < 0 or >= num_blocks, or past the
    table's end) is never read; its dst row gets zeros."""
    o_p = p0 + tl.arange(0, BLOCK_P)
    m_p = o_p < seq_len
    i_blk = o_p // block_size
    m_in_table = m_p & (i_blk < max_blocks)
    b_phys = tl.load(block_table_ptr + i_b * stride_bt_req + i_blk * stride_bt_blk,
                     mask=m_in_table, other=-1).to(tl.int64)
    m_read = m_in_table & (b_phys >= 0) & (b_phys < num_blocks)
    o_row = start + o_p
    m_write = m_p & (o_row >= 0) & (o_row < num_dst_rows)
    return b_phys, o_p % block_size, m_read, o_row, m_write


@triton.jit
def gather_upconvert_kernel(
    cache_ptr, dst_ptr, block_table_ptr, seq_lens_ptr, starts_ptr,
    stride_cache_block, stride_cache_row, stride_dst_row, stride_bt_req, stride_bt_blk,
    block_size, num_blocks, max_blocks, num_dst_rows,
    NUM_TILES: tl.constexpr, TILE: tl.constexpr, ROPE: tl.constexpr,
    SCALE_OFFSET: tl.constexpr, ROPE_OFFSET: tl.constexpr, BLOCK_P: tl.constexpr,
    E4M3: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_s = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + i_b)
    start = tl.load(starts_ptr + i_b).to(tl.int64)
    LATENT: tl.constexpr = NUM_TILES * TILE
    o_tile = tl.arange(0, NUM_TILES)
    o_e = tl.arange(0, TILE)
    o_rope = tl.arange(0, ROPE)

    # Programs of one request stride over its tokens, so the result does not depend on the grid
    # (no host-side max of seq_lens needed for correctness).
    p0 = i_s * BLOCK_P
    while p0 < seq_len:
        b_phys, o_in_blk, m_read, o_row, m_write = gather_positions(
            p0, block_table_ptr, i_b, stride_bt_req, stride_bt_blk, seq_len, start,
            block_size, num_blocks, max_blocks, num_dst_rows, BLOCK_P)
        p_src = cache_ptr + b_phys * stride_cache_block + o_in_blk * stride_cache_row
        p_lat = p_src[:, None, None] + (o_tile[None, :, None] * TILE + o_e[None, None, :])
        b_q = tl.load(p_lat, mask=m_read[:, None, None], other=0)
        b_lat = e4m3_to_f32(b_q, E4M3)
        p_scale = (p_src + SCALE_OFFSET).to(tl.pointer_type(tl.float32))
        b_scale = tl.load(p_scale[:, None] + o_tile[None, :], mask=m_read[:, None], other=0.0)
        b_out = (b_lat * b_scale[:, :, None]).to(tl.bfloat16)

        p_dst = dst_ptr + o_row * stride_dst_row
        p_dst_lat = p_dst[:, None, None] + (o_tile[None, :, None] * TILE + o_e[None, None, :])
        tl.store(p_dst_lat, b_out, mask=m_write[:, None, None])

        p_rope = (p_src + ROPE_OFFSET).to(tl.pointer_type(tl.bfloat16))
        b_rope = tl.load(p_rope[:, None] + o_rope[None, :], mask=m_read[:, None], other=0.0)
        tl.store(p_dst[:, None] + LATENT + o_rope[None, :], b_rope, mask=m_write[:, None])
        p0 += tl.num_programs(1) * BLOCK_P


def gather_upconvert(cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, starts: torch.Tensor, *, max_seq_len: int | None = None,
                     fmt=None) -> None:
    """Gather B requests' cached tokens into a bf16 workspace, dequantizing the latent. In place on dst.

    Args:
        cache: [num_blocks, block_size, 656] uint8, fp8_ds_mla (any scale rule: reading does not
            depend on it), or a DeepSeek-V4 FP8_MODEL1 cache ([num_blocks, block_size, (1,) 584],
            laid out per block; its kernel is quant/model1_gather.py). Strided views are fine;
            rows contiguous.
        dst: [N, head_dim] bf16 workspace (576; 512 for FP8_MODEL1: nope 448 | rope 64); last dim
            contiguous, any row stride. Only rows
            starts[b] + p for 0 <= p < seq_lens[b] are written; every other row is untouched.
        block_table: [B, M] int32, physical block of each request's logical block.
        seq_lens: [B] int32, tokens to gather per request (<= 0: none).
        starts: [B] int32, first dst row of each request.
        max_seq_len: optional grid-size hint (a host int, e.g. the chunk's known max seq_len). The
            result never depends on it: each request's programs stride over all its tokens. None
            sizes the grid from N. No host sync either way.
        fmt: the cache's format (an fp8_ds_mla descriptor, either scale rule), default
            `mla_format_of(cache)`.

    Token p of request b: latent (MODEL1: nope) = bf16(fp32(fp8) * scale) (round to nearest
    even), rope bits verbatim. Bad entries never cause an out-of-bounds access:
      - a needed block_table entry < 0 or >= num_blocks, or p // block_size >= M: that dst row is
        written with zeros (deterministic, and visibly not data; the cache is not read);
      - a target row starts[b] + p outside [0, N): not written.
    """
    check_tensor("cache", cache, last_dim_contiguous=True)
    fmt = check_mla_format(cache, fmt)
    if fmt.blocked:
        fmt.check_cache(cache)
    else:
        check_tensor("cache", cache, ndim=3)
    if not fmt.quantized:
        raise NotImplementedError(
            f"gather_upconvert: cache format {fmt.name} ({cache.dtype}); only fp8_ds_mla (uint8) caches "
            "are gathered (a bf16 cache is read by the prefill kernel directly)")
    check_tensor("dst", dst, dtype=torch.bfloat16, shape=(None, fmt.head_dim), last_dim_contiguous=True)
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2)
    num_reqs = block_table.shape[0]
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(num_reqs,), contiguous=True)
    check_tensor("starts", starts, dtype=torch.int32, shape=(num_reqs,), contiguous=True)
    if max_seq_len is not None and (not isinstance(max_seq_len, int) or max_seq_len < 0):
        fail("max_seq_len", "None or a non-negative python int", repr(max_seq_len))
    check_same_device(cache=cache, dst=dst, block_table=block_table, seq_lens=seq_lens, starts=starts)
    if not fmt.blocked:
        check_fp32_aligned_rows(cache)

    num_blocks, block_size = cache.shape[0], cache.shape[1]
    if num_reqs == 0 or dst.shape[0] == 0:
        return
    hint = dst.shape[0] if max_seq_len is None else min(max_seq_len, dst.shape[0])
    splits = max(1, min(triton.cdiv(hint, _BLOCK_P), _MAX_PROGRAMS // num_reqs))
    grid = (num_reqs, splits)
    if fmt.blocked:
        from .model1_gather import launch_gather_model1  # imports this module's gather_positions
        launch_gather_model1(cache, dst, block_table, seq_lens, starts, grid, fmt, _BLOCK_P)
        return
    gather_upconvert_kernel[grid](
        cache, dst, block_table, seq_lens, starts,
        cache.stride(0), cache.stride(1), dst.stride(0), block_table.stride(0), block_table.stride(1),
        block_size, num_blocks, block_table.shape[1], dst.shape[0],
        NUM_TILES=fmt.num_tiles, TILE=fmt.tile_size, ROPE=fmt.rope_dim,
        SCALE_OFFSET=fmt.scale_offset, ROPE_OFFSET=fmt.rope_offset, BLOCK_P=_BLOCK_P,
        E4M3=arch_of(cache.device).e4m3_plain, num_warps=4,
    )
