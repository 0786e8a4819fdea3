"""The split decode's merge and MLA's output projection in one launch.

    out[t, h] = round(merge_s(po[t, s, h], plse[t, s, h])) @ w[h]

A split sparse MLA decode leaves per-split partials (po normalized over each split's keys, plse
their natural-log denominators; kernels/sparse_mla_decode, run_plan without its merge); the merge
kernel folds them into the latent output [T, H, 512] and kernels.head_matmul projects that with
W_UV. At one or two tokens both launches are short and a layer's eager cost is its launches, so
mla.sparse.impl's decode-only steps run this kernel instead where `fuses` says it is also the
faster kernel: one launch and no latent round trip.

A program takes one token, one head and BLOCK_N output columns: it weighs the splits once from
their lse (every split of the row in one tile: at most MAX_PARTS of them), then merges the
latent (in one slice up to 32 splits, else in unrolled slices), rounds it to w's dtype (the
latent output's bf16 in the two-launch form) and multiplies it into the columns (bf16 x bf16
products summed in fp32, no tensor-core tile: a token is one row). Programs of the same head and
token re-merge the row for their columns, and each token reads w again: the partials' and the
weights' extra reads outgrow the saved launch beyond a few tokens and 64 heads.

Faults as in kernels.merge: an empty split (lse +-inf) is ignored whatever its partial holds; a
non-empty split whose lse is NaN, or a non-finite merged latent element, makes the row's output
NaN; a row whose splits are all empty projects a latent of zeros (out = 0).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from openmla.kernels.device import num_sms
from openmla.kernels.launch import BoundLaunch, FastLaunch, cdiv, next_pow2
from openmla.quant.validate import check_same_device, check_tensor, fail

__all__ = ["merge_project", "fuses", "MAX_PARTS", "MAX_TOKENS"]

MAX_PARTS = 256  # splits a row holds in one tile (the decode's split counts stay far below)
MAX_TOKENS = 2  # `fuses`: at most this many tokens (each token reads w once more)
_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def merge_project_kernel(po_ptr, plse_ptr, w_ptr, out_ptr, S, H, N,
                         stride_wh, stride_wk, stride_ot, stride_oh,
                         D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    i_t = tl.program_id(0).to(tl.int64)
    i_n = tl.program_id(1)
    i_h = tl.program_id(2).to(tl.int64)
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < S
    rows = (i_t * S + o_s) * H + i_h  # the row's partials: po[t, s, h], plse[t, s, h]
    lse = tl.load(plse_ptr + rows, mask=m_s, other=float("-inf"))
    empty = (lse == float("inf")) | (lse == float("-inf"))
    lse = tl.where(empty, float("-inf"), lse)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: no inf - inf below
    e = tl.exp(lse - m)  # 0 for an empty split, NaN for a NaN lse (then l and every weight)
    l = tl.sum(e, 0)
    wts = e * tl.where(l == 0.0, 0.0, 1.0 / l)

    o_k = tl.arange(0, BLOCK_K)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    p_rows = po_ptr + rows[:, None] * D
    w_cols = w_ptr + i_h * stride_wh + o_n[None, :]
    acc = tl.zeros([BLOCK_N], tl.float32)
    bad = tl.zeros([BLOCK_K], tl.float32)  # NaN once a merged element is not finite
    # unrolled: every slice's loads can be in flight at once (a loop waited for each slice's
    # reductions before the next slice's loads; the whole latent in one slice where it fits)
    for k0 in tl.static_range(0, D, BLOCK_K):
        m_k = (k0 + o_k) < D
        part = tl.load(p_rows + (k0 + o_k)[None, :], mask=m_s[:, None] & m_k[None, :], other=0.0)
        # (select, not multiply: an empty split's partial may hold anything)
        x = tl.sum(tl.where(empty[:, None], 0.0, wts[:, None] * part), 0)
        bad += x * 0.0
        x = x.to(w_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_cols + (k0 + o_k).to(tl.int64)[:, None] * stride_wk,
                    mask=m_k[:, None] & m_n[None, :], other=0.0)
        acc += tl.sum(x[:, None] * w.to(tl.float32), 0)
    acc += tl.sum(bad, 0)
    tl.store(out_ptr + i_t * stride_ot + i_h * stride_oh + o_n, acc.to(out_ptr.dtype.element_ty),
             mask=m_n)


_KERNEL = FastLaunch(merge_project_kernel)
_TILE = 16384  # elements of a program's partials slice and of its weights slice, each


def _plan(T, S, H, D, N, sms):
    """(grid, constexprs): all S splits in one tile; the latent in slices of up to _TILE / BLOCK_S
    elements (the whole 512 up to 32 splits); column blocks from 128 down to 16, narrowed while
    the weights slice exceeds _TILE elements or the grid holds fewer programs than half the SMs.
    Eight warps: 1.3x faster than four at one or two tokens and 16 heads (H200)."""
    block_s = max(2, next_pow2(S))
    block_k = min(next_pow2(D), max(16, _TILE // block_s))
    block_n = min(128, max(16, next_pow2(N)))
    while block_n > 16 and (block_k * block_n > _TILE or 2 * T * cdiv(N, block_n) * H < sms):
        block_n //= 2
    return (T, cdiv(N, block_n), H), dict(D=D, BLOCK_S=block_s, BLOCK_K=block_k, BLOCK_N=block_n,
                                          num_warps=8)


def fuses(T: int, H: int, S: int, D: int) -> bool:
    """Whether one merge_project launch beats the merge kernel plus head_matmul for a split
    decode of T tokens, H heads and S splits of a D-wide latent: at most two tokens and 64 heads,
    the whole latent in one slice (H200, kernel time: docs/notes/host_overhead.md)."""
    return T <= MAX_TOKENS and H <= 64 and max(2, next_pow2(S)) * next_pow2(D) <= _TILE


def _args(po, plse, w, out):
    """(grid, args, constexprs, FastLaunch key or None where a pointer is not 16-byte aligned)."""
    T, S, H, D = po.shape
    N = w.shape[2]
    grid, consts = _plan(T, S, H, D, N, num_sms(po.device))
    args = (po, plse, w, out, S, H, N, w.stride(0), w.stride(1), out.stride(0), out.stride(1))
    aligned = (po.data_ptr() | plse.data_ptr() | w.data_ptr() | out.data_ptr()) & 15 == 0
    # the sizes (D too: a constexpr no stride need tell), the strides and the dtypes fix every
    # specialization
    key = (T, D, w.dtype, out.dtype, *args[4:]) if aligned else None
    return grid, args, consts, key


def bind_merge_project(po, plse):
    """merge_project(po, plse, w, out=out) without its checks and with the partials fixed
    (mla.sparse.impl: a decode step's partial buffers, checked tensors' shapes): returns
    `run(w, out)`, which rebuilds its argument list only when w's or out's shapes or strides
    change and launches through a BoundLaunch with the partials as addresses."""
    last = [None, None, None]
    p_po, p_plse = po.data_ptr(), plse.data_ptr()  # (this closure holds the tensors)

    def run(w, out):
        sig = (w.shape, w.stride(), out.shape, out.stride(), w.dtype, out.dtype)
        if sig != last[0] or (w.data_ptr() | out.data_ptr()) & 15:
            grid, args, consts, key = _args(po, plse, w, out)
            if key is None:  # (not remembered: the next call builds its arguments again)
                last[0] = None
                _KERNEL(grid, *args, **consts)
                return
            last[:] = sig, BoundLaunch(_KERNEL, key, grid, **consts), args[4:]
        _, go, ints = last
        if not go.try_launch(p_po, p_plse, w, out, *ints):
            go(po, plse, w, out, *ints)
    return run


def merge_project(po: torch.Tensor, plse: torch.Tensor, w: torch.Tensor, *,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Merge per-split partial attention results and project them per head.

    Args:
        po: [T, S, H, D] fp32, contiguous: each split's output, normalized over its own keys.
        plse: [T, S, H] fp32, contiguous: their natural-log denominators; +inf or -inf marks an
            empty split (ignored, whatever its po holds). 1 <= S <= MAX_PARTS.
        w: [H, D, N] bf16 or fp16, last dim contiguous.
        out: optional [T, H, N] in w's dtype, last dim contiguous, to write into.

    Returns out: out[t, h] = x[t, h] @ w[h] with x[t, h] = sum_s exp(plse_s - lse) po_s (lse over
    the non-empty splits) rounded to w's dtype; fp32 sums, rounded once. x is 0 for a row whose
    splits are all empty; a NaN lse of a non-empty split or a non-finite x element makes the row
    NaN.
    """
    check_tensor("po", po, dtype=torch.float32, ndim=4, contiguous=True)
    T, S, H, D = po.shape
    check_tensor("plse", plse, dtype=torch.float32, shape=(T, S, H), contiguous=True)
    if not 1 <= S <= MAX_PARTS:
        raise NotImplementedError(f"merge_project: {S} splits (po.shape[1]); 1 to {MAX_PARTS} supported")
    check_tensor("w", w, ndim=3, last_dim_contiguous=True)
    if w.dtype not in _DTYPES:
        fail("w.dtype", "torch.bfloat16 or torch.float16", w.dtype)
    if tuple(w.shape[:2]) != (H, D):
        fail("w.shape", f"({H}, {D}, N) for po of shape {tuple(po.shape)}", tuple(w.shape))
    N = w.shape[2]
    if out is None:
        out = torch.empty((T, H, N), dtype=w.dtype, device=po.device)
    else:
        check_tensor("out", out, dtype=w.dtype, shape=(T, H, N), last_dim_contiguous=True)
    check_same_device(po=po, plse=plse, w=w, out=out)
    if T > 0 and H > 0 and N > 0:
        grid, args, consts, key = _args(po, plse, w, out)
        if key is not None:
            _KERNEL.keyed(key, grid, *args, **consts)
        else:
            _KERNEL(grid, *args, **consts)
    return out
