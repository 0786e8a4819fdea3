"""Merging partial attention results computed over disjoint key sets (cascade, split-KV).

Each part holds an output normalized over its own keys and the natural-log denominator `lse`:

    lse = log(exp(a_lse) + exp(b_lse))
    out = exp(a_lse - lse) * a_out + exp(b_lse - lse) * b_out

An lse of +inf or -inf marks an empty part (FlashAttention reports +inf for an empty split): it
is ignored whatever its out holds, NaN included. Both parts empty gives out = 0, lse = -inf.
Faults stay visible (DESIGN.md): a non-empty part whose lse is NaN, or whose out holds a NaN or
inf, makes the merged row NaN, out and lse.

`merge_parts` is the one place this maths lives in Triton: `merge_attn_states_kernel` folds two
parts with it (`merge_step`, one part at a time) and the split-KV reductions of
`kernels.paged_attention`, `kernels.sparse_mla_decode` and the prefill's split last round fold any
number of parts, a chunk of them at a time (the last two through `fold_parts`).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from openmla.kernels.softmax import row_faults
from openmla.quant.validate import check_same_device, check_tensor

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


# fp32 partial elements a reduction program loads per step (64 registers a thread at 4 warps).
PARTS_TILE = 8192


def parts_tile(T: int, H: int, D: int, parts: int, num_sms: int):
    """(BLOCK_S, BLOCK_H, BLOCK_D) of a reduction of `parts` partials [T, H, D] with grid
    (T, cdiv(H, BLOCK_H)): whole head rows, as many heads a program as PARTS_TILE holds while
    the grid still fills the SMs, fewer where it would not (few tokens: a batch-1 decode runs one
    head a program); then as many parts a step as the rest of PARTS_TILE holds (a decode's 4-64
    parts in one or two steps)."""
    block_d = triton.next_power_of_2(D)
    block_h = min(triton.next_power_of_2(H), max(1, PARTS_TILE // block_d))
    while block_h > 1 and T * triton.cdiv(H, block_h) < num_sms:
        block_h //= 2
    block_s = min(triton.next_power_of_2(max(parts, 1)), max(1, PARTS_TILE // (block_h * block_d)))
    return block_s, block_h, block_d


@triton.jit
def merge_parts(acc, m_i, l_i, b_out, b_lse):
    """Fold S parts at once into a running merge state; all of it fp32, natural log.

    acc [BH, BD]: sum of exp(lse_p - m_i) * out_p over the parts so far; m_i [BH]: their largest
    lse (-inf while all were empty); l_i [BH]: sum of exp(lse_p - m_i). b_out [S, BH, BD], b_lse
    [S, BH]: the new parts (a part padded in with lse -inf is empty). Returns the new (acc, m_i,
    l_i). A NaN lse is not empty: its weight is NaN, so l_i turns NaN and stays NaN (merge_finish
    reports it). S parts at once let a reduction issue all their loads before it needs any.
    """
    m_empty = (b_lse == float("inf")) | (b_lse == float("-inf"))
    b_lse = tl.where(m_empty, float("-inf"), b_lse)
    m_new = tl.maximum(m_i, tl.max(b_lse, 0))
    # While every part so far is empty the max is -inf; shift by 0 so no inf - inf appears.
    m_sh = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_sh)
    w = tl.exp(b_lse - m_sh[None, :])
    # An empty part's out may hold anything: select instead of multiplying by a zero weight.
    b_add = tl.sum(tl.where(m_empty[:, :, None], 0.0, w[:, :, None] * b_out), 0)
    return acc * alpha[:, None] + b_add, m_new, l_i * alpha + tl.sum(w, 0)


@triton.jit
def fold_parts(po_ptr, plse_ptr, row0, n_parts, row_len, o_h, m_h, BLOCK_S: tl.constexpr,
               BLOCK_H: tl.constexpr, DV: tl.constexpr):
    """The merge state (acc, m_i, l_i) of n_parts normalized partials: part p's lse of head h at
    plse_ptr + (row0 + p) * row_len + h, its fp32 out row at DV times that offset of po_ptr;
    heads o_h [BLOCK_H] where m_h, BLOCK_S parts a step (their loads issued together)."""
    o_d = tl.arange(0, DV)
    o_s = tl.arange(0, BLOCK_S)
    acc = tl.zeros([BLOCK_H, DV], tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    for s0 in range(0, n_parts, BLOCK_S):
        m_sh = ((o_s + s0) < n_parts)[:, None] & m_h[None, :]
        o_row = (row0 + (o_s + s0))[:, None] * row_len + o_h[None, :]  # [BLOCK_S, BLOCK_H]
        b_lse = tl.load(plse_ptr + o_row, mask=m_sh, other=float("-inf"))
        b_out = tl.load(po_ptr + o_row[:, :, None] * DV + o_d[None, None, :], mask=m_sh[:, :, None],
                        other=0.0)
        acc, m_i, l_i = merge_parts(acc, m_i, l_i, b_out, b_lse)
    return acc, m_i, l_i


@triton.jit
def merge_step(acc, m_i, l_i, b_out, b_lse):
    """`merge_parts` with one part: b_out [BH, BD], b_lse [BH]."""
    return merge_parts(acc, m_i, l_i, b_out[None, :, :], b_lse[None, :])


@triton.jit
def merge_finish(acc, m_i, l_i):
    """(out [BH, BD], lse [BH]) of a merge state; out = 0, lse = -inf when every part was empty
    (l_i exactly 0). A NaN l_i (a part with a NaN lse) or a non-finite element of acc (a part
    whose out held a NaN or inf) gives NaN for the whole row, out and lse."""
    empty = l_i == 0.0
    one = tl.where(empty, 1.0, l_i)
    bad = row_faults(acc)
    inv = tl.where(empty, 0.0, 1.0 / one) + bad
    lse = tl.where(empty, float("-inf"), m_i + tl.log(one)) + bad
    return acc * inv[:, None], lse


@triton.jit
def merge_attn_states_kernel(
    out_ptr, lse_out_ptr, a_ptr, a_lse_ptr, b_ptr, b_lse_ptr,
    H, D,
    s_ot, s_oh, s_lot, s_loh, s_at, s_ah, s_alt, s_alh, s_bt, s_bh, s_blt, s_blh,
    HAS_LSE_OUT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_D)
    m_h = o_h < H
    m_hd = m_h[:, None] & (o_d < D)[None, :]

    b_a = tl.load(a_ptr + i_t * s_at + o_h[:, None] * s_ah + o_d[None, :], mask=m_hd, other=0.0)
    b_al = tl.load(a_lse_ptr + i_t * s_alt + o_h * s_alh, mask=m_h, other=float("-inf"))
    b_b = tl.load(b_ptr + i_t * s_bt + o_h[:, None] * s_bh + o_d[None, :], mask=m_hd, other=0.0)
    b_bl = tl.load(b_lse_ptr + i_t * s_blt + o_h * s_blh, mask=m_h, other=float("-inf"))

    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc, m_i, l_i = merge_step(acc, m_i, l_i, b_a.to(tl.float32), b_al.to(tl.float32))
    acc, m_i, l_i = merge_step(acc, m_i, l_i, b_b.to(tl.float32), b_bl.to(tl.float32))
    b_o, b_lse = merge_finish(acc, m_i, l_i)

    tl.store(out_ptr + i_t * s_ot + o_h[:, None] * s_oh + o_d[None, :],
             b_o.to(out_ptr.dtype.element_ty), mask=m_hd)
    if HAS_LSE_OUT:
        tl.store(lse_out_ptr + i_t * s_lot + o_h * s_loh, b_lse, mask=m_h)


def _launch(out, a_out, a_lse, b_out, b_lse, out_lse):
    T, H, D = out.shape
    if T == 0 or H == 0 or D == 0:
        return
    block_d = triton.next_power_of_2(D)
    # About 2048 elements per program (16 fp32 values per thread): whole head rows, several
    # heads when D is small.
    block_h = min(triton.next_power_of_2(H), max(1, 2048 // block_d))
    lse_out = out_lse if out_lse is not None else a_lse  # never written when HAS_LSE_OUT is off
    grid = (T, triton.cdiv(H, block_h))
    merge_attn_states_kernel[grid](
        out, lse_out, a_out, a_lse, b_out, b_lse, H, D,
        out.stride(0), out.stride(1), lse_out.stride(0), lse_out.stride(1),
        a_out.stride(0), a_out.stride(1), a_lse.stride(0), a_lse.stride(1),
        b_out.stride(0), b_out.stride(1), b_lse.stride(0), b_lse.stride(1),
        HAS_LSE_OUT=out_lse is not None, BLOCK_H=block_h, BLOCK_D=block_d,
    )


@torch.library.custom_op("openmla::merge_attn_states", mutates_args=("out", "out_lse"))
def _merge_attn_states_op(out: torch.Tensor, a_out: torch.Tensor, a_lse: torch.Tensor,
                          b_out: torch.Tensor, b_lse: torch.Tensor,
                          out_lse: Optional[torch.Tensor]) -> None:
    _launch(out, a_out, a_lse, b_out, b_lse, out_lse)


@_merge_attn_states_op.register_fake
def _(out, a_out, a_lse, b_out, b_lse, out_lse):
    return None


def merge_attn_states(out: torch.Tensor, a_out: torch.Tensor, a_lse: torch.Tensor,
                      b_out: torch.Tensor, b_lse: torch.Tensor,
                      out_lse: Optional[torch.Tensor] = None) -> None:
    """Merge two partial attention results over disjoint key sets, in place into `out`.

    Args:
        out: [T, H, D] bf16/fp16/fp32, written; last dim contiguous, any token/head strides.
        a_out, b_out: [T, H, D] bf16/fp16/fp32, each normalized over its own keys; last dim
            contiguous.
        a_lse, b_lse: [T, H] fp32 natural-log denominators of a and b, any strides (a transposed
            view of vLLM's [H, T] lse works). +inf or -inf marks an empty part: it is ignored,
            whatever its out holds (NaN included).
        out_lse: [T, H] fp32 or None; when given, receives log(exp(a_lse) + exp(b_lse)).

    Both parts empty gives out = 0 and lse = -inf, never NaN. A non-empty part with a NaN lse or
    a NaN or inf in its out makes the row's out and lse NaN (faults stay visible). The maths runs
    in fp32; out is rounded once to its dtype. `out` may be one of the inputs (each element is read before it
    is written, by the same program).
    """
    check_tensor("out", out, dtype=_FLOATS, ndim=3, last_dim_contiguous=True)
    shape3, shape2 = tuple(out.shape), tuple(out.shape[:2])
    check_tensor("a_out", a_out, dtype=_FLOATS, shape=shape3, last_dim_contiguous=True)
    check_tensor("b_out", b_out, dtype=_FLOATS, shape=shape3, last_dim_contiguous=True)
    check_tensor("a_lse", a_lse, dtype=torch.float32, shape=shape2)
    check_tensor("b_lse", b_lse, dtype=torch.float32, shape=shape2)
    if out_lse is not None:
        check_tensor("out_lse", out_lse, dtype=torch.float32, shape=shape2)
    check_same_device(out=out, a_out=a_out, a_lse=a_lse, b_out=b_out, b_lse=b_lse, out_lse=out_lse)
    _merge_attn_states_op(out, a_out, a_lse, b_out, b_lse, out_lse)
