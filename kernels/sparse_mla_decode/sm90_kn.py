"""Hopper (sm_90) kernel of sparse_mla_decode for the fp8_ds_mla cache and H <= 32, in Gluon:
keys on the wgmma M dimension.

A head block of 16 or 32 is too short for a 64-row wgmma tile, so this kernel turns both dots
around: scores S^T [128 keys, HN heads] = K q^T (each warpgroup 64 keys) and O^T [512, HN] +=
V^T P^T. Both K and V^T are register operands built straight from the gathered e4m3 bytes: each
thread loads 16 or 8 contiguous bytes (LDS.128 / LDS.64) and converts them with F2FP, never going
through a 16-bit copy in shared memory. That works because a dot product does not care in which
order it visits its K dimension, nor a matrix in which order its rows are stored: the latent
dims of q^T are permuted once per program (k -> p(k) inside each 128-wide tile) so that each
thread's A-operand elements are contiguous bytes of a row, and the rows of O^T are a fixed
permutation of the 512 output dims (undone in registers before the epilogue, whose stores go
through shared memory to be 16 contiguous bytes a thread); reshape/permute of the
register tensors express this and compile to nothing (checked on the sm_90a SASS).

Arithmetic (same contract as the Triton kernel; kernels/sparse_mla_decode/triton_kernel.py):
- scores: per tile t, (q_t . k8_t) with q in fp16 after an exact per-head power of two and k8 the
  exact fp16 of the e4m3 byte, times the row's tile scale s_t in fp32; rope in bf16; four tile
  chains summed in fp32.
- values: V^T = k8 * (s_t / R) rounded to fp16 (exact for power-of-two scales unless it is
  below 2^-24 of the largest scale so far), R a running power of two >= every scale seen;
  O^T is kept in units of R. P in fp16 (2^-11). A block with a scale that is not a power of two
  (raw-scale caches) takes V^T as an fp16 pair v + r and two value wgmmas: rounded once, V^T
  can put rare elements past the tests' abs 1e-3 (test_raw_scales in
  tests/kernels/test_sparse_mla_decode.py holds such inputs); power-of-two blocks keep the single
  rounding, exact for them (above).
Warp-specialised: a producer warpgroup (48 registers) gathers block i + 1 with 16-byte cp.async
(256 / 128 / 16 contiguous bytes of a row per warp instruction, the faster of the gather layouts
tried) while the two consumer warpgroups compute block i; a stage is handed over with mbarriers
(full: every producer thread's copies landed; empty: the consumers are done with it). The
consumers do not issue gathers themselves: their compute would wait for the copies instead of
overlapping them.
Shared memory: two stages of 128 gathered rows (latent bytes 64 KB, bf16 rope 16 KB, scales 2 KB),
q^T, P^T: ~190 KB (HN 16) / ~215 KB (HN 32); 8 + 4 warps, one program per SM; the consumers run
at 240 registers and spill ~24 / ~160 bytes (HN 16 / 32; loop-invariant addresses).

Timings: docs/benchmarks.md; the measurements behind these choices and the variants tried:
docs/notes/sparse_mla_decode.md.
"""
from __future__ import annotations

import torch

from openmla.kernels.device import sm90_gluon

try:  # Gluon ships with Triton >= 3.5; without it the Triton kernel serves every GPU
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from openmla.kernels.sparse_mla_decode.sm90 import (_finish_rows, _fp8_to_f16, _head_f16_factor,
                                                        _keep_faults, _pow2_at_least, _row_ptrs,
                                                        _sink_factor, _split_range)
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier
    _GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    _GLUON = False

MAX_HEADS = 32
BLOCK_N = 128  # keys per step: 64 per warpgroup (the wgmma M)
NUM_WARPS = 8
OCCUPANCY = 1


def block_h(H: int) -> int:
    """The wgmma N (head block) for H heads."""
    return 16 if H <= 16 else 32


def bs_shift(block_size: int) -> int:
    """log2 of a power-of-two block size (slot -> row by shifts), else -1 (integer division)."""
    return block_size.bit_length() - 1 if block_size & (block_size - 1) == 0 else -1


