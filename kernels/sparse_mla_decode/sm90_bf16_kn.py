"""Hopper (sm_90) kernel of sparse_mla_decode for the bf16 cache and H <= 32, in Gluon: keys on
the wgmma M dimension.

Same arguments and outputs as `sparse_mla_decode_kernel` (kernels/sparse_mla_decode/triton_kernel.py:
one token and one split of its indices per program, all its heads in one block of HN = 16 or 32;
partial (out, lse) merged by the same merge kernel) and the bf16 Gluon kernel's arithmetic
(sm90_bf16.py): q . k as five bf16 chains (rope, four 128-wide latent tiles) summed in fp32, scores
in the log2 domain, P as bf16 hi + lo for the value dot.

A block of 16 or 32 heads is too short for a 64-row wgmma tile; the 64-head kernels pad it (4x the
score and value work at 16 heads), which made the bf16 cache's decode at 16-32 heads the
tensor-bound one (its gathers alone stream in 40 % of its time: docs/notes/sparse_mla_decode.md).
Here both dots are turned around so that the keys fill M:
  S^T [64 keys, HN] = K q^T            (K: the gathered rows in shared memory, q^T: shared memory),
  O^T [512, HN]    += V^T P^T          (V^T: the same rows read transposed; P^T: hi and lo in
                                        shared memory),
one warpgroup, every operand straight from shared memory; O^T (64 / 128 registers a thread at
HN 16 / 32) stays in registers until the epilogue. The rows of block i + 1 are gathered with
16-byte cp.async at the top of step i (zero-filled for invalid slots, which are never read), as in
sm90_bf16.py. The softmax runs over keys, i.e. down the columns of S^T: per-head maxima cross
warps once a step, the row sums are kept per element and reduced once at the end.
Shared memory: two row buffers of 64 x 1152 bytes, q^T (HN x 1152 bytes), P^T hi / lo: 164 / 182 KB
(HN 16 / 32): one program per SM.

Gluon runs on the GPU only (not in Triton's interpreter); `usable` says when it may run, the
planner (kernels/sparse_mla_decode/op.py) when it is picked. The CPU suite compiles it for sm_90a
(tests/kernels/test_sparse_mla_decode.py); the GPU suite checks it against the oracle.
"""
from __future__ import annotations

import torch

from openmla.kernels.device import sm90_gluon

try:  # Gluon ships with Triton >= 3.5; without it the Triton kernel serves every GPU
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from openmla.kernels.sparse_mla_decode.sm90_bf16 import (_finish_rows, _gather, _keep_faults,
                                                             _sink_factor, _split_range)
    _GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    _GLUON = False

MAX_HEADS = 32
BLOCK_N = 64  # keys per step: the wgmma M of one warpgroup
NUM_WARPS = 4
OCCUPANCY = 1  # programs per SM, for the split rule


def block_h(H: int) -> int:
    """The wgmma N (head block) for H <= MAX_HEADS heads."""
    return 16 if H <= 16 else 32


