"""The Triton kernels of `paged_attention` and `varlen_attention`, with their autotune configs.

One kernel, `paged_attention_kernel`:
- A program owns BLOCK_M packed rows of one request and one KV head. Row m is query token
  m // GQA and query head kv_head * GQA + m % GQA, so the GQA heads sharing a KV head (and,
  for short queries, several query tokens) fill the M dimension of both dots and each K/V tile
  is loaded once for all of them. Programs find their request by a binary search over
  cu_seqlens_q (request r's first block is cu_q[r] * GQA // BLOCK_M + r), so the grid comes
  from shapes alone. Rows past cu_seqlens_q[-1] form a pseudo-request that writes 0 / -inf.
- Per step it gathers BLOCK_N keys through the block table (64-bit block offsets, any page
  size, NHD or HND through strides), scores them with one dot in the log2 domain (softmax
  scale, log2(e) and the fp8 k_scale folded into one factor; fp8 K and V are converted to q's
  dtype exactly and v_scale multiplies the output), and keeps an online softmax.
- Only key tiles that some row of the program may see are visited (causal and window bounds),
  and only positions < seq_len (and inside that union) are read: block table entries beyond
  the sequence and cache rows outside it are never touched.
- Every program (prefill and decode alike) splits its keys into interior tiles, seen by every
  row of the block behind valid block ids, and the masked tiles at the causal diagonal and
  window edges (FlashAttention's off-band / on-band loops). Interior tiles use no masks and take
  their block ids from registers loaded one tile ahead, so the compiler's pipeliner issues
  their K / V copies num_stages - 1 tiles ahead (a block-id load in the same iteration would
  make it wait for every copy at each step).
  Row blocks launch last-first: the most expensive causal blocks start in the first wave.
- Short queries (decode, speculative decoding) whose grid would underfill the GPU split the key
  range over NUM_SPLITS programs; `paged_attention_reduce_kernel` folds the partial
  (out, lse) pairs with `kernels.merge.merge_parts`. The split count is chosen on the host from
  shapes and the SM count: the decode path reads no device tensor on the host.
- Short queries may run as key streams (autotune config STREAMS = warps): each warp takes its
  own BLOCK_N / STREAMS keys of every tile and keeps its own online softmax (3-D dots with the
  warps on the batch dimension), so no tile needs a cross-warp row max / sum or P through shared
  memory; the streams merge once per program. With 16 rows and GQA 4, the one-stream layout
  spends its time in those per-tile exchanges (docs/notes/paged_attention.md, key streams).
- int8 caches (int8_qkv / int8_qk): q is quantized per row in the kernel, Q.K is an int8 dot
  scaled by s_q * s_k per score, and an int8 V enters the P.V dot as fp16 (converted exactly,
  on NVIDIA with byte permutes instead of quarter-rate I2F), its per-channel scale applied to
  the output once.
- Encoder attention (`varlen_attention`, varlen.py) is the same kernel with IS_PAGED off:
  request r's keys are rows cu_seqlens_k[r] + j of contiguous k / v.

Block shapes are autotune configs keyed on shape classes (row bucket, GQA, head dim, page
size, fp8, split count), chosen as every op chooses them (kernels/configs.py): the first call per
class benchmarks them, so warm up outside CUDA-graph capture.
"""
from __future__ import annotations

import triton
import triton.language as tl

from openmla.kernels.device import arch_of
from openmla.kernels.configs import ConfigSpace
from openmla.kernels.merge import merge_finish, merge_parts
from openmla.kernels.softmax import finish_rows, row_faults
from openmla.kernels.paged_attention.key_flags import GROUP
from openmla.kernels.paged_attention.tile import (_attend_tile, _key_bounds, _merge_streams,
                                                  _rows)
from openmla.quant.int8 import INT8_SCALE_FLOOR, int8_quantize_rows

_INT8_FLOOR = tl.constexpr(INT8_SCALE_FLOOR)
KEY_GROUP = tl.constexpr(GROUP)


# ---------------------------------------------------------------------------------------------
# Autotune configs
# ---------------------------------------------------------------------------------------------
def _config(bm, bn, w, s, maxnreg=None, streams=0):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "STREAMS": streams}, num_warps=w,
                         num_stages=s, maxnreg=maxnreg)


