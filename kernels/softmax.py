"""Pieces of the online softmax that every attention kernel shares, so that faults stay visible
(DESIGN.md, Sparse MLA semantics): a NaN or inf in q or in a key or value a row attends to makes
that row's out and lse NaN, whatever the number of splits; only an lse of -inf means "no keys".

Elementwise code only: the Triton kernels call these as they are, the Gluon (sm_90) kernels
recompile them with `gluon.jit(fn.fn)`.

How a fault travels: `keep_faults` turns a non-finite score of an attended key into NaN (an
-inf score would otherwise drop its key without a trace, and +inf would only show through
inf - inf), so the row's running sum turns NaN and stays NaN through every rescale (NaN * alpha).
The finish (`finish_rows`) calls a row empty only when its sum is exactly 0, so a NaN sum gives
NaN for 1 / sum and for lse, and the merges (kernels/merge.py) keep a NaN part NaN. The running
max needs no care: on the GPU a max ignores NaN operands (maxnum), in the interpreter it
propagates them; either way the sum is NaN. A fault in a value whose key scored finite (separate
K and V) shows in the output accumulator instead; `row_faults` reads it from there.
`sink_factor` is the attention sink's share of a finished row (the decode kernels' finish and the
merges of split decodes and split prefills apply it).
"""
from __future__ import annotations

import triton
import triton.language as tl

_LN2 = tl.constexpr(0.6931471805599453)  # log2-domain lse -> natural log


@triton.jit
def keep_faults(s):
    """s where it is finite, NaN where it is +-inf or NaN: s * 0 + s (one fma). Applied to the
    scores before masking, so that keys a row does not attend to still end at -inf."""
    return tl.fma(s, 0.0, s)


@triton.jit
def row_faults(acc):
    """Per row of acc [BM, BD]: 0 where every element is finite, NaN otherwise (acc * 0 summed).
    Adding it to a row's 1 / sum and lse makes a row whose values held a NaN or inf NaN whole."""
    return tl.sum(acc * 0.0, 1)


@triton.jit
def finish_rows(b_l, b_m):
    """From the running sum and max (log2 domain): 1 / sum (0 for an empty row) and the
    natural-log lse (-inf for an empty row). Empty means a sum of exactly 0 (no key counted); a
    NaN sum (a fault) gives NaN for both."""
    b_empty = b_l == 0.0
    b_one = tl.where(b_empty, 1.0, b_l)
    b_inv = tl.where(b_empty, 0.0, 1.0 / b_one)
    b_lse = tl.where(b_empty, float("-inf"), (b_m + tl.log2(b_one)) * _LN2)
    return b_inv, b_lse


@triton.jit
def sink_factor(sink_ptr, o_h, m_h, b_lse):
    """exp(lse) / (exp(lse) + exp(sink)) per head; 0 for an empty row (lse = -inf), any sink;
    NaN for a NaN lse."""
    b_sink = tl.load(sink_ptr + o_h, mask=m_h, other=0.0)
    f = 1.0 / (1.0 + tl.exp(b_sink - tl.where(b_lse == float("-inf"), 0.0, b_lse)))
    return tl.where(b_lse == float("-inf"), 0.0, f)
