"""Sparse MLA decode over a paged latent cache (fp8_ds_mla or bf16), any H 1..128, any topk.

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

On Hopper, fp8 caches go to Gluon kernels with the same contract: more than 32 heads to
kernels/sparse_mla_decode/sm90.py (64-head wgmma tiles, score tile split over the warpgroups, row
bytes gathered a step ahead), up to 32 heads to kernels/sparse_mla_decode/sm90_kn.py (keys on the
wgmma M, K and V^T register operands built from the bytes, a producer warpgroup gathering); this
one serves everything else.

When T x head blocks cannot fill the GPU, topk is split across programs and a second kernel
merges the partial (out, lse) pairs (kernels.merge.merge_step). The split count comes from
shapes and the SM count alone, so the op never reads a device tensor on the host and can be
captured in a CUDA graph.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from openmla.kernels.sparse_mla_decode import sm90 as _sm90
from openmla.kernels.sparse_mla_decode import sm90_kn as _kn
from openmla.kernels.sparse_mla_decode.shared import (finish_rows, head_f16_factor, keep_faults, pow2_at_least,
                                                      sink_factor, split_range)
from openmla.kernels.configs import ConfigSpace
from openmla.kernels.merge import merge_finish, merge_step
from openmla.kernels.device import arch_of, num_sms, sm90_gluon
from openmla.kernels.launch import FastLaunch
from openmla.quant.e4m3 import e4m3_to_f16
from openmla.quant.validate import check_out, check_same_device, check_scale, check_tensor, fail
from openmla.quant.format_types import SPARSE_MLA
from openmla.quant.formats import cache_format
from openmla.quant.mla_formats import check_mla_format

LOG2E = 1.4426950408889634  # host: softmax scale -> log2-domain scale
_TILES = 4  # the kernels hold the 512-wide latent as four 128-wide tiles (fp8_ds_mla's scale tiles)
MAX_HEADS = 128

# The Triton kernel's config is selected on the host, not autotuned (kernels/configs.py):
# autotuning benchmarks on the first call, which cannot happen inside CUDA-graph capture, and the
# split count chosen on the host depends on the block shape. `_SPACE`'s prune rule is the table
# measured on Hopper (docs/notes/sparse_mla_decode.md).


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
):
    i_p = tl.program_id(0)
    i_s = tl.program_id(1)
    # head blocks of one token are adjacent program ids: they run together and share L2
    i_t = i_p // NUM_HB
    i_hb = i_p % NUM_HB
    i_t64 = i_t.to(tl.int64)

    k_lo, k_hi = split_range(len_ptr, i_t, i_s, TOPK, CHUNK, HAS_LEN)

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

        m_new = tl.maximum(b_m, tl.max(b_sc, 1))
        # a row with no valid key so far keeps m = -inf; subtract 0 instead to avoid inf - inf
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(b_m - m_use)
        b_p = tl.exp2(b_sc - m_use[:, None])
        b_l = b_l * alpha + tl.sum(b_p, 1)
        # rescale the accumulators only when some factor changed (rare once the max settles)
        grow = tl.max(tl.where(m_new > b_m, 1, 0), 0)
        b_m = m_new
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
        tl.store(lse_ptr + i_t64 * H + o_h, b_lse, mask=m_h)


@triton.jit
def sparse_mla_decode_merge_kernel(
    po_ptr, plse_ptr, sink_ptr, out_ptr, lse_ptr,
    H, NUM_SPLITS, stride_ot, stride_oh,
    HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr, DV: tl.constexpr,
):
    """Merge the NUM_SPLITS normalized partials (out_s, lse_s) of one token and head block."""
    i_t = tl.program_id(0).to(tl.int64)
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    o_d = tl.arange(0, DV)
    acc = tl.zeros([BLOCK_H, DV], tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    for i_s in range(NUM_SPLITS):
        o_row = (i_t * NUM_SPLITS + i_s) * H + o_h
        b_lse = tl.load(plse_ptr + o_row, mask=m_h, other=float("-inf"))
        b_out = tl.load(po_ptr + o_row[:, None] * DV + o_d[None, :], mask=m_h[:, None], other=0.0)
        acc, m_i, l_i = merge_step(acc, m_i, l_i, b_out, b_lse)
    b_o, b_lse = merge_finish(acc, m_i, l_i)
    if HAS_SINK:
        b_o = b_o * sink_factor(sink_ptr, o_h, m_h, b_lse)[:, None]
    tl.store(out_ptr + i_t * stride_ot + o_h[:, None] * stride_oh + o_d[None, :],
             b_o.to(out_ptr.dtype.element_ty), mask=m_h[:, None])
    tl.store(lse_ptr + i_t * H + o_h, b_lse, mask=m_h)


def _config(block_h, block_n, num_warps, maxnreg=None):
    return triton.Config({"BLOCK_H": block_h, "BLOCK_N": block_n}, num_warps=num_warps,
                         num_stages=2, maxnreg=maxnreg)


def _table(configs, named_args, *, H):
    """The table measured on Hopper (docs/notes/sparse_mla_decode.md), one config per head-count
    bucket: H <= 16 in 16-head blocks of 32 rows at 4 warps, capped at 168 registers (three
    programs per SM); larger H in 32-head blocks of 64 rows at 8 warps (one program per SM).
    Both fit every target's shared memory (at most 115 KB on sm_90, 63 KB before it, 41 KB on
    AMD: tests/kernels/test_aot_compile.py); the register cap is an NVIDIA option (AMD has no
    maxnreg), so there the 16-head block runs uncapped."""
    capped_ok = arch_of(named_args["q_ptr"].device).maxnreg
    return [c for c in configs if (c.kwargs["BLOCK_H"] == 16) == (H <= 16)
            and (c.maxnreg is None or capped_ok)]


_SPACE = ConfigSpace("sparse_mla_decode_kernel",
                     (_config(16, 32, 4, maxnreg=168), _config(16, 32, 4), _config(32, 64, 8)),
                     key=("H",), prune=_table)


def _pick_config(q, H: int) -> dict:
    """The config of the Triton kernel for H heads (`_SPACE.select`), as the planner reads it.

    occupancy: programs of this config resident per SM (registers and shared memory), used to
    size the split count. 16-head blocks: 168 registers x 128 threads and 72 KB shared -> 3 per
    SM. 32-head blocks: one program of 8 warps per SM (255 registers)."""
    c = _SPACE.select({"q_ptr": q}, H=H)
    return dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages, maxnreg=c.maxnreg,
                occupancy=3 if c.kwargs["BLOCK_H"] == 16 else 1)


WAVES = 2  # at most about two rounds of resident programs
MIN_STEPS = 5  # shorter splits spend more on the q prologue, partial stores and the merge
MIN_FILL = 0.9  # share of the resident-program slots the last round must keep busy


def _split_chunk(topk: int, splits: int, block_n: int) -> int:
    """Keys per split: a multiple of BLOCK_N; ceil(topk / chunk) splits actually run."""
    return triton.cdiv(triton.cdiv(topk, splits), block_n) * block_n


def _pick_splits(T: int, num_hb: int, topk: int, cfg: dict, num_sms: int) -> int:
    """Split count from shapes and the SM count only (no device tensor is read).

    Programs all run the same number of key blocks, so the GPU works in rounds of
    occupancy x SMs programs: a count just under a multiple of that round keeps every slot busy,
    one just over leaves a nearly empty last round that takes as long as a full one. Take the
    largest split count up to WAVES rounds whose rounds are
    at least MIN_FILL full, with at least MIN_STEPS key blocks per split; failing that, the
    fullest."""
    base = T * num_hb
    slots = cfg["occupancy"] * num_sms
    if cfg.get("one_round"):
        # the Gluon kernel (one program per SM): fewer, longer splits within a single round, as
        # each split pays the q prologue and a partial row for each of its 64 heads (the timings
        # against the two-round rule: docs/notes/sparse_mla_decode.md)
        most = max(1, min(slots // base, topk // (cfg.get("min_steps", MIN_STEPS) * cfg["BLOCK_N"])))
    else:
        most = max(1, min(triton.cdiv(WAVES * slots, base), topk // (MIN_STEPS * cfg["BLOCK_N"])))
    best, best_fill = 1, 0.0
    for s in range(1, most + 1):
        s = triton.cdiv(topk, _split_chunk(topk, s, cfg["BLOCK_N"]))
        n = base * s
        fill = n / (triton.cdiv(n, slots) * slots)
        if fill >= MIN_FILL or fill > best_fill + 1e-9 and best_fill < MIN_FILL:
            best, best_fill = s, fill
    return best


# What a launch needs beyond its tensors, per call signature: the kernel, grid, split count and
# constexprs depend only on shapes, strides, the format, the device and the optional inputs, so
# they are chosen once and reused (a decode step repeats the same call every layer).
_PLANS: dict = {}
_MAX_PLANS = 4096
_TRITON = FastLaunch(sparse_mla_decode_kernel)
_MERGE = FastLaunch(sparse_mla_decode_merge_kernel)
_SM90 = FastLaunch(_sm90.sparse_mla_decode_sm90_kernel) if _sm90._GLUON else None
_KN = FastLaunch(_kn.sparse_mla_decode_sm90_kn_kernel) if _kn._GLUON else None


def _plan_launch(q, cache, indices, topk_length, attn_sink, fmt, config, num_splits):
    """(kernel launcher, grid, the int arguments before q's strides, the cache's row strides,
    constexprs, splits)."""
    T, H, _ = q.shape
    topk = indices.shape[1]
    is_fp8 = fmt.quantized
    # Hopper, fp8 cache, more than 32 heads: the Gluon kernel (64-head wgmma tiles); a pinned
    # config (tests, sweeps) always means the Triton kernel
    sm90 = is_fp8 and H > 32 and not config and _sm90.usable(q, cache)
    kn = is_fp8 and H <= _kn.MAX_HEADS and not config and _kn.usable(q, cache)
    if sm90:
        cfg = dict(BLOCK_H=_sm90.BLOCK_H, BLOCK_N=_sm90.BLOCK_N, occupancy=_sm90.OCCUPANCY,
                   one_round=True)
    elif kn:
        cfg = dict(BLOCK_H=_kn.block_h(H), BLOCK_N=_kn.BLOCK_N, occupancy=_kn.OCCUPANCY,
                   one_round=True, min_steps=_kn.MIN_STEPS)
    else:
        cfg = _pick_config(q, H)
        if config:
            cfg.update(config)
    block_h = max(16, min(cfg["BLOCK_H"], triton.next_power_of_2(H)))
    block_n = cfg["BLOCK_N"]
    num_hb = triton.cdiv(H, block_h)
    if num_splits is None:
        num_splits = _pick_splits(T, num_hb, topk, cfg, num_sms(q.device))
    chunk = _split_chunk(topk, num_splits, block_n)
    num_splits = triton.cdiv(topk, chunk)
    split = num_splits > 1

    num_blocks, block_size, _ = cache.shape
    stride_cb, stride_cr = cache.stride(0), cache.stride(1)
    dense = block_size == 1 or stride_cb == block_size * stride_cr
    if block_size == 1:
        stride_cr = stride_cb
    ints = (H, topk, chunk, num_hb, num_splits, num_blocks * block_size, block_size)
    consts = dict(DENSE=dense, HAS_LEN=topk_length is not None, HAS_SINK=attn_sink is not None,
                  SPLIT=split, BLOCK_H=block_h, BLOCK_N=block_n, TILE=fmt.latent_dim // _TILES,
                  ROPE=fmt.rope_dim, SCALE_OFF=fmt.scale_offset if is_fp8 else 0,
                  ROPE_OFF=fmt.rope_offset)
    if sm90:
        return (_SM90, (T * num_hb, num_splits), ints, (stride_cb, stride_cr),
                dict(consts, num_warps=_sm90.NUM_WARPS), num_splits)
    if kn:
        return (_KN, (T * num_hb, num_splits), ints, (stride_cb, stride_cr),
                dict(consts, BS_SHIFT=_kn.bs_shift(block_size), num_warps=_kn.NUM_WARPS), num_splits)
    consts.update(FP8=is_fp8, E4M3=arch_of(q.device).e4m3, num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"])
    if cfg.get("maxnreg"):
        consts["maxnreg"] = cfg["maxnreg"]
    return _TRITON, (T * num_hb, num_splits), ints, (stride_cb, stride_cr), consts, num_splits


def _launch(q, cache, indices, topk_length, attn_sink, out, scale, fmt, *, config=None, num_splits=None):
    """Launch on validated inputs; writes out, returns lse [T, H] fp32. fmt: the cache's
    sparse MLA format descriptor (the constexprs below come from it)."""
    T, H, _ = q.shape
    lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    if T == 0:
        return lse
    num_blocks, block_size, _ = cache.shape
    key = (q.device, T, H, indices.shape[1], fmt, cache.dtype, num_blocks, block_size,
           cache.stride(0), cache.stride(1), cache.data_ptr() & 15 == 0, topk_length is None,
           attn_sink is None,
           tuple(sorted(config.items())) if config else None, num_splits, sm90_gluon(q.device),
           arch_of(q.device))  # the path and e4m3 mode follow the device (or an assumed one)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = _plan_launch(q, cache, indices, topk_length, attn_sink, fmt, config,
                                          num_splits)
    kernel, grid, ints, cache_strides, consts, num_splits = plan
    if num_splits > 1:
        po = torch.empty((T, num_splits, H, fmt.latent_dim), dtype=torch.float32, device=q.device)
        plse = torch.empty((T, num_splits, H), dtype=torch.float32, device=q.device)
    else:
        po = plse = lse  # unused
    sink = attn_sink if attn_sink is not None else lse
    length = topk_length if topk_length is not None else lse
    args = (q, cache, indices, length, sink, out, lse, po, plse, *ints, q.stride(0), q.stride(1),
            *cache_strides, indices.stride(0), out.stride(0), out.stride(1), float(scale) * LOG2E)
    # the plan's key and the strides below fix every int argument and dtype; with every pointer
    # 16-byte aligned (as the caching allocator gives them) it keys the launch too
    aligned = (q.data_ptr() | indices.data_ptr() | out.data_ptr() | length.data_ptr()
               | sink.data_ptr() | po.data_ptr() | plse.data_ptr() | lse.data_ptr()) & 15 == 0
    if aligned:
        kernel.keyed((key, q.stride(0), q.stride(1), indices.stride(0), out.stride(0), out.stride(1)),
                     grid, *args, **consts)
    else:
        kernel(grid, *args, **consts)
    if num_splits > 1:
        block_hm = min(16, triton.next_power_of_2(H))
        margs = (po, plse, sink, out, lse, H, num_splits, out.stride(0), out.stride(1))
        mconsts = dict(HAS_SINK=attn_sink is not None, BLOCK_H=block_hm, DV=fmt.latent_dim,
                       num_warps=4)
        mgrid = (T, triton.cdiv(H, block_hm))
        if aligned:
            _MERGE.keyed((key, out.stride(0), out.stride(1)), mgrid, *margs, **mconsts)
        else:
            _MERGE(mgrid, *margs, **mconsts)
    return lse


@torch.library.custom_op("openmla::sparse_mla_decode", mutates_args=("out",))
def _sparse_mla_decode_op(q: torch.Tensor, cache: torch.Tensor, indices: torch.Tensor,
                          topk_length: Optional[torch.Tensor], attn_sink: Optional[torch.Tensor],
                          out: torch.Tensor, scale: float, fmt_name: str) -> torch.Tensor:
    # the format travels by its registry name (a custom op's arguments are tensors and scalars)
    return _launch(q, cache, indices, topk_length, attn_sink, out, scale,
                   cache_format(fmt_name, SPARSE_MLA))


@_sparse_mla_decode_op.register_fake
def _(q, cache, indices, topk_length, attn_sink, out, scale, fmt_name):
    return q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)


def sparse_mla_decode(q: torch.Tensor, cache: torch.Tensor, indices: torch.Tensor, *, scale: float,
                      topk_length: Optional[torch.Tensor] = None, attn_sink: Optional[torch.Tensor] = None,
                      out: Optional[torch.Tensor] = None, fmt=None):
    """Sparse MLA decode attention over a paged latent cache.

    Args:
        q: [T, H, 576] bf16, absorbed query (latent 512 | rope 64), H any 1..128; last dim contiguous.
        cache: fp8_ds_mla [num_blocks, block_size, 656] uint8 (dequantized in the kernel) or
            bf16 [num_blocks, block_size, 576]; a strided view is fine (block stride >= block_size
            rows, rows contiguous). Slot s is row (s // block_size, s % block_size).
        indices: [T, topk] int32 global slots, topk >= 1; invalid = < 0 or >= num_blocks * block_size,
            skipped and never read.
        scale: softmax scale applied to q.k.
        topk_length: optional [T] int32; only the first topk_length[i] indices of row i count
            (values > topk act as topk, values <= 0 give an empty row).
        attn_sink: optional [H] fp32; out *= exp(lse) / (exp(lse) + exp(attn_sink)), lse unchanged.
        out: optional [T, H, 512] bf16 to write into (last dim contiguous).
        fmt: the cache's sparse MLA format (quant.FP8_DS_MLA, FP8_DS_MLA_RAW, BF16_MLA, or a
            layer's descriptor), checked against the cache; default `mla_format_of(cache)`.

    Returns:
        (out [T, H, 512] bf16, lse [T, H] fp32 natural log of the softmax denominator of scale*q.k).
        A row with no valid index gives out = 0 and lse = -inf.
    """
    check_tensor("q", q, dtype=torch.bfloat16, ndim=3, last_dim_contiguous=True)
    T, H, d_qk = q.shape
    fmt = check_mla_format(cache, fmt)
    if (fmt.latent_dim, fmt.rope_dim) != (_TILES * 128, 64) or (fmt.quantized and fmt.num_tiles != _TILES):
        raise NotImplementedError(f"sparse_mla_decode: format {fmt} (the kernels read a {_TILES} x 128 "
                                  "latent in 128-wide scale tiles and a 64-wide rope)")
    if d_qk != fmt.head_dim:
        fail("q.shape[-1]", fmt.head_dim, d_qk)
    if not 1 <= H <= MAX_HEADS:
        fail("q.shape[1] (heads)", f"1..{MAX_HEADS}", H)
    check_tensor("cache", cache, ndim=3, last_dim_contiguous=True)
    num_blocks, block_size, width = cache.shape
    if num_blocks < 1 or block_size < 1:
        fail("cache.shape", "[num_blocks >= 1, block_size >= 1, width]", tuple(cache.shape))
    if cache.stride(1) < width:
        fail("cache.stride(1)", f">= {width} (rows must not overlap)", cache.stride(1))
    if cache.stride(0) < block_size * cache.stride(1):
        fail("cache.stride(0)", f">= block_size * stride(1) = {block_size * cache.stride(1)}", cache.stride(0))
    check_tensor("indices", indices, dtype=torch.int32, ndim=2, last_dim_contiguous=True)
    if indices.shape[0] != T:
        fail("indices.shape[0]", f"{T} (q.shape[0])", indices.shape[0])
    if indices.shape[1] < 1:
        fail("indices.shape[1] (topk)", ">= 1", indices.shape[1])
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtype=torch.int32, shape=(T,), contiguous=True)
    if attn_sink is not None:
        check_tensor("attn_sink", attn_sink, dtype=torch.float32, shape=(H,), contiguous=True)
    scale = check_scale("scale", scale)
    out = check_out(out, q, fmt.latent_dim)
    check_same_device(q=q, cache=cache, indices=indices, topk_length=topk_length, attn_sink=attn_sink,
                      out=out)
    if torch.compiler.is_compiling():
        # traced by torch.compile: the registered op, which the compiler treats as one opaque call
        lse = _sparse_mla_decode_op(q, cache, indices, topk_length, attn_sink, out, float(scale),
                                    fmt.name)
    else:
        # eager and CUDA-graph capture: straight to the launch (the custom op's dispatcher costs
        # more host time than the launch itself)
        lse = _launch(q, cache, indices, topk_length, attn_sink, out, float(scale), fmt)
    return out, lse
