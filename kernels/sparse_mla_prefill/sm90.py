"""Hopper (sm_90) kernel of sparse_mla_prefill for 64-head blocks, written in Gluon.

Same maths and arguments as `sparse_mla_prefill_kernel` (kernels/sparse_mla_prefill/op.py); a
program owns one query token and 64 heads, 8 warps = two warpgroups. It exists because Triton
3.6 lays the 64-head tile out badly and cannot be told otherwise:
- Triton gives a dot whose result feeds another dot (S -> P -> P.V) the warps [8, 1], so with
  64 heads (one wgmma M tile) both warpgroups would compute the whole score tile: the q.k work,
  53 % of the FLOPs, twice. Here S is laid out [4, 2]: each warpgroup scores half of the rows
  (m64n32 at 64 rows), the row max / sum cross the warpgroups through shared memory, and
  P is exchanged once for the value wgmma (each warpgroup owns 256 of the 512 output columns).
- Triton's pipeliner issues the gather of the next rows after the value dot and waits for it
  at the next step's top, which exposes the gather latency. Here the copy of block i+1 is issued
  at the top of step i (two 72 KB row buffers, cp.async, zero-fill for masked rows) and the
  next block's indices are loaded a step ahead, so a whole step hides the gather.
Shared memory: q 72 KB + 2 x 72 KB rows + P exchange ~ 220 KB (one program per SM). DeepSeek-V4's
512-wide rows (d_qk 512, the value the whole row: D_ROPE = 0) take the same kernel without the rope
buffers and its score wgmma: 64 + 2 x 64 KB.

Timings: docs/benchmarks.md; against the Triton kernel: docs/notes/sparse_mla_prefill.md.

Gluon runs on the GPU only (not in Triton's interpreter); `usable` says when to use it. The
CPU suite compiles it for sm_90a (tests/kernels/test_sparse_mla_prefill.py); the GPU suite checks it
against the oracle like every other path.
"""
from __future__ import annotations

import torch
import triton

from openmla.kernels.device import sm90_gluon

try:  # Gluon ships with Triton >= 3.5; without it the Triton kernel serves every GPU
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from openmla.kernels.sparse_mla_prefill.shared import finish_rows, keep_faults, max_logits
    _finish_rows = gluon.jit(finish_rows.fn)
    _keep_faults = gluon.jit(keep_faults.fn)
    _max_logits = gluon.jit(max_logits.fn)
    _GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    _GLUON = False

BLOCK_H = 64
BLOCK_N = 64  # rows per step: 32 would halve each warpgroup's score tile (m64n16) and was slower
NUM_WARPS = 8


