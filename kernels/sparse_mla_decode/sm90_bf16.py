"""Hopper (sm_90) kernel of sparse_mla_decode for the bf16 cache and 64-head blocks, in Gluon.

Same arguments and outputs as `sparse_mla_decode_kernel` (kernels/sparse_mla_decode/triton_kernel.py:
one token, a head block and one split of its indices per program; partial (out, lse) merged by the
same merge kernel) and the same arithmetic: bf16 q . k as five chains (rope, four 128-wide latent
tiles) summed in fp32, scores in the log2 domain, P split into bf16 hi + lo parts for the value dot (a
single bf16 P errs by 2^-9 a weight: the decode tests' abs 1e-3 / rel 2/128 fail on peaked rows).

8 warps = two warpgroups (the row copy is the 64-head prefill kernel's, kernels/sparse_mla_prefill/
sm90.py, with the decode's paged row addressing); the score tile [64 heads, 64 keys] is
laid out [4, 2] (each warpgroup scores half of the keys: no q.k work done twice), the output
[64, 512] [4, 2] (each warpgroup owns 256 columns); block i+1's rows are gathered with 16-byte
cp.async (zero-filled for invalid slots, which are never read) at the top of step i, so a whole
step hides the gather. Nothing is converted: the rows go from global to shared memory as they are.
Shared memory: q 72 KB + two 72 KB row buffers + the P exchange: one program per SM.

Why a kernel of its own: the portable Triton kernel (32-head blocks, row tiles through registers)
took 2x the fp8 Gluon kernel's time at 64 and 128 heads (docs/benchmarks.md), whereas a bf16 row
needs no dequantization at all.

Gluon runs on the GPU only (not in Triton's interpreter); `usable` says when it may run; the
planner (kernels/sparse_mla_decode/op.py) picks it from MIN_HEADS heads. The CPU
suite compiles it for sm_90a (tests/kernels/test_sparse_mla_decode.py); the GPU suite checks it
against the oracle like every other path.
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
    from openmla.kernels.sparse_mla_decode.sm90 import _row_ptrs
    from openmla.kernels.sparse_mla_prefill.sm90 import copy_rows_at
    _split_range = gluon.jit(_dm.split_range.fn)
    _finish_rows = gluon.jit(_dm.finish_rows.fn)
    _keep_faults = gluon.jit(_dm.keep_faults.fn)
    _sink_factor = gluon.jit(_dm.sink_factor.fn)
    _GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    _GLUON = False

BLOCK_H = 64
BLOCK_N = 64  # keys per step
NUM_WARPS = 8
OCCUPANCY = 1  # programs per SM, for the split rule
# At most this many heads run the keys-on-M kernel (sm90_bf16_kn.py) instead: padded to 64 heads
# here, their score and value work is 2-4x what they need (docs/notes/sparse_mla_decode.md)
MIN_HEADS = 33


def usable(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether this kernel serves these inputs: Gluon kernels may run on their device
    (`sm90_gluon`), and cache rows start on 16 bytes (16-byte copies; strides in elements)."""
    return (sm90_gluon(q.device) and cache.data_ptr() % 16 == 0 and cache.stride(0) % 8 == 0
            and cache.stride(1) % 8 == 0)


