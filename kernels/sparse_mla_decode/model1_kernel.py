"""The portable Triton kernel of sparse MLA decode over MODEL1 (DeepSeek-V4) caches (any GPU),
with an optional extra cache whose selected tokens join the same softmax.

MODEL1 token (quant/model1_format.py): d_qk = d_v = 512 = 448 "nope" dims stored as e4m3 bytes
in 7 tiles of 64, one ue8m0 scale byte (2^(b - 127)) per tile, and 64 rope dims in bf16; V is the
whole dequantized token, rope included. Within a page block the token records (448 nope bytes,
then 128 rope bytes; REC bytes apart) come first, then one SCALE_BYTES group per token (7 scale
bytes and a pad byte that is never read).

One program owns one token, one block of BLOCK_H heads and one contiguous split of the token's
joined index list: the main list (TOPK indices into `cache`, cut at topk_length), then from
position XSTART (TOPK rounded up to BLOCK_N) the extra list (XTOPK indices into `extra_cache`,
cut at extra_topk_length). Both parts run through one online softmax, so a split that straddles
them, or the whole list in one program, needs no merge; the sink is applied once, to the joined
result (here when one split covers everything, else in the merge kernel).

Arithmetic as in the fp8_ds_mla kernel (kernels/sparse_mla_decode/triton_kernel.py): the e4m3
bytes become fp16 exactly and are never multiplied per element; a tile's scale multiplies the
scores (S += s_t * (q_t . k8_t), q_t fp16 after an exact power-of-two scaling per head) and the
probabilities for P.V (P_t = P * s_t / R_t in fp16, R_t a running power of two >= every tile-t
scale, the tile's accumulator kept in units of R_t). The rope is bf16 in K and in V: its P.V takes
P as bf16 hi + lo parts. Scores live in the log2 domain (scale * log2(e) folded in).

Dispatch, splits and the merge: kernels/sparse_mla_decode/op.py.
"""
import triton
import triton.language as tl

from openmla.kernels.sparse_mla_decode.shared import (finish_rows, head_f16_factor, keep_faults,
                                                      sink_factor, softmax_step)
from openmla.kernels.sparse_mla_decode.triton_kernel import _load_rows, _pv, _split4
from openmla.quant.e4m3 import e4m3_to_f16
from openmla.quant.ue8m0 import ue8m0_to_f32


@triton.jit
def _split8(x):
    """[..., 8] -> its eight [...] slices, in order."""
    ev, od = tl.split(tl.reshape(x, x.shape[:-1] + [4, 2]))
    x0, x2, x4, x6 = _split4(ev)
    x1, x3, x5, x7 = _split4(od)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _scores(b_q, b_k, b_s):
    """[BLOCK_H, BLOCK_N] s_t * (q_t . k8_t) of one nope tile (fp16 operands, fp32 accumulation)."""
    return tl.dot(b_q, tl.trans(b_k)) * b_s[None, :]


