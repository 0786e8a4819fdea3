"""Hopper (sm_90) kernel of sparse_mla_prefill for 64-head blocks, warp-specialised, in Gluon.

Same maths, arguments and outputs as `sparse_mla_prefill_kernel` (kernels/sparse_mla_prefill/op.py);
a program owns one query token and 64 heads. Three partitions of one warpgroup each (the fp8
decode kernel's partition, kernels/sparse_mla_decode/sm90.py, with bf16 rows that need no
conversion):
- the producer (P_REGS registers; sm90_kn.py's `_producer`) gathers block i (BLOCK_N rows: latent
  and rope, 16-byte cp.async, rows outside [0, N) zero-filled and never read) into stage
  i % NUM_STAGES once both consumers have released it;
- the score warpgroup (the default partition: the q prologue and the registers the workers leave)
  computes S [64 heads, BLOCK_N keys] (one wgmma chain: rope, then latent), the online softmax,
  stores P (bf16) and the heads' rescale factor into shared memory for the value warpgroup, then
  adds P V[:, :256] into its half of the output (P from registers);
- the value warpgroup (V_REGS registers) holds the output's other half and adds P V[:, 256:] (P
  from shared memory) while the score warpgroup goes on to the next block's scores.
So the next block's score wgmmas and softmax overlap this block's value wgmmas, and the gathers of
up to NUM_STAGES - 1 blocks ahead overlap both. P of a block goes into its stage's rope buffer
(the score wgmma has read it; the stage is refilled only after the value warpgroup released it):
[64 heads, BLOCK_N] bf16 is the size of [BLOCK_N, 64] rope; 512-wide rows (DeepSeek-V4, no rope)
get buffers of their own. The shift of the exponent follows a head's running max lazily (as in
sm90_kn.py: only when the max rose by more than 2^TAU), the exact max kept for max_logits.
Shared memory: q 72 KB + NUM_STAGES x 72 KB / (64 / BLOCK_N) rows: one program per SM.

Timings: docs/benchmarks.md; the measurements behind the choices: docs/notes/sparse_mla_prefill.md.
"""
from __future__ import annotations

from openmla.kernels.sparse_mla_prefill import sm90 as _sm90

try:  # Gluon ships with Triton >= 3.5; without it the Triton kernel serves every GPU
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier
    from openmla.kernels.sparse_mla_prefill.sm90 import _finish_rows, _keep_faults, _max_logits
    from openmla.kernels.sparse_mla_prefill.sm90_kn import _producer
    _GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    _GLUON = False

BLOCK_H = 64
BLOCK_N = 64  # keys per block (the score wgmma's N)
NUM_STAGES = 2
NUM_WARPS = 4  # the score warpgroup (and the q prologue); the value and producer warpgroups are workers
TAU = 8.0  # lazy rescale: the shift trails the running max by at most this (exp2 domain)
V_REGS = 160  # registers of the value warpgroup (its half of the output alone is 128)
P_REGS = 64  # registers of the producer (at 56 it spills); the score warpgroup gets the rest


