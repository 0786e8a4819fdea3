"""mqa_logits: the indexer's ragged prefill logits over a contiguous fp8 K (what vLLM gets from
DeepGEMM's fp8_mqa_logits after gathering a chunk's keys out of the paged cache), in Triton.

One program takes BLOCK_M query tokens (every head: one dot of BLOCK_M * 64 rows) and walks the
key tiles that their windows [ks, ke) touch, with a stride of the grid's second dimension (sized
so that about two waves of programs fill the GPU); tiles outside every window are not computed
(a causal prompt costs half the square). Semantics:
kernels/reference/indexer.py (mqa_logits_ref).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from openmla.kernels.configs import ConfigSpace
from openmla.kernels.device import arch_of, num_sms
from openmla.kernels.launch import cdiv, next_pow2
from openmla.quant.validate import check_same_device, check_tensor, fail
from openmla.kernels.indexer._tile import (as_dot_operand, fp8_dot, load_query_block, operand_view,
                                           weighted_relu_logits)

__all__ = ["mqa_logits"]


def _prune(configs, named_args, **constexprs):
    # a dot needs >= 16 rows: BLOCK_M tokens x HP heads
    kept = [c for c in configs if c.kwargs["BLOCK_M"] * constexprs["HP"] >= 16]
    return kept or [triton.Config({"BLOCK_M": 16 // constexprs["HP"], "BLOCK_N": 64}, num_warps=4)]


# K of the fp8 MMA steps summed at reduced precision before an fp32 add (weighted_relu_logits):
# None sums all of K = 128 in the MMA, as DeepGEMM's fp8_mqa_logits does (why, and what steps of
# 32 cost: docs/notes/indexer.md).
_ACC_STEP = None

# Candidates, the untimed default first (BLOCK_M * 64 heads = 128 dot rows, 64 keys a tile).
# Not measured yet on a GPU: the first launch of a class times them all (kernels/configs.py).
MQA_LOGITS_CONFIGS = ConfigSpace(
    name="mqa_logits_kernel",
    candidates=tuple(triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
                     for m, n, w, st in ((2, 64, 4, 3), (2, 128, 8, 3), (4, 64, 8, 3),
                                         (4, 128, 8, 2), (1, 128, 4, 3))),
    key=("HP", "CLEAN", "FP8_DOT"),
    prune=_prune,
)


@MQA_LOGITS_CONFIGS.autotune()
@triton.jit
def mqa_logits_kernel(
    q_ptr, w_ptr, k_ptr, ks_scale_ptr, ks_ptr, ke_ptr, out_ptr,
    stride_qt, stride_qh, stride_wr, stride_kn, stride_or,
    T, H, S,
    HP: tl.constexpr, D: tl.constexpr, CLEAN: tl.constexpr, FP8_DOT: tl.constexpr,
    E4M3: tl.constexpr, ACC_STEP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    i_m = tl.program_id(0)
    i_s = tl.program_id(1)
    splits = tl.num_programs(1)
    o_t = (i_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    m_t = o_t < T
    b_ks = tl.minimum(tl.maximum(tl.load(ks_ptr + o_t, mask=m_t, other=0), 0), S)
    b_ke = tl.minimum(tl.maximum(tl.load(ke_ptr + o_t, mask=m_t, other=0), b_ks), S)
    # The key tiles any row of the block sees; empty rows do not widen it.
    m_nz = m_t & (b_ke > b_ks)
    lo = tl.min(tl.where(m_nz, b_ks, S))
    hi = tl.max(tl.where(m_nz, b_ke, 0))
    tile_lo = lo // BLOCK_N
    tile_hi = tl.where(hi > lo, tl.cdiv(hi, BLOCK_N), tile_lo)

    b_q, b_w = load_query_block(q_ptr, w_ptr, o_t, m_t, stride_qt, stride_qh, stride_wr, H,
                                BLOCK_M, HP, D, FP8_DOT, E4M3)
    o_n = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, D)
    p_out = out_ptr + o_t[:, None] * stride_or
    m_out = m_t[:, None]
    # The tiles some row of the block sees: no branch in this loop, so its loads pipeline.
    for i_n in range(tile_lo + i_s, tile_hi, splits):
        o_p = i_n * BLOCK_N + o_n
        m_k = (o_p >= lo) & (o_p < hi)  # keys nobody in the block sees are never read
        b_k = tl.load(k_ptr + o_p.to(tl.int64)[:, None] * stride_kn + o_d[None, :],
                      mask=m_k[:, None], other=0.0)
        b_sc = tl.load(ks_scale_ptr + o_p, mask=m_k, other=0.0)
        b_l = weighted_relu_logits(b_q, b_w, as_dot_operand(b_k, FP8_DOT, E4M3), b_sc,
                                   BLOCK_M, HP, BLOCK_N, ACC_STEP)
        m_vis = (o_p[None, :] >= b_ks[:, None]) & (o_p[None, :] < b_ke[:, None])
        tl.store(p_out + o_p[None, :], tl.where(m_vis, b_l, float("-inf")),
                 mask=m_out & (o_p[None, :] < S))
    if CLEAN:  # the tiles before and after: -inf
        b_inf = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)
        n_tiles = tl.cdiv(S, BLOCK_N)
        for i_n in range(i_s, n_tiles - (tile_hi - tile_lo), splits):
            i_c = tl.where(i_n < tile_lo, i_n, i_n + (tile_hi - tile_lo))
            o_p = i_c * BLOCK_N + o_n
            tl.store(p_out + o_p[None, :], b_inf, mask=m_out & (o_p[None, :] < S))


def mqa_logits(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor,
               ks: torch.Tensor, ke: torch.Tensor, *, clean_logits: bool = True,
               out: torch.Tensor = None) -> torch.Tensor:
    """Ragged prefill logits of the DSA indexer.

    Args:
        q: [T, H, D = 128] float8_e4m3fn (or its uint8 bytes), last dim contiguous.
        weights: [T, H] fp32, the folded weights, last dim contiguous.
        k: [S, 128] float8_e4m3fn (or uint8 bytes), last dim contiguous: the keys of the chunk's
            requests back to back (quant's gather, or vLLM's cp_gather_indexer_k_quant_cache).
        k_scale: [S] fp32 (a [S, 1] or [S, 4]-uint8 view is the caller's to flatten).
        ks, ke: [T] int32; row t sees keys [ks[t], ke[t]) (clipped to [0, S]).
        clean_logits: write -inf everywhere a key is not visible (True), or only inside the key
            tiles the row's block of BLOCK_M tokens sees (False; what the top-k reads).
        out: optional [T, S] fp32 with a contiguous last dim.

    The tile shape (BLOCK_M query tokens x every head in one dot, BLOCK_N keys) is autotuned per
    class (MQA_LOGITS_CONFIGS): warm up outside CUDA-graph capture.

    Returns logits [T, S] fp32 (see kernels/reference/indexer.py).
    """
    check_tensor("q", q, dtype=(torch.float8_e4m3fn, torch.uint8), ndim=3, last_dim_contiguous=True)
    T, H, D = q.shape
    if D != 128:
        fail("q.shape[-1]", 128, D)
    check_tensor("weights", weights, dtype=torch.float32, shape=(T, H), last_dim_contiguous=True)
    check_tensor("k", k, dtype=(torch.float8_e4m3fn, torch.uint8), shape=(None, D), last_dim_contiguous=True)
    S = k.shape[0]
    check_tensor("k_scale", k_scale, dtype=torch.float32, shape=(S,))
    check_tensor("ks", ks, dtype=torch.int32, shape=(T,))
    check_tensor("ke", ke, dtype=torch.int32, shape=(T,))
    if out is None:
        out = torch.empty(T, S, dtype=torch.float32, device=q.device)
    else:
        check_tensor("out", out, dtype=torch.float32, shape=(T, S), last_dim_contiguous=True)
    check_same_device(q=q, weights=weights, k=k, k_scale=k_scale, ks=ks, ke=ke, out=out)
    if T == 0 or S == 0:
        return out
    arch = arch_of(q.device)
    sms = num_sms(q.device)

    def grid(meta):
        m_blocks = cdiv(T, meta["BLOCK_M"])
        return m_blocks, max(1, min(cdiv(S, meta["BLOCK_N"]), cdiv(2 * sms, m_blocks)))

    k_scale = k_scale if k_scale.stride(0) == 1 else k_scale.contiguous()
    fp8 = fp8_dot(arch)
    mqa_logits_kernel[grid](
        operand_view(q, fp8), weights, operand_view(k, fp8), k_scale, ks.contiguous(), ke.contiguous(), out,
        q.stride(0), q.stride(1), weights.stride(0), k.stride(0), out.stride(0),
        T, H, S,
        HP=next_pow2(H), D=D, CLEAN=clean_logits, FP8_DOT=fp8, E4M3=arch.e4m3,
        ACC_STEP=_ACC_STEP,
    )
    return out
