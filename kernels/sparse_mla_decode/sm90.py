"""Hopper (sm_90) kernel of sparse_mla_decode for the fp8_ds_mla cache and 64-head blocks, in Gluon.

Same arguments and outputs as `sparse_mla_decode_kernel` (kernels/sparse_mla_decode/triton_kernel.py: one token,
a head block and one split of its indices per program; partial (out, lse) merged by the same
merge kernel), and the same exact arithmetic: e4m3 bytes become fp16 exactly, q goes to fp16 after
a per-head power of two, per-tile scales multiply the scores and P_t = P * s_t / R (R a running
power of two >= every scale seen, one for all four tiles as in the keys-on-M kernel) feeds each
tile's value dot in fp16. What differs is the layout, which Triton 3.6
cannot be told (see kernels/sparse_mla_prefill/sm90.py for the same change in prefill):
- 64 heads x 64 rows per step on wgmma, the score tile split over the two warpgroups ([4, 2];
  Triton gives a chained dot [8, 1], both warpgroups computing every score); each warpgroup owns
  64 of every tile's 128 output columns.
- rows gathered as raw bytes with 16-byte cp.async into two buffers (latent bytes, bf16 rope), the
  copy of block i+1 issued at the top of step i; per step the latent bytes are converted to fp16
  once, a 128-wide tile at a time, into one swizzled buffer both dots read.
8 warps, ~220 KB shared memory: one program per SM (the split rule's occupancy 1).

Timings: docs/benchmarks.md; where a step's time goes and the variants tried:
docs/notes/sparse_mla_decode.md.
"""
from __future__ import annotations

import torch

from openmla.kernels.sparse_mla_decode import shared as _dm
from openmla.kernels.device import sm90_gluon

try:  # Gluon ships with Triton >= 3.5; without it the Triton kernel serves every GPU
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    _GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    _GLUON = False

BLOCK_H = 64
BLOCK_N = 64  # rows per step: 32 would halve each warpgroup's score wgmma (m64n16) and was slower
NUM_WARPS = 8
OCCUPANCY = 1  # programs per SM, for the split rule