@triton.jit
def _attend(b_m, b_l, b_r, b_o0, b_o1, b_o2, b_o3, b_o4, b_o5, b_o6, b_or,
            b_q0, b_q1, b_q2, b_q3, b_q4, b_q5, b_q6, b_qr, b_fq, qk_scale,
            p_idx, k_lo, k_hi, cache_ptr, num_slots, block_size, stride_cb,
            E4M3: tl.constexpr, BLOCK_N: tl.constexpr, TILE: tl.constexpr, NT: tl.constexpr,
            ROPE: tl.constexpr, REC: tl.constexpr, ROPE_OFF: tl.constexpr, SCALE_BYTES: tl.constexpr):
    """Fold the indices p_idx[k_lo:k_hi] of one cache into the online softmax state."""
    o_sb = tl.arange(0, SCALE_BYTES)
    for start in range(k_lo, k_hi, BLOCK_N):
        o_n = start + tl.arange(0, BLOCK_N)
        m_n = o_n < k_hi
        b_idx = tl.load(p_idx + o_n, mask=m_n, other=-1)
        m_kv = m_n & (b_idx >= 0) & (b_idx < num_slots)
        b_idx = tl.where(m_kv, b_idx, 0)
        # 64-bit offsets: block * block stride can pass 2^31 bytes
        b_blk = (b_idx // block_size).to(tl.int64) * stride_cb
        b_tok = (b_idx % block_size).to(tl.int64)
        p_rec = cache_ptr + b_blk + b_tok * REC
        b_kr = _load_rows((p_rec + ROPE_OFF).to(tl.pointer_type(tl.bfloat16)), m_kv, ROPE, False, E4M3)
        b_k0 = _load_rows(p_rec + 0 * TILE, m_kv, TILE, True, E4M3)
        b_k1 = _load_rows(p_rec + 1 * TILE, m_kv, TILE, True, E4M3)
        b_k2 = _load_rows(p_rec + 2 * TILE, m_kv, TILE, True, E4M3)
        b_k3 = _load_rows(p_rec + 3 * TILE, m_kv, TILE, True, E4M3)
        b_k4 = _load_rows(p_rec + 4 * TILE, m_kv, TILE, True, E4M3)
        b_k5 = _load_rows(p_rec + 5 * TILE, m_kv, TILE, True, E4M3)
        b_k6 = _load_rows(p_rec + 6 * TILE, m_kv, TILE, True, E4M3)
        # the seven scale bytes of each row in one load (the pad byte is not read: writers may
        # leave it unset), split in registers; unread bytes come back 0 = 2^-127, under every R_t
        p_s = cache_ptr + b_blk + block_size * REC + b_tok * SCALE_BYTES
        b_sb = tl.load(p_s[:, None] + o_sb[None, :], mask=m_kv[:, None] & (o_sb < NT)[None, :], other=0)
        b_sv = ue8m0_to_f32(b_sb)  # exact; byte 255 is NaN (a fault)
        b_s0, b_s1, b_s2, b_s3, b_s4, b_s5, b_s6, _ = _split8(b_sv)
        b_sc = _scores(b_q0, b_k0, b_s0)
        b_sc += _scores(b_q1, b_k1, b_s1)
        b_sc += _scores(b_q2, b_k2, b_s2)
        b_sc += _scores(b_q3, b_k3, b_s3)
        b_sc += _scores(b_q4, b_k4, b_s4)
        b_sc += _scores(b_q5, b_k5, b_s5)
        b_sc += _scores(b_q6, b_k6, b_s6)
        b_sc = b_sc * b_fq[:, None] + tl.dot(b_qr, tl.trans(b_kr)) * qk_scale
        # a NaN or inf score of a valid key turns NaN (kernels/softmax.py): the row ends NaN
        b_sc = tl.where(m_kv[None, :], keep_faults(b_sc), float("-inf"))

        b_m, alpha, b_p, b_l, grow = softmax_step(b_m, b_l, b_sc)
        # fp16 P_t = P * s_t / R_t in [0, 1], R_t a power of two >= every tile-t scale so far (the
        # scales are powers of two: their max is one); accumulators rescale only when a factor grew
        b_n = tl.maximum(b_r, tl.max(b_sv, 0))
        grow = grow | tl.max(tl.where(b_n > b_r, 1, 0), 0)
        b_f0, b_f1, b_f2, b_f3, b_f4, b_f5, b_f6, _ = _split8(b_r / b_n)
        b_n0, b_n1, b_n2, b_n3, b_n4, b_n5, b_n6, _ = _split8(b_n)
        b_r = b_n
        if grow > 0:
            b_o0 = b_o0 * (alpha * b_f0)[:, None]
            b_o1 = b_o1 * (alpha * b_f1)[:, None]
            b_o2 = b_o2 * (alpha * b_f2)[:, None]
            b_o3 = b_o3 * (alpha * b_f3)[:, None]
            b_o4 = b_o4 * (alpha * b_f4)[:, None]
            b_o5 = b_o5 * (alpha * b_f5)[:, None]
            b_o6 = b_o6 * (alpha * b_f6)[:, None]
            b_or = b_or * alpha[:, None]
        b_o0 = _pv(b_o0, b_p * (b_s0 / b_n0)[None, :], b_k0, True)
        b_o1 = _pv(b_o1, b_p * (b_s1 / b_n1)[None, :], b_k1, True)
        b_o2 = _pv(b_o2, b_p * (b_s2 / b_n2)[None, :], b_k2, True)
        b_o3 = _pv(b_o3, b_p * (b_s3 / b_n3)[None, :], b_k3, True)
        b_o4 = _pv(b_o4, b_p * (b_s4 / b_n4)[None, :], b_k4, True)
        b_o5 = _pv(b_o5, b_p * (b_s5 / b_n5)[None, :], b_k5, True)
        b_o6 = _pv(b_o6, b_p * (b_s6 / b_n6)[None, :], b_k6, True)
        b_or = _pv(b_or, b_p, b_kr, False)
    return b_m, b_l, b_r, b_o0, b_o1, b_o2, b_o3, b_o4, b_o5, b_o6, b_or


@triton.jit
def _load_q_tile(p_q, t, m_h, TILE: tl.constexpr, b_fq):
    """Nope tile t of q [BLOCK_H, TILE] in fp16: q / f per head (f a power of two: exact)."""
    b = tl.load(p_q + (t * TILE + tl.arange(0, TILE))[None, :], mask=m_h[:, None], other=0.0)
    return (b.to(tl.float32) / b_fq[:, None]).to(tl.float16)


@triton.jit
def _tile_amax(p_q, t, m_h, TILE: tl.constexpr):
    b = tl.load(p_q + (t * TILE + tl.arange(0, TILE))[None, :], mask=m_h[:, None], other=0.0)
    return tl.max(tl.abs(b.to(tl.float32)), 1)


@triton.jit
def _store_tile(p, b_o, m_h):
    """Store [BLOCK_H, TILE] fp32 at p in p's dtype (fp32 partials, or the output's)."""
    tl.store(p, b_o.to(p.dtype.element_ty), mask=m_h[:, None])


@triton.jit
def sparse_mla_decode_model1_kernel(
    q_ptr, cache_ptr, idx_ptr, len_ptr, xcache_ptr, xidx_ptr, xlen_ptr, sink_ptr,
    out_ptr, lse_ptr, po_ptr, plse_ptr,
    H, TOPK, XTOPK, XSTART, CHUNK, NUM_HB, NUM_SPLITS,
    num_slots, block_size, x_num_slots, x_block_size,
    stride_qt, stride_qh, stride_cb, stride_xb, stride_it, stride_xt, stride_ot, stride_oh,
    qk_scale,
    E4M3: tl.constexpr, HAS_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_XLEN: tl.constexpr,
    HAS_SINK: tl.constexpr, SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    TILE: tl.constexpr, NT: tl.constexpr, ROPE: tl.constexpr, REC: tl.constexpr,
    ROPE_OFF: tl.constexpr, SCALE_BYTES: tl.constexpr,
):
    tl.static_assert(ROPE == TILE)  # the rope is stored as one more output tile
    i_p = tl.program_id(0)
    i_s = tl.program_id(1)
    # head blocks of one token are adjacent program ids: they run together and share L2
    i_t = i_p // NUM_HB
    i_hb = i_p % NUM_HB
    i_t64 = i_t.to(tl.int64)

    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    p_q = q_ptr + i_t64 * stride_qt + o_h[:, None] * stride_qh
    # the nope dots run in fp16 (K is exact there); q goes to fp16 exactly after scaling each head
    # by a power of two that puts its |max| over the nope dims in (2^13, 2^14]
    b_amax = tl.maximum(tl.maximum(tl.maximum(_tile_amax(p_q, 0, m_h, TILE), _tile_amax(p_q, 1, m_h, TILE)),
                                   tl.maximum(_tile_amax(p_q, 2, m_h, TILE), _tile_amax(p_q, 3, m_h, TILE))),
                        tl.maximum(tl.maximum(_tile_amax(p_q, 4, m_h, TILE), _tile_amax(p_q, 5, m_h, TILE)),
                                   _tile_amax(p_q, 6, m_h, TILE)))
    b_fq = head_f16_factor(b_amax)
    b_q0 = _load_q_tile(p_q, 0, m_h, TILE, b_fq)
    b_q1 = _load_q_tile(p_q, 1, m_h, TILE, b_fq)
    b_q2 = _load_q_tile(p_q, 2, m_h, TILE, b_fq)
    b_q3 = _load_q_tile(p_q, 3, m_h, TILE, b_fq)
    b_q4 = _load_q_tile(p_q, 4, m_h, TILE, b_fq)
    b_q5 = _load_q_tile(p_q, 5, m_h, TILE, b_fq)
    b_q6 = _load_q_tile(p_q, 6, m_h, TILE, b_fq)
    b_qr = tl.load(p_q + (NT * TILE + tl.arange(0, ROPE))[None, :], mask=m_h[:, None], other=0.0)
    b_fq = b_fq * qk_scale  # scores in the log2 domain: qk_scale = scale * log2(e)

    b_m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_H], tl.float32)
    b_o0 = tl.zeros([BLOCK_H, TILE], tl.float32)
    b_o1 = tl.zeros([BLOCK_H, TILE], tl.float32)
    b_o2 = tl.zeros([BLOCK_H, TILE], tl.float32)
    b_o3 = tl.zeros([BLOCK_H, TILE], tl.float32)
    b_o4 = tl.zeros([BLOCK_H, TILE], tl.float32)
    b_o5 = tl.zeros([BLOCK_H, TILE], tl.float32)
    b_o6 = tl.zeros([BLOCK_H, TILE], tl.float32)
    b_or = tl.zeros([BLOCK_H, ROPE], tl.float32)
    b_r = tl.full([SCALE_BYTES], 2.0**-126, tl.float32)

    # this split's part [lo, hi) of the joined list: main positions [0, TOPK), extra from XSTART
    k_lo = i_s * CHUNK
    k_hi = k_lo + CHUNK
    n_main = TOPK
    if HAS_LEN:
        n_main = tl.minimum(tl.maximum(tl.load(len_ptr + i_t), 0), TOPK)
    b_m, b_l, b_r, b_o0, b_o1, b_o2, b_o3, b_o4, b_o5, b_o6, b_or = _attend(
        b_m, b_l, b_r, b_o0, b_o1, b_o2, b_o3, b_o4, b_o5, b_o6, b_or,
        b_q0, b_q1, b_q2, b_q3, b_q4, b_q5, b_q6, b_qr, b_fq, qk_scale,
        idx_ptr + i_t64 * stride_it, k_lo, tl.minimum(k_hi, n_main),
        cache_ptr, num_slots, block_size, stride_cb,
        E4M3, BLOCK_N, TILE, NT, ROPE, REC, ROPE_OFF, SCALE_BYTES)
    if HAS_EXTRA:
        n_extra = XTOPK
        if HAS_XLEN:
            n_extra = tl.minimum(tl.maximum(tl.load(xlen_ptr + i_t), 0), XTOPK)
        b_m, b_l, b_r, b_o0, b_o1, b_o2, b_o3, b_o4, b_o5, b_o6, b_or = _attend(
            b_m, b_l, b_r, b_o0, b_o1, b_o2, b_o3, b_o4, b_o5, b_o6, b_or,
            b_q0, b_q1, b_q2, b_q3, b_q4, b_q5, b_q6, b_qr, b_fq, qk_scale,
            xidx_ptr + i_t64 * stride_xt, tl.maximum(k_lo - XSTART, 0),
            tl.minimum(k_hi - XSTART, n_extra),
            xcache_ptr, x_num_slots, x_block_size, stride_xb,
            E4M3, BLOCK_N, TILE, NT, ROPE, REC, ROPE_OFF, SCALE_BYTES)

    b_inv, b_lse = finish_rows(b_l, b_m)
    if SPLIT:
        # normalized partial out and natural-log lse per split; the merge kernel combines them
        p_o = po_ptr + ((i_t64 * NUM_SPLITS + i_s) * H + o_h)[:, None] * (NT * TILE + ROPE)
    else:
        if HAS_SINK:
            b_inv = b_inv * sink_factor(sink_ptr, o_h, m_h, b_lse)
        p_o = out_ptr + i_t64 * stride_ot + o_h[:, None] * stride_oh
    p_o = p_o + tl.arange(0, TILE)[None, :]
    b_r0, b_r1, b_r2, b_r3, b_r4, b_r5, b_r6, _ = _split8(b_r)
    # the nope tiles' accumulators are in units of R_t; the rope's is plain
    _store_tile(p_o + 0 * TILE, b_o0 * (b_r0 * b_inv)[:, None], m_h)
    _store_tile(p_o + 1 * TILE, b_o1 * (b_r1 * b_inv)[:, None], m_h)
    _store_tile(p_o + 2 * TILE, b_o2 * (b_r2 * b_inv)[:, None], m_h)
    _store_tile(p_o + 3 * TILE, b_o3 * (b_r3 * b_inv)[:, None], m_h)
    _store_tile(p_o + 4 * TILE, b_o4 * (b_r4 * b_inv)[:, None], m_h)
    _store_tile(p_o + 5 * TILE, b_o5 * (b_r5 * b_inv)[:, None], m_h)
    _store_tile(p_o + 6 * TILE, b_o6 * (b_r6 * b_inv)[:, None], m_h)
    _store_tile(p_o + NT * TILE, b_or * b_inv[:, None], m_h)
    if SPLIT:
        tl.store(plse_ptr + (i_t64 * NUM_SPLITS + i_s) * H + o_h, b_lse, mask=m_h)
    else:
        tl.store(lse_ptr + i_t64 * H + o_h, b_lse, mask=m_h)
