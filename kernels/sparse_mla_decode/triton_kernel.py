"""The portable Triton kernel of sparse MLA decode (any GPU): fp8_ds_mla or bf16 latent cache.

One program owns one token, one block of BLOCK_H heads and one contiguous split of its topk
indices. Per step it gathers BLOCK_N cache rows once and uses them twice: as K (scores over the
four 128-wide latent tiles plus the 64-wide rope) and as V (P.V over the four latent tiles).

fp8_ds_mla: the e4m3 bytes become fp16 exactly (one cvt per two bytes) and are never multiplied
per element. The per-tile scale multiplies the scores (S += s_t * (q_t . k8_t), q_t in fp16
after an exact power-of-two scaling per head) and the probabilities for P.V
(P_t = P * s_t / R_t in fp16, R_t a running power of two >= every tile-t scale, the tile's
accumulator kept in units of R_t). bf16 cache: bf16 operands, P split into bf16 hi + lo parts.
Either way P reaches the tensor cores to ~2^-11 or better: a bf16 P (2^-9) misses the tests'
2/128 where outputs cancel. Scores live in the log2 domain (scale * log2(e) folded in).

A second kernel merges the partial (out, lse) pairs of a topk split (kernels.merge.merge_parts).
Dispatch, configs and splits: kernels/sparse_mla_decode/op.py.
"""
import triton
import triton.language as tl

from openmla.kernels.sparse_mla_decode.shared import (finish_rows, head_f16_factor, keep_faults, pow2_at_least,
                                                      sink_factor, softmax_step, split_range)
from openmla.kernels.merge import fold_parts, merge_finish
from openmla.quant.e4m3 import e4m3_to_f16


@triton.jit
def _split4(x):
    """[..., 4] -> its four [...] slices (in registers when the 4 sit in one thread)."""
    a, b = tl.split(tl.reshape(x, x.shape[:-1] + [2, 2]))
    x0, x2 = tl.split(a)
    x1, x3 = tl.split(b)
    return x0, x1, x2, x3


@triton.jit
def _load_rows(p_row, m_kv, WIDTH: tl.constexpr, FP8: tl.constexpr, E4M3: tl.constexpr):
    """[BLOCK_N, WIDTH] tile of the gathered rows; p_row [BLOCK_N] points at each tile start.

    Rows with m_kv False are never read (masked loads) and come back as 0. FP8: the e4m3 bytes
    come back as fp16, exactly (every e4m3 value is an fp16 value), by the device's e4m3 path
    (quant/e4m3.py; on sm_89+ one cvt.rn.f16x2.e4m3x2 per two bytes, kept before the layout
    change to the dot operand so that the change moves 16-bit data: ldmatrix, not bytes)."""
    b = tl.load(p_row[:, None] + tl.arange(0, WIDTH)[None, :], mask=m_kv[:, None], other=0)
    if FP8:
        b = e4m3_to_f16(b, E4M3)
    return b


@triton.jit
def _pv(b_o, b_p, b_v, FP8: tl.constexpr):
    """b_o [BLOCK_H, TILE] += b_p [BLOCK_H, BLOCK_N] @ b_v [BLOCK_N, TILE], P exact to ~2^-11.

    fp8: b_p in [0, 1] as fp16 against the exact fp16 V. bf16 cache: P as bf16 hi + lo parts
    (a single bf16 P errs by 2^-9 per weight, more than the tests' 2/128 allows where the
    output cancels)."""
    if FP8:
        b_o = tl.dot(b_p.to(tl.float16), b_v, b_o)
    else:
        b_hi = b_p.to(tl.bfloat16)
        b_o = tl.dot(b_hi, b_v, b_o)
        b_o = tl.dot((b_p - b_hi.to(tl.float32)).to(tl.bfloat16), b_v, b_o)
    return b_o


