"""Hopper (sm_90) kernel of sparse_mla_decode for the fp8_ds_mla cache and 64-head blocks, in Gluon.

Same arguments and outputs as `sparse_mla_decode_kernel` (kernels/sparse_mla_decode/triton_kernel.py:
one token, a head block and one split of its indices per program; partial (out, lse) merged by the
same merge kernel), and the same exact arithmetic: e4m3 bytes become fp16 exactly, q goes to fp16
after a per-head power of two, per-tile scales multiply the scores (four K = 128 chains summed in
fp32, plus the bf16 rope chain) and P_t = P * s_t / R (R a running power of two >= every scale
seen) feeds each tile's value dot in fp16, rounded once.

Three warpgroups, each with its own part of a 64-row block of keys (FlashMLA's sm90 partition):
- the producer (worker, P_REGS registers) loads block i's rows with 16-byte global loads into
  registers (latent bytes, rope, scales; the row numbers of a block are loaded with it), waits
  until stage i % 2 is released, converts the bytes to fp16 and stores the stage (K [64, 512]
  fp16, rope, scales, and each key's validity), then arrives on the stage's `full` barrier;
- the score warpgroup (the default partition: the registers the workers leave, and the q
  prologue) computes
  S [64 heads, 64 keys] (m64n64 wgmma chains, each head's row inside one warp: the softmax needs no
  cross-warp exchange), the online softmax, P_2 and P_3 (the value warpgroup's operands) into
  shared memory, then O[:, 0:256] += P_0 V_0 + P_1 V_1 with P in registers;
- the value warpgroup (worker, V_REGS registers) holds O[:, 256:512] and adds P_2 V_2 + P_3 V_3 (both operands from shared
  memory) while the score warpgroup goes on to the next block's scores.
Hand-overs: `full` / `empty` per stage (producer <-> both consumers), `pfull` per stage (P_2, P_3
and the per-head rescale factor are in shared memory), `pfree` (the value warpgroup is done with
P_3's buffer), `done` (the score warpgroup left 1 / sum in shared memory for the epilogue).
Shared memory: q 72 KB + two stages of 73 KB + P_3 8 KB (P_2 goes into the stage's rope buffer,
which the score warpgroup has finished reading) = 227 KB: one program per SM, 12 warps.

Timings: docs/benchmarks.md; the profile behind this partition and the variants tried:
docs/notes/sparse_mla_decode.md (v8).
"""
from __future__ import annotations

import torch

from openmla.kernels.sparse_mla_decode import shared as _dm
from openmla.kernels.device import sm90_gluon

try:  # Gluon ships with Triton >= 3.5; without it the Triton kernel serves every GPU
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier
    _GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    _GLUON = False

BLOCK_H = 64
BLOCK_N = 64  # keys per block: the score wgmma's N
NUM_WARPS = 4  # the score warpgroup (and prologue); the value and producer warpgroups are workers
OCCUPANCY = 1  # programs per SM, for the split rule
V_REGS = 160  # registers of the value warpgroup (O[:, 256:] alone is 128)
P_REGS = 96  # registers of the producer; the score warpgroup gets the rest (248)
# At most this many (token, 64-head block) pairs run the Triton kernel instead: its 32-head blocks
# make twice the programs, and there the split programs' serial gathers, not the per-block rate,
# bound the time (the A/B behind the cut: docs/notes/sparse_mla_decode.md, "Small batches")
FEW_BLOCKS = 2