def usable(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether this kernel may serve these inputs (the caller picks it for H <= MAX_HEADS): Gluon
    kernels may run on their device (`sm90_gluon`), and cache rows start on 16 bytes (16-byte
    cp.async)."""
    return (sm90_gluon(q.device) and cache.data_ptr() % 16 == 0 and cache.stride(0) % 16 == 0
            and cache.stride(1) % 16 == 0)


if _GLUON:
    @gluon.jit
    def _perm_col(k):
        # logical latent column k -> physical column: inside each 128-wide tile, the A-operand
        # element (j: k16 step, a: +8, c: quad lane, b: pair) sits at byte 32c + 4j + 2a + b, so
        # that a thread's 32 elements of a row are 32 contiguous bytes
        kk = k & 127
        p = (kk & 1) | (((kk >> 3) & 1) << 1) | (((kk >> 4) & 7) << 2) | (((kk >> 1) & 3) << 5)
        return (k - kk) + p

    @gluon.jit
    def _load_idx(p_idx, k, k_hi, BLOCK_N: gl.constexpr, G8: gl.constexpr, GR: gl.constexpr,
                  GS: gl.constexpr):
        # slots k..k+BLOCK_N-1 (-1 past k_hi), once for each of the three gather layouts
        o8 = k + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, G8))
        o_r = k + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, GR))
        o_s = k + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, GS))
        return (gl.load(p_idx + o8, mask=o8 < k_hi, other=-1), gl.load(p_idx + o_r, mask=o_r < k_hi, other=-1),
                gl.load(p_idx + o_s, mask=o_s < k_hi, other=-1))

    @gluon.jit
    def _tile_col(b_s4, o_c4, t: gl.constexpr, ROW_S: gl.constexpr):
        # column t of the [128, 4] scales (all four sit in each thread: no data movement)
        return gl.convert_layout(gl.sum(gl.where(o_c4[None, :] == t, b_s4, 0.0), 1), ROW_S)

    @gluon.jit
    def _score_a(s_b8, t: gl.constexpr, TILE: gl.constexpr, Y_L: gl.constexpr, A_L: gl.constexpr):
        # tile t of the block's K [128 keys, 128] as the wgmma register operand, k permuted
        y = _fp8_to_f16(s_b8.slice(t * TILE, TILE, dim=1).load(Y_L))
        x = y.reshape([128, 4, 8, 2, 2]).permute((0, 2, 3, 1, 4)).reshape([128, TILE])
        return gl.convert_layout(x, A_L)

    @gluon.jit
    def _max_flag(a0, b0, a1, b1):
        # combine: max of a; max of |b| carrying a minus sign if either b was negative
        m = gl.maximum(gl.abs(b0), gl.abs(b1))
        return gl.maximum(a0, a1), gl.where((b0 < 0.0) | (b1 < 0.0), -m, m)

    @gluon.jit
    def _value_parts(s_b8, s_sc, j: gl.constexpr, inv_r, V2_L: gl.constexpr, V3_L: gl.constexpr):
        # keys 16j..16j+15: the e4m3 bytes as fp16 [16, 4, 128] (a thread's 8 contiguous dims of
        # 4 keys) and s_t / R of each (key, tile) as an fp16 hi + lo pair
        y = _fp8_to_f16(s_b8.slice(16 * j, 16, dim=0).load(V2_L))
        sc = s_sc.slice(16 * j, 16, dim=0).load(gl.SliceLayout(2, V3_L)) * inv_r
        sc_hi = sc.to(gl.float16)
        sc_lo = (sc - sc_hi.to(gl.float32)).to(gl.float16)
        return gl.convert_layout(y.reshape([16, 4, 128]), V3_L), sc_hi[:, :, None], sc_lo[:, :, None]

    @gluon.jit
    def _v_operand(v, A_L: gl.constexpr):
        # [16 keys, 4, 128] -> V^T [512, 16] as the wgmma register operand, rows permuted: row m
        # of O^T holds dim d with, by bits, d0 = m3, d1 = m7, d2 = m8, d3..d5 = m0..m2,
        # d6..d8 = m4..m6, so that a thread's eight rows (+8, +128, +256) are eight contiguous
        # dims (one 8-byte load per key)
        v = v.reshape([16, 2, 2, 2, 2, 2, 2, 2, 2, 2]).permute((7, 8, 1, 2, 3, 9, 4, 5, 6, 0))
        return gl.convert_layout(v.reshape([512, 16]), A_L)

    @gluon.jit
    def _value_a(s_b8, s_sc, j: gl.constexpr, inv_r, V2_L: gl.constexpr, V3_L: gl.constexpr,
                 A_L: gl.constexpr):
        # keys 16j..16j+15 of V^T: k8 * (s_t / R) rounded once to fp16 (exact for power-of-two
        # scales)
        y3, hi, lo = _value_parts(s_b8, s_sc, j, inv_r, V2_L, V3_L)
        return _v_operand(gl.fma(y3, hi, y3 * lo), A_L)

    @gluon.jit
    def _value_a2(s_b8, s_sc, j: gl.constexpr, inv_r, V2_L: gl.constexpr, V3_L: gl.constexpr,
                  A_L: gl.constexpr):
        # the same as an fp16 pair v + r (raw scales: k8 * s_t / R is not an fp16 number); the fma
        # gives k8 * hi - v exactly (k8 has 4 significant bits, hi 11), so v + r is k8 * s_t / R
        # to ~2^-22
        y3, hi, lo = _value_parts(s_b8, s_sc, j, inv_r, V2_L, V3_L)
        v = gl.fma(y3, hi, y3 * lo)
        return _v_operand(v, A_L), _v_operand(gl.fma(y3, hi, -v) + y3 * lo, A_L)

    @gluon.jit
    def _issue_block(cache_ptr, b_i8, b_ir, b_is, num_slots, block_size, stride_cb, stride_cr, s_b8, s_rope,
                    s_sc, G8: gl.constexpr, GR: gl.constexpr, GS: gl.constexpr, DENSE: gl.constexpr,
                    BS_SHIFT: gl.constexpr, D_LAT: gl.constexpr, ROPE: gl.constexpr, ROPE_OFF: gl.constexpr,
                    SCALE_OFF: gl.constexpr):
        # start the gather of one block of rows (one commit group): latent bytes, bf16 rope and the
        # four fp32 scales, each a contiguous run of a row per warp instruction (256 / 128 / 16
        # bytes); an invalid slot is masked (zero-filled: scale 0), never read
        p8, m8 = _row_ptrs(cache_ptr, b_i8, num_slots, block_size, stride_cb, stride_cr, DENSE, BS_SHIFT)
        o_b = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, G8))
        cp.async_copy_global_to_shared(s_b8, p8[:, None] + o_b[None, :], mask=m8[:, None])
        p_r, m_r = _row_ptrs(cache_ptr, b_ir, num_slots, block_size, stride_cb, stride_cr, DENSE, BS_SHIFT)
        p_r = gl.multiple_of((p_r + ROPE_OFF).to(gl.pointer_type(gl.bfloat16)), 16)
        o_r = gl.arange(0, ROPE, layout=gl.SliceLayout(0, GR))
        cp.async_copy_global_to_shared(s_rope, p_r[:, None] + o_r[None, :], mask=m_r[:, None])
        p_s, m_s = _row_ptrs(cache_ptr, b_is, num_slots, block_size, stride_cb, stride_cr, DENSE, BS_SHIFT)
        p_s = gl.multiple_of((p_s + SCALE_OFF).to(gl.pointer_type(gl.float32)), 16)
        o_s = gl.arange(0, 4, layout=gl.SliceLayout(0, GS))
        cp.async_copy_global_to_shared(s_sc, p_s[:, None] + o_s[None, :], mask=m_s[:, None])

    @gluon.jit
    def _producer(cache_ptr, p_idx, k_lo, k_hi, n_blk, num_slots, block_size, stride_cb, stride_cr,
                  s_b8, s_kr, s_sc, full, empty, DENSE: gl.constexpr, BS_SHIFT: gl.constexpr,
                  BLOCK_N: gl.constexpr, D_LAT: gl.constexpr, ROPE: gl.constexpr, ROPE_OFF: gl.constexpr,
                  SCALE_OFF: gl.constexpr):
        # one warpgroup: gathers block i into stage i % 2 once the consumers released it; the stage's
        # full barrier completes when every producer thread's copies have landed
        G8: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [4, 1], [1, 0])
        GR: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        GS: gl.constexpr = gl.BlockedLayout([1, 2], [32, 1], [4, 1], [1, 0])
        for i in range(n_blk):
            buf = i % 2
            mbarrier.wait(empty.index(buf), ((i // 2) & 1) ^ 1)
            b_i8, b_ir, b_is = _load_idx(p_idx, k_lo + i * BLOCK_N, k_hi, BLOCK_N, G8, GR, GS)
            _issue_block(cache_ptr, b_i8, b_ir, b_is, num_slots, block_size, stride_cb, stride_cr,
                         s_b8.index(buf), s_kr.index(buf), s_sc.index(buf), G8, GR, GS, DENSE,
                         BS_SHIFT, D_LAT, ROPE, ROPE_OFF, SCALE_OFF)
            cp.mbarrier_arrive(full.index(buf), increment_count=False)

    @gluon.jit
    def _consumer(s_b8, s_kr, s_sc, s_p, s_ql, s_qr, full, empty, p_idx, k_lo, k_hi, n_blk, num_slots, b_fq,
                  qk_scale, HN: gl.constexpr, BLOCK_N: gl.constexpr, TILE: gl.constexpr, D_LAT: gl.constexpr):
        # two warpgroups: scores and values of each block, online softmax; returns the running
        # (O^T, per-thread row sums, max, R). Layouts: S^T [128, HN] and O^T [512, HN] with warps on
        # M (one m64nHN wgmma per warpgroup); Y_L: a K tile's bytes, a thread's 32 contiguous bytes of
        # rows r and r + 8; V2_L / V3_L: 16 keys' bytes for V^T, a thread's 8 contiguous dims of 4
        # keys; SC_L: the four scales of each key in the score tile's row distribution
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, HN, 16])
        A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=S_L, k_width=2)
        Y_L: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [8, 0]],
            lane_bases=[[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0], [64, 0]], block_bases=[], shape=[128, TILE])
        V2_L: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [1, 0], [8, 0]],
            lane_bases=[[2, 0], [4, 0], [0, 8], [0, 16], [0, 32]],
            warp_bases=[[0, 64], [0, 128], [0, 256]], block_bases=[], shape=[16, D_LAT])
        V3_L: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [1, 0, 0], [8, 0, 0]],
            lane_bases=[[2, 0, 0], [4, 0, 0], [0, 0, 8], [0, 0, 16], [0, 0, 32]],
            warp_bases=[[0, 0, 64], [0, 1, 0], [0, 2, 0]], block_bases=[], shape=[16, 4, TILE])
        SC_L: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [8, 0]],
            lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0], [64, 0]], block_bases=[], shape=[128, 4])
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
        COL_S: gl.constexpr = gl.SliceLayout(0, S_L)
        o_ns = gl.arange(0, BLOCK_N, layout=ROW_S)
        zs = gl.zeros([BLOCK_N, HN], gl.float32, S_L)
        b_m = gl.full([HN], float("-inf"), gl.float32, COL_S)
        b_l = gl.zeros([BLOCK_N, HN], gl.float32, S_L)
        b_o = gl.zeros([D_LAT, HN], gl.float32, S_L)
        b_r = gl.to_tensor(2.0 ** -126)
        o_c4 = gl.arange(0, 4, layout=gl.SliceLayout(0, SC_L))
        for i in range(n_blk):
            buf = i % 2
            o_n = k_lo + i * BLOCK_N + o_ns
            b_col = gl.load(p_idx + o_n, mask=o_n < k_hi, other=-1)
            m_n = (b_col >= 0) & (b_col < num_slots)

            mbarrier.wait(full.index(buf), (i // 2) & 1)
            hopper.fence_async_shared()
            sb = s_b8.index(buf)
            # scores: rope (bf16, shared-memory operand) and the four latent tiles (register
            # operands); with 16 heads the next tile's chain is issued before this one is waited
            # (two A operands live), with 32 heads one at a time (registers)
            b_s4 = s_sc.index(buf).load(SC_L)
            t_r = hopper.warpgroup_mma(s_kr.index(buf), s_qr.permute((1, 0)), zs, use_acc=False, is_async=True)
            x = _score_a(sb, 0, TILE, Y_L, A_L)
            acc = hopper.warpgroup_mma(x, s_ql.slice(0, TILE, dim=1).permute((1, 0)), zs, use_acc=False, is_async=True)
            b_rope = hopper.warpgroup_mma_wait(1, deps=[t_r])
            lat = zs
            for t in gl.static_range(1, 4):
                if HN == 16:
                    x_n = _score_a(sb, t, TILE, Y_L, A_L)
                    acc_n = hopper.warpgroup_mma(x_n, s_ql.slice(t * TILE, TILE, dim=1).permute((1, 0)), zs,
                                                 use_acc=False, is_async=True)
                    acc, x = hopper.warpgroup_mma_wait(1, deps=[acc, x])
                    lat += acc * _tile_col(b_s4, o_c4, t - 1, ROW_S)[:, None]
                    acc = acc_n
                    x = x_n
                else:
                    acc, x = hopper.warpgroup_mma_wait(0, deps=[acc, x])
                    lat += acc * _tile_col(b_s4, o_c4, t - 1, ROW_S)[:, None]
                    x = _score_a(sb, t, TILE, Y_L, A_L)
                    acc = hopper.warpgroup_mma(x, s_ql.slice(t * TILE, TILE, dim=1).permute((1, 0)), zs,
                                               use_acc=False, is_async=True)
            acc, x = hopper.warpgroup_mma_wait(0, deps=[acc, x])
            lat += acc * _tile_col(b_s4, o_c4, 3, ROW_S)[:, None]
            b_sc = (b_rope + lat * b_fq[None, :]) * qk_scale
            # a NaN or inf score of a valid key turns NaN (kernels/softmax.py): the row ends NaN
            b_sc = gl.where(m_n[:, None], _keep_faults(b_sc), float("-inf"))

            # online softmax over the keys (rows); R grows to cover this block's scales. The block's
            # score max per head and its largest scale come out of one cross-warp reduction (each
            # reduction is a shared-memory exchange and a barrier)
            sc_row = gl.convert_layout(gl.max(b_s4, 1), ROW_S)
            # the sign of the scale operand carries "some scale of the row is not a power of two"
            # (raw-scale caches), so the same reduction tells whether V^T needs an fp16 pair
            raw_row = gl.convert_layout(gl.max(b_s4.to(gl.int32, bitcast=True) & 0x7FFFFF, 1) != 0, ROW_S)
            sc_row = gl.where(raw_row, -sc_row, sc_row)
            m_blk, s_blk = gl.reduce((b_sc, gl.zeros_like(b_sc) + sc_row[:, None]), 0, _max_flag)
            r_new = gl.maximum(b_r, _pow2_at_least(gl.max(gl.abs(s_blk), 0) + 1e-38))
            m_new = gl.maximum(b_m, m_blk)
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(b_m - m_use)
            b_p = gl.exp2(b_sc - m_use[None, :])
            b_l = b_l * alpha[None, :] + b_p
            b_m = m_new
            s_p.store(b_p.to(gl.float16))
            b_o = b_o * (alpha * (b_r / r_new))[None, :]
            b_r = r_new
            hopper.fence_async_shared()
            gl.thread_barrier()
            inv_r = 1.0 / b_r
            if gl.min(s_blk, 0) < 0.0:
                # a scale of this block is not a power of two: V^T as an fp16 pair, two wgmmas
                for j in gl.static_range(BLOCK_N // 16):
                    xv, xr = _value_a2(sb, s_sc.index(buf), j, inv_r, V2_L, V3_L, A_L)
                    b_o = hopper.warpgroup_mma(xv, s_p.slice(16 * j, 16, dim=0), b_o, is_async=True)
                    b_o = hopper.warpgroup_mma(xr, s_p.slice(16 * j, 16, dim=0), b_o, is_async=True)
                    b_o, xv, xr = hopper.warpgroup_mma_wait(0, deps=[b_o, xv, xr])
            else:
                for j in gl.static_range(BLOCK_N // 16):
                    xv = _value_a(sb, s_sc.index(buf), j, inv_r, V2_L, V3_L, A_L)
                    b_o = hopper.warpgroup_mma(xv, s_p.slice(16 * j, 16, dim=0), b_o, is_async=True)
                    b_o, xv = hopper.warpgroup_mma_wait(1, deps=[b_o, xv])
            b_o = hopper.warpgroup_mma_wait(0, deps=[b_o])
            mbarrier.arrive(empty.index(buf))
        return b_o, b_l, b_m, b_r

    @gluon.jit
    def store_heads_t(b_o, b_lse, o_h, m_h, out_ptr, lse_ptr, po_ptr, plse_ptr, i_t64, i_s, H, NUM_SPLITS,
                      stride_ot, stride_oh, SPLIT: gl.constexpr, INF_EMPTY: gl.constexpr, D_LAT: gl.constexpr,
                      HN: gl.constexpr, NW: gl.constexpr):
        """The keys-on-M kernels' epilogue (also sm90_bf16_kn.py's): one token's normalized O^T
        [D_LAT, HN] and lse [HN] (heads o_h, valid m_h) to the split's partials, or to out and
        lse. O^T goes through shared memory once so that each thread stores 16 contiguous bytes of
        one head's output (straight from the wgmma layout, a warp's store would scatter 4- or
        2-byte pieces over 32 sectors). NW: the kernel's warps."""
        SPT: gl.constexpr = 4 if SPLIT else 8
        WD: gl.constexpr = D_LAT // (32 * SPT)
        ST_L: gl.constexpr = gl.BlockedLayout([SPT, 1], [32, 1], [WD, NW // WD], [0, 1])
        o_d = gl.arange(0, D_LAT, layout=gl.SliceLayout(1, ST_L))
        o_hs = gl.arange(0, HN, layout=gl.SliceLayout(0, ST_L))
        m_hs = o_hs < H
        if SPLIT:
            p_po = po_ptr + ((i_t64 * NUM_SPLITS + i_s) * H + o_hs)[None, :] * D_LAT + o_d[:, None]
            gl.store(p_po, gl.convert_layout(b_o, ST_L), mask=m_hs[None, :])
            gl.store(plse_ptr + (i_t64 * NUM_SPLITS + i_s) * H + o_h, b_lse, mask=m_h)
        else:
            p_o = out_ptr + i_t64 * stride_ot + o_hs[None, :] * stride_oh + o_d[:, None]
            gl.store(p_o, gl.convert_layout(b_o.to(out_ptr.dtype.element_ty), ST_L), mask=m_hs[None, :])
            if INF_EMPTY:  # FlashMLA's lse for a row without a valid index
                b_lse = gl.where(b_lse == float("-inf"), float("inf"), b_lse)
            gl.store(lse_ptr + i_t64 * H + o_h, b_lse, mask=m_h)

    @gluon.jit
    def sparse_mla_decode_sm90_kn_kernel(
        q_ptr, cache_ptr, idx_ptr, len_ptr, sink_ptr, out_ptr, lse_ptr, po_ptr, plse_ptr,
        H, TOPK, CHUNK, NUM_HB, NUM_SPLITS, num_slots, block_size,
        stride_qt, stride_qh, stride_cb, stride_cr, stride_it, stride_ot, stride_oh,
        qk_scale,
        DENSE: gl.constexpr, HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr,
        BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, TILE: gl.constexpr, ROPE: gl.constexpr,
        SCALE_OFF: gl.constexpr, ROPE_OFF: gl.constexpr, BS_SHIFT: gl.constexpr, INF_EMPTY: gl.constexpr,
    ):
        gl.static_assert(BLOCK_N == 128)
        gl.static_assert(TILE == 128)
        HN: gl.constexpr = BLOCK_H
        D_LAT: gl.constexpr = 4 * TILE
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, HN, 16])
        GQ: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        SH16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        SHP: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * HN, element_bitwidth=16, rank=2)
        SH8: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[1, 0])
        SHS: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        COL_S: gl.constexpr = gl.SliceLayout(0, S_L)

        i_t = gl.program_id(0)
        i_s = gl.program_id(1)
        i_t64 = i_t.to(gl.int64)
        k_lo, k_hi = _split_range(len_ptr, i_t, i_s, TOPK, CHUNK, gl.num_programs(1), BLOCK_N, HAS_LEN)

        # q^T: latent to fp16 exactly after a per-head power of two, columns permuted (_perm_col);
        # rope stays bf16
        o_hq = gl.arange(0, HN, layout=gl.SliceLayout(1, GQ))
        m_hq = (o_hq < H)[:, None]
        p_q = q_ptr + i_t64 * stride_qt + o_hq[:, None] * stride_qh
        o_lq = _perm_col(gl.arange(0, D_LAT, layout=gl.SliceLayout(0, GQ)))
        b_ql = gl.load(p_q + o_lq[None, :], mask=m_hq, other=0.0).to(gl.float32)
        o_rq = D_LAT + gl.arange(0, ROPE, layout=gl.SliceLayout(0, GQ))
        b_qr = gl.load(p_q + o_rq[None, :], mask=m_hq, other=0.0)
        b_amax = gl.max(gl.abs(b_ql), 1)
        b_fq = _head_f16_factor(b_amax)
        s_ql = gl.allocate_shared_memory(gl.float16, [HN, D_LAT], SH16, (b_ql / b_fq[:, None]).to(gl.float16))
        s_qr = gl.allocate_shared_memory(gl.bfloat16, [HN, ROPE], SH16, b_qr)
        b_fq = gl.convert_layout(b_fq, COL_S)

        s_b8 = gl.allocate_shared_memory(gl.uint8, [2, BLOCK_N, D_LAT], SH8)
        s_kr = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, ROPE], SH16)
        s_sc = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N, 4], SHS)
        s_p = gl.allocate_shared_memory(gl.float16, [BLOCK_N, HN], SHP)

        n_blk = gl.cdiv(gl.maximum(k_hi - k_lo, 0), BLOCK_N)
        p_idx = idx_ptr + i_t64 * stride_it
        full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for b in gl.static_range(2):
            mbarrier.init(full.index(b), count=128)
            mbarrier.init(empty.index(b), count=1)  # Gluon: a partition barrier, then one thread arrives
        b_o, b_l, b_m, b_r = gl.warp_specialize(
            [(_consumer, (s_b8, s_kr, s_sc, s_p, s_ql, s_qr, full, empty, p_idx, k_lo, k_hi, n_blk, num_slots,
                          b_fq, qk_scale, HN, BLOCK_N, TILE, D_LAT)),
             (_producer, (cache_ptr, p_idx, k_lo, k_hi, n_blk, num_slots, block_size, stride_cb, stride_cr,
                          s_b8, s_kr, s_sc, full, empty, DENSE, BS_SHIFT, BLOCK_N, D_LAT, ROPE, ROPE_OFF,
                          SCALE_OFF))],
            [4], [48])

        b_inv, b_lse = _finish_rows(gl.sum(b_l, 0), b_m)
        o_h = gl.arange(0, HN, layout=COL_S)
        m_h = o_h < H
        if not SPLIT:
            if HAS_SINK:
                b_inv = b_inv * _sink_factor(sink_ptr, o_h, m_h, b_lse)
        b_o = b_o * (b_inv * b_r)[None, :]
        # undo O^T's row permutation (see _value_a) in the register layout (free)
        b_o = b_o.reshape([2, 2, 2, 2, 2, 2, 2, 2, 2, HN]).permute((2, 3, 4, 6, 7, 8, 0, 1, 5, 9))
        store_heads_t(b_o.reshape([D_LAT, HN]), b_lse, o_h, m_h, out_ptr, lse_ptr, po_ptr, plse_ptr, i_t64, i_s, H,
                      NUM_SPLITS, stride_ot, stride_oh, SPLIT, INF_EMPTY, D_LAT, HN, 8)
