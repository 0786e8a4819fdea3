"""Hopper (sm_90) kernel of sparse_mla_prefill for H <= 32, in Gluon: keys on the wgmma M.

A block of 16 or 32 heads is too short for a 64-row wgmma tile (padding to 64 does the 64-head
work), so both dots are turned around, as in the fp8 decode kernel for small H
(kernels/sparse_mla_decode/sm90_kn.py): scores S^T [64 keys, HN heads] = K q^T and output
O^T [512, HN] += V^T P^T. Every operand is read by the tensor cores from shared memory: K (the
gathered rows, K-major), q^T (K-major), V^T (the same gathered latent rows, M-major) and P^T
(stored by the consumer, N-major); nothing is converted.

Warp-specialised, three partitions of one warpgroup each:
- a producer gathers block i (64 rows: latent 1 KB + rope 128 B each, 16-byte cp.async, masked
  rows zero-filled and never read) into stage i % 2 once that stage is released;
- two consumers own alternate blocks (consumer 0 the even ones from stage 0, consumer 1 the odd
  ones from stage 1), each with its own online softmax and O^T, so while one waits for its rows
  or runs its softmax the other's wgmmas keep the tensor cores busy (ping-pong). At the end both
  leave (O^T, shift, row sum, max) in shared memory and the producer's warps merge them.
Scores run as two accumulator chains (rope + latent[:256] and latent[256:]) of separately issued
k16 wgmmas, alternating: one wgmma op over the whole K, chains issued as one op each, or four
chains make the consumers spill, and here the spills cost, not the chains' latency.
Shared memory: q 36 KB (HN 32) + 2 stages x 72 KB + P^T 2 x 4 KB + merge ~ 190 KB: one program
per SM. Registers: 232 per consumer (the accumulator O^T alone is 128 at HN 32), 40 for the
producer; at HN 32 a few loop-invariant values spill (40 bytes, reloaded from L1).

Faults (a NaN or inf in q or in a row a token attends makes its rows NaN; kernels/softmax.py): one
fma a score (keep_faults) pushes the consumers past their registers at HN 32 (spills 48 -> 224
bytes, 2.07 -> 2.35 ms at the benchmark's H32 shape), so at HN 32, where the kernel gathers at
least FLAG_RATIO times the rows of kv a pass over kv reads (T * topk >= FLAG_RATIO * N, prefill's
usual case), two Triton passes run first: `kv_row_faults` flags the rows of kv holding a NaN or inf,
`token_faults` reads each token's indices (the kernel's own validity rule: in [0, N), before
topk_length) and records whether the token counts no key, only clean keys, or a flagged one. The
consumers' loop then carries no fault work at all; the epilogue reads the token's state and marks
the token's rows NaN where a counted key was flagged, and a head's row where its q is not finite
and the token counts any key (FLAGS). Otherwise (HN 16, or few tokens over a large kv) the loop
checks every score. Flags gathered per key by the consumers (2.18 ms) or recorded by the producer
(2.37 ms: the producer is on the critical path) were slower (docs/notes/sparse_mla_prefill.md).

The producer loads block i + 1's row numbers while block i waits for its stage (issued after the
wait, those global loads would sit between a released stage and its refill, on the consumers'
critical path), and the consumers rescale O^T lazily (the shift moves only when a head's max rose by
more than 2^TAU; the exact max is kept for max_logits).

Timings: docs/benchmarks.md; the profile, the measurements behind these choices and the variants
tried: docs/notes/sparse_mla_prefill.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from openmla.kernels.sparse_mla_prefill import sm90 as _sm90

try:  # Gluon ships with Triton >= 3.5; without it the Triton kernel serves every GPU
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier
    from openmla.kernels.sparse_mla_prefill.sm90 import (_finish_rows, _keep_faults, _max_logits, _piece_range,
                                                         _producer, _split_program)
    _GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    _GLUON = False

MAX_HEADS = 32
BLOCK_N = 64  # keys per block: one consumer warpgroup's wgmma M
NUM_WARPS = 4  # the producer (default partition; prologue and epilogue); the consumers are workers
TAU = 8.0  # lazy rescale: the shift trails the running max by at most this (exp2 domain)
C_REGS = 232  # registers of each consumer; the producer (the default partition) gets the rest, 40
# Faults via row flags (FLAGS) at 32 heads when the kernel gathers at least this many times the
# rows that the flag pass reads (T * topk >= FLAG_RATIO * N): the flag pass then costs under
# 1 / FLAG_RATIO of the kernel's own row traffic, and the loop keeps one fma a score off its
# register budget (at 16 heads the fma fits and the per-score check is the faster one)
FLAG_RATIO = 8
FLAG_MIN_BLOCK_H = 32  # the head blocks that take the passes (16-head blocks check per score)


@triton.jit
def kv_row_faults_kernel(kv_ptr, flag_ptr, N, stride_kv, D: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    """flag[r] = 1 where row r of kv [N, D] holds a NaN or inf, else 0 (one program a BLOCK_R rows)."""
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    m_r = o_r < N
    bad = tl.zeros([BLOCK_R], tl.float32)
    for d0 in tl.static_range(0, D, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(kv_ptr + o_r.to(tl.int64)[:, None] * stride_kv + o_d[None, :],
                    mask=m_r[:, None] & (o_d < D)[None, :], other=0.0).to(tl.float32)
        bad += tl.sum(x * 0.0, 1)  # NaN where a value is NaN or +-inf
    tl.store(flag_ptr + o_r, (bad != 0.0).to(tl.uint8), mask=m_r)


@triton.jit
def token_faults_kernel(idx_ptr, len_ptr, kv_flag_ptr, tok_ptr, N, TOPK, stride_it,
                        HAS_LEN: tl.constexpr, BLOCK_K: tl.constexpr):
    """tok[t] = 0 if token t counts no key, 1 if only clean keys, 2 if a key whose kv row is
    flagged; a key counts when its index is in [0, N) and it lies before topk_length[t]."""
    i_t = tl.program_id(0).to(tl.int64)
    n_use = TOPK
    if HAS_LEN:
        n_use = tl.minimum(tl.maximum(tl.load(len_ptr + i_t), 0), TOPK)
    state = tl.zeros([BLOCK_K], tl.int32)
    for k0 in range(0, n_use, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        i_k = tl.load(idx_ptr + i_t * stride_it + o_k, mask=o_k < n_use, other=-1)
        m_k = (i_k >= 0) & (i_k < N)
        f_k = tl.load(kv_flag_ptr + i_k, mask=m_k, other=0).to(tl.int32)
        state = tl.maximum(state, tl.where(m_k, 1 + f_k, 0))
    tl.store(tok_ptr + i_t, tl.max(state, 0).to(tl.uint8))


def block_h(H: int) -> int:
    """The wgmma N (head block) for H heads."""
    return 16 if H <= 16 else 32


if _GLUON:

    @gluon.jit
    def _consumer(s_kl, s_kr, s_ql, s_qr, s_p, s_ml, full, empty, p_idx, n_use, n_blk, N,
                  scale_log2, WG: gl.constexpr, HN: gl.constexpr, BLOCK_N: gl.constexpr,
                  D_LAT: gl.constexpr, TAU: gl.constexpr, FLAGS: gl.constexpr):
        # the blocks i = WG, WG + 2, ... from stage WG: scores, online softmax over the keys
        # (rows; a per-thread partial row sum, summed once at the end), values. m_i (the shift of
        # the exponent) and m_ex (the max) are in raw q.k units (scale > 0). The state is left for
        # the epilogue to merge: O^T in this stage's latent rows (this consumer was their last
        # reader: the producer has no block left for them), shift, row sum and max in s_ml
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, HN, 16])
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
        COL_S: gl.constexpr = gl.SliceLayout(0, S_L)
        zs = gl.zeros([BLOCK_N, HN], gl.float32, S_L)
        m_i = gl.full([HN], float("-inf"), gl.float32, COL_S)
        m_ex = gl.full([HN], float("-inf"), gl.float32, COL_S)
        l_i = gl.zeros([BLOCK_N, HN], gl.float32, S_L)
        acc = gl.zeros([D_LAT, HN], gl.float32, S_L)
        o_ns = gl.arange(0, BLOCK_N, layout=ROW_S)
        s_lat = s_kl.index(WG)
        s_rope = s_kr.index(WG)
        s_pw = s_p.index(WG)
        for j in range((n_blk + 1 - WG) // 2):
            o_n = (2 * j + WG) * BLOCK_N + o_ns
            b_col = gl.load(p_idx + o_n, mask=o_n < n_use, other=-1)
            m_n = (b_col >= 0) & (b_col < N)
            mbarrier.wait(full.index(WG), j & 1)
            hopper.fence_async_shared()
            # scores: two accumulator chains (rope + latent[:256], latent[256:]) of k16 wgmmas,
            # alternating (one op over the whole K spilled: see the module docstring)
            t_0 = hopper.warpgroup_mma(s_rope, s_qr.permute((1, 0)), zs, use_acc=False, is_async=True)
            t_1 = zs
            for k in gl.static_range(D_LAT // 32):
                t_0 = hopper.warpgroup_mma(s_lat.slice(16 * k, 16, dim=1),
                                           s_ql.slice(16 * k, 16, dim=1).permute((1, 0)), t_0, is_async=True)
                t_1 = hopper.warpgroup_mma(s_lat.slice(D_LAT // 2 + 16 * k, 16, dim=1),
                                           s_ql.slice(D_LAT // 2 + 16 * k, 16, dim=1).permute((1, 0)), t_1,
                                           use_acc=k > 0, is_async=True)
            t_0, t_1 = hopper.warpgroup_mma_wait(0, deps=[t_0, t_1])
            b_s = t_0 + t_1
            if FLAGS:  # faults come from the token's state and q (the epilogue)
                b_s = gl.where(m_n[:, None], b_s, float("-inf"))
            else:  # a NaN or inf score of a valid row turns NaN (kernels/softmax.py): the query ends NaN
                b_s = gl.where(m_n[:, None], _keep_faults(b_s), float("-inf"))

            m_blk = gl.max(b_s, 0)
            m_ex = gl.maximum(m_ex, m_blk)
            # lazy rescaling (as in FlashAttention 4): the shift m_i follows the max only when it
            # rose by more than TAU in the exp2 domain, so P <= 2^TAU (bf16 and the fp32 sums take
            # it) and most blocks skip the rescale of O^T (4 * HN multiplies a thread); m_ex stays
            # the exact max for max_logits
            up = m_blk * scale_log2 > m_i * scale_log2 + TAU
            m_new = gl.where(up, m_blk, m_i)
            # a head with nothing valid yet keeps max -inf; shift by 0 there so no inf - inf appears
            m_sh = gl.where(m_new == float("-inf"), 0.0, m_new * scale_log2)
            b_p = gl.exp2(b_s * scale_log2 - m_sh[None, :])
            alpha = gl.exp2(m_i * scale_log2 - m_sh)
            l_i = l_i * alpha[None, :] + b_p
            m_i = m_new
            s_pw.store(b_p.to(gl.bfloat16))
            if gl.max(up.to(gl.int32), 0) > 0:  # uniform over the warpgroup: m_i is per head
                acc = acc * alpha[None, :]
            hopper.fence_async_shared()
            gl.thread_barrier()
            t_o = hopper.warpgroup_mma(s_lat.permute((1, 0)), s_pw, acc, is_async=True)
            acc = hopper.warpgroup_mma_wait(0, deps=[t_o])
            mbarrier.arrive(empty.index(WG))
        SHO: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0, 1])
        s_kl.index(WG)._reinterpret(gl.float32, [D_LAT, HN], SHO).store(acc)
        s_ml.slice(2 * WG, 1, dim=0).store(m_i[None, :])
        s_ml.slice(2 * WG + 1, 1, dim=0).store(gl.sum(l_i, 0)[None, :])
        s_ml.slice(4 + WG, 1, dim=0).store(m_ex[None, :])

    @gluon.jit
    def _store_rows(s_oa, s_ob, w_a, w_b, p_o, m_o, D_LAT: gl.constexpr, GO: gl.constexpr):
        # rows w_a O_a + w_b O_b of the block's heads (O^T of the two consumers in shared memory),
        # 64 dims at a time, 16-byte stores along the dims, at p_o [HN, 64] (+ 64 c), rows m_o
        for c in gl.static_range(D_LAT // 64):
            b_o = (s_oa.slice(64 * c, 64, dim=0).permute((1, 0)).load(GO) * w_a
                   + s_ob.slice(64 * c, 64, dim=0).permute((1, 0)).load(GO) * w_b)
            gl.store(p_o + 64 * c, b_o.to(p_o.dtype.element_ty), mask=m_o[:, None])

    @gluon.jit(do_not_specialize=["p_main", "splits"])  # one compile whatever the grid's split
    def sparse_mla_prefill_sm90_kn_kernel(
        q_ptr, kv_ptr, idx_ptr, len_ptr, sink_ptr, out_ptr, ml_ptr, lse_ptr,
        H, N, TOPK, NUM_HB,
        stride_qt, stride_qh, stride_kv, stride_it, stride_ot, stride_oh,
        scale, scale_log2,
        HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr, OFF32: gl.constexpr,
        D_LAT: gl.constexpr, D_ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
        C_REGS: gl.constexpr, TAU: gl.constexpr, flag_ptr, FLAGS: gl.constexpr,
        p_main, splits, ws_o, ws_lse, ws_ml,
    ):
        HN: gl.constexpr = BLOCK_H
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, HN, 16])
        COL_S: gl.constexpr = gl.SliceLayout(0, S_L)
        GQ: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        SHP: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * HN, element_bitwidth=16, rank=2)
        SHF: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        SHO: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0, 1])

        # one program per token and head block (NUM_HB = 1 while H <= 32); programs from p_main on
        # are pieces of the split programs p_main.. (tail.py), `splits` of each in a row
        i_t, i_hb, i_w = _split_program(gl.program_id(0), p_main, splits, NUM_HB)  # i_w >= 0: a piece
        o_hq = i_hb * HN + gl.arange(0, HN, layout=gl.SliceLayout(1, GQ))
        p_q = q_ptr + i_t * stride_qt + o_hq[:, None] * stride_qh
        o_lq = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, GQ))
        o_rq = D_LAT + gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, GQ))
        b_ql = gl.load(p_q + o_lq[None, :], mask=(o_hq < H)[:, None], other=0.0)
        b_qr = gl.load(p_q + o_rq[None, :], mask=(o_hq < H)[:, None], other=0.0)
        s_ql = gl.allocate_shared_memory(gl.bfloat16, [HN, D_LAT], SH, b_ql)
        s_qr = gl.allocate_shared_memory(gl.bfloat16, [HN, D_ROPE], SH, b_qr)
        s_kl = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, D_LAT], SH)
        s_kr = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, D_ROPE], SH)
        s_p = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, HN], SHP)
        # shift, sum, max (rows 0-5); FLAGS: q faults (6)
        s_ml = gl.allocate_shared_memory(gl.float32, [16, HN], SHF)
        if FLAGS:  # 1.0 for a head whose q holds a NaN or inf
            q_bad = (gl.sum(b_ql.to(gl.float32) * 0.0, 1) + gl.sum(b_qr.to(gl.float32) * 0.0, 1)) != 0.0
            s_ml.slice(6, 1, dim=0).store(gl.convert_layout(q_bad.to(gl.float32), COL_S)[None, :])

        n_use = TOPK
        if HAS_LEN:
            n_use = gl.minimum(gl.maximum(gl.load(len_ptr + i_t), 0), TOPK)
        p_idx, n_use = _piece_range(idx_ptr + i_t * stride_it, n_use, i_w, splits, BLOCK_N)
        n_blk = gl.cdiv(n_use, BLOCK_N)
        full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for b in gl.static_range(2):
            mbarrier.init(full.index(b), count=128)  # every producer thread's copies
            mbarrier.init(empty.index(b), count=1)  # Gluon: a partition barrier, then one thread
        gl.warp_specialize(
            [(_producer, (kv_ptr, p_idx, n_use, n_blk, N, stride_kv, s_kl, s_kr, full, empty,
                          BLOCK_N, D_LAT, D_ROPE, OFF32)),
             (_consumer, (s_kl, s_kr, s_ql, s_qr, s_p, s_ml, full, empty, p_idx, n_use, n_blk,
                          N, scale_log2, 0, HN, BLOCK_N, D_LAT, TAU, FLAGS)),
             (_consumer, (s_kl, s_kr, s_ql, s_qr, s_p, s_ml, full, empty, p_idx, n_use, n_blk,
                          N, scale_log2, 1, HN, BLOCK_N, D_LAT, TAU, FLAGS))],
            [4, 4], [C_REGS, C_REGS])

        # merge the two consumers' states (every partition has finished: their shared-memory
        # writes are visible here)
        m_a = gl.max(s_ml.slice(0, 1, dim=0).load(S_L), 0)
        l_a = gl.max(s_ml.slice(1, 1, dim=0).load(S_L), 0)
        m_b = gl.max(s_ml.slice(2, 1, dim=0).load(S_L), 0)
        l_b = gl.max(s_ml.slice(3, 1, dim=0).load(S_L), 0)
        m_i = gl.maximum(m_a, m_b)
        m_x = gl.maximum(gl.max(s_ml.slice(4, 1, dim=0).load(S_L), 0),
                         gl.max(s_ml.slice(5, 1, dim=0).load(S_L), 0))
        m_sh = gl.where(m_i == float("-inf"), 0.0, m_i * scale_log2)
        f_a = gl.exp2(m_a * scale_log2 - m_sh)
        f_b = gl.exp2(m_b * scale_log2 - m_sh)
        l_i = l_a * f_a + l_b * f_b
        o_h = i_hb * HN + gl.arange(0, HN, layout=COL_S)
        m_h = o_h < H
        # a piece (i_w >= 0) leaves the sink to the merge: its sink load is masked off (factor 1)
        inv, lse = _finish_rows(l_i, m_i, scale, sink_ptr, o_h, m_h & (i_w < 0), HAS_SINK)
        if FLAGS:  # a faulty key the token attends, or a faulty q of a head with a key: NaN rows
            t_tok = gl.load(flag_ptr + i_t)  # token_faults: 0 no key, 1 clean keys, 2 a faulty key
            q_bad = gl.max(s_ml.slice(6, 1, dim=0).load(S_L), 0)
            bad = (t_tok == 2) | ((t_tok == 1) & (q_bad > 0.5))
            inv = gl.where(bad, float("nan"), inv)
            lse = gl.where(bad, float("nan"), lse)
        # out = inv * (f_a O_a + f_b O_b) (_store_rows)
        GO: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        COL_O: gl.constexpr = gl.SliceLayout(1, GO)
        w_a = gl.convert_layout(f_a * inv, COL_O)[:, None]
        w_b = gl.convert_layout(f_b * inv, COL_O)[:, None]
        s_oa = s_kl.index(0)._reinterpret(gl.float32, [D_LAT, HN], SHO)
        s_ob = s_kl.index(1)._reinterpret(gl.float32, [D_LAT, HN], SHO)
        o_hl = gl.arange(0, HN, layout=COL_O)
        o_do = gl.arange(0, 64, layout=gl.SliceLayout(0, GO))
        if i_w >= 0:  # a piece: fp32 rows of every head of the block into workspace row i_w
            _store_rows(s_oa, s_ob, w_a, w_b, ws_o + i_w.to(gl.int64) * (HN * D_LAT) + o_hl[:, None] * D_LAT
                        + o_do[None, :], o_hl < HN, D_LAT, GO)
            o_hw = i_w * HN + gl.arange(0, HN, layout=COL_S)
            gl.store(ws_ml + o_hw, _max_logits(m_x, lse, scale))
            gl.store(ws_lse + o_hw, lse)
        else:
            o_ho = i_hb * HN + o_hl
            _store_rows(s_oa, s_ob, w_a, w_b, out_ptr + i_t * stride_ot + o_ho[:, None] * stride_oh + o_do[None, :],
                        o_ho < H, D_LAT, GO)
            gl.store(ml_ptr + i_t * H + o_h, _max_logits(m_x, lse, scale), mask=m_h)
            gl.store(lse_ptr + i_t * H + o_h, lse, mask=m_h)


def kv_row_faults(kv: torch.Tensor) -> torch.Tensor:
    """uint8 [N]: 1 where a row of kv [N, D] (row stride kv.stride(0)) holds a NaN or inf."""
    N, D = kv.shape[0], kv.shape[-1]
    flags = torch.empty(N, dtype=torch.uint8, device=kv.device)
    kv_row_faults_kernel[(triton.cdiv(N, 64),)](kv, flags, N, kv.stride(0), D=D, BLOCK_R=64, BLOCK_D=64)
    return flags


def token_faults(indices: torch.Tensor, topk_length, kv_flags: torch.Tensor) -> torch.Tensor:
    """uint8 [T]: per token of indices [T, topk] (last dim contiguous), 0 when it counts no key,
    1 when only keys whose kv_flags [N] are 0, 2 when a counted key is flagged (token_faults_kernel)."""
    T, topk = indices.shape
    tok = torch.empty(T, dtype=torch.uint8, device=indices.device)
    token_faults_kernel[(T,)](indices, topk_length if topk_length is not None else indices, kv_flags, tok,
                              kv_flags.shape[0], topk, indices.stride(0), HAS_LEN=topk_length is not None,
                              BLOCK_K=512)
    return tok


def launch(q, kv, indices, topk_length, attn_sink, out, max_logits, lse, scale, log2e,
           d_lat, d_rope):
    """Run the kernel on validated inputs into the given outputs (T >= 1, 1 <= H <= MAX_HEADS),
    through the 64-head kernel's launcher (same arguments). Faults: per score in the loop, or from
    the token states of the two fault passes and q when the kernel gathers FLAG_RATIO times the
    rows the kv pass reads."""
    flags = block_h(q.shape[1]) >= FLAG_MIN_BLOCK_H and q.shape[0] * indices.shape[1] >= FLAG_RATIO * kv.shape[0]
    tok = token_faults(indices, topk_length, kv_row_faults(kv)) if flags else lse
    _sm90.launch(q, kv, indices, topk_length, attn_sink, out, max_logits, lse, scale, log2e, d_lat,
                 d_rope, kernel=sparse_mla_prefill_sm90_kn_kernel, block_h=block_h(q.shape[1]),
                 BLOCK_N=BLOCK_N, C_REGS=C_REGS, TAU=TAU, num_warps=NUM_WARPS,
                 flag_ptr=tok, FLAGS=flags)
