"""Per-head matmul, the two projections around MLA's latent attention: out[t, h] = x[t, h] @ w[h].

    q_lat = head_matmul(q_nope, W_UK, tail=q_pe)   # [T, H, 512 + 64]: the absorbed query
    o     = head_matmul(o_lat, W_UV)               # [T, H, 128]: the output projection

A decode step runs both once per layer with a handful of tokens, where they are bound by reading
the weights (H x 128 x 512 bf16: 2 MB at 16 heads, 16 MB at 128) and, eagerly, by the host: one
launch through `FastLaunch` with the plan's ints cached, where `torch.bmm` plus the rope's copy
cost two dispatches of the torch op path and cuBLAS's heuristics (mla/sparse/impl.py calls this).
`tail` writes the rope part of the absorbed query in the same launch (the programs of the first
column block copy it), so the query the sparse kernels read is one tensor without a second pass.

Arithmetic: bf16 products summed in fp32 (tl.dot), rounded once to out's dtype, as torch.bmm on
bf16 does; the summation order differs from cuBLAS's, so results agree to rounding, not bit for
bit. Any K and N (masked tails; the tensor-core tiles are at least 16 wide).

For the later layers of a decode step (mla.sparse.impl, unchecked: their tensors passed the ops'
checks in the step's first layer) the module also has `absorb_convert_kernel`, the absorption and
kernels.index's conversion of the step's top-k positions in one launch (the same tiles and the
same conversion, so the same bits as the two ops), and binders (`bind_absorb_convert`,
`bind_head_matmul`) that keep a launch's argument list between layers and launch through
kernels.launch.BoundLaunch.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from openmla.kernels.device import num_sms
from openmla.kernels.index import convert_row
from openmla.kernels.launch import BoundLaunch, FastLaunch, cdiv, next_pow2
from openmla.quant.validate import CheckedCalls, check_same_device, check_tensor, fail, tensor_signature

__all__ = ["head_matmul"]


@triton.jit
def head_matmul_kernel(x_ptr, w_ptr, tail_ptr, out_ptr, T, K, N, R,
                       stride_xt, stride_xh, stride_wh, stride_wk, stride_tt, stride_th,
                       stride_ot, stride_oh,
                       BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       HAS_TAIL: tl.constexpr, BLOCK_R: tl.constexpr):
    # token blocks vary fastest, so programs that read the same weight block run side by side
    _tile(tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64),
          x_ptr, w_ptr, tail_ptr, out_ptr, T, K, N, R, stride_xt, stride_xh, stride_wh, stride_wk,
          stride_tt, stride_th, stride_ot, stride_oh, BLOCK_T, BLOCK_N, BLOCK_K, HAS_TAIL, BLOCK_R)


@triton.jit
def absorb_convert_kernel(x_ptr, w_ptr, tail_ptr, out_ptr, T, K, N, R,
                          stride_xt, stride_xh, stride_wh, stride_wk, stride_tt, stride_th,
                          stride_ot, stride_oh, T_BLOCKS, N_BLOCKS, MM_PROGRAMS,
                          req_id_ptr, block_table_ptr, tok_ptr, slots_ptr, len_ptr,
                          KI, M, R_REQ, block_size, stride_bt, stride_tok, stride_slots,
                          BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          HAS_TAIL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_KI: tl.constexpr):
    """A decode layer's prologue in one launch: the first MM_PROGRAMS programs are head_matmul_kernel's
    grid (token block fastest, then column block, then head), the rest convert one token's
    per-request indices to slots each (kernels.index.convert_row, with the requests' lengths)."""
    pid = tl.program_id(0)
    if pid < MM_PROGRAMS:
        _tile(pid % T_BLOCKS, (pid // T_BLOCKS) % N_BLOCKS, (pid // (T_BLOCKS * N_BLOCKS)).to(tl.int64),
              x_ptr, w_ptr, tail_ptr, out_ptr, T, K, N, R, stride_xt, stride_xh, stride_wh, stride_wk,
              stride_tt, stride_th, stride_ot, stride_oh, BLOCK_T, BLOCK_N, BLOCK_K, HAS_TAIL, BLOCK_R)
    else:
        convert_row((pid - MM_PROGRAMS).to(tl.int64), req_id_ptr, block_table_ptr, tok_ptr, slots_ptr,
                    slots_ptr, slots_ptr, slots_ptr, len_ptr, KI, M, R_REQ, 0, block_size,
                    stride_bt, stride_tok, stride_slots, BLOCK_KI, False, False, True)


@triton.jit
def _tile(i_t, i_n, i_h, x_ptr, w_ptr, tail_ptr, out_ptr, T, K, N, R,
          stride_xt, stride_xh, stride_wh, stride_wk, stride_tt, stride_th, stride_ot, stride_oh,
          BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          HAS_TAIL: tl.constexpr, BLOCK_R: tl.constexpr):
    """out[t, h, n] for the BLOCK_T tokens of block i_t, the BLOCK_N columns of block i_n, head
    i_h (int64); with HAS_TAIL the programs of column block 0 also copy the tail."""
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    m_t = o_t < T
    m_n = o_n < N
    x_row = x_ptr + i_h * stride_xh + o_t.to(tl.int64)[:, None] * stride_xt
    w_blk = w_ptr + i_h * stride_wh + o_n[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        m_k = (k0 + o_k) < K
        x = tl.load(x_row + (k0 + o_k)[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        w = tl.load(w_blk + (k0 + o_k).to(tl.int64)[:, None] * stride_wk,
                    mask=m_k[:, None] & m_n[None, :], other=0.0)
        acc = tl.dot(x, w, acc)
    o_row = out_ptr + i_h * stride_oh + o_t.to(tl.int64)[:, None] * stride_ot
    tl.store(o_row + o_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=m_t[:, None] & m_n[None, :])
    if HAS_TAIL:
        if i_n == 0:  # out[t, h, N:N + R] = tail[t, h]
            o_r = tl.arange(0, BLOCK_R)
            m_r = m_t[:, None] & (o_r < R)[None, :]
            tail = tl.load(tail_ptr + i_h * stride_th + o_t.to(tl.int64)[:, None] * stride_tt + o_r[None, :],
                           mask=m_r, other=0.0)
            tl.store(o_row + N + o_r[None, :], tail, mask=m_r)


_KERNEL = FastLaunch(head_matmul_kernel)
_PLANS: dict = {}
_MAX_PLANS = 1024


def _plan(T, H, K, N, R, sms):
    """(grid, constexprs) for these sizes: token blocks of 16-64 rows; the widest column block
    that still gives about one program per SM (reading the weights is the work at few tokens);
    K in steps of 64 (32 for a short K)."""
    block_t = 16 if T <= 16 else (32 if T <= 32 else 64)
    t_blocks = cdiv(T, block_t)
    block_n = min(128, max(16, next_pow2(N)))
    while block_n > 32 and t_blocks * cdiv(N, block_n) * H < sms:
        block_n //= 2
    block_k = 64 if K > 32 else max(16, next_pow2(K))
    grid = (t_blocks, cdiv(N, block_n), H)
    consts = dict(BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k, HAS_TAIL=R > 0,
                  BLOCK_R=max(16, next_pow2(R)), num_warps=4, num_stages=3)
    return grid, consts


def _get_plan(x, w, tail):
    """(plan key, (grid, constexprs)) of head_matmul(x, w, tail=tail), cached per key."""
    T, H, K = x.shape
    N = w.shape[2]
    R = tail.shape[2] if tail is not None else 0
    key = (x.device, T, H, K, N, R)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = _plan(T, H, K, N, R, num_sms(x.device))
    return key, plan


def _head_matmul_args(x, w, tail, out):
    """(grid, args, constexprs, FastLaunch key or None where a pointer is not 16-byte aligned)."""
    key, (grid, consts) = _get_plan(x, w, tail)
    _, T, _, K, N, R = key
    t = tail if tail is not None else x
    sx, st, so = x.stride(), t.stride(), out.stride()
    args = (x, w, t, out, T, K, N, R, sx[0], sx[1], w.stride(0), w.stride(1), st[0], st[1], so[0], so[1])
    # the sizes, the strides and the (checked) dtypes fix every specialization
    aligned = (x.data_ptr() | w.data_ptr() | t.data_ptr() | out.data_ptr()) & 15 == 0
    return grid, args, consts, (key, x.dtype, out.dtype, *args[8:]) if aligned else None


def _launch(x, w, tail, out):
    grid, args, consts, lkey = _head_matmul_args(x, w, tail, out)
    if lkey is not None:
        _KERNEL.keyed(lkey, grid, *args, **consts)
    else:
        _KERNEL(grid, *args, **consts)


_PROLOGUE = FastLaunch(absorb_convert_kernel)


def _absorb_convert_args(x, w, tail, out, req_id, block_table, token_indices, block_size, seq_lens,
                         slots):
    """absorb_convert_kernel's (grid, args, constexprs, FastLaunch key or None where a pointer is
    not 16-byte aligned) for what head_matmul(x, w, tail=tail, out=out) and kernels.index.
    convert_req_index_to_global(req_id, block_table, token_indices, block_size, seq_lens=seq_lens,
    out=slots) do, with the same results bit for bit (the same tile code and block sizes; the same
    conversion). req_id contiguous, T >= 1 tokens."""
    key, ((t_blocks, n_blocks, H), consts) = _get_plan(x, w, tail)
    _, T, _, K, N, R = key
    mm = t_blocks * n_blocks * H
    KI = token_indices.shape[1]
    sx, st, so = x.stride(), tail.stride(), out.stride()
    args = (x, w, tail, out, T, K, N, R, sx[0], sx[1], w.stride(0), w.stride(1), st[0], st[1], so[0],
            so[1], t_blocks, n_blocks, mm, req_id, block_table, token_indices, slots, seq_lens,
            KI, block_table.shape[1], block_table.shape[0], block_size, block_table.stride(0),
            token_indices.stride(0), slots.stride(0))
    block_ki = min(1024, next_pow2(max(KI, 16)))
    aligned = (x.data_ptr() | w.data_ptr() | tail.data_ptr() | out.data_ptr() | req_id.data_ptr()
               | block_table.data_ptr() | token_indices.data_ptr() | slots.data_ptr()
               | seq_lens.data_ptr()) & 15 == 0
    # the sizes, the strides and the (checked) dtypes fix every specialization
    lkey = (key, x.dtype, out.dtype, *args[8:19], *args[24:]) if aligned else None
    return (mm + token_indices.shape[0],), args, dict(consts, BLOCK_KI=block_ki), lkey


def bind_absorb_convert(out, req_id, block_table, slots, seq_lens, block_size):
    """absorb_convert_kernel (_absorb_convert_args) with `out` and the step's index tensors fixed,
    for a caller whose tensors passed head_matmul's and the index conversion's checks before
    (mla.sparse.impl: a decode step's query buffer, request ids, block table, slots and lengths;
    the layers after the step's first): returns `run(x, w, tail, token_indices)`. It rebuilds the
    argument list only when the four tensors' shapes or strides differ from the last call's, and
    launches through a BoundLaunch; a misaligned pointer takes FastLaunch's own key."""
    last = [None, None, None]  # shapes and strides, the BoundLaunch, the ints around the tensors
    # the fixed tensors' addresses, for the compiled launcher (BoundLaunch.try_launch; this closure
    # holds the tensors)
    p_out, p_req, p_table, p_slots, p_lens = (t.data_ptr() for t in (out, req_id, block_table, slots,
                                                                      seq_lens))

    def run(x, w, tail, token_indices):
        sig = (x.shape, x.stride(), w.shape, w.stride(), tail.shape, tail.stride(),
               token_indices.shape, token_indices.stride())
        if sig != last[0] or (x.data_ptr() | w.data_ptr() | tail.data_ptr()
                              | token_indices.data_ptr()) & 15:
            grid, args, consts, lkey = _absorb_convert_args(x, w, tail, out, req_id, block_table,
                                                            token_indices, block_size, seq_lens, slots)
            if lkey is None:  # (not remembered: the next call builds its arguments again)
                last[0] = None
                _PROLOGUE(grid, *args, **consts)
                return
            last[:] = sig, BoundLaunch(_PROLOGUE, lkey, grid, **consts), (args[4:19], args[24:])
        _, go, (mid, end) = last
        if not go.try_launch(x, w, tail, p_out, *mid, p_req, p_table, token_indices, p_slots, p_lens,
                             *end):
            go(x, w, tail, out, *mid, req_id, block_table, token_indices, slots, seq_lens, *end)
    return run


def bind_head_matmul(x):
    """head_matmul(x, w, out=out) without its checks and with x fixed (mla.sparse.impl: a decode
    step's latent output buffer): returns `run(w, out)`, built as bind_absorb_convert's."""
    last = [None, None, None]
    p_x = x.data_ptr()  # for the compiled launcher, as in bind_absorb_convert

    def run(w, out):
        sig = (w.shape, w.stride(), out.shape, out.stride())
        if sig != last[0] or (w.data_ptr() | out.data_ptr()) & 15:
            grid, args, consts, lkey = _head_matmul_args(x, w, None, out)
            if lkey is None:
                last[0] = None
                _KERNEL(grid, *args, **consts)
                return
            last[:] = sig, BoundLaunch(_KERNEL, lkey, grid, **consts), args[4:]
        _, go, ints = last
        if not go.try_launch(p_x, w, p_x, out, *ints):
            go(x, w, x, out, *ints)
    return run


# call signatures that passed head_matmul's checks
_CHECKED = CheckedCalls()
_DTYPES = (torch.bfloat16, torch.float16)


def head_matmul(x: torch.Tensor, w: torch.Tensor, *, tail: Optional[torch.Tensor] = None,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out[t, h, :N] = x[t, h] @ w[h] (and out[t, h, N:] = tail[t, h] when tail is given).

    Args:
        x: [T, H, K] bf16 or fp16, last dim contiguous (other strides free).
        w: [H, K, N] in x's dtype, last dim contiguous.
        tail: optional [T, H, R] in x's dtype, last dim contiguous: copied after the product.
        out: optional [T, H, N + R] in x's dtype, last dim contiguous, to write into.

    Returns out: fp32 sums of the products, rounded once to x's dtype (torch.bmm's arithmetic).
    """
    try:
        sig = (tensor_signature(x), tensor_signature(w), tensor_signature(tail), tensor_signature(out))
        checked = sig in _CHECKED
    except (AttributeError, TypeError):
        sig, checked = None, False
    if not checked:
        check_tensor("x", x, ndim=3, last_dim_contiguous=True)
        if x.dtype not in _DTYPES:
            fail("x.dtype", "torch.bfloat16 or torch.float16", x.dtype)
        T, H, K = x.shape
        check_tensor("w", w, dtype=x.dtype, ndim=3, last_dim_contiguous=True)
        if tuple(w.shape[:2]) != (H, K):
            fail("w.shape", f"({H}, {K}, N) for x of shape {tuple(x.shape)}", tuple(w.shape))
        R = 0
        if tail is not None:
            check_tensor("tail", tail, dtype=x.dtype, ndim=3, last_dim_contiguous=True)
            if tuple(tail.shape[:2]) != (T, H):
                fail("tail.shape", f"({T}, {H}, R)", tuple(tail.shape))
            R = tail.shape[2]
        if out is not None:
            check_tensor("out", out, dtype=x.dtype, shape=(T, H, w.shape[2] + R), last_dim_contiguous=True)
        check_same_device(x=x, w=w, tail=tail, out=out)
        if sig is not None:
            _CHECKED.remember(sig)
    if out is None:
        R = tail.shape[2] if tail is not None else 0
        out = torch.empty((x.shape[0], x.shape[1], w.shape[2] + R), dtype=x.dtype, device=x.device)
    if x.shape[0] > 0 and x.shape[1] > 0:
        _launch(x, w, tail, out)
    return out
