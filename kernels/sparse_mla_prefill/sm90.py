"""Hopper (sm_90) kernel of sparse_mla_prefill for 64-head blocks, warp-specialised, in Gluon.

Same maths, arguments and outputs as `sparse_mla_prefill_kernel` (kernels/sparse_mla_prefill/op.py);
a program owns one query token and 64 heads, or, in a short grid's split last round (tail.py), a
piece of that token's index list whose fp32 rows, lse and max_logits go to a workspace for the
merge. Three partitions of one warpgroup each (the fp8
decode kernel's partition, kernels/sparse_mla_decode/sm90.py, with bf16 rows that need no
conversion):
- the producer (P_REGS registers; `_producer`, also the keys-on-M kernel's) gathers block i (64
  rows: latent and rope, 16-byte cp.async, rows outside [0, N) zero-filled and never read) into
  stage i % 2 once both consumers have released it;
- the score warpgroup (the default partition: the registers the workers leave) loads q into shared
  memory (TMA tiles of 64 columns, or cp.async for a strided q or a partial head block, while the
  producer gathers the first blocks), then per block computes S [64 heads, 64
  keys] (one wgmma chain: rope, then latent), the online softmax, stores P (bf16) and the heads'
  rescale factor into shared memory for the value warpgroup and adds P V[:, :SCORE_COLS] into its
  part of the output (P from registers);
- the value warpgroup (V_REGS registers) holds the output's other columns (three accumulators of
  128) and adds P V[:, SCORE_COLS:] (P from shared memory) while the score warpgroup goes on to the
  next block's scores.
So the score warpgroup, whose S, softmax and value wgmmas run in series, carries a quarter of the
value work. P of a block goes into its stage's rope buffer (the score wgmma has read it; the stage
is refilled only after both consumers released it): [64 heads, 64 keys] bf16 is the size of
[64 keys, 64] rope; 512-wide rows (DeepSeek-V4, no rope) get P buffers of their own. The shift of
the exponent follows a head's running max lazily (as in sm90_kn.py: only when the max rose by more
than 2^TAU), the exact max kept for max_logits. The output goes through q's buffer (free once the
last score chain has read it) and leaves by TMA stores (~2 us a program faster than stores from
registers: docs/notes/sparse_mla_prefill.md; the value warpgroup waits once, after its last
store); where a head block is not 64 whole rows of the output (H not a multiple of 64, a strided
out) the rows are stored from registers, past L2 (evict-first), so that they do not push the
gathered rows out.
Shared memory: q 72 KB + two 72 KB stages: one program per SM.

Also here: the row copy of the bf16-cache decode kernel (`copy_rows_at`) and the launcher of both
Gluon prefill kernels (`launch`). Gluon runs on the GPU only (not in Triton's interpreter); `usable`
says when to use it. The CPU suite compiles the kernels for sm_90a (tests/kernels/
test_sparse_mla_prefill.py); the GPU suite checks them against the oracle like every other path.

Timings: docs/benchmarks.md; the measurements behind the partition and the variants that lost:
docs/notes/sparse_mla_prefill.md ("A warp-specialised 64-head kernel").
"""
from __future__ import annotations

import torch
import triton

from openmla.kernels.device import num_sms, sm90_gluon
from openmla.kernels.sparse_mla_prefill.tail import merge_tail, tail_split, tail_workspace

try:  # Gluon ships with Triton >= 3.5; without it the Triton kernel serves every GPU
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from openmla.kernels.sparse_mla_prefill.shared import finish_rows, keep_faults, max_logits, piece_range, \
        split_program
    _finish_rows = gluon.jit(finish_rows.fn)
    _piece_range = gluon.jit(piece_range.fn)
    _split_program = gluon.jit(split_program.fn)
    _keep_faults = gluon.jit(keep_faults.fn)
    _max_logits = gluon.jit(max_logits.fn)
    _GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    _GLUON = False

