"""Hopper (sm_90) kernel of sparse_mla_decode over MODEL1 (DeepSeek-V4) caches, 64-head blocks, in
Gluon.

Same arguments and outputs as `sparse_mla_decode_model1_kernel` (kernels/sparse_mla_decode/
model1_kernel.py: one token, a head block and one split of the joined index list per program, the
main list then from XSTART the extra cache's; partial (out, lse) merged by the same merge kernel;
the sink applied once). The partition is the fp8_ds_mla Gluon kernel's (sm90.py): a producer
warpgroup gathers and converts a block of 64 keys into a shared stage, a score warpgroup computes
the scores, the softmax and O[:, 0:256], a value warpgroup O[:, 256:512]. The producers are in
sm90_model1_gather.py; at <= 64 heads it is `producer_roll` (`roll`): the same stages, with a
block's gathers in flight while the previous block converts; at 128 heads two producer warpgroups
(`producer`, PART 0 / 1) each gather and convert half of every block's keys.

Arithmetic: a MODEL1 tile scale is a power of two (ue8m0), so each key is dequantized once, in the
producer, to bf16 K = float(e4m3) * 2^(b - 127), exact (e4m3 has 4 significant bits; bf16 has
fp32's exponent range: only a product under 2^-133 would round, which the format's scale rule,
s >= 2^-13, never writes), and the rope is bf16 already. The scores are one bf16 wgmma chain
q . K over all 512 dims (q is bf16 as given: no per-head rescaling), accumulated in fp32, so they
are exact products as in the portable kernel. P feeds P.V over the same K stage (V is the whole
dequantized token) as two bf16 operands, hi = bf16(P) and lo = bf16(P - hi): 16 significant bits
(the portable kernel's fp16 P_t has 11). FlashMLA rounds P to bf16 once (8 bits); that misses the
tests' absolute bound where large terms cancel; the second value wgmma costs 3-9 %
(docs/benchmarks.md).
A NaN byte (e4m3 0x7f / 0xff) or a NaN scale byte (255) gives a NaN K element, a NaN score, and a
NaN row, as in every kernel (kernels/softmax.py).

Shared memory: q [64, 512] bf16 64 KB + two K stages [64, 512] bf16 128 KB + P hi / lo [64, 64]
bf16 16 KB = 209 KB: one program per SM, 12 warps (16 with two producers). After the last block's
scores the q buffer stages the output (`stage_out`: 16-byte stores of bf16 rows).
"""
from __future__ import annotations

import torch

from openmla.kernels.device import sm90_gluon
from openmla.kernels.sparse_mla_decode import shared as _dm
from openmla.kernels.sparse_mla_decode import sm90 as _v32
from openmla.kernels.sparse_mla_decode import sm90_model1_gather as _gather

_GLUON = _v32._GLUON
if _GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

BLOCK_H = 64
BLOCK_N = 64  # keys per block: the score wgmma's N
NUM_WARPS = 4  # the score warpgroup (and prologue); the value and producer warpgroups are workers
OCCUPANCY = 1  # programs per SM, for the split rule
V_REGS = 160  # registers of the value warpgroup (O[:, 256:] alone is 128)
# registers of the rolling producer (a block's 576 bytes a key in flight; the score warpgroup gets
# the rest)
P_REGS = 120
P2_REGS = 64  # registers of each of the two half-block producers at 128 heads (score warpgroup: 224)


def stage_out(H: int, num_splits: int) -> bool:
    """Whether the epilogue stores the bf16 output through shared memory (16-byte stores): measured
    2-8 % faster at 64 and 128 heads, 2-3 % slower at 16 (most rows of the block are padding), not
    measured on fp32 partials (split rows keep the direct stores); docs/notes/sparse_mla_decode.md."""
    return num_splits == 1 and H > 32


def roll(H: int) -> bool:
    """Whether the producer overlaps each block's gathers with half a block's conversion
    (`sm90_model1_gather.producer_roll`): at <= 64 heads (one head block), where the gathers bound the kernel; H200,
    2026-11-28: config 1 (H64) 0.0523 -> 0.0449 ms at 128 tokens, H16 0.0935 -> 0.0778 at 256; at
    128 heads, where two programs gather each token's keys, 4-6 % slower (docs/notes/sparse_mla_decode.md);
    there two producers of half a block each take the stage (config 2 / 4 at 128 tokens 153.3 /
    128.6 -> 148.7 / 119.8 us, H200, 2026-11-29; at 64 heads they lose to this one: 44.4 -> 52.7)."""
    return H <= BLOCK_H