if _GLUON:

    @gluon.jit
    def _gather(cache_ptr, b_idx, num_slots, block_size, stride_cb, stride_cr, s_lat, s_rope,
                G_L: gl.constexpr, D_LAT: gl.constexpr, ROPE: gl.constexpr, DENSE: gl.constexpr,
                BS_SHIFT: gl.constexpr):
        # start the copy of the rows of slots b_idx (-1: none) into a row buffer
        p_kv, m_kv = _row_ptrs(cache_ptr, b_idx, num_slots, block_size, stride_cb, stride_cr, DENSE, BS_SHIFT)
        copy_rows_at(p_kv, m_kv, s_lat, s_rope, G_L, D_LAT, ROPE)

    @gluon.jit
    def _q_to_shared(q_ptr, i_t64, stride_qt, stride_qh, o_hg, H, G_L: gl.constexpr, SH: gl.constexpr,
                     D_LAT: gl.constexpr, ROPE: gl.constexpr):
        # the token's q rows o_hg (zeros past H) into shared memory as they are: latent, rope
        m_hg = (o_hg < H)[:, None]
        p_q = q_ptr + i_t64 * stride_qt + o_hg[:, None] * stride_qh
        o_lg = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, G_L))
        o_rg = D_LAT + gl.arange(0, ROPE, layout=gl.SliceLayout(0, G_L))
        s_ql = gl.allocate_shared_memory(gl.bfloat16, [o_hg.shape[0], D_LAT], SH,
                                         gl.load(p_q + o_lg[None, :], mask=m_hg, other=0.0))
        s_qr = gl.allocate_shared_memory(gl.bfloat16, [o_hg.shape[0], ROPE], SH,
                                         gl.load(p_q + o_rg[None, :], mask=m_hg, other=0.0))
        return s_ql, s_qr

    @gluon.jit
    def _first_step(cache_ptr, p_idx, n_use, o_ng, num_slots, block_size, stride_cb, stride_cr, s_kl, s_kr,
                    G_L: gl.constexpr, D_LAT: gl.constexpr, ROPE: gl.constexpr, DENSE: gl.constexpr,
                    BS_SHIFT: gl.constexpr, BLOCK_N: gl.constexpr):
        # before step 0 (both bf16 decode kernels): start block 0's gather into row buffer 0 and
        # return block 1's slots, loaded a step ahead (the copy's addresses do not wait on them)
        b_idx = gl.load(p_idx + o_ng, mask=o_ng < n_use, other=-1)
        _gather(cache_ptr, b_idx, num_slots, block_size, stride_cb, stride_cr, s_kl.index(0), s_kr.index(0),
                G_L, D_LAT, ROPE, DENSE, BS_SHIFT)
        return gl.load(p_idx + BLOCK_N + o_ng, mask=BLOCK_N + o_ng < n_use, other=-1)

    @gluon.jit
    def _next_step(i, cache_ptr, b_nx, p_idx, n_use, o_ng, o_ns, num_slots, block_size, stride_cb, stride_cr,
                   s_kl, s_kr, G_L: gl.constexpr, D_LAT: gl.constexpr, ROPE: gl.constexpr, DENSE: gl.constexpr,
                   BS_SHIFT: gl.constexpr, BLOCK_N: gl.constexpr):
        # the top of step i (both bf16 decode kernels): once every warp has finished block i-1's
        # value wgmmas, which read the row buffer that block i+1 is gathered into now, start that
        # gather (b_nx: its slots; past the end all positions are masked, nothing is read); load
        # block i+2's slots a step ahead (the copy's addresses do not wait on them) and block i's
        # validity (in o_ns's layout); then wait until block i's rows have landed (all but the
        # newest copy group) for every thread and are visible to the tensor cores' (async proxy)
        # reads. Returns (block i+2's slots, block i's validity).
        gl.thread_barrier()
        _gather(cache_ptr, b_nx, num_slots, block_size, stride_cb, stride_cr, s_kl.index(1 - i % 2),
                s_kr.index(1 - i % 2), G_L, D_LAT, ROPE, DENSE, BS_SHIFT)
        o_nx = (i + 2) * BLOCK_N + o_ng
        b_nx = gl.load(p_idx + o_nx, mask=o_nx < n_use, other=-1)
        o_n = i * BLOCK_N + o_ns
        b_col = gl.load(p_idx + o_n, mask=o_n < n_use, other=-1)
        m_n = (b_col >= 0) & (b_col < num_slots)
        cp.wait_group(1)
        hopper.fence_async_shared()
        gl.thread_barrier()
        return b_nx, m_n

    @gluon.jit
    def _score_chains(s_ql, s_qr, s_lat, s_rope, zs, TILE: gl.constexpr, KEYS_ON_M: gl.constexpr):
        # q . k of a block as five bf16 wgmma chains (rope, four 128-wide latent tiles) summed in
        # fp32, two in flight (one K = 576 chain accumulates less exactly: lse off by up to 3e-5 at
        # ~32): S [heads, keys] = q K^T, or with KEYS_ON_M S^T [keys, heads] = K q^T
        if KEYS_ON_M:
            t_a = hopper.warpgroup_mma(s_rope, s_qr.permute((1, 0)), zs, use_acc=False, is_async=True)
            t_b = hopper.warpgroup_mma(s_lat.slice(0, TILE, dim=1), s_ql.slice(0, TILE, dim=1).permute((1, 0)),
                                       zs, use_acc=False, is_async=True)
        else:
            t_a = hopper.warpgroup_mma(s_qr, s_rope.permute((1, 0)), zs, use_acc=False, is_async=True)
            t_b = hopper.warpgroup_mma(s_ql.slice(0, TILE, dim=1), s_lat.slice(0, TILE, dim=1).permute((1, 0)),
                                       zs, use_acc=False, is_async=True)
        b_s = hopper.warpgroup_mma_wait(1, deps=[t_a])
        t_a = t_b
        for t in gl.static_range(1, 4):
            if KEYS_ON_M:
                t_b = hopper.warpgroup_mma(s_lat.slice(t * TILE, TILE, dim=1),
                                           s_ql.slice(t * TILE, TILE, dim=1).permute((1, 0)), zs,
                                           use_acc=False, is_async=True)
            else:
                t_b = hopper.warpgroup_mma(s_ql.slice(t * TILE, TILE, dim=1),
                                           s_lat.slice(t * TILE, TILE, dim=1).permute((1, 0)), zs,
                                           use_acc=False, is_async=True)
            b_s += hopper.warpgroup_mma_wait(1, deps=[t_a])
            t_a = t_b
        return b_s + hopper.warpgroup_mma_wait(0, deps=[t_a])

    @gluon.jit
    def sparse_mla_decode_sm90_bf16_kernel(
        q_ptr, cache_ptr, idx_ptr, len_ptr, sink_ptr, out_ptr, lse_ptr, po_ptr, plse_ptr,
        H, TOPK, CHUNK, NUM_HB, NUM_SPLITS, num_slots, block_size,
        stride_qt, stride_qh, stride_cb, stride_cr, stride_it, stride_ot, stride_oh,
        qk_scale,
        DENSE: gl.constexpr, HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr,
        BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, TILE: gl.constexpr, ROPE: gl.constexpr,
        SCALE_OFF: gl.constexpr, ROPE_OFF: gl.constexpr, BS_SHIFT: gl.constexpr, INF_EMPTY: gl.constexpr,
    ):
        # (SCALE_OFF: the fp8 kernels' argument, unused; ROPE_OFF is D_LAT: the rope follows the latent)
        D_LAT: gl.constexpr = 4 * TILE
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, BLOCK_N // 2, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, D_LAT // 2, 16])
        P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        # gathers: 16-byte vectors, 8 threads per 128 bytes of a row, 2 rows per thread per 64
        G_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        ROW_G: gl.constexpr = gl.SliceLayout(1, G_L)
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
        COL_S: gl.constexpr = gl.SliceLayout(0, S_L)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)

        # the head blocks of one token are neighbouring programs: they gather the same rows
        i_p = gl.program_id(0)
        i_s = gl.program_id(1)
        i_t = i_p // NUM_HB
        i_hb = i_p % NUM_HB
        i_t64 = i_t.to(gl.int64)
        k_lo, k_hi = _split_range(len_ptr, i_t, i_s, TOPK, CHUNK, gl.num_programs(1), BLOCK_N, HAS_LEN)
        n_use = k_hi - k_lo  # this split's list positions, from k_lo (<= 0: nothing)
        n_blk = gl.cdiv(gl.maximum(n_use, 0), BLOCK_N)
        p_idx = idx_ptr + i_t64 * stride_it + k_lo

        s_ql, s_qr = _q_to_shared(q_ptr, i_t64, stride_qt, stride_qh,
                                  i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_G), H, G_L, SH, D_LAT, ROPE)
        s_kl = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, D_LAT], SH)
        s_kr = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, ROPE], SH)

        o_ng = gl.arange(0, BLOCK_N, layout=ROW_G)
        o_ns = gl.arange(0, BLOCK_N, layout=COL_S)
        b_nx = _first_step(cache_ptr, p_idx, n_use, o_ng, num_slots, block_size, stride_cb, stride_cr, s_kl, s_kr,
                           G_L, D_LAT, ROPE, DENSE, BS_SHIFT, BLOCK_N)

        zs = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_L)
        b_m = gl.full([BLOCK_H], float("-inf"), gl.float32, ROW_S)
        b_l = gl.zeros([BLOCK_H], gl.float32, ROW_S)
        acc = gl.zeros([BLOCK_H, D_LAT], gl.float32, O_L)
        for i in range(n_blk):
            buf = i % 2
            b_nx, m_n = _next_step(i, cache_ptr, b_nx, p_idx, n_use, o_ng, o_ns, num_slots, block_size,
                                   stride_cb, stride_cr, s_kl, s_kr, G_L, D_LAT, ROPE, DENSE, BS_SHIFT, BLOCK_N)
            s_lat = s_kl.index(buf)
            b_s = _score_chains(s_ql, s_qr, s_lat, s_kr.index(buf), zs, TILE, False) * qk_scale
            # a NaN or inf score of a valid key turns NaN (kernels/softmax.py): the row ends NaN
            b_s = gl.where(m_n[None, :], _keep_faults(b_s), float("-inf"))

            m_new = gl.maximum(b_m, gl.max(b_s, 1))
            # a head with nothing valid yet keeps max -inf; shift by 0 there so no inf - inf appears
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            b_p = gl.exp2(b_s - m_use[:, None])
            alpha = gl.exp2(b_m - m_use)
            b_l = b_l * alpha + gl.sum(b_p, 1)
            b_m = m_new
            p_hi = b_p.to(gl.bfloat16)
            p_lo = gl.convert_layout((b_p - p_hi.to(gl.float32)).to(gl.bfloat16), P_L)
            acc = acc * gl.convert_layout(alpha, ROW_O)[:, None]
            t_o = hopper.warpgroup_mma(gl.convert_layout(p_hi, P_L), s_lat, acc, is_async=True)
            t_o = hopper.warpgroup_mma(p_lo, s_lat, t_o, is_async=True)
            acc = hopper.warpgroup_mma_wait(0, deps=[t_o])
        cp.wait_group(0)

        b_inv, b_lse = _finish_rows(b_l, b_m)
        o_hs = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_S)
        m_hs = o_hs < H
        o_ho = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_O)
        m_ho = (o_ho < H)[:, None]
        o_do = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, O_L))
        if SPLIT:
            # normalized partial out and natural-log lse per split; the merge kernel combines them
            b_o = acc * gl.convert_layout(b_inv, ROW_O)[:, None]
            p_po = po_ptr + ((i_t64 * NUM_SPLITS + i_s) * H + o_ho)[:, None] * D_LAT + o_do[None, :]
            gl.store(p_po, b_o, mask=m_ho)
            gl.store(plse_ptr + (i_t64 * NUM_SPLITS + i_s) * H + o_hs, b_lse, mask=m_hs)
        else:
            if HAS_SINK:
                b_inv = b_inv * _sink_factor(sink_ptr, o_hs, m_hs, b_lse)
            b_o = acc * gl.convert_layout(b_inv, ROW_O)[:, None]
            p_o = out_ptr + i_t64 * stride_ot + o_ho[:, None] * stride_oh + o_do[None, :]
            gl.store(p_o, b_o.to(out_ptr.dtype.element_ty), mask=m_ho)
            if INF_EMPTY:  # FlashMLA's lse for a row without a valid index
                b_lse = gl.where(b_lse == float("-inf"), float("inf"), b_lse)
            gl.store(lse_ptr + i_t64 * H + o_hs, b_lse, mask=m_hs)