BLOCK_H = 64
BLOCK_N = 64  # keys per block (the score wgmma's N)
NUM_WARPS = 4  # the score warpgroup; the value and producer warpgroups are workers
SCORE_COLS = 128  # output columns of the score warpgroup; the value warpgroup has the other 384
TAU = 8.0  # lazy rescale: the shift trails the running max by at most this (exp2 domain)
V_REGS = 224  # registers of the value warpgroup (its output columns alone are 192)
P_REGS = 64  # registers of the producer (at 56 it spills); the score warpgroup gets the rest


def usable(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether this kernel serves these inputs: Gluon kernels may run on their device
    (`sm90_gluon`), and q and kv rows start on 16 bytes (the row copies are 16-byte cp.async;
    other strides or offsets take the Triton kernel)."""
    return (sm90_gluon(q.device) and kv.data_ptr() % 16 == 0 and kv.stride(0) % 8 == 0
            and q.data_ptr() % 16 == 0 and q.stride(0) % 8 == 0 and q.stride(1) % 8 == 0)


if _GLUON:

    @gluon.jit
    def copy_rows_at(p_kv, m_n, s_lat, s_rope, GATHER: gl.constexpr, D_LAT: gl.constexpr,
                     D_ROPE: gl.constexpr):
        """Start the asynchronous copy of the rows at p_kv (16-byte aligned, one pointer a row;
        rows with m_n False zero-filled, never read) into s_lat / s_rope: one commit group. Also
        the bf16-cache decode kernel's gather (kernels/sparse_mla_decode/sm90_bf16.py)."""
        o_l = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, GATHER))
        cp.async_copy_global_to_shared(s_lat, p_kv[:, None] + o_l[None, :], mask=m_n[:, None])
        if D_ROPE > 0:  # d_qk 576; 512-wide (V4) rows are all value
            o_r = D_LAT + gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, GATHER))
            cp.async_copy_global_to_shared(s_rope, p_kv[:, None] + o_r[None, :], mask=m_n[:, None])
        cp.commit_group()

    # the gather layout: 128 contiguous bytes of a row (one 128-byte swizzle line) per 8 threads,
    # four rows per warp instruction (faster than 256 or 64 bytes a row: docs/notes/
    # sparse_mla_prefill.md, "The gather's layout")
    _G = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))

    @gluon.jit
    def _load_rows(p_idx, k0, n_use, BLOCK_N: gl.constexpr):
        # the row numbers of block k0..k0+BLOCK_N-1 (-1 past n_use)
        o_n = k0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _G))
        return gl.load(p_idx + o_n, mask=o_n < n_use, other=-1)

    @gluon.jit
    def _gather(kv_ptr, i_n, N, stride_kv, s_lat, s_rope, D_LAT: gl.constexpr, D_ROPE: gl.constexpr,
                OFF32: gl.constexpr):
        # start the copy of the rows i_n, latent and rope; a row outside [0, N) is masked
        # (zero-filled), never read
        if OFF32:
            p_n = kv_ptr + i_n * stride_kv
        else:
            p_n = kv_ptr + i_n.to(gl.int64) * stride_kv
        p_n = gl.multiple_of(p_n, 16)
        m_n = ((i_n >= 0) & (i_n < N))[:, None]
        c_l = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, _G))
        cp.async_copy_global_to_shared(s_lat, p_n[:, None] + c_l[None, :], mask=m_n)
        if D_ROPE > 0:  # 512-wide (V4) rows have no rope part
            c_r = D_LAT + gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, _G))
            cp.async_copy_global_to_shared(s_rope, p_n[:, None] + c_r[None, :], mask=m_n)

    @gluon.jit
    def _producer(kv_ptr, p_idx, n_use, n_blk, N, stride_kv, s_kl, s_kr, full, empty,
                  BLOCK_N: gl.constexpr, D_LAT: gl.constexpr, D_ROPE: gl.constexpr, OFF32: gl.constexpr):
        # the producer warpgroup of both warp-specialised prefill kernels (this one, sm90_kn.py):
        # block i into stage i % 2 once its consumers released it; the row numbers of block i + 1
        # are loaded while block i waits for its stage (off the critical path); the stage's full
        # barrier completes when every producer thread's copies have landed
        i_n = _load_rows(p_idx, 0, n_use, BLOCK_N)
        for i in range(n_blk):
            s = i % 2
            mbarrier.wait(empty.index(s), ((i // 2) & 1) ^ 1)
            _gather(kv_ptr, i_n, N, stride_kv, s_kl.index(s), s_kr.index(s), D_LAT, D_ROPE, OFF32)
            cp.mbarrier_arrive(full.index(s), increment_count=False)
            i_n = _load_rows(p_idx, (i + 1) * BLOCK_N, n_use, BLOCK_N)

    @gluon.jit
    def _store_cols(acc, inv, C0: gl.constexpr, out_ptr, i_t, i_hb, H, stride_ot, stride_oh,
                    BLOCK_H: gl.constexpr, O_L: gl.constexpr, KEEP: gl.constexpr = False):
        # output columns C0 .. C0 + acc.shape[1] of this program's heads, times 1 / sum: past L2
        # (evict-first), or kept there (KEEP: a split piece's rows, which the merge reads next)
        o_h = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_L))
        o_d = C0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, O_L))
        p_o = out_ptr + i_t * stride_ot + o_h[:, None] * stride_oh + o_d[None, :]
        o = (acc * inv[:, None]).to(out_ptr.dtype.element_ty)
        if KEEP:
            gl.store(p_o, o, mask=(o_h < H)[:, None])
        else:
            gl.store(p_o, o, mask=(o_h < H)[:, None], eviction_policy="evict_first")

    @gluon.jit
    def _store_cols_tma(o, s_o, C0: gl.constexpr, o_desc, i_t, i_hb, H, BLOCK_H: gl.constexpr,
                        WAIT: gl.constexpr = True):
        # output columns C0 .. C0 + o.shape[1] (already times 1 / sum) through the same columns of
        # s_o [BLOCK_H, 512] (q's buffer), then TMA stores of [BLOCK_H, 64] tiles (the buffer's
        # 128-byte swizzle keeps each 64-column block as one 8 KB tile); a warpgroup's last call
        # waits for all its stores (WAIT), so the buffer outlives the copies
        s_o.slice(C0, o.shape[1], dim=1).store(o.to(gl.bfloat16))
        hopper.fence_async_shared()
        gl.thread_barrier()
        row0 = (i_t * H + i_hb * BLOCK_H).to(gl.int32)
        for c in gl.static_range(C0 // 64, (C0 + o.shape[1]) // 64):
            tma.async_copy_shared_to_global(o_desc, [row0, c * 64], s_o.slice(c * 64, 64, dim=1))
        if WAIT:
            tma.store_wait(0)

    @gluon.jit
    def _load_q(q_ptr, i_t, i_hb, H, stride_qt, stride_qh, s_ql, s_qr, D_LAT: gl.constexpr, D_ROPE: gl.constexpr,
                BLOCK_H: gl.constexpr):
        # this program's q [BLOCK_H, D_LAT + D_ROPE] into shared memory by cp.async: every copy in
        # flight at once (one round trip), then waited for; heads >= H zero-filled
        GQ: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        # (q rows start on 16 bytes: `usable`)
        o_hq = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, GQ))
        p_q = gl.multiple_of(q_ptr + i_t * stride_qt + o_hq * stride_qh, 16)
        o_lq = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, GQ))
        cp.async_copy_global_to_shared(s_ql, p_q[:, None] + o_lq[None, :], mask=(o_hq < H)[:, None])
        if D_ROPE > 0:
            o_hr = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, _G))  # (the gathers' layout)
            p_r = gl.multiple_of(q_ptr + i_t * stride_qt + o_hr * stride_qh, 16)
            o_rq = D_LAT + gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, _G))
            cp.async_copy_global_to_shared(s_qr, p_r[:, None] + o_rq[None, :], mask=(o_hr < H)[:, None])
        cp.commit_group()
        cp.wait_group(0)

    @gluon.jit
    def _scores(q_ptr, stride_qt, stride_qh, s_ql, s_qr, s_kl, s_kr, s_p, s_f, s_inv, full, empty, pfull, done,
                p_idx, n_use, n_blk, N, scale, scale_log2, sink_ptr, out_ptr, ml_ptr, lse_ptr, i_t, i_hb, H,
                stride_ot, stride_oh, HAS_SINK: gl.constexpr, D_LAT: gl.constexpr, D_ROPE: gl.constexpr,
                BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, DS: gl.constexpr, TAU: gl.constexpr,
                o_desc, TMA_OUT: gl.constexpr, q_desc, qbar, Q_TMA: gl.constexpr, i_w, ws_o, ws_lse, ws_ml):
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_N, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, DS, 16])
        P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        SHP: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], gl.bfloat16)
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
        COL_S: gl.constexpr = gl.SliceLayout(0, S_L)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
        if Q_TMA:  # q's [BLOCK_H, 64] tiles of q viewed as [T * H, D_LAT + D_ROPE], on one mbarrier
            row_q = (i_t * H + i_hb * BLOCK_H).to(gl.int32)
            mbarrier.expect(qbar, BLOCK_H * (D_LAT + D_ROPE) * 2)
            for c in gl.static_range(D_LAT // 64):
                tma.async_copy_global_to_shared(q_desc, [row_q, c * 64], qbar, s_ql.slice(c * 64, 64, dim=1))
            if D_ROPE > 0:
                tma.async_copy_global_to_shared(q_desc, [row_q, D_LAT], qbar, s_qr)
            mbarrier.wait(qbar, 0)
        else:
            _load_q(q_ptr, i_t, i_hb, H, stride_qt, stride_qh, s_ql, s_qr, D_LAT, D_ROPE, BLOCK_H)
            hopper.fence_async_shared()
            gl.thread_barrier()
        zs = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_L)
        # m_i: the exponent's shift, m_x: the exact max, both in raw q.k units (scale > 0)
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, ROW_S)
        m_x = gl.full([BLOCK_H], float("-inf"), gl.float32, ROW_S)
        l_i = gl.zeros([BLOCK_H], gl.float32, ROW_S)
        acc = gl.zeros([BLOCK_H, DS], gl.float32, O_L)
        o_ns = gl.arange(0, BLOCK_N, layout=COL_S)
        b_col = gl.load(p_idx + o_ns, mask=o_ns < n_use, other=-1)
        for i in range(n_blk):
            buf = i % 2
            # the next block's row numbers (validity) load while this block's rows land
            o_nx = (i + 1) * BLOCK_N + o_ns
            b_nx = gl.load(p_idx + o_nx, mask=o_nx < n_use, other=-1)
            m_n = (b_col >= 0) & (b_col < N)
            mbarrier.wait(full.index(buf), (i // 2) & 1)
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
            # lazy rescaling (sm90_kn.py): the shift follows the max only when it rose by more than TAU
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
            t_o = hopper.warpgroup_mma(gl.convert_layout(p16, P_L), s_lat.slice(0, DS, dim=1), acc, is_async=True)
            acc = hopper.warpgroup_mma_wait(0, deps=[t_o])
            mbarrier.arrive(empty.index(buf))
            b_col = b_nx
        o_hs = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_S)
        m_hs = o_hs < H
        # a piece (i_w >= 0) leaves the sink to the merge: its sink load is masked off (factor 1)
        inv, lse = _finish_rows(l_i, m_i, scale, sink_ptr, o_hs, m_hs & (i_w < 0), HAS_SINK)
        s_inv.store(inv)
        mbarrier.arrive(done)
        if i_w >= 0:  # a piece of a split program: fp32 rows, lse and max_logits into workspace row i_w
            _store_cols(acc, gl.convert_layout(inv, ROW_O), 0, ws_o, i_w, 0, BLOCK_H, BLOCK_H * D_LAT, D_LAT,
                        BLOCK_H, O_L, True)
            o_hw = i_w * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_S)
            gl.store(ws_ml + o_hw, _max_logits(m_x, lse, scale))
            gl.store(ws_lse + o_hw, lse)
        else:
            if TMA_OUT:  # q's buffer is free: its last reader, this warpgroup's last score chain, is done
                _store_cols_tma(acc * gl.convert_layout(inv, ROW_O)[:, None], s_ql, 0, o_desc, i_t, i_hb, H, BLOCK_H)
            else:
                _store_cols(acc, gl.convert_layout(inv, ROW_O), 0, out_ptr, i_t, i_hb, H, stride_ot, stride_oh,
                            BLOCK_H, O_L)
            gl.store(ml_ptr + i_t * H + o_hs, _max_logits(m_x, lse, scale), mask=m_hs)
            gl.store(lse_ptr + i_t * H + o_hs, lse, mask=m_hs)

    @gluon.jit
    def _values(s_kl, s_p, s_f, s_inv, empty, pfull, done, n_blk, out_ptr, i_t, i_hb, H, stride_ot, stride_oh,
                D_LAT: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, DS: gl.constexpr,
                s_ql, o_desc, TMA_OUT: gl.constexpr, i_w, ws_o):
        # output columns DS .. D_LAT in three chunks of DS (a shared-memory slice starts at a
        # multiple of its width, so no single wgmma takes 256 columns from DS = 128)
        gl.static_assert(D_LAT == 4 * DS)
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, DS, 16])
        SHP: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], gl.bfloat16)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
        acc_a = gl.zeros([BLOCK_H, DS], gl.float32, O_L)
        acc_b = acc_a
        acc_c = acc_a
        for i in range(n_blk):
            buf = i % 2
            mbarrier.wait(pfull.index(buf), (i // 2) & 1)
            f = s_f.index(buf).load(ROW_O)[:, None]
            p = s_p.index(buf)._reinterpret(gl.bfloat16, [BLOCK_H, BLOCK_N], SHP)
            s_v = s_kl.index(buf)
            # every accumulator rescaled before the first wgmma is issued: a rescale between the
            # issues makes ptxas wait for the wgmma in flight (its warning C7517)
            acc_a = acc_a * f
            acc_b = acc_b * f
            acc_c = acc_c * f
            t_a = hopper.warpgroup_mma(p, s_v.slice(DS, DS, dim=1), acc_a, is_async=True)
            t_b = hopper.warpgroup_mma(p, s_v.slice(2 * DS, DS, dim=1), acc_b, is_async=True)
            t_c = hopper.warpgroup_mma(p, s_v.slice(3 * DS, DS, dim=1), acc_c, is_async=True)
            acc_a, acc_b, acc_c = hopper.warpgroup_mma_wait(0, deps=[t_a, t_b, t_c])
            mbarrier.arrive(empty.index(buf))
        mbarrier.wait(done, 0)
        inv = s_inv.load(ROW_O)
        if i_w >= 0:  # a piece: fp32 rows into workspace row i_w
            _store_cols(acc_a, inv, DS, ws_o, i_w, 0, BLOCK_H, BLOCK_H * D_LAT, D_LAT, BLOCK_H, O_L, True)
            _store_cols(acc_b, inv, 2 * DS, ws_o, i_w, 0, BLOCK_H, BLOCK_H * D_LAT, D_LAT, BLOCK_H, O_L, True)
            _store_cols(acc_c, inv, 3 * DS, ws_o, i_w, 0, BLOCK_H, BLOCK_H * D_LAT, D_LAT, BLOCK_H, O_L, True)
        else:
            if TMA_OUT:  # into q's buffer (the score warpgroup read q last before it arrived on done)
                _store_cols_tma(acc_a * inv[:, None], s_ql, DS, o_desc, i_t, i_hb, H, BLOCK_H, False)
                _store_cols_tma(acc_b * inv[:, None], s_ql, 2 * DS, o_desc, i_t, i_hb, H, BLOCK_H, False)
                _store_cols_tma(acc_c * inv[:, None], s_ql, 3 * DS, o_desc, i_t, i_hb, H, BLOCK_H)
            else:
                _store_cols(acc_a, inv, DS, out_ptr, i_t, i_hb, H, stride_ot, stride_oh, BLOCK_H, O_L)
                _store_cols(acc_b, inv, 2 * DS, out_ptr, i_t, i_hb, H, stride_ot, stride_oh, BLOCK_H, O_L)
                _store_cols(acc_c, inv, 3 * DS, out_ptr, i_t, i_hb, H, stride_ot, stride_oh, BLOCK_H, O_L)

    # the output tiles' shared layout: q's buffer's (bf16, 128-byte swizzle)
    _OUT_TILE = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    @gluon.jit(do_not_specialize=["p_main", "splits"])  # one compile whatever the grid's split
    def sparse_mla_prefill_sm90_kernel(
        q_ptr, kv_ptr, idx_ptr, len_ptr, sink_ptr, out_ptr, ml_ptr, lse_ptr,
        H, N, TOPK, NUM_HB,
        stride_qt, stride_qh, stride_kv, stride_it, stride_ot, stride_oh,
        scale, scale_log2,
        HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr, OFF32: gl.constexpr,
        D_LAT: gl.constexpr, D_ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
        DS: gl.constexpr, TAU: gl.constexpr, V_REGS: gl.constexpr, P_REGS: gl.constexpr,
        p_main, splits, ws_o, ws_lse, ws_ml,
        o_desc, TMA_OUT: gl.constexpr, q_desc=None, Q_TMA: gl.constexpr = False,
    ):
        SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        SHP: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], gl.bfloat16)
        SH1: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])

        # the head blocks of one token are neighbouring programs: they gather the same rows. Programs
        # from p_main on are pieces of the split programs p_main.. (tail.py), `splits` of each in a row
        i_t, i_hb, i_w = _split_program(gl.program_id(0), p_main, splits, NUM_HB)  # i_w >= 0: a piece
        s_ql = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_LAT], SH)
        s_kl = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, D_LAT], SH)
        if D_ROPE > 0:
            s_qr = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_ROPE], SH)
            s_kr = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, D_ROPE], SH)
            gl.static_assert(D_ROPE == BLOCK_H)  # P [BLOCK_H, BLOCK_N] fills a stage's rope buffer
            s_p = s_kr
        else:  # 512-wide rows: no rope (s_qr, s_kr are never read), P in buffers of its own
            s_qr = s_ql
            s_kr = s_kl
            s_p = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_H, BLOCK_N], SHP)
        s_f = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], SH1)
        s_inv = gl.allocate_shared_memory(gl.float32, [BLOCK_H], SH1)
        full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        pfull = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for b in gl.static_range(2):
            mbarrier.init(full.index(b), count=128)  # every producer thread's copies
            mbarrier.init(empty.index(b), count=2)  # the score and the value warpgroups
            mbarrier.init(pfull.index(b), count=1)
        mbarrier.init(done, count=1)
        qbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(qbar, count=1)
        hopper.fence_async_shared()  # the barriers' init before q's TMA loads signal one

        n_use = TOPK
        if HAS_LEN:
            n_use = gl.minimum(gl.maximum(gl.load(len_ptr + i_t), 0), TOPK)
        p_idx, n_use = _piece_range(idx_ptr + i_t * stride_it, n_use, i_w, splits, BLOCK_N)
        n_blk = gl.cdiv(n_use, BLOCK_N)
        gl.warp_specialize(
            [(_scores, (q_ptr, stride_qt, stride_qh, s_ql, s_qr, s_kl, s_kr, s_p, s_f, s_inv, full, empty, pfull,
                        done, p_idx, n_use, n_blk, N, scale, scale_log2, sink_ptr, out_ptr, ml_ptr, lse_ptr, i_t,
                        i_hb, H, stride_ot, stride_oh, HAS_SINK, D_LAT, D_ROPE, BLOCK_H, BLOCK_N, DS, TAU, o_desc,
                        TMA_OUT, q_desc, qbar, Q_TMA, i_w, ws_o, ws_lse, ws_ml)),
             (_values, (s_kl, s_p, s_f, s_inv, empty, pfull, done, n_blk, out_ptr, i_t, i_hb, H, stride_ot,
                        stride_oh, D_LAT, BLOCK_H, BLOCK_N, DS, s_ql, o_desc, TMA_OUT, i_w, ws_o)),
             (_producer, (kv_ptr, p_idx, n_use, n_blk, N, stride_kv, s_kl, s_kr, full, empty, BLOCK_N, D_LAT,
                          D_ROPE, OFF32))],
            [4, 4], [V_REGS, P_REGS])


