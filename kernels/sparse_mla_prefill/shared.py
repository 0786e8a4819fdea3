"""Layout-free code shared by the sparse prefill kernels (a split grid's program and piece, the rows'
finish): the Triton kernel uses it as it is, the Gluon (sm_90) kernels recompile it with
`gluon.jit(fn.fn)` (scalar and elementwise code only, so it means the same in both languages). How a
NaN or inf reaches out, lse and max_logits: kernels/softmax.py (`keep_faults` is every attention
kernel's)."""
from __future__ import annotations

import triton
import triton.language as tl

from openmla.kernels.softmax import keep_faults  # noqa: F401 (the prefill kernels' score check)


@triton.jit
def finish_rows(l_i, m_i, scale, sink_ptr, o_h, m_h, HAS_SINK: tl.constexpr):
    """From the running sum and the running max of the raw q.k: the factor of the output rows
    (1 / sum, times the sink's share; 0 for an empty row) and the natural-log lse (-inf for an
    empty row). Empty means a sum of exactly 0; a NaN sum (a fault) gives NaN for both."""
    empty = l_i == 0.0
    one = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), m_i * scale + tl.log(one))
    inv = tl.where(empty, 0.0, 1.0 / one)
    if HAS_SINK:
        # out *= exp(lse) / (exp(lse) + exp(sink)), written so that neither exp overflows
        b_sink = tl.load(sink_ptr + o_h, mask=m_h, other=float("-inf"))
        inv = inv / (1.0 + tl.exp(b_sink - tl.where(empty, 0.0, lse)))
    return inv, lse


@triton.jit
def max_logits(m_x, lse, scale):
    """max_logits of a row from its max raw q.k: scale * m_x, NaN where lse is NaN (a fault: on
    the GPU the running max skips NaN scores, so m_x alone would look clean)."""
    return tl.where(lse != lse, lse, m_x * scale)


@triton.jit
def split_program(i_p, p_main, splits, NUM_HB):
    """Program i_p of a grid whose programs from p_main on are pieces of the programs p_main.., each
    split into `splits` pieces in a row (tail.py): (token (int64), head block, i_w), i_w the piece's
    workspace row, < 0 for a whole program."""
    i_w = i_p - p_main
    i_q = i_p
    if i_w >= 0:
        i_q = p_main + i_w // splits
    return (i_q // NUM_HB).to(tl.int64), i_q % NUM_HB, i_w


@triton.jit
def piece_range(p_idx, n_use, i_w, splits, UNIT: tl.constexpr):
    """The part of a token's list (its first n_use indices at p_idx) that piece i_w walks: units
    [j n / splits, (j + 1) n / splits) of UNIT keys, n = cdiv(n_use, UNIT), j = i_w % splits, as
    (p_idx, n_use) moved there (n_use 0 for an empty piece); a whole program's (i_w < 0) unchanged."""
    if i_w >= 0:
        n_unit = (n_use + UNIT - 1) // UNIT
        j = i_w % splits
        lo = j * n_unit // splits
        hi = (j + 1) * n_unit // splits
        p_idx += lo * UNIT
        n_use = tl.maximum(tl.minimum(n_use - lo * UNIT, (hi - lo) * UNIT), 0)
    return p_idx, n_use
