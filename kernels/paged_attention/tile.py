"""Device functions of `paged_attention_kernel` (kernel.py): one key tile of the online softmax,
the key bounds a row block may see, the key-stream helpers and the int8 -> fp16 conversion.
An fp8 cache reaches them as float8e4nv, or as uint8 bytes on GPUs whose Triton has no
float8e4nv (launch.py decides; quant/e4m3.py converts)."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from openmla.kernels.softmax import keep_faults
from openmla.quant.e4m3 import E4M3_BITS, e4m3_to_f16

_E4M3_BITS = tl.constexpr(E4M3_BITS)


@triton.jit
def _int8_to_fp16_ptx(x):
    """int8 -> fp16 (exact) four at a time with byte permutes and one fp16x2 subtract per pair:
    the bytes u = x ^ 0x80 become fp16 1024 + u (exponent byte 0x64), minus 1152 gives x. NVIDIA
    only (PTX); `sitofp` would spend one quarter-rate I2F per element.
    Not pure on purpose: a pure elementwise op is moved past the layout change to the dot
    operand, which then gathers single bytes from shared memory (LDS.U8 + PRMT per value); here
    the tile converts where it was loaded and reaches the dot through ldmatrix (far fewer
    instructions executed: docs/notes/paged_attention.md)."""
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
                 BLOCK_N: tl.constexpr, KEEP_FAULTS: tl.constexpr):
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
    permutes); an int8 V's per-channel scale is the caller's epilogue.
    Faults (kernels/softmax.py): a NaN or inf score of a loaded key turns NaN before masking, so
    the rows that attend it end NaN and the others mask it away (in an interior tile without
    softcap, alibi or a quantized K, KEEP_FAULTS=False leaves that to the caller's key flags).
    A NaN or inf value reaches the accumulator of every row of the tile through the value dot,
    the rows that attend it and, in a masked tile, also the rows that share the tile without
    attending it (0 * NaN); the caller's finish turns any such row NaN whole. Keeping those rows clean would take zeroing bad value
    rows per element and moving a per-key flag from the value layout to the score layout in
    every masked tile (instructions and registers the decode kernel would pay on every step), so
    they are left to turn NaN: they belong to the request whose value is bad."""
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
    if b_k.dtype == tl.uint8:  # fp8 cache passed as bytes (no float8e4nv type on this GPU)
        b_k = e4m3_to_f16(b_k, _E4M3_BITS)
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
        b_s = keep_faults(b_s)  # before softcap, which would map +-inf to +-softcap
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
        # also holds k_scale, a device value). Every row sees every key: m_new is finite unless
        # a fault made a whole first tile NaN (then l_i is NaN, which is all the finish needs).
        # KEEP_FAULTS=False: the caller knows this tile's faults from per-key flags (kernel.py).
        if KEEP_FAULTS:
            b_s = keep_faults(b_s)
        m_new = tl.maximum(m_i, tl.max(b_s, -1) * qk_scale)
        m_sh = m_new
        b_p = tl.exp2(b_s * qk_scale - tl.expand_dims(m_sh, -1))
    alpha = tl.exp2(m_i - m_sh)
    l_i = l_i * alpha + tl.sum(b_p, -1)
    if MASKED or HEAD_DIM != BLOCK_D:
        b_v = tl.load(p_v + tl.expand_dims(o_vr, -1) + o_d, mask=m_nd, other=0.0)
    else:
        b_v = tl.load(p_v + tl.expand_dims(o_vr, -1) + o_d)
    if b_v.dtype == tl.uint8:
        b_v = e4m3_to_f16(b_v, _E4M3_BITS)
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