# Sound defaults first (the first survivor of pruning is what runs without benchmarking), then
# the rest of the grid. Long queries: 128 x 128 tiles, 8 warps, 3 stages (D <= 128), else
# 128 x 64, else 64 x 64 (D = 256): the fastest for each head dim (docs/notes/paged_attention.md).
_DEFAULTS = [(16, 64, 4, 2), (32, 64, 4, 2), (128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 2),
             (64, 64, 8, 3), (64, 64, 8, 2), (64, 32, 8, 2)]
_CONFIGS = [_config(*c) for c in _DEFAULTS] + [
    _config(bm, bn, w, s)
    for bm in (16, 32, 64, 128) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3)
    if (bm, bn, w, s) not in _DEFAULTS
] + [
    # int8 decode: the 128-key kernel capped at 168 registers (from 255), for large batches
    # (int8-only: see _prune).
    _config(16, 128, 4, 3, maxnreg=168),
] + [
    # Short queries, one key stream per warp (see the kernel), BLOCK_N / 4 keys per warp and
    # tile; 4-warp programs only (2-warp ones with 2 streams were slower: see the notes).
    _config(16, bn, 4, 3, streams=4) for bn in (64, 128)
]


def _prune(configs, named_args, **kwargs):
    """Configs worth timing for one launch on its device; each rule says why it drops a config."""
    want_m = kwargs["BLOCK_M_WANT"]
    d = kwargs["BLOCK_D"]
    arch = arch_of(named_args["q_ptr"].device)
    lanes = arch.warp_size  # threads of a warp (an AMD wavefront has 64)
    kept = []
    for c in configs:
        bm, bn, w, s = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages
        # Register caps were measured for the int8 decode kernels only, and are an NVIDIA option.
        if c.maxnreg is not None and not ((kwargs["K_INT8"] or kwargs["V_INT8"]) and arch.maxnreg):
            continue
        streams = c.kwargs["STREAMS"]
        if streams:
            # One stream per warp, for short queries (their programs hold one row block), with
            # >= 16 keys per stream and tile (the P.V dot's k) and at most 64 accumulator values
            # per thread (each warp holds all [BLOCK_M, D] of its stream: D <= 128 at 16 rows;
            # this replaces the register rule below, which assumes warps share the accumulator).
            if not want_m or streams != w or bn // streams < 16 or bm * d / lanes > 64:
                continue
        # Short queries: the host sized the grid and the split count for this BLOCK_M.
        if want_m and bm != want_m:
            continue
        # Long queries: below 64 rows Hopper's wgmma (M = 64 per warpgroup) runs partly empty.
        if not want_m and bm < 64:
            continue
        # Decode-sized row blocks do little math per key: 8 warps only split the same loads.
        if bm <= 32 and w == 8:
            continue
        # Registers: the fp32 accumulator, the score tile and one K/V operand tile spread over the
        # threads. ptxas for sm_90 spills past ~176 such values per
        # thread (D=128: 64x128 keys at 4 warps, 128x128 at 8) and never below it. Long bf16/fp16
        # queries copy K/V straight to shared memory (no operand tile in registers) and keep
        # their interior loop free of spills up to 144 accumulator + score values per thread
        # (D=128 128x128 at 8 warps is 128).
        if not want_m and not (kwargs["IS_FP8"] or kwargs["K_INT8"] or kwargs["V_INT8"]):
            if (bm * d + bm * bn) / (lanes * w) > 144:
                continue
        elif not streams and (bm * d + bm * bn + bn * d) / (lanes * w) > 176:
            continue
        # Shared memory: q plus `s` stages of K and V tiles (2-byte operands) within the device's
        # budget; the compiler's reduction scratch reuses that space (D=128 128x128 at 3 stages
        # compiles to 224 KB on sm_90).
        if 2 * (bm * d + 2 * s * bn * d) > arch.smem_bytes - 2 * 1024:
            continue
        kept.append(c)
    if not kept:  # the smallest tile for the wanted BLOCK_M always runs
        kept = [_config(want_m or 64, 32, 4, 2)]
    return kept


_SPACE = ConfigSpace("paged_attention_kernel", tuple(_CONFIGS),
                     key=("BLOCK_M_WANT", "GQA", "HEAD_DIM", "PAGE_SIZE", "IS_FP8", "K_INT8",
                          "V_INT8", "NUM_SPLITS"),
                     prune=_prune)