def usable(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether this kernel serves these inputs: Gluon kernels may run on their device
    (`sm90_gluon`), and cache rows start on 16 bytes (16-byte loads)."""
    return (sm90_gluon(q.device) and cache.data_ptr() % 16 == 0 and cache.stride(0) % 16 == 0
            and cache.stride(1) % 16 == 0)


if _GLUON:
    _V_REGS = gl.constexpr(V_REGS)
    _P_REGS = gl.constexpr(P_REGS)

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
    def _fp8_to_f16(x):
        # e4m3 bytes -> fp16, exact (F2FP, two bytes per instruction)
        return gl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [x], dtype=gl.float16, is_pure=True, pack=4)


    @gluon.jit
    def _producer(cache_ptr, p_idx, k_lo, k_hi, n_blk, num_slots, block_size, stride_cb, stride_cr,
                  s_k16, s_kr, s_sc, s_ok, full, empty, DENSE: gl.constexpr, BS_SHIFT: gl.constexpr,
                  BLOCK_N: gl.constexpr, TILE: gl.constexpr, ROPE: gl.constexpr, ROPE_OFF: gl.constexpr,
                  SCALE_OFF: gl.constexpr):
        GB: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
        GR: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        GS: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        o_nb = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, GB))
        o_nr = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, GR))
        o_ns = gl.arange(0, BLOCK_N, layout=GS)
        o_b = gl.arange(0, TILE, layout=gl.SliceLayout(0, GB))
        o_r = gl.arange(0, ROPE, layout=gl.SliceLayout(0, GR))
        for i in range(n_blk):
            buf = i % 2
            # block i's row numbers, once in each load layout (cheaper than converting them);
            # loading them a block ahead kept more registers live and measured slower
            k = k_lo + i * BLOCK_N
            b_ib = gl.load(p_idx + k + o_nb, mask=k + o_nb < k_hi, other=-1)
            b_ir = gl.load(p_idx + k + o_nr, mask=k + o_nr < k_hi, other=-1)
            b_is = gl.load(p_idx + k + o_ns, mask=k + o_ns < k_hi, other=-1)
            p_b, m_b = _row_ptrs(cache_ptr, b_ib, num_slots, block_size, stride_cb, stride_cr, DENSE, BS_SHIFT)
            p_b = p_b[:, None] + o_b[None, :]
            x0 = gl.load(p_b + 0 * TILE, mask=m_b[:, None], other=0)
            x1 = gl.load(p_b + 1 * TILE, mask=m_b[:, None], other=0)
            x2 = gl.load(p_b + 2 * TILE, mask=m_b[:, None], other=0)
            x3 = gl.load(p_b + 3 * TILE, mask=m_b[:, None], other=0)
            p_r, m_r = _row_ptrs(cache_ptr, b_ir, num_slots, block_size, stride_cb, stride_cr, DENSE, BS_SHIFT)
            p_r = gl.multiple_of((p_r + ROPE_OFF).to(gl.pointer_type(gl.bfloat16)), 16)
            xr = gl.load(p_r[:, None] + o_r[None, :], mask=m_r[:, None], other=0.0)
            p_s, m_s = _row_ptrs(cache_ptr, b_is, num_slots, block_size, stride_cb, stride_cr, DENSE, BS_SHIFT)
            p_s = (p_s + SCALE_OFF).to(gl.pointer_type(gl.float32))
            xs0 = gl.load(p_s + 0, mask=m_s, other=0.0)
            xs1 = gl.load(p_s + 1, mask=m_s, other=0.0)
            xs2 = gl.load(p_s + 2, mask=m_s, other=0.0)
            xs3 = gl.load(p_s + 3, mask=m_s, other=0.0)
            mbarrier.wait(empty.index(buf), ((i // 2) & 1) ^ 1)
            sk = s_k16.index(buf)
            sk.slice(0 * TILE, TILE, dim=1).store(_fp8_to_f16(x0))
            sk.slice(1 * TILE, TILE, dim=1).store(_fp8_to_f16(x1))
            sk.slice(2 * TILE, TILE, dim=1).store(_fp8_to_f16(x2))
            sk.slice(3 * TILE, TILE, dim=1).store(_fp8_to_f16(x3))
            s_kr.index(buf).store(xr)
            s_sc.index(4 * buf + 0).store(xs0)
            s_sc.index(4 * buf + 1).store(xs1)
            s_sc.index(4 * buf + 2).store(xs2)
            s_sc.index(4 * buf + 3).store(xs3)
            s_ok.index(buf).store(m_s.to(gl.int8))
            hopper.fence_async_shared()
            mbarrier.arrive(full.index(buf))
    @gluon.jit
    def _barriers(PRODUCERS: gl.constexpr):
        """The partition's hand-overs (module docstring): full / empty / pfull per stage, pfree, done
        (also sm90_model1.py's, whose stage may be filled by two producer partitions)."""
        full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        pfull = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        pfree = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for b in gl.static_range(2):
            mbarrier.init(full.index(b), count=PRODUCERS)
            mbarrier.init(empty.index(b), count=2)  # the score and the value warpgroups
            mbarrier.init(pfull.index(b), count=1)
        mbarrier.init(pfree, count=1)
        mbarrier.init(done, count=1)
        return full, empty, pfull, pfree, done

    @gluon.jit
    def _store_tiles(b_oa, b_ob, T0: gl.constexpr, inv_o, out_ptr, po_ptr, i_t64, i_hb, i_s, H, NUM_SPLITS,
                     stride_ot, stride_oh, SPLIT: gl.constexpr, BLOCK_H: gl.constexpr, TILE: gl.constexpr,
                     O_L: gl.constexpr):
        # output tiles T0 and T0 + 1 of this program's heads (partials when split)
        o_ho = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_L))
        m_ho = (o_ho < H)[:, None]
        o_d = T0 * TILE + gl.arange(0, TILE, layout=gl.SliceLayout(0, O_L))
        if SPLIT:
            p_po = po_ptr + ((i_t64 * NUM_SPLITS + i_s) * H + o_ho)[:, None] * (4 * TILE) + o_d[None, :]
            gl.store(p_po, b_oa * inv_o[:, None], mask=m_ho)
            gl.store(p_po + TILE, b_ob * inv_o[:, None], mask=m_ho)
        else:
            p_o = out_ptr + i_t64 * stride_ot + o_ho[:, None] * stride_oh + o_d[None, :]
            ty = out_ptr.dtype.element_ty
            gl.store(p_o, (b_oa * inv_o[:, None]).to(ty), mask=m_ho)
            gl.store(p_o + TILE, (b_ob * inv_o[:, None]).to(ty), mask=m_ho)


    @gluon.jit
    def _scores(s_ql, s_qr, s_k16, s_kr, s_sc, s_ok, s_p3, s_f, full, empty, pfull, pfree, done,
                n_blk, b_fq, qk_scale,
                sink_ptr, out_ptr, lse_ptr, po_ptr, plse_ptr, i_t64, i_hb, i_s, H, NUM_SPLITS,
                stride_ot, stride_oh, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr, INF_EMPTY: gl.constexpr,
                BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, TILE: gl.constexpr):
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TILE, 16])
        P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        SH16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
        COL_S: gl.constexpr = gl.SliceLayout(0, S_L)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
        zs = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_L)
        b_m = gl.full([BLOCK_H], float("-inf"), gl.float32, ROW_S)
        b_l = gl.zeros([BLOCK_H], gl.float32, ROW_S)
        b_o0 = gl.zeros([BLOCK_H, TILE], gl.float32, O_L)
        b_o1 = gl.zeros([BLOCK_H, TILE], gl.float32, O_L)
        b_r = gl.to_tensor(2.0 ** -126)
        for i in range(n_blk):
            buf = i % 2
            mbarrier.wait(full.index(buf), (i // 2) & 1)
            sk = s_k16.index(buf)
            t_r = hopper.warpgroup_mma(s_qr, s_kr.index(buf).permute((1, 0)), zs, use_acc=False, is_async=True)
            t_c = hopper.warpgroup_mma(s_ql.slice(0, TILE, dim=1), sk.slice(0, TILE, dim=1).permute((1, 0)), zs,
                                       use_acc=False, is_async=True)
            b_sc = hopper.warpgroup_mma_wait(1, deps=[t_r]) * qk_scale
            c = hopper.warpgroup_mma_wait(0, deps=[t_c])
            b_st = s_sc.index(4 * buf).load(COL_S)
            b_sc += c * b_st[None, :] * b_fq[:, None]
            s_mx = b_st
            for t in gl.static_range(1, 4):
                t_c = hopper.warpgroup_mma(s_ql.slice(t * TILE, TILE, dim=1), sk.slice(t * TILE, TILE, dim=1).permute((1, 0)),
                                           zs, use_acc=False, is_async=True)
                c = hopper.warpgroup_mma_wait(0, deps=[t_c])
                b_st = s_sc.index(4 * buf + t).load(COL_S)
                b_sc += c * b_st[None, :] * b_fq[:, None]
                s_mx = gl.maximum(s_mx, b_st)
            # validity from the producer: a global load of the indices here sat on the critical
            # path (its latency under the gather's traffic showed in the softmax)
            m_n = s_ok.index(buf).load(COL_S) != 0
            # a NaN or inf score of a valid key turns NaN (kernels/softmax.py): the row ends NaN
            b_sc = gl.where(m_n[None, :], _keep_faults(b_sc), float("-inf"))
            r_new = gl.maximum(b_r, _pow2_at_least(gl.max(s_mx, 0) + 1e-38))
            m_new = gl.maximum(b_m, gl.max(b_sc, 1))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(b_m - m_use)
            b_p = gl.exp2(b_sc - m_use[:, None])
            b_l = b_l * alpha + gl.sum(b_p, 1)
            b_m = m_new
            f = alpha * (b_r / r_new)
            b_r = r_new
            b_p = b_p * (1.0 / r_new)
            # the value warpgroup's operands: P_2 into this stage's rope buffer (the rope wgmma above
            # has completed; the producer refills it only after the stage is released), P_3 into s_p3
            # once the value warpgroup is done with the previous one
            mbarrier.wait(pfree, (i & 1) ^ 1)
            s_kr.index(buf)._reinterpret(gl.float16, [BLOCK_H, BLOCK_N], SH16).store(
                (b_p * s_sc.index(4 * buf + 2).load(COL_S)[None, :]).to(gl.float16))
            s_p3.store((b_p * s_sc.index(4 * buf + 3).load(COL_S)[None, :]).to(gl.float16))
            s_f.index(buf).store(f)
            hopper.fence_async_shared()
            mbarrier.arrive(pfull.index(buf))
            f_o = gl.convert_layout(f, ROW_O)
            b_o0 = b_o0 * f_o[:, None]
            b_o1 = b_o1 * f_o[:, None]
            p0 = gl.convert_layout((b_p * s_sc.index(4 * buf).load(COL_S)[None, :]).to(gl.float16), P_L)
            t0 = hopper.warpgroup_mma(p0, sk.slice(0, TILE, dim=1), b_o0, is_async=True)
            p1 = gl.convert_layout((b_p * s_sc.index(4 * buf + 1).load(COL_S)[None, :]).to(gl.float16), P_L)
            t1 = hopper.warpgroup_mma(p1, sk.slice(TILE, TILE, dim=1), b_o1, is_async=True)
            b_o0, b_o1, p0, p1 = hopper.warpgroup_mma_wait(0, deps=[t0, t1, p0, p1])
            mbarrier.arrive(empty.index(buf))
        b_inv, b_lse = _finish_rows(b_l, b_m)
        o_hs = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_S)
        m_hs = o_hs < H
        if not SPLIT:
            if HAS_SINK:
                b_inv = b_inv * _sink_factor(sink_ptr, o_hs, m_hs, b_lse)
        inv = b_inv * b_r
        # the stage of s_f the last block did not use: the value warpgroup read it before releasing
        # its previous block, which the pfree wait of the last block saw
        s_f.index(n_blk % 2).store(inv)
        mbarrier.arrive(done)
        _store_tiles(b_o0, b_o1, 0, gl.convert_layout(inv, ROW_O), out_ptr, po_ptr, i_t64, i_hb, i_s, H,
                     NUM_SPLITS, stride_ot, stride_oh, SPLIT, BLOCK_H, TILE, O_L)
        if SPLIT:
            gl.store(plse_ptr + (i_t64 * NUM_SPLITS + i_s) * H + o_hs, b_lse, mask=m_hs)
        else:
            if INF_EMPTY:  # FlashMLA's lse for a row without a valid index
                b_lse = gl.where(b_lse == float("-inf"), float("inf"), b_lse)
            gl.store(lse_ptr + i_t64 * H + o_hs, b_lse, mask=m_hs)


    @gluon.jit
    def _values(s_k16, s_kr, s_p3, s_f, empty, pfull, pfree, done, n_blk,
                out_ptr, po_ptr, i_t64, i_hb, i_s, H, NUM_SPLITS, stride_ot, stride_oh,
                SPLIT: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, TILE: gl.constexpr):
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TILE, 16])
        SH16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
        b_o2 = gl.zeros([BLOCK_H, TILE], gl.float32, O_L)
        b_o3 = gl.zeros([BLOCK_H, TILE], gl.float32, O_L)
        for i in range(n_blk):
            buf = i % 2
            mbarrier.wait(pfull.index(buf), (i // 2) & 1)
            f = s_f.index(buf).load(ROW_O)
            b_o2 = b_o2 * f[:, None]
            b_o3 = b_o3 * f[:, None]
            sk = s_k16.index(buf)
            t2 = hopper.warpgroup_mma(s_kr.index(buf)._reinterpret(gl.float16, [BLOCK_H, BLOCK_N], SH16),
                                      sk.slice(2 * TILE, TILE, dim=1), b_o2, is_async=True)
            t3 = hopper.warpgroup_mma(s_p3, sk.slice(3 * TILE, TILE, dim=1), b_o3, is_async=True)
            b_o2, b_o3 = hopper.warpgroup_mma_wait(0, deps=[t2, t3])
            mbarrier.arrive(pfree)
            mbarrier.arrive(empty.index(buf))
        mbarrier.wait(done, 0)
        inv = s_f.index(n_blk % 2).load(ROW_O)
        _store_tiles(b_o2, b_o3, 2, inv, out_ptr, po_ptr, i_t64, i_hb, i_s, H, NUM_SPLITS, stride_ot,
                     stride_oh, SPLIT, BLOCK_H, TILE, O_L)


    @gluon.jit
    def sparse_mla_decode_sm90_kernel(
        q_ptr, cache_ptr, idx_ptr, len_ptr, sink_ptr, out_ptr, lse_ptr, po_ptr, plse_ptr,
        H, TOPK, CHUNK, NUM_HB, NUM_SPLITS, num_slots, block_size,
        stride_qt, stride_qh, stride_cb, stride_cr, stride_it, stride_ot, stride_oh,
        qk_scale,
        DENSE: gl.constexpr, HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr,
        BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, TILE: gl.constexpr, ROPE: gl.constexpr,
        SCALE_OFF: gl.constexpr, ROPE_OFF: gl.constexpr, BS_SHIFT: gl.constexpr, INF_EMPTY: gl.constexpr,
    ):
        D_LAT: gl.constexpr = 4 * TILE
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        GQ: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        SH16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        SH1: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        ROW_Q: gl.constexpr = gl.SliceLayout(1, GQ)

        i_p = gl.program_id(0)
        i_s = gl.program_id(1)
        i_t = i_p // NUM_HB
        i_hb = i_p % NUM_HB
        i_t64 = i_t.to(gl.int64)
        k_lo, k_hi = _split_range(len_ptr, i_t, i_s, TOPK, CHUNK, gl.num_programs(1), BLOCK_N, HAS_LEN)

        # q: latent to fp16 exactly after a per-head power-of-two scaling (a pass for the heads' max,
        # then one tile at a time: the whole q in registers of one warpgroup would spill), rope bf16
        o_hq = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_Q)
        m_hq = (o_hq < H)[:, None]
        p_q = q_ptr + i_t64 * stride_qt + o_hq[:, None] * stride_qh
        o_tq = gl.arange(0, TILE, layout=gl.SliceLayout(0, GQ))
        b_amax = gl.zeros([BLOCK_H], gl.float32, ROW_Q)
        for t in gl.static_range(4):
            x = gl.load(p_q + t * TILE + o_tq[None, :], mask=m_hq, other=0.0).to(gl.float32)
            b_amax = gl.maximum(b_amax, gl.max(gl.abs(x), 1))
        b_fq = _head_f16_factor(b_amax)
        s_ql = gl.allocate_shared_memory(gl.float16, [BLOCK_H, D_LAT], SH16)
        for t in gl.static_range(4):
            x = gl.load(p_q + t * TILE + o_tq[None, :], mask=m_hq, other=0.0).to(gl.float32)
            s_ql.slice(t * TILE, TILE, dim=1).store((x / b_fq[:, None]).to(gl.float16))
        o_rq = D_LAT + gl.arange(0, ROPE, layout=gl.SliceLayout(0, GQ))
        s_qr = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, ROPE], SH16,
                                         gl.load(p_q + o_rq[None, :], mask=m_hq, other=0.0))
        b_fq = gl.convert_layout(b_fq, gl.SliceLayout(1, S_L)) * qk_scale

        s_k16 = gl.allocate_shared_memory(gl.float16, [2, BLOCK_N, D_LAT], SH16)
        s_kr = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, ROPE], SH16)
        s_sc = gl.allocate_shared_memory(gl.float32, [8, BLOCK_N], SH1)
        s_p3 = gl.allocate_shared_memory(gl.float16, [BLOCK_H, BLOCK_N], SH16)
        s_f = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], SH1)
        s_ok = gl.allocate_shared_memory(gl.int8, [2, BLOCK_N], SH1)
        full, empty, pfull, pfree, done = _barriers(1)

        n_blk = gl.cdiv(gl.maximum(k_hi - k_lo, 0), BLOCK_N)
        p_idx = idx_ptr + i_t64 * stride_it
        gl.warp_specialize(
            [(_scores, (s_ql, s_qr, s_k16, s_kr, s_sc, s_ok, s_p3, s_f, full, empty, pfull, pfree, done,
                        n_blk, b_fq, qk_scale, sink_ptr, out_ptr, lse_ptr, po_ptr, plse_ptr, i_t64, i_hb, i_s, H, NUM_SPLITS,
                        stride_ot, stride_oh, HAS_SINK, SPLIT, INF_EMPTY, BLOCK_H, BLOCK_N, TILE)),
             (_values, (s_k16, s_kr, s_p3, s_f, empty, pfull, pfree, done, n_blk,
                        out_ptr, po_ptr, i_t64, i_hb, i_s, H, NUM_SPLITS, stride_ot, stride_oh,
                        SPLIT, BLOCK_H, BLOCK_N, TILE)),
             (_producer, (cache_ptr, p_idx, k_lo, k_hi, n_blk, num_slots, block_size, stride_cb, stride_cr,
                          s_k16, s_kr, s_sc, s_ok, full, empty, DENSE, BS_SHIFT, BLOCK_N, TILE, ROPE, ROPE_OFF,
                          SCALE_OFF))],
            [4, 4], [_V_REGS, _P_REGS])