def usable(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether this kernel serves these inputs: Gluon kernels may run on their device
    (`sm90_gluon`), and kv rows start on 16 bytes (the row copies are 16-byte cp.async; other
    strides or offsets take the Triton kernel)."""
    return sm90_gluon(q.device) and kv.data_ptr() % 16 == 0 and kv.stride(0) % 8 == 0


if _GLUON:

    @gluon.jit
    def _copy_rows(kv_ptr, b_idx, N, stride_kv, s_lat, s_rope, GATHER: gl.constexpr,
                   D_LAT: gl.constexpr, D_ROPE: gl.constexpr, OFF32: gl.constexpr):
        """Start the asynchronous gather of one block of rows into a row buffer (one commit
        group). A row whose index is invalid is never read: its copy is masked (zero-filled)."""
        m_n = (b_idx >= 0) & (b_idx < N)
        if OFF32:
            p_kv = kv_ptr + b_idx * stride_kv
        else:
            p_kv = kv_ptr + b_idx.to(gl.int64) * stride_kv
        # launch() only runs 16-byte aligned rows here, so every copy moves 16 bytes
        copy_rows_at(gl.multiple_of(p_kv, 16), m_n, s_lat, s_rope, GATHER, D_LAT, D_ROPE)

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

    @gluon.jit
    def sparse_mla_prefill_sm90_kernel(
        q_ptr, kv_ptr, idx_ptr, len_ptr, sink_ptr, out_ptr, ml_ptr, lse_ptr,
        H, N, TOPK, NUM_HB,
        stride_qt, stride_qh, stride_kv, stride_it, stride_ot, stride_oh,
        scale, scale_log2,
        HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr, OFF32: gl.constexpr,
        D_LAT: gl.constexpr, D_ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
    ):
        # scores [heads, rows]: each warpgroup half of the rows; output [heads, 512]: each
        # warpgroup half of the columns; P enters the value wgmma from registers
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
        i_t = (i_p // NUM_HB).to(gl.int64)
        i_hb = i_p % NUM_HB

        o_hg = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_G)
        p_q = q_ptr + i_t * stride_qt + o_hg[:, None] * stride_qh
        o_lg = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, G_L))
        b_ql = gl.load(p_q + o_lg[None, :], mask=(o_hg < H)[:, None], other=0.0)
        s_ql = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_LAT], SH, b_ql)
        s_kl = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, D_LAT], SH)
        s_kr = s_kl  # no rope buffers for 512-wide rows (D_ROPE = 0): never read
        if D_ROPE > 0:
            o_rg = D_LAT + gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, G_L))
            b_qr = gl.load(p_q + o_rg[None, :], mask=(o_hg < H)[:, None], other=0.0)
            s_qr = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_ROPE], SH, b_qr)
            s_kr = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, D_ROPE], SH)

        n_use = TOPK
        if HAS_LEN:
            n_use = gl.minimum(gl.maximum(gl.load(len_ptr + i_t), 0), TOPK)
        n_blk = gl.cdiv(n_use, BLOCK_N)

        p_idx = idx_ptr + i_t * stride_it
        o_ng = gl.arange(0, BLOCK_N, layout=ROW_G)
        o_ns = gl.arange(0, BLOCK_N, layout=COL_S)
        b_idx = gl.load(p_idx + o_ng, mask=o_ng < n_use, other=-1)
        _copy_rows(kv_ptr, b_idx, N, stride_kv, s_kl.index(0), s_kr.index(0), G_L, D_LAT, D_ROPE, OFF32)
        b_nx = gl.load(p_idx + BLOCK_N + o_ng, mask=BLOCK_N + o_ng < n_use, other=-1)

        # m_i is the running max of the raw q.k (scale > 0), so max_logits = scale * m_i exactly
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, ROW_S)
        l_i = gl.zeros([BLOCK_H], gl.float32, ROW_S)
        acc = gl.zeros([BLOCK_H, D_LAT], gl.float32, O_L)
        for i in range(n_blk):
            buf = i % 2
            # every warp has finished the value wgmma of block i-1, which read the buffer that
            # block i+1 is gathered into now (past the end: all indices -1, nothing is read)
            gl.thread_barrier()
            _copy_rows(kv_ptr, b_nx, N, stride_kv, s_kl.index(1 - buf), s_kr.index(1 - buf), G_L,
                       D_LAT, D_ROPE, OFF32)
            o_nx = (i + 2) * BLOCK_N + o_ng
            b_nx = gl.load(p_idx + o_nx, mask=o_nx < n_use, other=-1)
            o_n = i * BLOCK_N + o_ns
            b_col = gl.load(p_idx + o_n, mask=o_n < n_use, other=-1)
            m_n = (b_col >= 0) & (b_col < N)

            # block i's rows have landed (all but the newest copy group), for every thread, and
            # are visible to the tensor cores' (async proxy) reads
            cp.wait_group(1)
            hopper.fence_async_shared()
            gl.thread_barrier()
            s_lat = s_kl.index(buf)
            s_rope = s_kr.index(buf)
            b_s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_L)
            if D_ROPE > 0:
                t_s = hopper.warpgroup_mma(s_qr, s_rope.permute((1, 0)), b_s, use_acc=False, is_async=True)
                t_s = hopper.warpgroup_mma(s_ql, s_lat.permute((1, 0)), t_s, is_async=True)
            else:
                t_s = hopper.warpgroup_mma(s_ql, s_lat.permute((1, 0)), b_s, use_acc=False, is_async=True)
            b_s = hopper.warpgroup_mma_wait(0, deps=[t_s])
            # a NaN or inf score of a valid row turns NaN (kernels/softmax.py): the query ends NaN
            b_s = gl.where(m_n[None, :], _keep_faults(b_s), float("-inf"))

            m_new = gl.maximum(m_i, gl.max(b_s, 1))
            # a head with nothing valid yet keeps max -inf; shift by 0 there so no inf - inf appears
            m_sh = gl.where(m_new == float("-inf"), 0.0, m_new * scale_log2)
            b_p = gl.exp2(b_s * scale_log2 - m_sh[:, None])
            alpha = gl.exp2(m_i * scale_log2 - m_sh)
            l_i = l_i * alpha + gl.sum(b_p, 1)
            m_i = m_new
            b_pv = gl.convert_layout(b_p.to(gl.bfloat16), P_L)
            acc = acc * gl.convert_layout(alpha, ROW_O)[:, None]
            t_o = hopper.warpgroup_mma(b_pv, s_lat, acc, is_async=True)
            acc = hopper.warpgroup_mma_wait(0, deps=[t_o])
        cp.wait_group(0)

        o_hs = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_S)
        inv, lse = _finish_rows(l_i, m_i, scale, sink_ptr, o_hs, o_hs < H, HAS_SINK)
        o_ho = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_O)
        o_do = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, O_L))
        b_o = acc * gl.convert_layout(inv, ROW_O)[:, None]
        p_o = out_ptr + i_t * stride_ot + o_ho[:, None] * stride_oh + o_do[None, :]
        gl.store(p_o, b_o.to(out_ptr.dtype.element_ty), mask=(o_ho < H)[:, None])
        gl.store(ml_ptr + i_t * H + o_hs, _max_logits(m_i, lse, scale), mask=o_hs < H)
        gl.store(lse_ptr + i_t * H + o_hs, lse, mask=o_hs < H)


def launch(q, kv, indices, topk_length, attn_sink, out, max_logits, lse, scale, log2e,
           d_lat, d_rope, kernel=None, block_h=BLOCK_H, **config):
    """Run the kernel (or `kernel`, a Gluon prefill kernel with the same arguments: the keys-on-M
    one passes itself, its head block and its `config`) on validated inputs into the given
    outputs (T >= 1, H >= 1)."""
    T, H, _ = q.shape
    N, topk = kv.shape[0], indices.shape[1]
    num_hb = triton.cdiv(H, block_h)
    if kernel is None:
        kernel, config = sparse_mla_prefill_sm90_kernel, dict(BLOCK_N=BLOCK_N, num_warps=NUM_WARPS)
    kernel[(T * num_hb,)](
        q, kv, indices,
        topk_length if topk_length is not None else indices,
        attn_sink if attn_sink is not None else lse,
        out, max_logits, lse,
        H, N, topk, num_hb,
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), out.stride(0), out.stride(1),
        scale, scale * log2e,
        HAS_LEN=topk_length is not None, HAS_SINK=attn_sink is not None,
        OFF32=(N - 1) * kv.stride(0) + d_lat + d_rope < 2 ** 31,
        D_LAT=d_lat, D_ROPE=d_rope, BLOCK_H=block_h, **config,
    )