@_SPACE.autotune()
@triton.jit
def paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cu_q_ptr, lens_ptr,
    alibi_ptr, sink_ptr, k_scale_ptr, v_scale_ptr, ksc_ptr, ksm_ptr, kflags_ptr, out_ptr, lse_ptr,
    T, R, NUM_BLOCKS, MAX_KV,
    qk_scale2, softcap2, win_left, win_right,
    s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bt,
    s_os, s_ot, s_oh, s_ls, s_lt, s_lh, s_kscb, s_ksch, s_ksct, s_vsh, s_vsd, s_ksmh, s_ksmd,
    s_kfr, s_kfh,
    BLOCK_M_WANT: tl.constexpr, GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, IS_PAGED: tl.constexpr, IS_FP8: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, ALIBI_SQRT: tl.constexpr, HAS_SINKS: tl.constexpr,
    NUM_SPLITS: tl.constexpr, WRITE_LSE: tl.constexpr, NEG_Q: tl.constexpr,
    KV_SAME: tl.constexpr, K_INT8: tl.constexpr, V_INT8: tl.constexpr, V_FAST_CVT: tl.constexpr,
    K_SMOOTH: tl.constexpr, KEY_FLAGS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    STREAMS: tl.constexpr,
):
    i_qb = tl.program_id(0)
    if BLOCK_M_WANT == 0:
        # Long causal queries: a request's last row blocks see the most keys. Launch them first
        # so that the last wave holds short programs instead of a tail of long ones.
        i_qb = tl.num_programs(0) - 1 - i_qb
    i_kvh = tl.program_id(1)
    i_split = tl.program_id(2)

    # Request of this row block: the largest r in [0, R] whose first block is <= i_qb
    # (r == R is the pseudo-request of padding rows past cu_seqlens_q[R]).
    r_lo = tl.full([], 0, tl.int32)
    r_hi = tl.full([], 0, tl.int32) + R
    while r_lo < r_hi:
        r_mid = (r_lo + r_hi + 1) // 2
        if tl.load(cu_q_ptr + r_mid) * GQA // BLOCK_M + r_mid <= i_qb:
            r_lo = r_mid
        else:
            r_hi = r_mid - 1
    i_r = r_lo
    q_start = tl.load(cu_q_ptr + i_r)
    q_end = tl.load(cu_q_ptr + i_r + 1, mask=i_r < R, other=T)
    q_rows = (q_end - q_start) * GQA
    row0 = (i_qb - (q_start * GQA // BLOCK_M + i_r)) * BLOCK_M
    if row0 >= q_rows:
        return

    if IS_PAGED:
        seq_len = tl.load(lens_ptr + i_r, mask=i_r < R, other=0)
        kv_cap = MAX_KV  # block table columns * page size
    else:  # lens_ptr is cu_seqlens_k: keys of request r are rows kv_start + j
        kv_start = tl.load(lens_ptr + i_r, mask=i_r < R, other=0).to(tl.int64)
        seq_len = tl.load(lens_ptr + i_r + 1, mask=i_r < R, other=0) - kv_start.to(tl.int32)
        kv_cap = MAX_KV - kv_start.to(tl.int32)  # rows of k / v
    context_len = seq_len - (q_end - q_start)

    o_m = row0 + tl.arange(0, BLOCK_M)
    m_m = o_m < q_rows
    o_tq = o_m // GQA  # query token within the request
    o_h = i_kvh * GQA + o_m % GQA  # query head
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    o_qpos = context_len + o_tq  # absolute key position of each row's query
    o_tok = (q_start + o_tq).to(tl.int64)

    # Keys any row of this block may see: [lo, hi).
    tq_first = row0 // GQA
    tq_last = (tl.minimum(row0 + BLOCK_M, q_rows) - 1) // GQA
    # A seq_len past the block table (or past k / v) is a caller bug: never read beyond them.
    lo, hi = _key_bounds(tl.zeros([], tl.int32), tl.minimum(seq_len, kv_cap), context_len,
                         tq_first, tq_last, win_left, win_right, CAUSAL, HAS_WINDOW)
    # This split's share, whole BLOCK_N tiles from a tile-aligned start.
    lo_al = lo // BLOCK_N * BLOCK_N
    chunk = tl.cdiv(tl.cdiv(tl.maximum(hi - lo_al, 0), NUM_SPLITS), BLOCK_N) * BLOCK_N
    n_start = lo_al + i_split * chunk
    n_end = tl.minimum(hi, n_start + chunk)

    b_q = tl.load(q_ptr + o_tok[:, None] * s_qt + o_h[:, None] * s_qh + o_d[None, :],
                  mask=m_m[:, None] & m_d[None, :], other=0.0)
    if NEG_Q:  # scale < 0: the host passed |scale| (interior tiles need a scale >= 0)
        b_q = (-b_q.to(tl.float32)).to(b_q.dtype)  # exact
    qk_scale = qk_scale2
    if IS_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    # P.V runs in q's dtype; with an int8 V in fp16, which holds every int8 value and P with 3
    # more mantissa bits than bf16 (so a smaller error against the oracle).
    if V_INT8:
        PV_DT: tl.constexpr = tl.float16
    else:
        PV_DT: tl.constexpr = q_ptr.dtype.element_ty
    if K_INT8:
        # Q quantized per (token, head) here, by quant/int8.py's rule (bit-equal to
        # quantize_per_token_head_ref of q; padding rows are all 0 and stay 0). The softmax scale
        # joins each row's scale once, so a score costs two multiplies on the int32 dot.
        b_qf = b_q.to(tl.float32)
        if K_SMOOTH:  # the cache holds K / f per channel: q * f keeps q.k (masked lanes: 0 * 1)
            b_f = tl.load(ksm_ptr + i_kvh * s_ksmh + o_d * s_ksmd, mask=m_d, other=1.0)
            b_qf = b_qf * b_f[None, :]
        b_q, b_qs = int8_quantize_rows(b_qf, _INT8_FLOOR)
        b_qs = b_qs * qk_scale
    else:
        b_qs = qk_scale  # unused
    if HAS_ALIBI:
        b_slope = tl.load(alibi_ptr + o_h, mask=m_m, other=0.0) * 1.4426950408889634
    else:
        b_slope = qk_scale  # unused

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:
        # The sink is one more logit with no value vector: start the softmax from it, once
        # (split 0), and never for padding rows.
        if (i_split == 0) & (i_r < R):
            m_i = tl.load(sink_ptr + o_h, mask=m_m, other=0.0).to(tl.float32) * 1.4426950408889634
            l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Row operands as columns of the score tile.
    o_qpos_r = _rows(o_qpos, STREAMS)
    if K_INT8:
        b_qs = _rows(b_qs, STREAMS)
    if HAS_ALIBI:
        b_slope = _rows(b_slope, STREAMS)
    if STREAMS:
        # STREAMS key streams, one per warp: key j of a BLOCK_N tile goes to stream
        # j // (BLOCK_N / STREAMS). Each warp keeps its own softmax over its keys (3-D dots, warps
        # on the batch dim), so no tile needs a cross-warp reduction or P through shared memory;
        # the streams merge once after the loops. The sink starts stream 0 only.
        o_s = tl.arange(0, STREAMS)[:, None]
        o_nn = o_s * (BLOCK_N // STREAMS) + tl.arange(0, BLOCK_N // STREAMS)[None, :]
        b_q = tl.broadcast_to(b_q[None, :, :], (STREAMS, BLOCK_M, BLOCK_D))
        m_i = tl.where(o_s == 0, m_i[None, :], float("-inf"))
        l_i = tl.where(o_s == 0, l_i[None, :], 0.0)
        acc = tl.zeros([STREAMS, BLOCK_M, BLOCK_D], tl.float32)
    else:
        o_nn = tl.arange(0, BLOCK_N)

    p_k = k_ptr + i_kvh * s_kh
    p_v = v_ptr + i_kvh * s_vh
    p_ks = ksc_ptr + i_kvh * s_ksch
    if IS_PAGED:
        p_bt = bt_ptr + i_r.to(tl.int64) * s_bt
        kv_start = 0
    else:
        p_bt = bt_ptr
    # Tiles [n_in, n_out) are interior (no masks, see _attend_tile); the tiles before and after
    # them within [n_start, n_end) are masked. Decode takes the same two loops: a split of a long
    # context is almost all interior tiles, whose K / V copies then pipeline.
    # Keys every row of the block sees: [full_lo, full_hi) (the bounds of its last query token
    # from below, of its first from above).
    full_lo, full_hi = _key_bounds(lo, n_end, context_len, tq_last, tq_first, win_left,
                                   win_right, CAUSAL, HAS_WINDOW)
    n_grid_end = n_start + tl.cdiv(tl.maximum(n_end - n_start, 0), BLOCK_N) * BLOCK_N
    n_in = tl.minimum(n_start + tl.cdiv(tl.maximum(full_lo - n_start, 0), BLOCK_N) * BLOCK_N,
                      n_grid_end)
    n_out = tl.maximum(n_start + tl.maximum(full_hi - n_start, 0) // BLOCK_N * BLOCK_N, n_in)
    n_flag = tl.zeros([], tl.int32)
    if IS_PAGED:
        # Interior tiles read block ids unchecked: an invalid id among them (a caller bug)
        # sends the whole range through the masked loop instead.
        # KEY_FLAGS (long queries over a bf16 / fp16 cache): the interior tiles' key faults come
        # from the flags of key_flags.py (whole 16-key groups: interior bounds are multiples of
        # BLOCK_N), read in the same steps as the block ids (one memory round trip a step for
        # both; with an invalid id they go unused).
        n_bad = tl.zeros([], tl.int32)
        pg_beg = n_in // PAGE_SIZE
        pg_end = tl.cdiv(n_out, PAGE_SIZE)
        g_beg = n_in // KEY_GROUP
        g_end = n_out // KEY_GROUP
        n_steps = tl.cdiv(pg_end - pg_beg, 256)
        if KEY_FLAGS:
            p_kf = kflags_ptr + i_r.to(tl.int64) * s_kfr + i_kvh * s_kfh
            n_steps = tl.maximum(n_steps, tl.cdiv(g_end - g_beg, 256))
        for i_s in range(0, n_steps):
            o_pg = pg_beg + i_s * 256 + tl.arange(0, 256)
            b_pg = tl.load(p_bt + o_pg, mask=o_pg < pg_end, other=0)
            n_bad += tl.sum(((b_pg < 0) | (b_pg >= NUM_BLOCKS)).to(tl.int32))
            if KEY_FLAGS:
                o_g = g_beg + i_s * 256 + tl.arange(0, 256)
                n_flag += tl.sum(tl.load(p_kf + o_g,
                                         mask=o_g < g_end, other=0).to(tl.int32))
        if n_bad > 0:
            n_out = n_in
    # The block ids of the next interior tile are loaded one step ahead into registers: the
    # K / V copies then depend on no load of their own iteration, and the pipeliner can
    # issue them num_stages - 1 tiles ahead.
    if BLOCK_N % PAGE_SIZE == 0:  # row o_nn of tile n0 sits in page n0 // PAGE + o_nn // PAGE
        o_npg = o_nn // PAGE_SIZE
    b_blk_nx = tl.zeros_like(o_nn)
    if IS_PAGED:
        b_blk_nx = tl.load(p_bt + (n_in + o_nn) // PAGE_SIZE, mask=n_in + o_nn < n_out,
                           other=0)
    for n0 in range(n_in, n_out, BLOCK_N):
        b_blk = b_blk_nx
        if IS_PAGED:
            if BLOCK_N % PAGE_SIZE == 0:  # whole tiles: the next one is in range or not at all
                # (`o_npg >= 0`, always true, only gives the scalar condition a row shape)
                b_blk_nx = tl.load(p_bt + ((n0 + BLOCK_N) // PAGE_SIZE + o_npg),
                                   mask=(n0 + BLOCK_N < n_out) & (o_npg >= 0), other=0)
            else:
                o_nx = n0 + BLOCK_N + o_nn
                b_blk_nx = tl.load(p_bt + o_nx // PAGE_SIZE, mask=o_nx < n_out, other=0)
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, b_q, p_k, p_v, p_bt, b_blk, n0, o_nn, lo, n_end, o_qpos_r, context_len,
            b_slope, qk_scale, softcap2, win_left, win_right, NUM_BLOCKS, kv_start,
            s_kb, s_kt, s_vb, s_vt, o_d, m_d, b_qs, p_ks, s_kscb, s_ksct, K_INT8, PV_DT,
            V_FAST_CVT, False, HEAD_DIM, BLOCK_D, PAGE_SIZE, IS_PAGED,
            CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, ALIBI_SQRT, IS_FP8, KV_SAME, BLOCK_N,
            not KEY_FLAGS)
    # Masked tiles: [n_start, n_in) then [n_out, n_end).
    n_head = (n_in - n_start) // BLOCK_N
    n_tiles = n_head + tl.cdiv(tl.maximum(n_end - n_out, 0), BLOCK_N)
    for i_n in range(0, n_tiles):
        n0 = tl.where(i_n < n_head, n_start + i_n * BLOCK_N, n_out + (i_n - n_head) * BLOCK_N)
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, b_q, p_k, p_v, p_bt, 0, n0, o_nn, lo, n_end, o_qpos_r, context_len,
            b_slope, qk_scale, softcap2, win_left, win_right, NUM_BLOCKS, kv_start,
            s_kb, s_kt, s_vb, s_vt, o_d, m_d, b_qs, p_ks, s_kscb, s_ksct, K_INT8, PV_DT,
            V_FAST_CVT, True, HEAD_DIM, BLOCK_D, PAGE_SIZE, IS_PAGED,
            CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, ALIBI_SQRT, IS_FP8, KV_SAME, BLOCK_N,
            True)
    if STREAMS:
        acc, m_i, l_i = _merge_streams(acc, m_i, l_i)

    if IS_FP8:
        acc = acc * tl.load(v_scale_ptr)
    if V_INT8:  # the static per-channel V scale, once per output (splits merge linearly after it)
        acc = acc * tl.load(v_scale_ptr + i_kvh * s_vsh + o_d * s_vsd, mask=m_d, other=0.0)[None, :]
    # faults (kernels/softmax.py): a NaN sum, or a NaN or inf that reached the accumulator
    # through a value, makes the row's out and lse NaN
    if KEY_FLAGS:
        # a flagged interior key makes every row NaN; a NaN or inf in a row's q already made its
        # sum NaN in the interior tiles (all its scores are non-finite: +inf or NaN give
        # exp2(NaN), all -inf give exp2(-inf + inf))
        l_i = l_i + tl.where((n_out > n_in) & (n_flag > 0), float("nan"), 0.0)
    b_inv, b_lse = finish_rows(l_i, m_i)
    b_bad = row_faults(acc)
    b_o = acc * (b_inv + b_bad)[:, None]
    b_lse = b_lse + b_bad

    o_row = i_split.to(tl.int64) * s_os + o_tok * s_ot + o_h * s_oh
    tl.store(out_ptr + o_row[:, None] + o_d[None, :], b_o.to(out_ptr.dtype.element_ty),
             mask=m_m[:, None] & m_d[None, :])
    if WRITE_LSE:
        tl.store(lse_ptr + i_split.to(tl.int64) * s_ls + o_tok * s_lt + o_h * s_lh, b_lse,
                 mask=m_m)


@triton.jit
def paged_attention_reduce_kernel(
    po_ptr, plse_ptr, out_ptr, lse_ptr,
    H, s_ps, s_pt, s_ph, s_pls, s_plt, s_ot, s_oh, s_lt, s_lh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, WRITE_LSE: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out, lse of BLOCK_H heads of one token from the NUM_SPLITS partials, BLOCK_S partials a
    step: one step's loads are independent, so a decode's 16-64 partials of a head arrive in one
    round of memory latency rather than one round a split (kernels.merge.merge_parts)."""
    i_t = tl.program_id(0).to(tl.int64)
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_D)
    o_s = tl.arange(0, BLOCK_S)
    m_h = o_h < H
    m_hd = m_h[:, None] & (o_d < HEAD_DIM)[None, :]
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    o_hd = (o_h[:, None] * s_ph + o_d[None, :])[None]
    p_po = po_ptr + i_t * s_pt
    p_pl = plse_ptr + i_t * s_plt
    for s0 in range(0, NUM_SPLITS, BLOCK_S):  # a loop, not unrolled: one step's loads at a time
        o_sp = o_s + s0
        m_s = o_sp < NUM_SPLITS
        o_sp = o_sp.to(tl.int64)  # 64-bit split offsets however large splits * T * H * D is
        b_l = tl.load(p_pl + o_sp[:, None] * s_pls + o_h[None, :],
                      mask=m_s[:, None] & m_h[None, :], other=float("-inf"))
        b_o = tl.load(p_po + o_sp[:, None, None] * s_ps + o_hd,
                      mask=m_s[:, None, None] & m_hd[None], other=0.0)
        acc, m_i, l_i = merge_parts(acc, m_i, l_i, b_o, b_l)
    b_o, b_lse = merge_finish(acc, m_i, l_i)
    tl.store(out_ptr + i_t * s_ot + o_h[:, None] * s_oh + o_d[None, :],
             b_o.to(out_ptr.dtype.element_ty), mask=m_hd)
    if WRITE_LSE:
        tl.store(lse_ptr + i_t * s_lt + o_h * s_lh, b_lse, mask=m_h)