def usable(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether this kernel serves these inputs: Gluon kernels may run on their device
    (`sm90_gluon`), and cache rows start on 16 bytes (16-byte cp.async)."""
    return (sm90_gluon(q.device) and cache.data_ptr() % 16 == 0 and cache.stride(0) % 16 == 0
            and cache.stride(1) % 16 == 0)


if _GLUON:
    # the Triton kernel's layout-free helpers, compiled as Gluon
    _pow2_at_least = gluon.jit(_dm.pow2_at_least.fn)
    _head_f16_factor = gluon.jit(_dm.head_f16_factor.fn)
    _split_range = gluon.jit(_dm.split_range.fn)
    _finish_rows = gluon.jit(_dm.finish_rows.fn)
    _keep_faults = gluon.jit(_dm.keep_faults.fn)
    _sink_factor = gluon.jit(_dm.sink_factor.fn)

    @gluon.jit
    def _row_ptrs(cache_ptr, b_idx, num_slots, block_size, stride_cb, stride_cr, DENSE: gl.constexpr,
                  BS_SHIFT: gl.constexpr = -1):
        # byte pointer of each slot's row (64-bit offsets: a cache may pass 2 GB) and its validity;
        # rows start on 16 bytes (usable() checked the base and both strides). BS_SHIFT >= 0: the
        # block size is 2^BS_SHIFT (shifts instead of an integer division)
        m = (b_idx >= 0) & (b_idx < num_slots)
        if DENSE:
            row = b_idx.to(gl.int64) * stride_cr
        elif BS_SHIFT >= 0:
            row = ((b_idx >> BS_SHIFT).to(gl.int64) * stride_cb
                   + (b_idx & ((1 << BS_SHIFT) - 1)).to(gl.int64) * stride_cr)
        else:
            row = (b_idx // block_size).to(gl.int64) * stride_cb + (b_idx % block_size).to(gl.int64) * stride_cr
        return gl.multiple_of(cache_ptr + row, 16), m


    @gluon.jit
    def _copy_rows(cache_ptr, b_idx, num_slots, block_size, stride_cb, stride_cr, s_b8, s_rope,
                   G8: gl.constexpr, GR: gl.constexpr, DENSE: gl.constexpr, D_LAT: gl.constexpr,
                   ROPE: gl.constexpr, ROPE_OFF: gl.constexpr):
        # start the gather of one block of rows (one commit group): the 512 latent bytes and the
        # bf16 rope; an invalid slot is masked (zero-filled), never read
        p_row, m = _row_ptrs(cache_ptr, b_idx, num_slots, block_size, stride_cb, stride_cr, DENSE)
        o_b = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, G8))
        cp.async_copy_global_to_shared(s_b8, p_row[:, None] + o_b[None, :], mask=m[:, None])
        p_rr = gl.convert_layout(p_row, gl.SliceLayout(1, GR))
        m_r = gl.convert_layout(m, gl.SliceLayout(1, GR))
        p_r = gl.multiple_of((p_rr + ROPE_OFF).to(gl.pointer_type(gl.bfloat16)), 16)
        o_r = gl.arange(0, ROPE, layout=gl.SliceLayout(0, GR))
        cp.async_copy_global_to_shared(s_rope, p_r[:, None] + o_r[None, :], mask=m_r[:, None])
        cp.commit_group()


    @gluon.jit
    def _max2(a0, b0, a1, b1):
        # combine of a two-tensor max reduction (one cross-warp exchange for both)
        return gl.maximum(a0, a1), gl.maximum(b0, b1)

    @gluon.jit
    def _tile_scores(s_ql, s_k16, p_s, m_n, b_fq, zs, T: gl.constexpr, TILE: gl.constexpr):
        # latent tile T's scores: (q_T . k_T) x the rows' tile-T scale x the heads' q factor, and
        # that scale
        t_s = hopper.warpgroup_mma(s_ql.slice(T * TILE, TILE, dim=1),
                                   s_k16.slice(T * TILE, TILE, dim=1).permute((1, 0)), zs,
                                   use_acc=False, is_async=True)
        b_st = gl.load(p_s + T, mask=m_n, other=0.0)
        return hopper.warpgroup_mma_wait(0, deps=[t_s]) * b_st[None, :] * b_fq[:, None], b_st

    @gluon.jit
    def sparse_mla_decode_sm90_kernel(
        q_ptr, cache_ptr, idx_ptr, len_ptr, sink_ptr, out_ptr, lse_ptr, po_ptr, plse_ptr,
        H, TOPK, CHUNK, NUM_HB, NUM_SPLITS, num_slots, block_size,
        stride_qt, stride_qh, stride_cb, stride_cr, stride_it, stride_ot, stride_oh,
        qk_scale,
        DENSE: gl.constexpr, HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr,
        BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, TILE: gl.constexpr, ROPE: gl.constexpr,
        SCALE_OFF: gl.constexpr, ROPE_OFF: gl.constexpr, INF_EMPTY: gl.constexpr,
    ):
        D_LAT: gl.constexpr = 4 * TILE
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, TILE // 2, 16])
        P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        G8: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [8, 1], [1, 0])
        GR: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        GC: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [8, 1], [1, 0])
        SH16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        SH8: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=1, order=[1, 0])
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
        COL_S: gl.constexpr = gl.SliceLayout(0, S_L)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
        ROW_G: gl.constexpr = gl.SliceLayout(1, GR)
        ROW_8: gl.constexpr = gl.SliceLayout(1, G8)

        i_p = gl.program_id(0)
        i_s = gl.program_id(1)
        i_t = i_p // NUM_HB
        i_hb = i_p % NUM_HB
        i_t64 = i_t.to(gl.int64)
        k_lo, k_hi = _split_range(len_ptr, i_t, i_s, TOPK, CHUNK, HAS_LEN)

        # q: latent to fp16 exactly after a per-head power-of-two scaling, rope stays bf16
        o_hg = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_G)
        p_q = q_ptr + i_t64 * stride_qt + o_hg[:, None] * stride_qh
        o_lg = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, GR))
        o_rg = D_LAT + gl.arange(0, ROPE, layout=gl.SliceLayout(0, GR))
        b_ql = gl.load(p_q + o_lg[None, :], mask=(o_hg < H)[:, None], other=0.0).to(gl.float32)
        b_qr = gl.load(p_q + o_rg[None, :], mask=(o_hg < H)[:, None], other=0.0)
        b_amax = gl.max(gl.abs(b_ql), 1)
        b_fq = _head_f16_factor(b_amax)
        b_q16 = (b_ql / b_fq[:, None]).to(gl.float16)
        s_ql = gl.allocate_shared_memory(gl.float16, [BLOCK_H, D_LAT], SH16, b_q16)
        s_qr = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, ROPE], SH16, b_qr)
        b_fq = gl.convert_layout(b_fq, ROW_S) * qk_scale
        s_b8 = gl.allocate_shared_memory(gl.uint8, [2, BLOCK_N, D_LAT], SH8)
        s_kr = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, ROPE], SH16)
        s_k16 = gl.allocate_shared_memory(gl.float16, [BLOCK_N, D_LAT], SH16)

        n_blk = gl.cdiv(gl.maximum(k_hi - k_lo, 0), BLOCK_N)
        p_idx = idx_ptr + i_t64 * stride_it
        o_n8 = gl.arange(0, BLOCK_N, layout=ROW_8)
        o_ns = gl.arange(0, BLOCK_N, layout=COL_S)
        b_idx = gl.load(p_idx + k_lo + o_n8, mask=k_lo + o_n8 < k_hi, other=-1)
        _copy_rows(cache_ptr, b_idx, num_slots, block_size, stride_cb, stride_cr, s_b8.index(0), s_kr.index(0),
                   G8, GR, DENSE, D_LAT, ROPE, ROPE_OFF)
        b_nx = gl.load(p_idx + k_lo + BLOCK_N + o_n8, mask=k_lo + BLOCK_N + o_n8 < k_hi, other=-1)

        b_m = gl.full([BLOCK_H], float("-inf"), gl.float32, ROW_S)
        b_l = gl.zeros([BLOCK_H], gl.float32, ROW_S)
        b_o0 = gl.zeros([BLOCK_H, TILE], gl.float32, O_L)
        b_o1 = gl.zeros([BLOCK_H, TILE], gl.float32, O_L)
        b_o2 = gl.zeros([BLOCK_H, TILE], gl.float32, O_L)
        b_o3 = gl.zeros([BLOCK_H, TILE], gl.float32, O_L)
        # R per head, every head holding the same value: it comes out of the per-head reduction,
        # and a scalar would cost another cross-warp one
        b_r = gl.full([BLOCK_H], 2.0 ** -126, gl.float32, ROW_S)
        for i in range(n_blk):
            buf = i % 2
            gl.thread_barrier()
            _copy_rows(cache_ptr, b_nx, num_slots, block_size, stride_cb, stride_cr, s_b8.index(1 - buf),
                       s_kr.index(1 - buf), G8, GR, DENSE, D_LAT, ROPE, ROPE_OFF)
            o_nx = k_lo + (i + 2) * BLOCK_N + o_n8
            b_nx = gl.load(p_idx + o_nx, mask=o_nx < k_hi, other=-1)
            o_n = k_lo + i * BLOCK_N + o_ns
            b_col = gl.load(p_idx + o_n, mask=o_n < k_hi, other=-1)
            p_row, m_n = _row_ptrs(cache_ptr, b_col, num_slots, block_size, stride_cb, stride_cr, DENSE)
            p_s = (p_row + SCALE_OFF).to(gl.pointer_type(gl.float32))

            cp.wait_group(1)
            gl.thread_barrier()
            # e4m3 bytes -> fp16 (exact), one 128-wide tile at a time (a whole row block in
            # registers at once would spill next to the accumulators)
            for t in gl.static_range(4):
                b8 = s_b8.index(buf).slice(t * TILE, TILE, dim=1).load(GC)
                k16 = gl.inline_asm_elementwise(
                    "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
                    "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
                    "=r,=r,r", [b8], dtype=gl.float16, is_pure=True, pack=4)
                s_k16.slice(t * TILE, TILE, dim=1).store(k16)
            hopper.fence_async_shared()
            gl.thread_barrier()

            zs = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_L)
            t_r = hopper.warpgroup_mma(s_qr, s_kr.index(buf).permute((1, 0)), zs, use_acc=False, is_async=True)
            b_sc = hopper.warpgroup_mma_wait(0, deps=[t_r]) * qk_scale
            # per tile: scores scaled by the rows' tile scale (loaded where used, to keep registers)
            b_t, b_st = _tile_scores(s_ql, s_k16, p_s, m_n, b_fq, zs, 0, TILE)
            b_sc += b_t
            s_mx = b_st
            b_t, b_st = _tile_scores(s_ql, s_k16, p_s, m_n, b_fq, zs, 1, TILE)
            b_sc += b_t
            s_mx = gl.maximum(s_mx, b_st)
            b_t, b_st = _tile_scores(s_ql, s_k16, p_s, m_n, b_fq, zs, 2, TILE)
            b_sc += b_t
            s_mx = gl.maximum(s_mx, b_st)
            b_t, b_st = _tile_scores(s_ql, s_k16, p_s, m_n, b_fq, zs, 3, TILE)
            b_sc += b_t
            s_mx = gl.maximum(s_mx, b_st)
            # a NaN or inf score of a valid key turns NaN (kernels/softmax.py): the row ends NaN
            b_sc = gl.where(m_n[None, :], _keep_faults(b_sc), float("-inf"))

            # the block's score max per head and its largest scale (R, one power of two for all four
            # tiles, grows to cover it) in one cross-warp reduction: each reduction is a
            # shared-memory exchange and a barrier, hence one R for the four tiles, not one per tile
            m_blk, s_blk = gl.reduce((b_sc, gl.zeros_like(b_sc) + s_mx[None, :]), 1, _max2)
            r_new = gl.maximum(b_r, _pow2_at_least(s_blk + 1e-38))
            m_new = gl.maximum(b_m, m_blk)
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(b_m - m_use)
            b_p = gl.exp2(b_sc - m_use[:, None])
            b_l = b_l * alpha + gl.sum(b_p, 1)
            b_m = m_new
            alpha_o = gl.convert_layout(alpha * (b_r / r_new), ROW_O)
            b_o0 = b_o0 * alpha_o[:, None]
            b_o1 = b_o1 * alpha_o[:, None]
            b_o2 = b_o2 * alpha_o[:, None]
            b_o3 = b_o3 * alpha_o[:, None]
            b_r = r_new
            b_p = b_p * (1.0 / r_new)[:, None]
            # one value wgmma in flight at a time: its register operand (P_t) must stay intact until
            # it completes, and four of them next to the accumulators would spill
            p0 = gl.convert_layout((b_p * gl.load(p_s + 0, mask=m_n, other=0.0)[None, :]).to(gl.float16), P_L)
            t0 = hopper.warpgroup_mma(p0, s_k16.slice(0 * TILE, TILE, dim=1), b_o0, is_async=True)
            p1 = gl.convert_layout((b_p * gl.load(p_s + 1, mask=m_n, other=0.0)[None, :]).to(gl.float16), P_L)
            b_o0 = hopper.warpgroup_mma_wait(0, deps=[t0])
            t1 = hopper.warpgroup_mma(p1, s_k16.slice(1 * TILE, TILE, dim=1), b_o1, is_async=True)
            p2 = gl.convert_layout((b_p * gl.load(p_s + 2, mask=m_n, other=0.0)[None, :]).to(gl.float16), P_L)
            b_o1 = hopper.warpgroup_mma_wait(0, deps=[t1])
            t2 = hopper.warpgroup_mma(p2, s_k16.slice(2 * TILE, TILE, dim=1), b_o2, is_async=True)
            p3 = gl.convert_layout((b_p * gl.load(p_s + 3, mask=m_n, other=0.0)[None, :]).to(gl.float16), P_L)
            b_o2 = hopper.warpgroup_mma_wait(0, deps=[t2])
            t3 = hopper.warpgroup_mma(p3, s_k16.slice(3 * TILE, TILE, dim=1), b_o3, is_async=True)
            b_o3 = hopper.warpgroup_mma_wait(0, deps=[t3])
        cp.wait_group(0)

        b_inv, b_lse = _finish_rows(b_l, b_m)
        o_hs = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_S)
        m_hs = o_hs < H
        if not SPLIT:
            if HAS_SINK:
                b_inv = b_inv * _sink_factor(sink_ptr, o_hs, m_hs, b_lse)
        inv_o = gl.convert_layout(b_inv * b_r, ROW_O)
        o_ho = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_O)
        m_ho = (o_ho < H)[:, None]
        o_d = gl.arange(0, TILE, layout=gl.SliceLayout(0, O_L))
        if SPLIT:
            p_po = po_ptr + ((i_t64 * NUM_SPLITS + i_s) * H + o_ho)[:, None] * (4 * TILE) + o_d[None, :]
            gl.store(p_po + 0 * TILE, b_o0 * inv_o[:, None], mask=m_ho)
            gl.store(p_po + 1 * TILE, b_o1 * inv_o[:, None], mask=m_ho)
            gl.store(p_po + 2 * TILE, b_o2 * inv_o[:, None], mask=m_ho)
            gl.store(p_po + 3 * TILE, b_o3 * inv_o[:, None], mask=m_ho)
            gl.store(plse_ptr + (i_t64 * NUM_SPLITS + i_s) * H + o_hs, b_lse, mask=m_hs)
        else:
            p_o = out_ptr + i_t64 * stride_ot + o_ho[:, None] * stride_oh + o_d[None, :]
            ty = out_ptr.dtype.element_ty
            gl.store(p_o + 0 * TILE, (b_o0 * inv_o[:, None]).to(ty), mask=m_ho)
            gl.store(p_o + 1 * TILE, (b_o1 * inv_o[:, None]).to(ty), mask=m_ho)
            gl.store(p_o + 2 * TILE, (b_o2 * inv_o[:, None]).to(ty), mask=m_ho)
            gl.store(p_o + 3 * TILE, (b_o3 * inv_o[:, None]).to(ty), mask=m_ho)
            if INF_EMPTY:  # FlashMLA's lse for a row without a valid index
                b_lse = gl.where(b_lse == float("-inf"), float("inf"), b_lse)
            gl.store(lse_ptr + i_t64 * H + o_hs, b_lse, mask=m_hs)