def _rows_desc(t, block_h):
    """A TMA descriptor of [block_h, 64] tiles over t [T, H, width] bf16 viewed as [T * H, width]
    rows, when every head block is block_h whole rows of it (H a multiple of block_h, t dense and
    16-byte aligned, rows within TMA's 32-bit coordinates); else None."""
    T, H, width = t.shape
    if (H % block_h or T * H >= 2 ** 31 or t.dtype != torch.bfloat16 or t.stride() != (H * width, width, 1)
            or t.data_ptr() % 16):
        return None
    return TensorDescriptor.from_tensor(t.view(T * H, width), [block_h, 64], _OUT_TILE)


def launch(q, kv, indices, topk_length, attn_sink, out, max_logits, lse, scale, log2e,
           d_lat, d_rope, kernel=None, block_h=BLOCK_H, **config):
    """Run the 64-head kernel (or `kernel`, a Gluon prefill kernel with the same leading and split
    arguments: the keys-on-M one passes itself, its head block and its `config`) on validated
    inputs into the given outputs (T >= 1, H >= 1). The grid's last round is split where
    `tail_split` says (tail.py; both kernels walk 64-key blocks)."""
    T, H, _ = q.shape
    N, topk = kv.shape[0], indices.shape[1]
    num_hb = triton.cdiv(H, block_h)
    grid = T * num_hb
    # pieces of whole key blocks (BLOCK_N = 64 in both kernels: the unit of tail.py's costs)
    p_main, splits = tail_split(grid, num_sms(q.device), triton.cdiv(topk, config.get("BLOCK_N", BLOCK_N)), block_h)
    grid, ws_o, ws_lse, ws_ml = tail_workspace(grid, p_main, splits, block_h, d_lat, lse)
    if kernel is None:
        # q in and the output out by TMA where they are [T * H, width] rows (else cp.async and
        # stores from registers)
        o_desc, q_desc = _rows_desc(out, block_h), _rows_desc(q, block_h)
        kernel, config = sparse_mla_prefill_sm90_kernel, dict(BLOCK_N=BLOCK_N, DS=SCORE_COLS, TAU=TAU,
                                                              V_REGS=V_REGS, P_REGS=P_REGS, num_warps=NUM_WARPS,
                                                              o_desc=o_desc, TMA_OUT=o_desc is not None,
                                                              q_desc=q_desc, Q_TMA=q_desc is not None)
    kernel[(grid,)](
        q, kv, indices,
        topk_length if topk_length is not None else indices,
        attn_sink if attn_sink is not None else lse,
        out, max_logits, lse,
        H, N, topk, num_hb,
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), out.stride(0), out.stride(1),
        scale, scale * log2e,
        HAS_LEN=topk_length is not None, HAS_SINK=attn_sink is not None,
        OFF32=(N - 1) * kv.stride(0) + d_lat + d_rope < 2 ** 31,
        D_LAT=d_lat, D_ROPE=d_rope, BLOCK_H=block_h,
        p_main=p_main, splits=splits, ws_o=ws_o, ws_lse=ws_lse, ws_ml=ws_ml, **config,
    )
    if splits > 1:
        merge_tail(ws_o, ws_lse, ws_ml, attn_sink, out, lse, max_logits, p_main, splits, num_hb, num_sms(q.device))