def usable(q: torch.Tensor, cache: torch.Tensor, extra_cache=None) -> bool:
    """Whether this kernel serves these inputs: Gluon kernels may run on the device, and every
    cache's records start on 16 bytes (16-byte loads: base and block stride; records are 576 B)."""
    if not sm90_gluon(q.device):
        return False
    for c in (cache, extra_cache):
        if c is not None and (c.data_ptr() % 16 or (c.shape[0] > 1 and c.stride(0) % 16)):
            return False
    return True


if _GLUON:
    _V_REGS = gl.constexpr(V_REGS)
    _P_REGS = gl.constexpr(P_REGS)
    _P2_REGS = gl.constexpr(P2_REGS)

    _finish_rows = gluon.jit(_dm.finish_rows.fn)
    _keep_faults = gluon.jit(_dm.keep_faults.fn)
    _sink_factor = gluon.jit(_dm.sink_factor.fn)
    _store_tiles = _v32._store_tiles
    _barriers = _v32._barriers

    @gluon.jit
    def _store_out(b_oa, b_ob, T0: gl.constexpr, inv_o, s_q, out_ptr, po_ptr, i_t64, i_hb, i_s, H,
                   NUM_SPLITS, stride_ot, stride_oh, SPLIT: gl.constexpr, BLOCK_H: gl.constexpr,
                   VT: gl.constexpr, O_L: gl.constexpr, STAGE_OUT: gl.constexpr):
        # output tiles T0 and T0 + 1 of this program's heads: sm90.py's direct stores, or (STAGE_OUT,
        # unsplit rows) bf16 rows through shared memory, 16 contiguous bytes a thread (the wgmma
        # layout's own stores are 8 bytes, 4 threads a row). The staging buffer is the 64 KB q
        # buffer s_q: free once the last block's scores are done, which the score warpgroup signals
        # with `done` before its epilogue and the value warpgroup waits for before its own; each
        # takes half of it (T0 // 2).
        if STAGE_OUT:
            gl.static_assert(not SPLIT)
            SW: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0])
            GO: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
            stage = s_q._reinterpret(gl.float32, [2 * BLOCK_H, VT], SW).slice((T0 // 2) * BLOCK_H, BLOCK_H)
            o_h = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, GO))
            o_d = T0 * VT + gl.arange(0, VT, layout=gl.SliceLayout(0, GO))
            p_o = out_ptr + i_t64 * stride_ot + o_h[:, None] * stride_oh + o_d[None, :]
            m_h = (o_h < H)[:, None]
            ty = out_ptr.dtype.element_ty
            stage.store(b_oa * inv_o[:, None])
            gl.thread_barrier()
            gl.store(p_o, stage.load(GO).to(ty), mask=m_h)
            gl.thread_barrier()
            stage.store(b_ob * inv_o[:, None])
            gl.thread_barrier()
            gl.store(p_o + VT, stage.load(GO).to(ty), mask=m_h)
        else:
            _store_tiles(b_oa, b_ob, T0, inv_o, out_ptr, po_ptr, i_t64, i_hb, i_s, H, NUM_SPLITS, stride_ot,
                         stride_oh, SPLIT, BLOCK_H, VT, O_L)

    @gluon.jit
    def _scores(q_ptr, stride_qt, stride_qh, s_q, s_k, s_ok, s_p, s_f, full, empty, pfull, pfree, done,
                n_blk, qk_scale, sink_ptr, out_ptr, lse_ptr, po_ptr, plse_ptr, i_t64, i_hb, i_s, H,
                NUM_SPLITS, stride_ot, stride_oh, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr,
                BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, VT: gl.constexpr, STAGE_OUT: gl.constexpr):
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, VT, 16])
        P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
        COL_S: gl.constexpr = gl.SliceLayout(0, S_L)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
        GQ: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        # q as given (bf16), one 128-wide tile at a time into shared memory; here rather than before
        # the partitions, so that the producer's first gathers are in flight meanwhile
        o_hq = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, GQ))
        m_hq = (o_hq < H)[:, None]
        p_q = q_ptr + i_t64 * stride_qt + o_hq[:, None] * stride_qh
        o_tq = gl.arange(0, VT, layout=gl.SliceLayout(0, GQ))
        for t in gl.static_range(4):
            s_q.slice(t * VT, VT, dim=1).store(gl.load(p_q + t * VT + o_tq[None, :], mask=m_hq, other=0.0))
        hopper.fence_async_shared()
        zs = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_L)
        b_m = gl.full([BLOCK_H], float("-inf"), gl.float32, ROW_S)
        b_l = gl.zeros([BLOCK_H], gl.float32, ROW_S)
        b_o0 = gl.zeros([BLOCK_H, VT], gl.float32, O_L)
        b_o1 = gl.zeros([BLOCK_H, VT], gl.float32, O_L)
        for i in range(n_blk):
            buf = i % 2
            mbarrier.wait(full.index(buf), (i // 2) & 1)
            sk = s_k.index(buf)
            t_s = hopper.warpgroup_mma(s_q, sk.permute((1, 0)), zs, use_acc=False, is_async=True)
            b_sc = hopper.warpgroup_mma_wait(0, deps=[t_s]) * qk_scale
            m_n = s_ok.index(buf).load(COL_S) != 0
            # a NaN or inf score of a valid key turns NaN (kernels/softmax.py): the row ends NaN
            b_sc = gl.where(m_n[None, :], _keep_faults(b_sc), float("-inf"))
            m_new = gl.maximum(b_m, gl.max(b_sc, 1))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(b_m - m_use)
            b_p = gl.exp2(b_sc - m_use[:, None])
            b_l = b_l * alpha + gl.sum(b_p, 1)
            b_m = m_new
            # P as bf16 hi + lo (16 significant bits): one bf16 P misses the tolerance where large
            # terms cancel (tests/kernels/test_sparse_mla_decode_model1.py: model1_cache)
            p_hi = b_p.to(gl.bfloat16)
            p_lo = (b_p - p_hi.to(gl.float32)).to(gl.bfloat16)
            # the value warpgroup's operands: P into s_p once it is done with the previous one
            mbarrier.wait(pfree, (i & 1) ^ 1)
            s_p.index(0).store(p_hi)
            s_p.index(1).store(p_lo)
            s_f.index(buf).store(alpha)
            hopper.fence_async_shared()
            mbarrier.arrive(pfull.index(buf))
            a_o = gl.convert_layout(alpha, ROW_O)
            b_o0 = b_o0 * a_o[:, None]
            b_o1 = b_o1 * a_o[:, None]
            ph = gl.convert_layout(p_hi, P_L)
            pl = gl.convert_layout(p_lo, P_L)
            t0 = hopper.warpgroup_mma(ph, sk.slice(0, VT, dim=1), b_o0, is_async=True)
            t0 = hopper.warpgroup_mma(pl, sk.slice(0, VT, dim=1), t0, is_async=True)
            t1 = hopper.warpgroup_mma(ph, sk.slice(VT, VT, dim=1), b_o1, is_async=True)
            t1 = hopper.warpgroup_mma(pl, sk.slice(VT, VT, dim=1), t1, is_async=True)
            b_o0, b_o1, ph, pl = hopper.warpgroup_mma_wait(0, deps=[t0, t1, ph, pl])
            mbarrier.arrive(empty.index(buf))
        b_inv, b_lse = _finish_rows(b_l, b_m)
        o_hs = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_S)
        m_hs = o_hs < H
        if not SPLIT:
            if HAS_SINK:
                b_inv = b_inv * _sink_factor(sink_ptr, o_hs, m_hs, b_lse)
        # the stage of s_f the last block did not use: the value warpgroup read it before releasing
        # its previous block, which the pfree wait of the last block saw
        s_f.index(n_blk % 2).store(b_inv)
        mbarrier.arrive(done)
        _store_out(b_o0, b_o1, 0, gl.convert_layout(b_inv, ROW_O), s_q, out_ptr, po_ptr, i_t64, i_hb, i_s,
                   H, NUM_SPLITS, stride_ot, stride_oh, SPLIT, BLOCK_H, VT, O_L, STAGE_OUT)
        if SPLIT:
            gl.store(plse_ptr + (i_t64 * NUM_SPLITS + i_s) * H + o_hs, b_lse, mask=m_hs)
        else:
            gl.store(lse_ptr + i_t64 * H + o_hs, b_lse, mask=m_hs)

    @gluon.jit
    def _values(s_q, s_k, s_p, s_f, empty, pfull, pfree, done, n_blk,
                out_ptr, po_ptr, i_t64, i_hb, i_s, H, NUM_SPLITS, stride_ot, stride_oh,
                SPLIT: gl.constexpr, BLOCK_H: gl.constexpr, VT: gl.constexpr, STAGE_OUT: gl.constexpr):
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, VT, 16])
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
        b_o2 = gl.zeros([BLOCK_H, VT], gl.float32, O_L)
        b_o3 = gl.zeros([BLOCK_H, VT], gl.float32, O_L)
        for i in range(n_blk):
            buf = i % 2
            mbarrier.wait(pfull.index(buf), (i // 2) & 1)
            f = s_f.index(buf).load(ROW_O)
            b_o2 = b_o2 * f[:, None]
            b_o3 = b_o3 * f[:, None]
            sk = s_k.index(buf)
            t2 = hopper.warpgroup_mma(s_p.index(0), sk.slice(2 * VT, VT, dim=1), b_o2, is_async=True)
            t2 = hopper.warpgroup_mma(s_p.index(1), sk.slice(2 * VT, VT, dim=1), t2, is_async=True)
            t3 = hopper.warpgroup_mma(s_p.index(0), sk.slice(3 * VT, VT, dim=1), b_o3, is_async=True)
            t3 = hopper.warpgroup_mma(s_p.index(1), sk.slice(3 * VT, VT, dim=1), t3, is_async=True)
            b_o2, b_o3 = hopper.warpgroup_mma_wait(0, deps=[t2, t3])
            mbarrier.arrive(pfree)
            mbarrier.arrive(empty.index(buf))
        mbarrier.wait(done, 0)
        inv = s_f.index(n_blk % 2).load(ROW_O)
        _store_out(b_o2, b_o3, 2, inv, s_q, out_ptr, po_ptr, i_t64, i_hb, i_s, H, NUM_SPLITS, stride_ot,
                   stride_oh, SPLIT, BLOCK_H, VT, O_L, STAGE_OUT)

    @gluon.jit
    def sparse_mla_decode_sm90_model1_kernel(
        q_ptr, cache_ptr, idx_ptr, len_ptr, xcache_ptr, xidx_ptr, xlen_ptr, sink_ptr,
        out_ptr, lse_ptr, po_ptr, plse_ptr,
        H, TOPK, XTOPK, XSTART, CHUNK, NUM_HB, NUM_SPLITS,
        num_slots, block_size, x_num_slots, x_block_size,
        stride_qt, stride_qh, stride_cb, stride_xb, stride_it, stride_xt, stride_ot, stride_oh,
        qk_scale,
        E4M3: gl.constexpr, HAS_LEN: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_XLEN: gl.constexpr,
        HAS_SINK: gl.constexpr, SPLIT: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
        TILE: gl.constexpr, NT: gl.constexpr, ROPE: gl.constexpr, REC: gl.constexpr,
        ROPE_OFF: gl.constexpr, SCALE_BYTES: gl.constexpr, STAGE_OUT: gl.constexpr, ROLL: gl.constexpr,
    ):
        gl.static_assert(NT * TILE + ROPE == 512)  # d_qk = d_v = 512: four 128-wide output tiles
        D: gl.constexpr = NT * TILE + ROPE
        VT: gl.constexpr = D // 4
        SH16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        SH1: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])

        i_p = gl.program_id(0)
        i_s = gl.program_id(1)
        i_t = i_p // NUM_HB
        i_hb = i_p % NUM_HB
        i_t64 = i_t.to(gl.int64)

        # this split's part [k_lo, k_lo + CHUNK) of the joined list: main positions [0, n_main),
        # extra ones from XSTART (a multiple of BLOCK_N: no block straddles the two lists)
        k_lo = i_s * CHUNK
        k_hi = k_lo + CHUNK
        n_main = TOPK
        if HAS_LEN:
            n_main = gl.minimum(gl.maximum(gl.load(len_ptr + i_t), 0), TOPK)
        m_hi = gl.minimum(k_hi, n_main)
        nm = gl.cdiv(gl.maximum(m_hi - k_lo, 0), BLOCK_N)
        x_lo = k_lo * 0
        x_hi = k_lo * 0
        nx = k_lo * 0
        if HAS_EXTRA:
            n_extra = XTOPK
            if HAS_XLEN:
                n_extra = gl.minimum(gl.maximum(gl.load(xlen_ptr + i_t), 0), XTOPK)
            x_lo = gl.maximum(k_lo - XSTART, 0)
            x_hi = gl.minimum(k_hi - XSTART, n_extra)
            nx = gl.cdiv(gl.maximum(x_hi - x_lo, 0), BLOCK_N)
        n_blk = nm + nx

        s_q = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D], SH16)

        s_k = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, D], SH16)
        s_p = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_H, BLOCK_N], SH16)
        s_f = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], SH1)
        s_ok = gl.allocate_shared_memory(gl.int8, [2, BLOCK_N], SH1)
        full, empty, pfull, pfree, done = _barriers(1 if ROLL else 2)

        p_idx = idx_ptr + i_t64 * stride_it
        p_xidx = xidx_ptr + i_t64 * stride_xt
        # the partition lists are written out twice: a Gluon kernel cannot hold a (function, args)
        # pair in a variable, nor an argument tuple (its constexprs then arrive as values: tried,
        # _scores' gl.arange fails), and the producers' count differs
        if ROLL:
            gl.warp_specialize(
                [(_scores, (q_ptr, stride_qt, stride_qh, s_q, s_k, s_ok, s_p, s_f, full, empty, pfull, pfree,
                            done, n_blk, qk_scale, sink_ptr, out_ptr, lse_ptr, po_ptr, plse_ptr, i_t64, i_hb, i_s, H, NUM_SPLITS,
                            stride_ot, stride_oh, HAS_SINK, SPLIT, BLOCK_H, BLOCK_N, VT, STAGE_OUT)),
                 (_values, (s_q, s_k, s_p, s_f, empty, pfull, pfree, done, n_blk,
                            out_ptr, po_ptr, i_t64, i_hb, i_s, H, NUM_SPLITS, stride_ot, stride_oh,
                            SPLIT, BLOCK_H, VT, STAGE_OUT)),
                 (_gather.producer_roll, (cache_ptr, p_idx, xcache_ptr, p_xidx, k_lo, m_hi, nm, x_lo, x_hi, n_blk,
                            num_slots, block_size, stride_cb, x_num_slots, x_block_size, stride_xb,
                            s_k, s_ok, full, empty, HAS_EXTRA, BLOCK_N, TILE, NT, ROPE, REC, ROPE_OFF,
                            SCALE_BYTES))],
                [4, 4], [_V_REGS, _P_REGS])
        else:  # two producers, each half of every block (sm90_model1_gather.py)
            gl.warp_specialize(
                [(_scores, (q_ptr, stride_qt, stride_qh, s_q, s_k, s_ok, s_p, s_f, full, empty, pfull, pfree,
                            done, n_blk, qk_scale, sink_ptr, out_ptr, lse_ptr, po_ptr, plse_ptr, i_t64, i_hb, i_s, H, NUM_SPLITS,
                            stride_ot, stride_oh, HAS_SINK, SPLIT, BLOCK_H, BLOCK_N, VT, STAGE_OUT)),
                 (_values, (s_q, s_k, s_p, s_f, empty, pfull, pfree, done, n_blk,
                            out_ptr, po_ptr, i_t64, i_hb, i_s, H, NUM_SPLITS, stride_ot, stride_oh,
                            SPLIT, BLOCK_H, VT, STAGE_OUT)),
                 (_gather.producer, (cache_ptr, p_idx, xcache_ptr, p_xidx, k_lo, m_hi, nm, x_lo, x_hi, n_blk,
                            num_slots, block_size, stride_cb, x_num_slots, x_block_size, stride_xb,
                            s_k, s_ok, full, empty, HAS_EXTRA, BLOCK_N, TILE, NT, ROPE, REC, ROPE_OFF,
                            SCALE_BYTES, 0)),
                 (_gather.producer, (cache_ptr, p_idx, xcache_ptr, p_xidx, k_lo, m_hi, nm, x_lo, x_hi, n_blk,
                            num_slots, block_size, stride_cb, x_num_slots, x_block_size, stride_xb,
                            s_k, s_ok, full, empty, HAS_EXTRA, BLOCK_N, TILE, NT, ROPE, REC, ROPE_OFF,
                            SCALE_BYTES, 1))],
                [4, 4, 4], [_V_REGS, _P2_REGS, _P2_REGS])
