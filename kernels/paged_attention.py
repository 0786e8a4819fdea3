"""Attention of varlen queries over a paged KV cache (general MHA/GQA path).

Semantics are vLLM's FlashAttention backend (DESIGN.md, General MHA path; oracle
`kernels.reference.paged_attention_ref`): query i of request r sits at key position
context_len + i with context_len = seq_len - q_len; causal keeps keys j <= context_len + i;
window (left, right); softcap c * tanh(s / c) after scaling, before masking; ALiBi; sinks in the
denominator; an all-masked row gives out = 0, lse = -inf (lse = sink with sinks).

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
  their K / V copies num_stages - 1 tiles ahead (a block-id load in the same iteration made it
  wait for every copy at each step: 2.47 ms -> 1.21 ms at 8k tokens on the H200).
  Row blocks launch last-first: the most expensive causal blocks start in the first wave.
- Short queries (decode, speculative decoding) whose grid would underfill the GPU split the key
  range over NUM_SPLITS programs; `paged_attention_reduce_kernel` folds the partial
  (out, lse) pairs with `kernels.merge.merge_step`. The split count is chosen on the host from
  shapes and the SM count: the decode path reads no device tensor on the host.
- Short queries may run as key streams (autotune config STREAMS = warps): each warp takes its
  own BLOCK_N / STREAMS keys of every tile and keeps its own online softmax (3-D dots with the
  warps on the batch dimension), so no tile needs a cross-warp row max / sum or P through shared
  memory; the streams merge once per program. With 16 rows and GQA 4, the one-stream layout
  spends its time in those per-tile exchanges (ncu, int8_qkv decode on the H200).
- int8 caches (int8_qkv / int8_qk): q is quantized per row in the kernel, Q.K is an int8 dot
  scaled by s_q * s_k per score, and an int8 V enters the P.V dot as fp16 (converted exactly,
  on NVIDIA with byte permutes instead of quarter-rate I2F), its per-channel scale applied to
  the output once.
- Encoder attention (`kernels.varlen_attention`) is the same kernel with IS_PAGED off: request r's
  keys are rows cu_seqlens_k[r] + j of contiguous k / v.

Block shapes are autotune configs keyed on shape classes (row bucket, GQA, head dim, page
size, fp8, split count); the first call per class benchmarks them, so warm up outside CUDA-graph
capture.
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from openmla.kernels.device import num_sms
from openmla.kernels.merge import merge_finish, merge_step
from openmla.quant.int8 import INT8_SCALE_FLOOR, int8_quantize_rows
from openmla.quant.validate import check_same_device, check_tensor, fail
from openmla.quant.kv_cache import LAYOUTS, cache_dims, cache_strides, check_int8_cache_scales

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
MAX_HEAD_DIM = 256
# Queries up to this many tokens (and GQA * tokens rows up to SHORT_MAX_ROWS) form the "short"
# class: one row block per request and KV head, split-KV when the grid underfills the GPU.
SHORT_MAX_Q = 16
SHORT_MAX_ROWS = 128
# A split gets at least this many keys (a few BLOCK_N steps), and there are at most MAX_SPLITS.
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64
# Programs per SM the split count aims for: the grid fills at most one round of WAVES programs
# per SM (decode programs run two per SM: ~255 registers x 128 threads). Rounding the split
# count up instead starts a second, mostly idle round (H200, int8_qkv B8 32k: 5 splits 0.255 ms,
# 4 splits 0.165 ms).
WAVES = 2
_SMEM_BYTES = 227 * 1024  # Hopper's per-block shared-memory limit (sm_90)
_INT8_FLOOR = tl.constexpr(INT8_SCALE_FLOOR)


# ---------------------------------------------------------------------------------------------
# Autotune configs
# ---------------------------------------------------------------------------------------------
def _config(bm, bn, w, s, maxnreg=None, streams=0):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "STREAMS": streams}, num_warps=w,
                         num_stages=s, maxnreg=maxnreg)


# Sound defaults first (the first survivor of pruning is what runs without benchmarking), then
# the rest of the grid. Long queries: 128 x 128 tiles, 8 warps, 3 stages (D <= 128), else
# 128 x 64, else 64 x 64 (D = 256); measured on the H200 in scratch/paged_perf/NOTES.md.
_DEFAULTS = [(16, 64, 4, 2), (32, 64, 4, 2), (128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 2),
             (64, 64, 8, 3), (64, 64, 8, 2), (64, 32, 8, 2)]
_CONFIGS = [_config(*c) for c in _DEFAULTS] + [
    _config(bm, bn, w, s)
    for bm in (16, 32, 64, 128) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3)
    if (bm, bn, w, s) not in _DEFAULTS
] + [
    # int8 decode: capping the 128-key kernel at 168 registers (from 255) measured 3% faster at
    # batch 32 / 128, 32k context on the H200 (int8-only: see _prune).
    _config(16, 128, 4, 3, maxnreg=168),
] + [
    # Short queries, one key stream per warp (see the kernel), BLOCK_N / 4 keys per warp and
    # tile. H200, int8_qkv decode at 32k: BLOCK_N 128 0.547 / 2.20 ms at batch 32 / 128 (one
    # stream per program: 0.605 / 2.41); 2-warp programs were slower (0.80 / 2.71 ms).
    _config(16, bn, 4, 3, streams=4) for bn in (64, 128)
]
# OPENMLA_AUTOTUNE=0: no benchmarking, every launch takes the first config its pruning keeps
# (one compile per shape class instead of one per config: GPU test runs, quick experiments).
_AUTOTUNE = os.environ.get("OPENMLA_AUTOTUNE", "1") != "0"


def _prune(configs, named_args, **kwargs):
    """Configs worth timing for one launch; each rule says why it drops a config."""
    want_m = kwargs["BLOCK_M_WANT"]
    d = kwargs["BLOCK_D"]
    kept = []
    for c in configs:
        bm, bn, w, s = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages
        # Register caps were measured for the int8 decode kernels only.
        if c.maxnreg is not None and not (kwargs["K_INT8"] or kwargs["V_INT8"]):
            continue
        streams = c.kwargs["STREAMS"]
        if streams:
            # One stream per warp, for short queries (their programs hold one row block), with
            # >= 16 keys per stream and tile (the P.V dot's k) and at most 64 accumulator values
            # per thread (each warp holds all [BLOCK_M, D] of its stream: D <= 128 at 16 rows;
            # this replaces the register rule below, which assumes warps share the accumulator).
            if not want_m or streams != w or bn // streams < 16 or bm * d / 32 > 64:
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
        # threads. ptxas for sm_90 (scratch/paged/NOTES.md) spills past ~176 such values per
        # thread (D=128: 64x128 keys at 4 warps, 128x128 at 8) and never below it. Long bf16/fp16
        # queries copy K/V straight to shared memory (no operand tile in registers) and keep
        # their interior loop free of spills up to 144 accumulator + score values per thread
        # (scratch/paged_perf/sweep_long.txt: D=128 128x128 at 8 warps is 128).
        if not want_m and not (kwargs["IS_FP8"] or kwargs["K_INT8"] or kwargs["V_INT8"]):
            if (bm * d + bm * bn) / (32 * w) > 144:
                continue
        elif not streams and (bm * d + bm * bn + bn * d) / (32 * w) > 176:
            continue
        # Shared memory: q plus `s` stages of K and V tiles (2-byte operands); the compiler's
        # reduction scratch reuses that space (D=128 128x128 at 3 stages compiles to 224 KB).
        if 2 * (bm * d + 2 * s * bn * d) > _SMEM_BYTES - 2 * 1024:
            continue
        kept.append(c)
    if not kept:  # the smallest tile for the wanted BLOCK_M always runs
        kept = [_config(want_m or 64, 32, 4, 2)]
    return kept if _AUTOTUNE else kept[:1]


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------
@triton.jit
def _int8_to_fp16_ptx(x):
    """int8 -> fp16 (exact) four at a time with byte permutes and one fp16x2 subtract per pair:
    the bytes u = x ^ 0x80 become fp16 1024 + u (exponent byte 0x64), minus 1152 gives x. NVIDIA
    only (PTX); `sitofp` would spend one quarter-rate I2F per element.
    Not pure on purpose: a pure elementwise op is moved past the layout change to the dot
    operand, which then gathers single bytes from shared memory (LDS.U8 + PRMT per value); here
    the tile converts where it was loaded and reaches the dot through ldmatrix (int8_qkv decode:
    35% fewer instructions executed, ncu on the H200; 2-3% faster at B32/B128, 0.253 -> 0.220 ms
    at B8 with the old split rule)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 a, lo, hi, c;
        xor.b32 a, $2, 0x80808080;
        prmt.b32 lo, a, 0x64646464, 0x4140;
        prmt.b32 hi, a, 0x64646464, 0x4342;
        mov.b32 c, 0x64806480;
        sub.f16x2 $0, lo, c;
        sub.f16x2 $1, hi, c;
        }""",
        constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _attend_tile(acc, m_i, l_i, b_q, p_k, p_v, p_bt, b_blk_in, n0, o_tile, lo, n_end, o_qpos,
                 context_len, b_slope, qk_scale, softcap2, win_left, win_right, NUM_BLOCKS,
                 kv_start, s_kb, s_kt, s_vb, s_vt, o_d, m_d, b_qs, p_ks, s_kscb, s_ksct,
                 K_INT8: tl.constexpr, PV_DT: tl.constexpr, V_FAST_CVT: tl.constexpr,
                 MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 PAGE_SIZE: tl.constexpr, IS_PAGED: tl.constexpr, CAUSAL: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                 ALIBI_SQRT: tl.constexpr, IS_FP8: tl.constexpr, KV_SAME: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """One BLOCK_N key tile (starting at n0, a multiple of BLOCK_N) of the online softmax.
    Rank-generic: keys n0 + o_tile, with o_tile [BLOCK_N] (one stream: acc [M, D], m_i / l_i
    [M], b_q [M, D]) or [S, BLOCK_N / S] (S key streams, one per warp: acc [S, M, D], m_i / l_i
    [S, M], b_q broadcast to [S, M, D]). Per-row operands (o_qpos, b_qs, b_slope) come as
    columns that broadcast against the score tile ([M, 1] or [1, M, 1]).
    MASKED=False is an interior tile: every key is < seq_len, inside every row's causal / window
    bounds and behind a valid block id (b_blk_in, loaded by the caller), so neither the loads
    nor the scores need a mask.
    K_INT8: b_q is int8 with per-row scales b_qs (softmax scale folded in); the int32 score tile
    is scaled by b_qs per row and by the keys' scales (k-scale cache, p_ks) per column. P.V runs
    in PV_DT (q's dtype; fp16 for an int8 V, which converts exactly, with V_FAST_CVT by byte
    permutes); an int8 V's per-channel scale is the caller's epilogue."""
    o_n = n0 + o_tile
    o_nc = tl.expand_dims(o_n, -2)  # keys as columns of the score tile
    if MASKED:
        m_n = (o_n >= lo) & (o_n < n_end)
    if IS_PAGED:
        # Block ids are read only for positions this program uses (all < seq_len).
        if MASKED:
            b_blk = tl.load(p_bt + o_n // PAGE_SIZE, mask=m_n, other=0).to(tl.int64)
            # An invalid block id (< 0 or >= num_blocks) drops its keys instead of reading them.
            m_n = m_n & (b_blk >= 0) & (b_blk < NUM_BLOCKS)
        else:  # loaded by the caller one tile ahead (see the interior loop)
            b_blk = b_blk_in
        if (not MASKED) and (BLOCK_N % PAGE_SIZE == 0):
            # Tiles start at multiples of BLOCK_N, so a row's offset in its page is fixed: the
            # compiler hoists it and the loop keeps one 64-bit multiply-add per row.
            o_pin = o_tile % PAGE_SIZE
        else:
            o_pin = o_n % PAGE_SIZE
        if MASKED:
            o_kr = b_blk * s_kb + o_pin * s_kt
        else:
            # Interior ids are checked valid (>= 0) and strides are >= 0: zero-extended 32-bit
            # factors make the 64-bit product one wide multiply instead of a 64 x 64 one.
            b_blk = b_blk.to(tl.uint32).to(tl.int64)
            o_kr = b_blk * s_kb.to(tl.uint32).to(tl.int64) + o_pin * s_kt
        if KV_SAME:  # K and V caches with the same strides share the row offsets
            o_vr = o_kr
        elif MASKED:
            o_vr = b_blk * s_vb + o_pin * s_vt
        else:
            o_vr = b_blk * s_vb.to(tl.uint32).to(tl.int64) + o_pin * s_vt
    else:
        o_kr = (kv_start + o_n) * s_kt
        if KV_SAME:
            o_vr = o_kr
        else:
            o_vr = (kv_start + o_n) * s_vt
    if MASKED:
        m_nd = tl.expand_dims(m_n, -1) & m_d
    else:
        m_nd = m_d
    if MASKED or HEAD_DIM != BLOCK_D:
        b_k = tl.load(p_k + tl.expand_dims(o_kr, -1) + o_d, mask=m_nd, other=0.0)
    else:
        b_k = tl.load(p_k + tl.expand_dims(o_kr, -1) + o_d)
    if K_INT8:
        b_s = tl.dot(b_q, tl.trans(b_k), out_dtype=tl.int32).to(tl.float32)
        # Scales of this tile's keys: [num_blocks, H_kv, block_size] rows at the keys' slots.
        if MASKED:
            b_ks = tl.load(p_ks + b_blk * s_kscb + o_pin * s_ksct, mask=m_n, other=0.0)
        else:
            b_ks = tl.load(p_ks + b_blk * s_kscb + o_pin * s_ksct)
        b_s = b_s * b_qs * tl.expand_dims(b_ks, -2)
    else:
        b_s = tl.dot(b_q, tl.trans(b_k.to(b_q.dtype)))
    if MASKED or HAS_SOFTCAP or HAS_ALIBI or IS_FP8 or K_INT8:
        if not K_INT8:  # int8: b_qs already holds the scale
            b_s = b_s * qk_scale
        if HAS_SOFTCAP:
            b_s = softcap2 * libdevice.tanh(b_s / softcap2)
        if MASKED:
            m_s = tl.expand_dims(m_n, -2)
            if CAUSAL:
                m_s = m_s & (o_nc <= o_qpos)
            if HAS_WINDOW:
                m_s = m_s & ((win_left < 0) | (o_nc >= o_qpos - win_left))
                m_s = m_s & ((win_right < 0) | (o_nc <= o_qpos + win_right))
            b_s = tl.where(m_s, b_s, float("-inf"))
        if HAS_ALIBI:
            if ALIBI_SQRT:
                b_dist = (o_qpos - o_nc).to(tl.float32)
                b_bias = tl.where(b_dist >= 0, -tl.sqrt(tl.maximum(b_dist, 0.0)), 0.0)
            else:
                b_bias = (o_nc - context_len).to(tl.float32)
            b_s = b_s + b_slope * b_bias
        m_new = tl.maximum(m_i, tl.max(b_s, -1))
        # A row with nothing counted yet keeps max -inf; shift by 0 there so no inf - inf appears.
        m_sh = tl.where(m_new == float("-inf"), 0.0, m_new)
        b_p = tl.exp2(b_s - tl.expand_dims(m_sh, -1))
    else:
        # qk_scale >= 0 (for scale < 0 the kernel negated q), so max(s) * scale = max(s * scale)
        # and the scaling folds into one fma per score (fp8 takes the branch above: its scale
        # also holds k_scale, a device value). Every row sees every key: m_new is finite.
        m_new = tl.maximum(m_i, tl.max(b_s, -1) * qk_scale)
        m_sh = m_new
        b_p = tl.exp2(b_s * qk_scale - tl.expand_dims(m_sh, -1))
    alpha = tl.exp2(m_i - m_sh)
    l_i = l_i * alpha + tl.sum(b_p, -1)
    if MASKED or HEAD_DIM != BLOCK_D:
        b_v = tl.load(p_v + tl.expand_dims(o_vr, -1) + o_d, mask=m_nd, other=0.0)
    else:
        b_v = tl.load(p_v + tl.expand_dims(o_vr, -1) + o_d)
    if V_FAST_CVT:
        b_v = _int8_to_fp16_ptx(b_v)
    acc = tl.dot(b_p.to(PV_DT), b_v.to(PV_DT), acc * tl.expand_dims(alpha, -1))
    return acc, m_new, l_i


@triton.jit
def _key_bounds(lo, hi, context_len, tq_lo, tq_hi, win_left, win_right, CAUSAL: tl.constexpr,
                HAS_WINDOW: tl.constexpr):
    """[lo, hi) narrowed to the keys that query token tq_lo may see from below and tq_hi from
    above (causal and window bounds). tq_lo = first, tq_hi = last token of a row block: the keys
    some row sees; tq_lo = last, tq_hi = first: the keys every row sees."""
    if CAUSAL:
        hi = tl.minimum(hi, context_len + tq_hi + 1)
    if HAS_WINDOW:
        if win_left >= 0:
            lo = tl.maximum(lo, context_len + tq_lo - win_left)
        if win_right >= 0:
            hi = tl.minimum(hi, context_len + tq_hi + win_right + 1)
    return lo, hi


@triton.jit
def _rows(x, STREAMS: tl.constexpr):
    """A per-row vector [M] as a column of the score tile: [M, 1], or [1, M, 1] with streams."""
    if STREAMS:
        y = x[None, :, None]
    else:
        y = x[:, None]
    return y


@triton.jit
def _merge_streams(acc, m_i, l_i):
    """Fold S key streams (acc [S, M, D], m_i / l_i [S, M], log2 domain) into one."""
    m_all = tl.max(m_i, 0)
    m_sh = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp2(m_i - m_sh[None, :])
    return tl.sum(acc * w[:, :, None], 0), m_all, tl.sum(l_i * w, 0)


@triton.autotune(configs=_CONFIGS,
                 key=["BLOCK_M_WANT", "GQA", "HEAD_DIM", "PAGE_SIZE", "IS_FP8", "K_INT8", "V_INT8",
                      "NUM_SPLITS"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cu_q_ptr, lens_ptr,
    alibi_ptr, sink_ptr, k_scale_ptr, v_scale_ptr, ksc_ptr, ksm_ptr, out_ptr, lse_ptr,
    T, R, NUM_BLOCKS, MAX_KV,
    qk_scale2, softcap2, win_left, win_right,
    s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bt,
    s_os, s_ot, s_oh, s_ls, s_lt, s_lh, s_kscb, s_ksch, s_ksct, s_vsh, s_vsd, s_ksmh, s_ksmd,
    BLOCK_M_WANT: tl.constexpr, GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, IS_PAGED: tl.constexpr, IS_FP8: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, ALIBI_SQRT: tl.constexpr, HAS_SINKS: tl.constexpr,
    NUM_SPLITS: tl.constexpr, WRITE_LSE: tl.constexpr, NEG_Q: tl.constexpr,
    KV_SAME: tl.constexpr, K_INT8: tl.constexpr, V_INT8: tl.constexpr, V_FAST_CVT: tl.constexpr,
    K_SMOOTH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STREAMS: tl.constexpr,
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
    # more mantissa bits than bf16 (measured on the H200: rel. error 2.3e-3 -> 1.7e-3).
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
    # context is almost all interior tiles, whose K / V copies then pipeline (H200, int8_qkv
    # decode at 32k, batch 32: 0.91 -> 0.75 ms; bf16 unchanged).
    # Keys every row of the block sees: [full_lo, full_hi) (the bounds of its last query token
    # from below, of its first from above).
    full_lo, full_hi = _key_bounds(lo, n_end, context_len, tq_last, tq_first, win_left,
                                   win_right, CAUSAL, HAS_WINDOW)
    n_grid_end = n_start + tl.cdiv(tl.maximum(n_end - n_start, 0), BLOCK_N) * BLOCK_N
    n_in = tl.minimum(n_start + tl.cdiv(tl.maximum(full_lo - n_start, 0), BLOCK_N) * BLOCK_N,
                      n_grid_end)
    n_out = tl.maximum(n_start + tl.maximum(full_hi - n_start, 0) // BLOCK_N * BLOCK_N, n_in)
    if IS_PAGED:
        # Interior tiles read block ids unchecked: an invalid id among them (a caller bug)
        # sends the whole range through the masked loop instead.
        n_bad = tl.zeros([], tl.int32)
        pg_end = tl.cdiv(n_out, PAGE_SIZE)
        for pg0 in range(n_in // PAGE_SIZE, pg_end, 256):
            o_pg = pg0 + tl.arange(0, 256)
            b_pg = tl.load(p_bt + o_pg, mask=o_pg < pg_end, other=0)
            n_bad += tl.sum(((b_pg < 0) | (b_pg >= NUM_BLOCKS)).to(tl.int32))
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
            CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, ALIBI_SQRT, IS_FP8, KV_SAME, BLOCK_N)
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
            CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, ALIBI_SQRT, IS_FP8, KV_SAME, BLOCK_N)
    if STREAMS:
        acc, m_i, l_i = _merge_streams(acc, m_i, l_i)

    if IS_FP8:
        acc = acc * tl.load(v_scale_ptr)
    if V_INT8:  # the static per-channel V scale, once per output (splits merge linearly after it)
        acc = acc * tl.load(v_scale_ptr + i_kvh * s_vsh + o_d * s_vsd, mask=m_d, other=0.0)[None, :]
    has = l_i > 0
    b_o = acc * tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)[:, None]
    b_lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453,
                     float("-inf"))

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
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_D)
    m_h = o_h < H
    m_hd = m_h[:, None] & (o_d < HEAD_DIM)[None, :]
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    # Pointers advance split by split: 64-bit arithmetic however large splits * T * H * D is.
    p_po = po_ptr + i_t * s_pt + o_h[:, None] * s_ph + o_d[None, :]
    p_pl = plse_ptr + i_t * s_plt + o_h
    for i_s in range(NUM_SPLITS):  # a loop, not unrolled: unrolled, every load is hoisted
        b_o = tl.load(p_po, mask=m_hd, other=0.0)
        b_l = tl.load(p_pl, mask=m_h, other=float("-inf"))
        acc, m_i, l_i = merge_step(acc, m_i, l_i, b_o, b_l)
        p_po += s_ps
        p_pl += s_pls
    b_o, b_lse = merge_finish(acc, m_i, l_i)
    tl.store(out_ptr + i_t * s_ot + o_h[:, None] * s_oh + o_d[None, :],
             b_o.to(out_ptr.dtype.element_ty), mask=m_hd)
    if WRITE_LSE:
        tl.store(lse_ptr + i_t * s_lt + o_h * s_lh, b_lse, mask=m_h)


# ---------------------------------------------------------------------------------------------
# Launch
# ---------------------------------------------------------------------------------------------
def _ptx_ok(t: torch.Tensor) -> bool:
    """Inline PTX may run: an NVIDIA GPU, not the interpreter (nor ROCm)."""
    return (t.is_cuda and torch.version.hip is None
            and os.environ.get("TRITON_INTERPRET", "0") != "1")


def _plan(T: int, R: int, H_kv: int, gqa: int, max_q: int, max_kv: int, num_sms: int,
          num_splits: Optional[int]):
    """(BLOCK_M_WANT, NUM_SPLITS) from shapes alone. BLOCK_M_WANT = 0: long queries, BLOCK_M is
    autotuned and keys are split only when forced (num_splits). max_kv bounds every seq_len
    (block table width * page size)."""
    rows = max_q * gqa
    if max_q > SHORT_MAX_Q or rows > SHORT_MAX_ROWS:
        return 0, num_splits or 1
    block_m = max(16, triton.next_power_of_2(rows))
    if num_splits is not None:
        return block_m, num_splits
    programs = R * H_kv  # one row block per request and KV head
    want = WAVES * num_sms // max(programs, 1)
    return block_m, max(1, min(want, MAX_SPLITS, triton.cdiv(max_kv, MIN_KEYS_PER_SPLIT)))


def launch_attention(q, k, v, block_table, cu_seqlens_q, lens, out, lse, scale, causal, window,
                     softcap, alibi_slopes, alibi_sqrt, sinks, k_scale, v_scale, layout, max_q,
                     max_kv, num_splits, k_scale_cache=None, k_smooth=None):
    """Run on validated inputs. block_table None: encoder mode, k/v are [Tk, H_kv, D] and lens
    is cu_seqlens_k. Writes out (and lse when given). An int8 k (int8_qk / int8_qkv) comes with
    its k_scale_cache; v_scale is then None (int8_qk) or the per-channel [H_kv, D] scale."""
    T, H, D = q.shape
    R = cu_seqlens_q.shape[0] - 1
    paged = block_table is not None
    if paged:
        num_blocks, page, H_kv, _ = cache_dims(k, layout)
        kv_cap = block_table.shape[1] * page
        s_kb, s_kt, s_kh = cache_strides(k, layout)
        s_vb, s_vt, s_vh = cache_strides(v, layout)
        s_bt = block_table.stride(0)
    else:
        H_kv, page = k.shape[1], 1
        num_blocks, kv_cap = 0, k.shape[0]
        s_kb, s_kt, s_kh = 0, k.stride(0), k.stride(1)
        s_vb, s_vt, s_vh = 0, v.stride(0), v.stride(1)
        block_table, s_bt = cu_seqlens_q, 0  # never read
    gqa = H // H_kv
    block_m_want, splits = _plan(T, R, H_kv, gqa, max_q, max_kv, num_sms(q.device), num_splits)
    is_fp8 = k.dtype == torch.float8_e4m3fn
    k_int8, v_int8 = k.dtype == torch.int8, v.dtype == torch.int8
    dummy = cu_seqlens_q  # pointer arguments the kernel never reads under its flags
    ksc = k_scale_cache if k_int8 else dummy
    s_ksc = tuple(k_scale_cache.stride()) if k_int8 else (0, 0, 0)
    s_vs = tuple(v_scale.stride()) if v_int8 else (0, 0)
    ksm = k_smooth if k_smooth is not None else dummy
    s_ksm = tuple(k_smooth.stride()) if k_smooth is not None else (0, 0)
    if splits > 1:
        part_out = torch.empty((splits, T, H, D), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((splits, T, H), dtype=torch.float32, device=q.device)
        o_args = (part_out, part_lse, *part_out.stride()[:3], *part_lse.stride())
        write_lse = True
    else:
        lse_arg = lse if lse is not None else dummy
        o_args = (out, lse_arg, 0, out.stride(0), out.stride(1), 0,
                  lse.stride(0) if lse is not None else 0, lse.stride(1) if lse is not None else 0)
        write_lse = lse is not None
    left, right = window
    grid = lambda meta: (triton.cdiv(T * gqa, meta["BLOCK_M"]) + R + 1, H_kv, splits)  # noqa: E731
    paged_attention_kernel[grid](
        q, k, v, block_table, cu_seqlens_q, lens,
        alibi_slopes if alibi_slopes is not None else dummy,
        sinks if sinks is not None else dummy,
        k_scale if is_fp8 else dummy, v_scale if (is_fp8 or v_int8) else dummy, ksc, ksm,
        o_args[0], o_args[1],
        T, R, num_blocks, kv_cap,
        abs(scale) * LOG2E, softcap * LOG2E, left, right,
        q.stride(0), q.stride(1), s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bt,
        *o_args[2:], *s_ksc, *s_vs, *s_ksm,
        # int8 dots take K in steps of 32 (mma k32).
        BLOCK_M_WANT=block_m_want, GQA=gqa, HEAD_DIM=D,
        BLOCK_D=max(32 if k_int8 else 16, triton.next_power_of_2(D)),
        PAGE_SIZE=page, IS_PAGED=paged, IS_FP8=is_fp8,
        CAUSAL=causal, HAS_WINDOW=left >= 0 or right >= 0, HAS_SOFTCAP=softcap > 0,
        HAS_ALIBI=alibi_slopes is not None, ALIBI_SQRT=alibi_sqrt, HAS_SINKS=sinks is not None,
        NUM_SPLITS=splits, WRITE_LSE=write_lse, NEG_Q=scale < 0,
        KV_SAME=(s_kb, s_kt) == (s_vb, s_vt), K_INT8=k_int8, V_INT8=v_int8,
        V_FAST_CVT=v_int8 and _ptx_ok(q), K_SMOOTH=k_smooth is not None,
    )
    if splits > 1:
        block_d = triton.next_power_of_2(D)
        block_h = min(triton.next_power_of_2(H), max(1, 2048 // block_d))
        lse_arg = lse if lse is not None else dummy
        paged_attention_reduce_kernel[(T, triton.cdiv(H, block_h))](
            part_out, part_lse, out, lse_arg,
            H, *part_out.stride()[:3], part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1),
            lse.stride(0) if lse is not None else 0, lse.stride(1) if lse is not None else 0,
            HEAD_DIM=D, NUM_SPLITS=splits, WRITE_LSE=lse is not None,
            BLOCK_H=block_h, BLOCK_D=block_d,
        )


@torch.library.custom_op("openmla::paged_attention", mutates_args=("out", "lse"))
def _paged_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        seq_lens: torch.Tensor, out: torch.Tensor, lse: Optional[torch.Tensor],
                        scale: float, causal: bool, window_left: int, window_right: int,
                        softcap: float, alibi_slopes: Optional[torch.Tensor], alibi_sqrt: bool,
                        sinks: Optional[torch.Tensor], k_scale: Optional[torch.Tensor],
                        v_scale: Optional[torch.Tensor], layout: str, max_query_len: int,
                        max_kv_len: int, num_splits: int,
                        k_scale_cache: Optional[torch.Tensor],
                        k_smooth: Optional[torch.Tensor]) -> None:
    launch_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, out, lse, scale,
                     causal, (window_left, window_right), softcap, alibi_slopes, alibi_sqrt, sinks,
                     k_scale, v_scale, layout, max_query_len, max_kv_len, num_splits or None,
                     k_scale_cache, k_smooth)


@_paged_attention_op.register_fake
def _(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, out, lse, *args):
    return None


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------
_Q_DTYPES = (torch.bfloat16, torch.float16)


def check_attention_options(q, H, scale, window, softcap, alibi_slopes, sinks):
    scale = float(scale)
    if not math.isfinite(scale):
        fail("scale", "a finite float", scale)
    if not (isinstance(window, (tuple, list)) and len(window) == 2
            and all(isinstance(w, int) and w >= -1 for w in window)):
        fail("window", "(left, right) ints >= -1 (-1: unbounded)", window)
    softcap = float(softcap)
    if not (math.isfinite(softcap) and softcap >= 0):
        fail("softcap", "a finite float >= 0 (0: off)", softcap)
    if alibi_slopes is not None:
        check_tensor("alibi_slopes", alibi_slopes, dtype=torch.float32, shape=(H,), contiguous=True)
    if sinks is not None:
        check_tensor("sinks", sinks, dtype=torch.float32, shape=(H,), contiguous=True)
    return scale, (int(window[0]), int(window[1])), softcap


def _check_fp8_scales(k_scale, v_scale, k_scale_cache, cache_dtype, device):
    """[k_scale, v_scale] of a bf16/fp16 (None) or fp8 (per-tensor [1], default 1.0) cache."""
    if k_scale_cache is not None:
        fail("k_scale_cache", f"None for a {cache_dtype} k_cache (int8 K only)", "a tensor")
    scales = []
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if cache_dtype != torch.float8_e4m3fn:
            if s is not None:
                fail(name, f"None for a {cache_dtype} cache (scales dequantize fp8 only)",
                     "a tensor")
        elif s is None:
            s = torch.ones(1, dtype=torch.float32, device=device)
        else:
            check_tensor(name, s, dtype=torch.float32, shape=(1,))
        scales.append(s)
    return scales


def check_q_out(q, out, return_lse):
    check_tensor("q", q, dtype=_Q_DTYPES, ndim=3, last_dim_contiguous=True)
    T, H, D = q.shape
    if not 1 <= D <= MAX_HEAD_DIM:
        raise NotImplementedError(f"head size {D}: supported are 1..{MAX_HEAD_DIM}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        check_tensor("out", out, dtype=q.dtype, shape=(T, H, D), last_dim_contiguous=True)
    lse = torch.empty((T, H), dtype=torch.float32, device=q.device) if return_lse else None
    return out, lse


def query_len_bound(max_query_len, cu_seqlens_q, T, R):
    """A python int bounding every query length (only picks tile shapes and splits)."""
    if max_query_len is not None:
        if not (isinstance(max_query_len, int) and max_query_len >= 0):
            fail("max_query_len", "None or an int >= 0", max_query_len)
        return max_query_len
    # With at least one token per request no query exceeds T - R + 1: decode batches are
    # recognised with no device read. Only longer bounds pay one sync for the true maximum.
    bound = max(T - R + 1, 1)
    if bound <= SHORT_MAX_Q or R == 0:
        return bound
    return int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    seq_lens: torch.Tensor, *, scale: float, causal: bool = True,
                    window: tuple = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[torch.Tensor] = None, alibi_sqrt: bool = False,
                    sinks: Optional[torch.Tensor] = None, k_scale: Optional[torch.Tensor] = None,
                    v_scale: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                    return_lse: bool = False, layout: str = "NHD",
                    max_query_len: Optional[int] = None, num_splits: Optional[int] = None,
                    k_scale_cache: Optional[torch.Tensor] = None,
                    k_smooth: Optional[torch.Tensor] = None):
    """Attention of varlen queries over a paged KV cache (vLLM FlashAttention semantics).

    Args:
        q: [T, H, D] bf16/fp16, last dim contiguous; D in 1..256 (multiples of 8 are the
            fast case).
        k_cache, v_cache: [num_blocks, block_size, H_kv, D] ("NHD") or
            [num_blocks, H_kv, block_size, D] ("HND"), q's dtype or float8_e4m3fn; last dim
            contiguous, other strides free (strided views, interleaved layers). H % H_kv == 0:
            query head h reads KV head h // (H // H_kv). Any block_size >= 1.
            int8 caches (DESIGN.md, as `quant.kv_cache.write_kv_cache` writes them; D a
            multiple of 8): an int8 k_cache with an int8 v_cache is `int8_qkv`, with a v_cache in
            q's dtype `int8_qk`. Q is then quantized per (token, head) inside the kernel
            (`quant.int8` rule), Q.K is an int8 dot with int32 accumulation scaled by
            s_q * s_k[token] * scale, and an int8 V is converted exactly for the P.V dot with
            its per-channel scale applied once to the output.
        block_table: [R, M] int32, last dim contiguous; token p of request r lives in block
            block_table[r, p // block_size] at offset p % block_size. Only entries for positions
            < seq_lens[r] are read; block offsets are computed in 64 bits. An invalid entry
            (< 0 or >= num_blocks) is never dereferenced: its keys are left out.
        cu_seqlens_q: [R + 1] int32: request r owns q rows cu_seqlens_q[r]:cu_seqlens_q[r+1].
            Rows past cu_seqlens_q[R] (padding) get out = 0, lse = -inf.
        seq_lens: [R] int32, total KV length of request r including its new tokens
            (<= M * block_size: keys past the table are never read); query i sits at position
            seq_len - q_len + i.
        scale: softmax scale, s = scale * q.k.
        causal: keys j <= seq_len - q_len + i (bottom-right aligned).
        window: (left, right), -1 unbounded (vLLM maps sliding window w to (w - 1, 0)).
        softcap: c > 0: s = c * tanh(s / c) after scaling, before masking and ALiBi.
        alibi_slopes: [H] fp32: s += slope[h] * (j - context_len); with alibi_sqrt,
            s += slope[h] * -sqrt(context_len + i - j) for j <= context_len + i (else 0).
        sinks: [H] fp32: one more logit per head in the denominator (no value); lse includes it.
        k_scale, v_scale: [1] fp32 per-tensor dequantization scales of an fp8 cache (None = 1.0);
            must be None for a bf16/fp16 cache. int8: k_scale None; v_scale the static
            per-channel scale [H_kv, D] fp32 of an int8 V (int8_qkv), None for int8_qk.
        out: optional [T, H, D] in q's dtype (last dim contiguous) to write into.
        return_lse: also return lse.
        layout: "NHD" or "HND".
        max_query_len: optional python int >= every query length. It only picks tile shapes and
            the split-KV count, never the result. When None it is T - R + 1 if that is
            <= 16 (every decode and short speculative batch: no device read); otherwise it is
            computed from cu_seqlens_q with ONE host sync. Pass it (vLLM's metadata has it) to
            keep speculative decoding free of syncs and CUDA-graph capturable.
        num_splits: None (choose from shapes and the SM count: short queries split when the
            grid underfills the GPU, long ones never) or a positive int forcing the split-KV
            count of any launch (tests, benchmarks, long-context chunked prefill).
        k_scale_cache: [num_blocks, H_kv, block_size] fp32 (any strides), the per-(token, head)
            K scales of an int8 k_cache (required there, None otherwise).
        k_smooth: optional [H_kv, D] fp32 per-channel K smoothing factors of an int8 k_cache
            written with the same factors (`write_kv_cache(..., k_smooth=)`, from
            `quant.int8.calibrate_k_smooth`): q is multiplied by them before it is quantized.

    Returns:
        out [T, H, D] in q's dtype; with return_lse also lse [T, H] fp32 natural log.
        An all-masked row gives out = 0 and lse = -inf (lse = sinks[h] with sinks).
    """
    out, lse = check_q_out(q, out, return_lse)
    T, H, D = q.shape
    if layout not in LAYOUTS:
        fail("layout", "'NHD' or 'HND'", repr(layout))
    check_tensor("k_cache", k_cache, dtype=(q.dtype, torch.float8_e4m3fn, torch.int8), ndim=4,
                 last_dim_contiguous=True)
    nb, page, H_kv, d = cache_dims(k_cache, layout)
    want = tuple(k_cache.shape)
    if d != D:
        fail(f"k_cache.shape ({layout})", f"head size {D} as q", want)
    if H_kv == 0 or H % H_kv:
        fail(f"k_cache.shape ({layout})", f"H_kv dividing H = {H}", want)
    k_int8 = k_cache.dtype == torch.int8
    v_dtypes = (torch.int8, q.dtype) if k_int8 else k_cache.dtype
    check_tensor("v_cache", v_cache, dtype=v_dtypes, shape=want, last_dim_contiguous=True)
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, last_dim_contiguous=True)
    R, M = block_table.shape
    check_tensor("cu_seqlens_q", cu_seqlens_q, dtype=torch.int32, shape=(R + 1,), contiguous=True)
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(R,), contiguous=True)
    scale, window, softcap = check_attention_options(q, H, scale, window, softcap, alibi_slopes,
                                                     sinks)
    if k_int8:
        if D % 8:
            raise NotImplementedError(f"int8 KV caches: head size {D} (supported: multiples of 8)")
        check_int8_cache_scales(k_scale, v_scale, k_scale_cache, v_cache.dtype, nb, page, H_kv, D)
        if k_smooth is not None:
            check_tensor("k_smooth", k_smooth, dtype=torch.float32, shape=(H_kv, D))
        scales = [None, v_scale]
    else:
        if k_smooth is not None:
            fail("k_smooth", f"None for a {k_cache.dtype} k_cache (int8 K only)", "a tensor")
        scales = _check_fp8_scales(k_scale, v_scale, k_scale_cache, k_cache.dtype, q.device)
    if num_splits is not None and not (isinstance(num_splits, int) and num_splits >= 1):
        fail("num_splits", "None or an int >= 1", num_splits)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                      cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens, out=out,
                      alibi_slopes=alibi_slopes, sinks=sinks, k_scale=scales[0],
                      v_scale=scales[1], k_scale_cache=k_scale_cache, k_smooth=k_smooth)
    if T > 0:
        max_q = query_len_bound(max_query_len, cu_seqlens_q, T, R)
        _paged_attention_op(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, out, lse,
                            scale, bool(causal), window[0], window[1], softcap, alibi_slopes,
                            bool(alibi_sqrt), sinks, scales[0], scales[1], layout, max_q,
                            M * page, num_splits or 0, k_scale_cache, k_smooth)
    return (out, lse) if return_lse else out