@triton.jit
def sparse_mla_decode_kernel(
    q_ptr, cache_ptr, idx_ptr, len_ptr, sink_ptr, out_ptr, lse_ptr, po_ptr, plse_ptr,
    H, TOPK, CHUNK, NUM_HB, NUM_SPLITS, num_slots, block_size,
    stride_qt, stride_qh, stride_cb, stride_cr, stride_it, stride_ot, stride_oh,
    qk_scale,
    FP8: tl.constexpr, E4M3: tl.constexpr, DENSE: tl.constexpr, HAS_LEN: tl.constexpr,
    HAS_SINK: tl.constexpr, SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    TILE: tl.constexpr, ROPE: tl.constexpr, SCALE_OFF: tl.constexpr, ROPE_OFF: tl.constexpr,
    INF_EMPTY: tl.constexpr,
):
    i_p = tl.program_id(0)
    i_s = tl.program_id(1)
    # head blocks of one token are adjacent program ids: they run together and share L2
    i_t = i_p // NUM_HB
    i_hb = i_p % NUM_HB
    i_t64 = i_t.to(tl.int64)

    k_lo, k_hi = split_range(len_ptr, i_t, i_s, TOPK, CHUNK, tl.num_programs(1), BLOCK_N, HAS_LEN)

    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    o_d = tl.arange(0, TILE)
    p_q = q_ptr + i_t64 * stride_qt + o_h[:, None] * stride_qh
    b_q0 = tl.load(p_q + (0 * TILE + o_d)[None, :], mask=m_h[:, None], other=0.0)
    b_q1 = tl.load(p_q + (1 * TILE + o_d)[None, :], mask=m_h[:, None], other=0.0)
    b_q2 = tl.load(p_q + (2 * TILE + o_d)[None, :], mask=m_h[:, None], other=0.0)
    b_q3 = tl.load(p_q + (3 * TILE + o_d)[None, :], mask=m_h[:, None], other=0.0)
    b_qr = tl.load(p_q + (4 * TILE + tl.arange(0, ROPE))[None, :], mask=m_h[:, None], other=0.0)
    b_fq = tl.full([BLOCK_H], 1.0, tl.float32)
    if FP8:
        # the latent dots run in fp16 (K is exact there); q goes to fp16 exactly after scaling
        # each head by a power of two that puts its |max| in (2^13, 2^14]
        b_amax = tl.maximum(tl.maximum(tl.max(tl.abs(b_q0.to(tl.float32)), 1), tl.max(tl.abs(b_q1.to(tl.float32)), 1)),
                            tl.maximum(tl.max(tl.abs(b_q2.to(tl.float32)), 1), tl.max(tl.abs(b_q3.to(tl.float32)), 1)))
        b_fq = head_f16_factor(b_amax)
        b_q0 = (b_q0.to(tl.float32) / b_fq[:, None]).to(tl.float16)
        b_q1 = (b_q1.to(tl.float32) / b_fq[:, None]).to(tl.float16)
        b_q2 = (b_q2.to(tl.float32) / b_fq[:, None]).to(tl.float16)
        b_q3 = (b_q3.to(tl.float32) / b_fq[:, None]).to(tl.float16)
    b_fq = b_fq * qk_scale  # scores in the log2 domain: qk_scale = scale * log2(e)

    b_m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_H], tl.float32)
    b_o0 = tl.zeros([BLOCK_H, TILE], tl.float32)
    b_o1 = tl.zeros([BLOCK_H, TILE], tl.float32)
    b_o2 = tl.zeros([BLOCK_H, TILE], tl.float32)
    b_o3 = tl.zeros([BLOCK_H, TILE], tl.float32)
    # fp8: b_o_t holds the tile's output in units of b_r_t, a power of two >= every tile scale
    # seen so far, so that P_t = P * scale_t / b_r_t stays in [0, 1] for the fp16 P.V
    b_r = tl.full([4], 2.0**-126, tl.float32)

    for start in range(k_lo, k_hi, BLOCK_N):
        o_n = start + tl.arange(0, BLOCK_N)
        m_n = o_n < k_hi
        b_idx = tl.load(idx_ptr + i_t64 * stride_it + o_n, mask=m_n, other=-1)
        m_kv = m_n & (b_idx >= 0) & (b_idx < num_slots)
        # 64-bit row offsets: block * block stride can pass 2^31 elements
        if DENSE:
            row = b_idx.to(tl.int64) * stride_cr
        else:
            row = (b_idx // block_size).to(tl.int64) * stride_cb + (b_idx % block_size).to(tl.int64) * stride_cr
        p_row = cache_ptr + row
        # the rope is bf16 in both formats (ROPE_OFF in cache elements: bytes for fp8_ds_mla)
        b_kr = _load_rows((p_row + ROPE_OFF).to(tl.pointer_type(tl.bfloat16)), m_kv, ROPE, False, E4M3)
        b_k0 = _load_rows(p_row + 0 * TILE, m_kv, TILE, FP8, E4M3)
        b_k1 = _load_rows(p_row + 1 * TILE, m_kv, TILE, FP8, E4M3)
        b_k2 = _load_rows(p_row + 2 * TILE, m_kv, TILE, FP8, E4M3)
        b_k3 = _load_rows(p_row + 3 * TILE, m_kv, TILE, FP8, E4M3)
        if FP8:
            # the four tile scales of each row: one 16-byte load, split in registers
            p_s = (p_row + SCALE_OFF).to(tl.pointer_type(tl.float32))
            b_sv = tl.load(p_s[:, None] + tl.arange(0, 4)[None, :], mask=m_kv[:, None], other=0.0)
            b_s0, b_s1, b_s2, b_s3 = _split4(b_sv)
            # the per-key tile scale multiplies the scores, never the cache elements
            b_sc = tl.dot(b_q0, tl.trans(b_k0)) * b_s0[None, :]
            b_sc += tl.dot(b_q1, tl.trans(b_k1)) * b_s1[None, :]
            b_sc += tl.dot(b_q2, tl.trans(b_k2)) * b_s2[None, :]
            b_sc += tl.dot(b_q3, tl.trans(b_k3)) * b_s3[None, :]
            b_sc = b_sc * b_fq[:, None] + tl.dot(b_qr, tl.trans(b_kr)) * qk_scale
        else:
            # one tensor-core accumulation per 128-wide tile, summed in fp32: a single K=576 chain
            # loses a few ulps more (its fp32 accumulation truncates), too many for lse at 1e-5.
            # The multiply keeps Triton from folding the adds back into one dot chain.
            b_sc = tl.dot(b_qr, tl.trans(b_kr)) * qk_scale
            b_sc += tl.dot(b_q0, tl.trans(b_k0)) * qk_scale
            b_sc += tl.dot(b_q1, tl.trans(b_k1)) * qk_scale
            b_sc += tl.dot(b_q2, tl.trans(b_k2)) * qk_scale
            b_sc += tl.dot(b_q3, tl.trans(b_k3)) * qk_scale
        # a NaN or inf score of a valid key turns NaN (kernels/softmax.py): the row ends NaN
        b_sc = tl.where(m_kv[None, :], keep_faults(b_sc), float("-inf"))

        # rescale the accumulators only when some factor changed (rare once the max settles)
        b_m, alpha, b_p, b_l, grow = softmax_step(b_m, b_l, b_sc)
        if FP8:
            # fp16 P_t = P * s_t / R_t in [0, 1] with R_t a power of two >= every tile-t scale so
            # far; the accumulator of tile t is kept in units of R_t
            b_n = tl.maximum(b_r, pow2_at_least(tl.max(b_sv, 0) + 1e-38))
            grow = grow | tl.max(tl.where(b_n > b_r, 1, 0), 0)
            b_f0, b_f1, b_f2, b_f3 = _split4(b_r / b_n)
            b_n0, b_n1, b_n2, b_n3 = _split4(b_n)
            b_r = b_n
            if grow > 0:
                b_o0 = b_o0 * (alpha * b_f0)[:, None]
                b_o1 = b_o1 * (alpha * b_f1)[:, None]
                b_o2 = b_o2 * (alpha * b_f2)[:, None]
                b_o3 = b_o3 * (alpha * b_f3)[:, None]
            b_o0 = _pv(b_o0, b_p * (b_s0 / b_n0)[None, :], b_k0, FP8)
            b_o1 = _pv(b_o1, b_p * (b_s1 / b_n1)[None, :], b_k1, FP8)
            b_o2 = _pv(b_o2, b_p * (b_s2 / b_n2)[None, :], b_k2, FP8)
            b_o3 = _pv(b_o3, b_p * (b_s3 / b_n3)[None, :], b_k3, FP8)
        else:
            if grow > 0:
                b_o0 = b_o0 * alpha[:, None]
                b_o1 = b_o1 * alpha[:, None]
                b_o2 = b_o2 * alpha[:, None]
                b_o3 = b_o3 * alpha[:, None]
            b_o0 = _pv(b_o0, b_p, b_k0, FP8)
            b_o1 = _pv(b_o1, b_p, b_k1, FP8)
            b_o2 = _pv(b_o2, b_p, b_k2, FP8)
            b_o3 = _pv(b_o3, b_p, b_k3, FP8)

    b_inv, b_lse = finish_rows(b_l, b_m)
    if FP8:
        b_r0, b_r1, b_r2, b_r3 = _split4(b_r)
        b_o0 = b_o0 * b_r0
        b_o1 = b_o1 * b_r1
        b_o2 = b_o2 * b_r2
        b_o3 = b_o3 * b_r3
    if SPLIT:
        # normalized partial out and natural-log lse per split; the merge kernel combines them
        p_po = po_ptr + ((i_t64 * NUM_SPLITS + i_s) * H + o_h)[:, None] * (4 * TILE) + o_d[None, :]
        tl.store(p_po + 0 * TILE, b_o0 * b_inv[:, None], mask=m_h[:, None])
        tl.store(p_po + 1 * TILE, b_o1 * b_inv[:, None], mask=m_h[:, None])
        tl.store(p_po + 2 * TILE, b_o2 * b_inv[:, None], mask=m_h[:, None])
        tl.store(p_po + 3 * TILE, b_o3 * b_inv[:, None], mask=m_h[:, None])
        tl.store(plse_ptr + (i_t64 * NUM_SPLITS + i_s) * H + o_h, b_lse, mask=m_h)
    else:
        if HAS_SINK:
            b_inv = b_inv * sink_factor(sink_ptr, o_h, m_h, b_lse)
        p_o = out_ptr + i_t64 * stride_ot + o_h[:, None] * stride_oh + o_d[None, :]
        ty = out_ptr.dtype.element_ty
        tl.store(p_o + 0 * TILE, (b_o0 * b_inv[:, None]).to(ty), mask=m_h[:, None])
        tl.store(p_o + 1 * TILE, (b_o1 * b_inv[:, None]).to(ty), mask=m_h[:, None])
        tl.store(p_o + 2 * TILE, (b_o2 * b_inv[:, None]).to(ty), mask=m_h[:, None])
        tl.store(p_o + 3 * TILE, (b_o3 * b_inv[:, None]).to(ty), mask=m_h[:, None])
        if INF_EMPTY:  # FlashMLA's lse for a row without a valid index
            b_lse = tl.where(b_lse == float("-inf"), float("inf"), b_lse)
        tl.store(lse_ptr + i_t64 * H + o_h, b_lse, mask=m_h)


@triton.jit
def sparse_mla_decode_merge_kernel(
    po_ptr, plse_ptr, sink_ptr, out_ptr, lse_ptr,
    H, NUM_SPLITS, stride_ot, stride_oh,
    HAS_SINK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, DV: tl.constexpr,
    INF_EMPTY: tl.constexpr,
):
    """Merge the NUM_SPLITS normalized partials (out_s, lse_s) of one token and head block,
    BLOCK_S of them a step (their loads issued together: kernels.merge.fold_parts)."""
    i_t = tl.program_id(0).to(tl.int64)
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    o_d = tl.arange(0, DV)
    acc, m_i, l_i = fold_parts(po_ptr, plse_ptr, i_t * NUM_SPLITS, NUM_SPLITS, H, o_h, m_h, BLOCK_S, BLOCK_H, DV)
    b_o, b_lse = merge_finish(acc, m_i, l_i)
    if HAS_SINK:
        b_o = b_o * sink_factor(sink_ptr, o_h, m_h, b_lse)[:, None]
    tl.store(out_ptr + i_t * stride_ot + o_h[:, None] * stride_oh + o_d[None, :],
             b_o.to(out_ptr.dtype.element_ty), mask=m_h[:, None])
    if INF_EMPTY:  # FlashMLA's lse for a row without a valid index
        b_lse = tl.where(b_lse == float("-inf"), float("inf"), b_lse)
    tl.store(lse_ptr + i_t * H + o_h, b_lse, mask=m_h)
