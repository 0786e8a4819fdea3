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


# the same rows and 16-byte copies as the 64-head bf16 kernel: the same `usable`
from openmla.kernels.sparse_mla_decode.sm90_bf16 import usable  # noqa: F401

try:  # Gluon ships with Triton >= 3.5; without it the Triton kernel serves every GPU
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from openmla.kernels.sparse_mla_decode.sm90_bf16 import (_finish_rows, _first_step, _keep_faults, _next_step,
                                                             _q_to_shared, _score_chains, _sink_factor,
                                                             _split_range)
    from openmla.kernels.sparse_mla_decode.sm90_kn import store_heads_t
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

        s_ql, s_qr = _q_to_shared(q_ptr, i_t64, stride_qt, stride_qh, gl.arange(0, HN, layout=ROW_G), H, G_L, SH,
                                  D_LAT, ROPE)
        s_kl = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, D_LAT], SH)
        s_kr = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, ROPE], SH)
        s_ph = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, HN], SHP)
        s_pl = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, HN], SHP)

        o_ng = gl.arange(0, BLOCK_N, layout=ROW_G)
        o_ns = gl.arange(0, BLOCK_N, layout=ROW_S)
        b_nx = _first_step(cache_ptr, p_idx, n_use, o_ng, num_slots, block_size, stride_cb, stride_cr, s_kl, s_kr,
                           G_L, D_LAT, ROPE, DENSE, BS_SHIFT, BLOCK_N)

        zs = gl.zeros([BLOCK_N, HN], gl.float32, S_L)
        b_m = gl.full([HN], float("-inf"), gl.float32, COL_S)
        b_l = gl.zeros([BLOCK_N, HN], gl.float32, S_L)
        acc = gl.zeros([D_LAT, HN], gl.float32, S_L)
        for i in range(n_blk):
            buf = i % 2
            b_nx, m_n = _next_step(i, cache_ptr, b_nx, p_idx, n_use, o_ng, o_ns, num_slots, block_size,
                                   stride_cb, stride_cr, s_kl, s_kr, G_L, D_LAT, ROPE, DENSE, BS_SHIFT, BLOCK_N)
            s_lat = s_kl.index(buf)
            # (_next_step's first barrier also frees the P^T buffers, last read by block i-1's value wgmmas)
            b_s = _score_chains(s_ql, s_qr, s_lat, s_kr.index(buf), zs, TILE, True) * qk_scale
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
        store_heads_t(b_o, b_lse, o_h, m_h, out_ptr, lse_ptr, po_ptr, plse_ptr, i_t64, i_s, H, NUM_SPLITS,
                      stride_ot, stride_oh, SPLIT, INF_EMPTY, D_LAT, HN, 4)