if _GLUON:

    @gluon.jit
    def _store_half(acc, inv, C0: gl.constexpr, out_ptr, i_t, i_hb, H, stride_ot, stride_oh,
                    BLOCK_H: gl.constexpr, DV: gl.constexpr, O_L: gl.constexpr):
        # columns C0 .. C0 + DV of this program's heads, times 1 / sum
        o_h = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_L))
        o_d = C0 + gl.arange(0, DV, layout=gl.SliceLayout(0, O_L))
        p_o = out_ptr + i_t * stride_ot + o_h[:, None] * stride_oh + o_d[None, :]
        gl.store(p_o, (acc * inv[:, None]).to(out_ptr.dtype.element_ty), mask=(o_h < H)[:, None])

    @gluon.jit
    def _scores(s_ql, s_qr, s_kl, s_kr, s_p, s_f, s_inv, full, empty, pfull, done, p_idx, n_use, n_blk, N,
                scale, scale_log2, sink_ptr, out_ptr, ml_ptr, lse_ptr, i_t, i_hb, H, stride_ot, stride_oh,
                HAS_SINK: gl.constexpr, D_LAT: gl.constexpr, D_ROPE: gl.constexpr, BLOCK_H: gl.constexpr,
                BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, TAU: gl.constexpr):
        DV: gl.constexpr = D_LAT // 2
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_N, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, DV, 16])
        P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        SHP: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], gl.bfloat16)
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
        COL_S: gl.constexpr = gl.SliceLayout(0, S_L)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
        zs = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_L)
        # m_i: the exponent's shift, m_x: the exact max, both in raw q.k units (scale > 0)
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, ROW_S)
        m_x = gl.full([BLOCK_H], float("-inf"), gl.float32, ROW_S)
        l_i = gl.zeros([BLOCK_H], gl.float32, ROW_S)
        acc = gl.zeros([BLOCK_H, DV], gl.float32, O_L)
        o_ns = gl.arange(0, BLOCK_N, layout=COL_S)
        b_col = gl.load(p_idx + o_ns, mask=o_ns < n_use, other=-1)
        for i in range(n_blk):
            buf = i % NUM_STAGES
            # the next block's row numbers (validity) load while this block's rows land
            o_nx = (i + 1) * BLOCK_N + o_ns
            b_nx = gl.load(p_idx + o_nx, mask=o_nx < n_use, other=-1)
            m_n = (b_col >= 0) & (b_col < N)
            mbarrier.wait(full.index(buf), (i // NUM_STAGES) & 1)
            s_lat = s_kl.index(buf)
            if D_ROPE > 0:
                t_s = hopper.warpgroup_mma(s_qr, s_kr.index(buf).permute((1, 0)), zs, use_acc=False, is_async=True)
                t_s = hopper.warpgroup_mma(s_ql, s_lat.permute((1, 0)), t_s, is_async=True)
            else:
                t_s = hopper.warpgroup_mma(s_ql, s_lat.permute((1, 0)), zs, use_acc=False, is_async=True)
            b_s = hopper.warpgroup_mma_wait(0, deps=[t_s])
            # a NaN or inf score of a valid row turns NaN (kernels/softmax.py): the query ends NaN
            b_s = gl.where(m_n[None, :], _keep_faults(b_s), float("-inf"))
            m_blk = gl.max(b_s, 1)
            m_x = gl.maximum(m_x, m_blk)
            up = m_blk * scale_log2 > m_i * scale_log2 + TAU
            m_new = gl.where(up, m_blk, m_i)
            # a head with nothing valid yet keeps -inf; shift by 0 there so no inf - inf appears
            m_sh = gl.where(m_new == float("-inf"), 0.0, m_new * scale_log2)
            b_p = gl.exp2(b_s * scale_log2 - m_sh[:, None])
            alpha = gl.exp2(m_i * scale_log2 - m_sh)
            l_i = l_i * alpha + gl.sum(b_p, 1)
            m_i = m_new
            p16 = b_p.to(gl.bfloat16)
            # the value warpgroup's P and rescale factor (P in the stage's rope buffer, read already)
            s_p.index(buf)._reinterpret(gl.bfloat16, [BLOCK_H, BLOCK_N], SHP).store(p16)
            s_f.index(buf).store(alpha)
            hopper.fence_async_shared()
            mbarrier.arrive(pfull.index(buf))
            acc = acc * gl.convert_layout(alpha, ROW_O)[:, None]
            t_o = hopper.warpgroup_mma(gl.convert_layout(p16, P_L), s_lat.slice(0, DV, dim=1), acc, is_async=True)
            acc = hopper.warpgroup_mma_wait(0, deps=[t_o])
            mbarrier.arrive(empty.index(buf))
            b_col = b_nx
        o_hs = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_S)
        m_hs = o_hs < H
        inv, lse = _finish_rows(l_i, m_i, scale, sink_ptr, o_hs, m_hs, HAS_SINK)
        s_inv.store(inv)
        mbarrier.arrive(done)
        _store_half(acc, gl.convert_layout(inv, ROW_O), 0, out_ptr, i_t, i_hb, H, stride_ot, stride_oh,
                    BLOCK_H, DV, O_L)
        gl.store(ml_ptr + i_t * H + o_hs, _max_logits(m_x, lse, scale), mask=m_hs)
        gl.store(lse_ptr + i_t * H + o_hs, lse, mask=m_hs)

    @gluon.jit
    def _values(s_kl, s_p, s_f, s_inv, empty, pfull, done, n_blk, out_ptr, i_t, i_hb, H, stride_ot,
                stride_oh, D_LAT: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
                NUM_STAGES: gl.constexpr):
        DV: gl.constexpr = D_LAT // 2
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, DV, 16])
        SHP: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], gl.bfloat16)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
        acc = gl.zeros([BLOCK_H, DV], gl.float32, O_L)
        for i in range(n_blk):
            buf = i % NUM_STAGES
            mbarrier.wait(pfull.index(buf), (i // NUM_STAGES) & 1)
            acc = acc * s_f.index(buf).load(ROW_O)[:, None]
            p = s_p.index(buf)._reinterpret(gl.bfloat16, [BLOCK_H, BLOCK_N], SHP)
            t_o = hopper.warpgroup_mma(p, s_kl.index(buf).slice(DV, DV, dim=1), acc, is_async=True)
            acc = hopper.warpgroup_mma_wait(0, deps=[t_o])
            mbarrier.arrive(empty.index(buf))
        mbarrier.wait(done, 0)
        _store_half(acc, s_inv.load(ROW_O), DV, out_ptr, i_t, i_hb, H, stride_ot, stride_oh, BLOCK_H, DV, O_L)

    @gluon.jit
    def sparse_mla_prefill_sm90_ws_kernel(
        q_ptr, kv_ptr, idx_ptr, len_ptr, sink_ptr, out_ptr, ml_ptr, lse_ptr,
        H, N, TOPK, NUM_HB,
        stride_qt, stride_qh, stride_kv, stride_it, stride_ot, stride_oh,
        scale, scale_log2,
        HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr, OFF32: gl.constexpr,
        D_LAT: gl.constexpr, D_ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
        NUM_STAGES: gl.constexpr, TAU: gl.constexpr, V_REGS: gl.constexpr, P_REGS: gl.constexpr,
    ):
        GQ: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        SHP: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], gl.bfloat16)
        SH1: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        QT: gl.constexpr = 128  # q's columns loaded at a time (the whole latent would spill)

        # the head blocks of one token are neighbouring programs: they gather the same rows
        i_p = gl.program_id(0)
        i_t = (i_p // NUM_HB).to(gl.int64)
        i_hb = i_p % NUM_HB
        o_hq = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, GQ))
        m_hq = (o_hq < H)[:, None]
        p_q = q_ptr + i_t * stride_qt + o_hq[:, None] * stride_qh
        o_tq = gl.arange(0, QT, layout=gl.SliceLayout(0, GQ))
        s_ql = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_LAT], SH)
        for c in gl.static_range(D_LAT // QT):
            s_ql.slice(c * QT, QT, dim=1).store(gl.load(p_q + c * QT + o_tq[None, :], mask=m_hq, other=0.0))
        s_kl = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, BLOCK_N, D_LAT], SH)
        if D_ROPE > 0:
            o_rq = D_LAT + gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, GQ))
            s_qr = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_ROPE], SH,
                                             gl.load(p_q + o_rq[None, :], mask=m_hq, other=0.0))
            s_kr = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, BLOCK_N, D_ROPE], SH)
            gl.static_assert(D_ROPE == BLOCK_H)  # P [BLOCK_H, BLOCK_N] fills a stage's rope buffer
            s_p = s_kr
        else:  # 512-wide rows: no rope (s_qr, s_kr are never read), P in buffers of its own
            s_qr = s_ql
            s_kr = s_kl
            s_p = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, BLOCK_H, BLOCK_N], SHP)
        s_f = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_H], SH1)
        s_inv = gl.allocate_shared_memory(gl.float32, [BLOCK_H], SH1)
        full = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        pfull = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for b in gl.static_range(NUM_STAGES):
            mbarrier.init(full.index(b), count=128)  # every producer thread's copies
            mbarrier.init(empty.index(b), count=2)  # the score and the value warpgroups
            mbarrier.init(pfull.index(b), count=1)
        mbarrier.init(done, count=1)

        n_use = TOPK
        if HAS_LEN:
            n_use = gl.minimum(gl.maximum(gl.load(len_ptr + i_t), 0), TOPK)
        n_blk = gl.cdiv(n_use, BLOCK_N)
        p_idx = idx_ptr + i_t * stride_it
        gl.warp_specialize(
            [(_scores, (s_ql, s_qr, s_kl, s_kr, s_p, s_f, s_inv, full, empty, pfull, done, p_idx, n_use, n_blk,
                        N, scale, scale_log2, sink_ptr, out_ptr, ml_ptr, lse_ptr, i_t, i_hb, H, stride_ot,
                        stride_oh, HAS_SINK, D_LAT, D_ROPE, BLOCK_H, BLOCK_N, NUM_STAGES, TAU)),
             (_values, (s_kl, s_p, s_f, s_inv, empty, pfull, done, n_blk, out_ptr, i_t, i_hb, H, stride_ot,
                        stride_oh, D_LAT, BLOCK_H, BLOCK_N, NUM_STAGES)),
             (_producer, (kv_ptr, p_idx, n_use, n_blk, N, stride_kv, s_kl, s_kr, full, empty,
                          BLOCK_N, D_LAT, D_ROPE, OFF32, NUM_STAGES))],
            [4, 4], [V_REGS, P_REGS])


def launch(q, kv, indices, topk_length, attn_sink, out, max_logits, lse, scale, log2e, d_lat, d_rope,
           block_n=BLOCK_N, num_stages=NUM_STAGES):
    """Run the kernel on validated inputs into the given outputs (T >= 1, H >= 1), through the
    two-warpgroup kernel's launcher (same arguments)."""
    _sm90.launch(q, kv, indices, topk_length, attn_sink, out, max_logits, lse, scale, log2e, d_lat, d_rope,
                 kernel=sparse_mla_prefill_sm90_ws_kernel, block_h=BLOCK_H, BLOCK_N=block_n,
                 NUM_STAGES=num_stages, TAU=TAU, V_REGS=V_REGS, P_REGS=P_REGS, num_warps=NUM_WARPS)