def usable(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether this kernel may serve these inputs (the caller picks it for H <= MAX_HEADS): Gluon
    kernels may run on their device (`sm90_gluon`), and cache rows start on 16 bytes (16-byte
    copies; strides in elements)."""
    return (sm90_gluon(q.device) and cache.data_ptr() % 16 == 0 and cache.stride(0) % 8 == 0
            and cache.stride(1) % 8 == 0)


if _GLUON:

    @gluon.jit
    def sparse_mla_decode_sm90_bf16_kn_kernel(
        q_ptr, cache_ptr, idx_ptr, len_ptr, sink_ptr, out_ptr, lse_ptr, po_ptr, plse_ptr,
        H, TOPK, CHUNK, NUM_HB, NUM_SPLITS, num_slots, block_size,
        stride_qt, stride_qh, stride_cb, stride_cr, stride_it, stride_ot, stride_oh,
        qk_scale,
        DENSE: gl.constexpr, HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr,
        BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, TILE: gl.constexpr, ROPE: gl.constexpr,
        SCALE_OFF: gl.constexpr, ROPE_OFF: gl.constexpr, BS_SHIFT: gl.constexpr, INF_EMPTY: gl.constexpr,
    ):
        # (SCALE_OFF: the fp8 kernels' argument, unused; ROPE_OFF is D_LAT: the rope follows the
        # latent; NUM_HB is 1: one block holds every head)
        gl.static_assert(BLOCK_N == 64)
        HN: gl.constexpr = BLOCK_H
        D_LAT: gl.constexpr = 4 * TILE
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, HN, 16])
        # gathers: 16-byte vectors, 8 threads per 128 bytes of a row, 4 rows a warp
        G_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        SHP: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * HN, element_bitwidth=16, rank=2)
        ROW_G: gl.constexpr = gl.SliceLayout(1, G_L)
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
        COL_S: gl.constexpr = gl.SliceLayout(0, S_L)

        i_t = gl.program_id(0)
        i_s = gl.program_id(1)
        i_t64 = i_t.to(gl.int64)
        k_lo, k_hi = _split_range(len_ptr, i_t, i_s, TOPK, CHUNK, gl.num_programs(1), BLOCK_N, HAS_LEN)
        n_use = k_hi - k_lo  # this split's list positions, from k_lo (<= 0: nothing)
        n_blk = gl.cdiv(gl.maximum(n_use, 0), BLOCK_N)
        p_idx = idx_ptr + i_t64 * stride_it + k_lo

        o_hg = gl.arange(0, HN, layout=ROW_G)
        m_hg = (o_hg < H)[:, None]
        p_q = q_ptr + i_t64 * stride_qt + o_hg[:, None] * stride_qh
        o_lg = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, G_L))
        o_rg = D_LAT + gl.arange(0, ROPE, layout=gl.SliceLayout(0, G_L))
        s_ql = gl.allocate_shared_memory(gl.bfloat16, [HN, D_LAT], SH,
                                         gl.load(p_q + o_lg[None, :], mask=m_hg, other=0.0))
        s_qr = gl.allocate_shared_memory(gl.bfloat16, [HN, ROPE], SH,
                                         gl.load(p_q + o_rg[None, :], mask=m_hg, other=0.0))
        s_kl = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, D_LAT], SH)
        s_kr = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, ROPE], SH)
        s_ph = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, HN], SHP)
        s_pl = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, HN], SHP)

        o_ng = gl.arange(0, BLOCK_N, layout=ROW_G)
        o_ns = gl.arange(0, BLOCK_N, layout=ROW_S)
        b_nx = gl.load(p_idx + o_ng, mask=o_ng < n_use, other=-1)
        _gather(cache_ptr, b_nx, num_slots, block_size, stride_cb, stride_cr, s_kl.index(0), s_kr.index(0),
                G_L, D_LAT, ROPE, DENSE, BS_SHIFT)
        # the next block's slots are loaded a step ahead: the copy's addresses do not wait on them
        b_nx = gl.load(p_idx + BLOCK_N + o_ng, mask=BLOCK_N + o_ng < n_use, other=-1)

        zs = gl.zeros([BLOCK_N, HN], gl.float32, S_L)
        b_m = gl.full([HN], float("-inf"), gl.float32, COL_S)
        b_l = gl.zeros([BLOCK_N, HN], gl.float32, S_L)
        acc = gl.zeros([D_LAT, HN], gl.float32, S_L)
        for i in range(n_blk):
            buf = i % 2
            # every warp has finished block i-1's value wgmmas, which read the row buffer that
            # block i+1 is gathered into now and the P^T buffers (past the end: all positions
            # masked, nothing read)
            gl.thread_barrier()
            _gather(cache_ptr, b_nx, num_slots, block_size, stride_cb, stride_cr, s_kl.index(1 - buf),
                    s_kr.index(1 - buf), G_L, D_LAT, ROPE, DENSE, BS_SHIFT)
            o_nx = (i + 2) * BLOCK_N + o_ng
            b_nx = gl.load(p_idx + o_nx, mask=o_nx < n_use, other=-1)
            o_n = i * BLOCK_N + o_ns
            b_col = gl.load(p_idx + o_n, mask=o_n < n_use, other=-1)
            m_n = (b_col >= 0) & (b_col < num_slots)

            # block i's rows have landed (all but the newest copy group), for every thread, and
            # are visible to the tensor cores' (async proxy) reads
            cp.wait_group(1)
            hopper.fence_async_shared()
            gl.thread_barrier()
            s_lat = s_kl.index(buf)
            # S^T: five chains (rope, four 128-wide latent tiles) summed in fp32, two in flight
            t_a = hopper.warpgroup_mma(s_kr.index(buf), s_qr.permute((1, 0)), zs, use_acc=False, is_async=True)
            t_b = hopper.warpgroup_mma(s_lat.slice(0, TILE, dim=1), s_ql.slice(0, TILE, dim=1).permute((1, 0)), zs,
                                       use_acc=False, is_async=True)
            b_s = hopper.warpgroup_mma_wait(1, deps=[t_a])
            t_a = t_b
            for t in gl.static_range(1, 4):
                t_b = hopper.warpgroup_mma(s_lat.slice(t * TILE, TILE, dim=1),
                                           s_ql.slice(t * TILE, TILE, dim=1).permute((1, 0)), zs,
                                           use_acc=False, is_async=True)
                b_s += hopper.warpgroup_mma_wait(1, deps=[t_a])
                t_a = t_b
            b_s = (b_s + hopper.warpgroup_mma_wait(0, deps=[t_a])) * qk_scale
            # a NaN or inf score of a valid key turns NaN (kernels/softmax.py): the head ends NaN
            b_s = gl.where(m_n[:, None], _keep_faults(b_s), float("-inf"))

            m_new = gl.maximum(b_m, gl.max(b_s, 0))
            # a head with nothing valid yet keeps max -inf; shift by 0 there so no inf - inf appears
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            b_p = gl.exp2(b_s - m_use[None, :])
            alpha = gl.exp2(b_m - m_use)
            b_l = b_l * alpha[None, :] + b_p
            b_m = m_new
            p_hi = b_p.to(gl.bfloat16)
            s_ph.store(p_hi)
            s_pl.store((b_p - p_hi.to(gl.float32)).to(gl.bfloat16))
            acc = acc * alpha[None, :]
            hopper.fence_async_shared()
            gl.thread_barrier()
            # O^T += V^T P^T: the rows read transposed (M = 512 dims, K = 64 keys)
            v_t = s_lat.permute((1, 0))
            t_o = hopper.warpgroup_mma(v_t, s_ph, acc, is_async=True)
            t_o = hopper.warpgroup_mma(v_t, s_pl, t_o, is_async=True)
            acc = hopper.warpgroup_mma_wait(0, deps=[t_o])
        cp.wait_group(0)

        b_inv, b_lse = _finish_rows(gl.sum(b_l, 0), b_m)
        o_h = gl.arange(0, HN, layout=COL_S)
        m_h = o_h < H
        if not SPLIT:
            if HAS_SINK:
                b_inv = b_inv * _sink_factor(sink_ptr, o_h, m_h, b_lse)
        b_o = acc * b_inv[None, :]
        # each thread stores 16 contiguous bytes of one head's output (straight from the wgmma
        # layout a warp's store would scatter 4-byte pieces over many sectors)
        SPT: gl.constexpr = 4 if SPLIT else 8
        WD: gl.constexpr = D_LAT // (32 * SPT)
        ST_L: gl.constexpr = gl.BlockedLayout([SPT, 1], [32, 1], [WD, 4 // WD], [0, 1])
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
