"""paged_mqa_logits: the indexer's decode logits over the paged fp8 indexer K cache (what vLLM
gets from DeepGEMM's fp8_paged_mqa_logits), in Triton, on any GPU Triton runs on.

One program takes one request's next_n query rows (every head: one dot of next_n * 64 rows) and
walks its key tiles with a stride of `splits`, so a small batch still fills the GPU and every
program reads each cache byte it needs once. The row ends are read on the device (no host sync,
CUDA-graph capturable); the grid depends on the batch size and max_model_len only.

On sm_90+ a tile is one page, its block_size x 128 key bytes fetched by TMA and its block_size
fp32 scales by pointer (by TMA too, a second descriptor, for requests of several query rows), when
the page size and the cache's alignment allow it (`_tma_ok`), and the query block comes by TMA too
when its rows allow (`_query_descriptor`); elsewhere a tile of block_n keys is gathered with
pointer loads (the choices measured: docs/notes/indexer.md).
Semantics: kernels/reference/indexer.py (paged_mqa_logits_ref).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from openmla.kernels.device import arch_of, num_sms
from openmla.kernels.launch import cdiv, next_pow2
from openmla.quant.indexer_cache import INDEXER_K_FP8, indexer_k_format_of
from openmla.quant.validate import check_same_device, check_tensor, fail
from openmla.kernels.indexer._tile import (as_dot_operand, fp8_dot, load_query_block, operand_view,
                                           weighted_relu_logits)

__all__ = ["paged_mqa_logits"]

# K of the fp8 MMA steps summed at reduced precision before an fp32 add (weighted_relu_logits):
# None sums all of K = 128 in the MMA, as DeepGEMM's fp8_paged_mqa_logits does (what vLLM runs).
# Its error bound is 4x that of steps of 32 (2^-7 instead of 2^-9 of the logits of |q|, |w|, |k|),
# still below what e4m3's rounding of q and k moves a logit (measurements: docs/notes/indexer.md).
_ACC_STEP = None


@triton.jit
def paged_mqa_logits_kernel(
    q_ptr, w_ptr, cache_ptr, scale_ptr, k_desc, s_desc, q_desc, ctx_ptr, bt_ptr, out_ptr,
    stride_qb, stride_qn, stride_qh, stride_wr, stride_cb, stride_ctx_b, stride_ctx_n,
    stride_bt, stride_or,
    N, H, block_size, num_blocks, table_width, max_model_len, splits,
    NP: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    PER_ROW_CTX: tl.constexpr, CLEAN: tl.constexpr, FP8_DOT: tl.constexpr, E4M3: tl.constexpr,
    TMA: tl.constexpr, ACC_STEP: tl.constexpr, SCALE_TMA: tl.constexpr, Q_TMA: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_s = tl.program_id(1)
    o_j = tl.arange(0, NP)
    m_j = o_j < N
    # Row j of the request sees positions [0, end_j): the last token and its speculative successors.
    if PER_ROW_CTX:
        b_end = tl.load(ctx_ptr + i_b * stride_ctx_b + o_j * stride_ctx_n, mask=m_j, other=0)
    else:
        b_end = tl.load(ctx_ptr + i_b * stride_ctx_b) - N + 1 + o_j
    b_end = tl.minimum(tl.maximum(tl.where(m_j, b_end, 0), 0), max_model_len)
    end_max = tl.max(b_end)

    b_q, b_w = load_query_block(q_ptr + i_b * stride_qb, w_ptr + i_b * N * stride_wr,
                                o_j.to(tl.int64), m_j, stride_qn, stride_qh, stride_wr, H,
                                NP, HP, D, FP8_DOT, E4M3)
    if Q_TMA:  # the request's rows are the box's NP * HP rows (no padding): see _query_descriptor;
        # the pointer load of b_q above is then unused, and the compiler drops it
        b_q = q_desc.load([(i_b * (NP * HP)).to(tl.int32), 0])
    o_n = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, D)
    p_out = out_ptr + (i_b * N + o_j.to(tl.int64))[:, None] * stride_or
    # The tiles some row sees: no branch in this loop, so its loads pipeline.
    n_work = tl.cdiv(end_max, BLOCK_N)
    for i_n in range(i_s, n_work, splits):
        o_p = i_n * BLOCK_N + o_n
        if TMA:  # BLOCK_N == block_size: the tile is page i_n, fetched whole
            page = tl.load(bt_ptr + i_b * stride_bt + i_n, mask=i_n < table_width, other=-1)
            ok = (page >= 0) & (page < num_blocks)
            # An invalid page holds no key: its coordinate is past the cache (TMA fills zeros).
            i_page = tl.where(ok, page, num_blocks)
            if SCALE_TMA:
                b_sc = tl.reshape(s_desc.load([i_page, 0]), (BLOCK_N,))
            else:
                # By pointer, issued before the key tile's wait: a TMA load whose tile feeds no dot is
                # not pipelined (it gets its own barrier, waited inside the iteration). Requests of
                # several query rows keep the TMA load (faster there: docs/notes/indexer.md).
                p_sc = scale_ptr + tl.where(ok, page, 0).to(tl.int64) * (stride_cb // 4) + block_size * (D // 4)
                b_sc = tl.load(p_sc + o_n, mask=ok, other=0.0)
            b_k = tl.reshape(k_desc.load([i_page, 0, 0]), (BLOCK_N, D))
            m_k = (o_p < end_max) & ok
        else:
            i_pg = o_p // block_size
            m_tab = (o_p < end_max) & (i_pg < table_width)
            page = tl.load(bt_ptr + i_b * stride_bt + i_pg, mask=m_tab, other=-1).to(tl.int64)
            # An invalid page holds no key: it is never read and its positions stay -inf.
            m_k = m_tab & (page >= 0) & (page < num_blocks)
            page = tl.where(m_k, page, 0)
            o_off = o_p % block_size
            p_k = cache_ptr + page[:, None] * stride_cb + o_off[:, None] * D + o_d[None, :]
            b_k = tl.load(p_k, mask=m_k[:, None], other=0.0)
            # scale_ptr is the cache as fp32 words: block stride / 4, scales after block_size * D bytes
            b_sc = tl.load(scale_ptr + page * (stride_cb // 4) + block_size * (D // 4) + o_off,
                           mask=m_k, other=0.0)
        b_l = weighted_relu_logits(b_q, b_w, as_dot_operand(b_k, FP8_DOT, E4M3), b_sc, NP, HP, BLOCK_N,
                                   ACC_STEP)
        m_vis = (o_p[None, :] < b_end[:, None]) & m_k[None, :]
        b_out = tl.where(m_vis, b_l, float("-inf"))
        tl.store(p_out + o_p[None, :], b_out, mask=m_j[:, None] & (o_p[None, :] < max_model_len))
    if CLEAN:  # the rest of the row: -inf
        b_inf = tl.full([NP, BLOCK_N], float("-inf"), tl.float32)
        for i_n in range(n_work + i_s, tl.cdiv(max_model_len, BLOCK_N), splits):
            o_p = i_n * BLOCK_N + o_n
            tl.store(p_out + o_p[None, :], b_inf, mask=m_j[:, None] & (o_p[None, :] < max_model_len))


def _splits(device, batch: int, tiles: int, waves: int) -> int:
    """Programs per request: about `waves` waves of the GPU over the whole batch, at most one per
    tile."""
    return max(1, min(tiles, cdiv(waves * num_sms(device), max(batch, 1))))


def _tma_config(batch: int, next_n: int):
    """(num_stages, waves) of the TMA path by the batch's query rows: the best of sweeps of
    2 / 3 / 4 / 6 stages x 2 / 4 / 8 / 16 (/ 32) waves (docs/notes/indexer.md); batch 64 with one
    row a request wants many small programs, two rows a request (a dot twice as wide) fewer."""
    rows = batch * next_n
    if rows < 8:
        return 3, 4
    if rows >= 64 and next_n == 1:
        return 6, 16
    return 3, 8


def _tma_ok(arch, fp8: bool, cache: torch.Tensor) -> bool:
    """Pages can be TMA tiles: sm_90+ with the fp8 dot, a page of 16..256 keys (a power of two: a
    tile and a TMA box), 16-byte aligned page blocks (TMA's base and stride rule; the scales then
    start 16-byte aligned too, after block_size x 128 bytes)."""
    bs = cache.shape[1]
    return (fp8 and arch.backend == "cuda" and arch.arch >= 90 and 16 <= bs <= 256
            and bs & (bs - 1) == 0 and cache.data_ptr() % 16 == 0 and cache.stride(0) % 16 == 0)


def _page_descriptors(cache: torch.Tensor, D: int):
    """TMA descriptors of the cache's keys [num_blocks, block_size, D] (e4m3fn) and scales
    [num_blocks, block_size] (fp32, the words after each page's keys), one page a box."""
    nb, bs, _ = cache.shape
    k_desc = TensorDescriptor(cache.view(torch.float8_e4m3fn), [nb, bs, D], [cache.stride(0), D, 1],
                              [1, bs, D])
    words = cache.view(torch.float32)  # the descriptor takes its base address and dtype only
    scales = torch.as_strided(words, (1,), (1,), words.storage_offset() + bs * D // 4)
    s_desc = TensorDescriptor(scales, [nb, bs], [cache.stride(0) // 4, 1], [1, bs])
    return k_desc, s_desc


def _query_descriptor(q: torch.Tensor, fp8: bool):
    """A TMA descriptor over q as [B * next_n * H, D] rows, one request's rows a box, when they are
    the kernel's query block exactly (next_n and H powers of two, 16 to 256 rows: a dot's least
    and a box's most), q is contiguous and 16-byte aligned, and the batch has at least 8 query
    rows; else None (the pointer load). H200, 2026-11-30: 1-4.5 % faster from 8 rows, 0.1 us
    slower at one (docs/notes/indexer.md)."""
    B, N, H, D = q.shape
    if (B * N < 8 or N & (N - 1) or H & (H - 1) or not 16 <= N * H <= 256 or not q.is_contiguous()
            or q.data_ptr() % 16):
        return None
    rows = operand_view(q, fp8).view(B * N * H, D)
    return TensorDescriptor(rows, [B * N * H, D], [D, 1], [N * H, D])


def paged_mqa_logits(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor,
                     context_lens: torch.Tensor, block_table: torch.Tensor, *, max_model_len: int,
                     fmt=INDEXER_K_FP8, clean_logits: bool = True, out: torch.Tensor = None,
                     block_n: int = 64) -> torch.Tensor:
    """Decode logits of the DSA indexer over its paged fp8 K cache.

    Args:
        q: [B, next_n, H, D = 128] float8_e4m3fn (or its uint8 bytes); any strides with a
            contiguous last dim. H any (64 in DeepSeek-V3.2), next_n >= 1.
        weights: [B * next_n, H] fp32, the folded weights (row b * next_n + j), last dim contiguous.
        cache: [num_blocks, block_size, 132] uint8, the indexer K cache (quant/indexer_cache.py),
            any block stride.
        context_lens: int32 [B] or [B, 1] (row j sees positions < context_lens[b] - next_n + 1 + j)
            or [B, next_n] (row j sees positions < context_lens[b, j]).
        block_table: [B, M] int32; an entry < 0 or >= num_blocks is an invalid page (never read,
            its positions -inf).
        max_model_len: logits width (positions past it are not scored).
        fmt: the cache's IndexerKFormat or vLLM's scale_fmt (both scale rules read the same).
        clean_logits: write -inf everywhere a key is not visible (True), or leave the columns at
            and past each request's longest row end unwritten (False, DeepGEMM's clean_logits=False:
            the top-k reads only [0, row_end)).
        out: optional [B * next_n, max_model_len] fp32 with a contiguous last dim.
        block_n: keys per tile of the pointer path (a power of two >= 16); the TMA path's tile
            is a page.

    Returns logits [B * next_n, max_model_len] fp32 (see kernels/reference/indexer.py).
    """
    fmt = indexer_k_format_of(fmt)
    check_tensor("q", q, dtype=(torch.float8_e4m3fn, torch.uint8), ndim=4, last_dim_contiguous=True)
    B, N, H, D = q.shape
    if D != fmt.head_dim:
        fail("q.shape[-1]", fmt.head_dim, D)
    if fmt.scales_per_token != 1:
        raise NotImplementedError(f"paged_mqa_logits: {fmt} has {fmt.scales_per_token} scales a key; "
                                  "the logits take one (quant_block_size == head_dim)")
    if N < 1 or H < 1:
        fail("q.shape", "(B, next_n >= 1, H >= 1, 128)", tuple(q.shape))
    check_tensor("weights", weights, dtype=torch.float32, shape=(B * N, H), last_dim_contiguous=True)
    fmt.check_cache(cache)
    check_tensor("context_lens", context_lens, dtype=torch.int32)
    per_row = context_lens.dim() == 2 and context_lens.shape[1] == N and N > 1
    if not (per_row or tuple(context_lens.shape) in ((B,), (B, 1))):
        fail("context_lens.shape", f"({B},), ({B}, 1) or ({B}, {N})", tuple(context_lens.shape))
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, last_dim_contiguous=True)
    if block_table.shape[0] != B:
        fail("block_table.shape[0]", B, block_table.shape[0])
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 0:
        fail("max_model_len", "an int >= 0", repr(max_model_len))
    if block_n < 16 or block_n & (block_n - 1):
        fail("block_n", "a power of two >= 16", block_n)
    if out is None:
        out = torch.empty(B * N, max_model_len, dtype=torch.float32, device=q.device)
    else:
        check_tensor("out", out, dtype=torch.float32, shape=(B * N, max_model_len), last_dim_contiguous=True)
    check_same_device(q=q, weights=weights, cache=cache, context_lens=context_lens,
                      block_table=block_table, out=out)
    if B == 0 or max_model_len == 0:
        return out
    arch = arch_of(q.device)
    fp8 = fp8_dot(arch)
    tma = _tma_ok(arch, fp8, cache)
    if tma:
        block_n, (stages, waves) = cache.shape[1], _tma_config(B, N)
        k_desc, s_desc = _page_descriptors(cache, D)
        q_desc = _query_descriptor(q, fp8)
    else:
        waves, stages = 2, 2
        k_desc = s_desc = q_desc = None
    tiles = cdiv(max_model_len, block_n)
    splits = _splits(q.device, B, tiles, waves)
    ctx_b = context_lens.stride(0)
    ctx_n = context_lens.stride(1) if per_row else 0
    HP = next_pow2(H)
    NP = max(next_pow2(N), 16 // min(HP, 16))  # a dot needs >= 16 rows
    paged_mqa_logits_kernel[(B, splits)](
        operand_view(q, fp8), weights, operand_view(cache, fp8), cache.view(torch.float32),
        k_desc, s_desc, q_desc, context_lens, block_table, out,
        q.stride(0), q.stride(1), q.stride(2), weights.stride(0), cache.stride(0), ctx_b, ctx_n,
        block_table.stride(0), out.stride(0),
        N, H, cache.shape[1], cache.shape[0], block_table.shape[1], max_model_len, splits,
        NP=NP, HP=HP, D=D, BLOCK_N=block_n, PER_ROW_CTX=per_row, CLEAN=clean_logits,
        FP8_DOT=fp8, E4M3=arch.e4m3, TMA=tma, ACC_STEP=_ACC_STEP, SCALE_TMA=N > 1,
        Q_TMA=q_desc is not None, num_warps=4, num_stages=stages,
    )
    return out
