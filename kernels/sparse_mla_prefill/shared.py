"""Layout-free finish shared by the sparse prefill kernels: the Triton kernel uses it as it is, the
Gluon (sm_90) kernels recompile it with `gluon.jit(fn.fn)` (elementwise code only, so it means the
same in both languages)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def finish_rows(l_i, m_i, scale, sink_ptr, o_h, m_h, HAS_SINK: tl.constexpr):
    """From the running sum and the running max of the raw q.k: the factor of the output rows
    (1 / sum, times the sink's share; 0 for an empty row) and the natural-log lse (-inf for an
    empty row)."""
    has = l_i > 0
    lse = tl.where(has, m_i * scale + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    if HAS_SINK:
        # out *= exp(lse) / (exp(lse) + exp(sink)), written so that neither exp overflows
        b_sink = tl.load(sink_ptr + o_h, mask=m_h, other=float("-inf"))
        inv = inv / (1.0 + tl.exp(b_sink - tl.where(has, lse, 0.0)))
    return inv, lse
