"""Layout-free pieces shared by the sparse decode kernels: the Triton kernel uses them as they are,
the Gluon (sm_90) kernels recompile them with `gluon.jit(fn.fn)` (elementwise and scalar code
only, so they mean the same in both languages). `finish_rows` and `keep_faults` are every
attention kernel's (kernels/softmax.py: how a NaN or inf reaches out and lse)."""
from __future__ import annotations

import triton
import triton.language as tl

from openmla.kernels.softmax import finish_rows, keep_faults, sink_factor  # noqa: F401 (the decode kernels' finish)


@triton.jit
def pow2_at_least(x):
    """Smallest power of two >= x for finite x > 0 (fp32, exact: built from the exponent bits)."""
    b = x.to(tl.int32, bitcast=True)
    e = (b >> 23) & 0xFF
    e = tl.where((b & 0x7FFFFF) != 0, e + 1, e)
    e = tl.minimum(tl.maximum(e, 1), 254)
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def head_f16_factor(b_amax):
    """Per head, the power of two f with |q| / f in (2^13, 2^14]: q / f is exact in fp16 (1 for
    an all-zero head)."""
    return tl.where(b_amax > 0, pow2_at_least(tl.maximum(b_amax, 1e-30)) * (1.0 / 16384.0), 1.0)


@triton.jit
def split_range(len_ptr, i_t, i_s, TOPK, CHUNK, n_splits, BLOCK_N: tl.constexpr, HAS_LEN: tl.constexpr):
    """[k_lo, k_hi): the indices split i_s of token i_t owns, cut at its topk_length. A row
    shorter than TOPK (the plan sized CHUNK for TOPK) is spread over all n_splits splits of its
    list (the grid's second dimension) in whole BLOCK_N blocks, so its splits stay busy instead of
    the first few alone (a DCP rank's rows hold ~TOPK / N entries)."""
    n_len = TOPK
    chunk = CHUNK
    if HAS_LEN:
        n_len = tl.minimum(tl.maximum(tl.load(len_ptr + i_t), 0), TOPK)
        per = (n_len + n_splits - 1) // n_splits
        chunk = tl.minimum(CHUNK, (per + BLOCK_N - 1) // BLOCK_N * BLOCK_N)
    k_lo = i_s * chunk
    return k_lo, tl.minimum(k_lo + chunk, n_len)


@triton.jit
def softmax_step(b_m, b_l, b_sc):
    """One block of log2-domain scores b_sc [BLOCK_H, BLOCK_N] (-inf where a key is not counted)
    folded into the running max b_m and sum b_l [BLOCK_H] (Triton kernels: it reduces over keys). Returns (m_new, alpha, p, l_new, grow):
    alpha rescales what was accumulated before, p = exp2(b_sc - m_new), grow is 1 when some row's
    max rose (the accumulators need rescaling), else 0."""
    m_new = tl.maximum(b_m, tl.max(b_sc, 1))
    # a row with no valid key so far keeps m = -inf; subtract 0 instead to avoid inf - inf
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(b_m - m_use)
    b_p = tl.exp2(b_sc - m_use[:, None])
    grow = tl.max(tl.where(m_new > b_m, 1, 0), 0)
    return m_new, alpha, b_p, b_l * alpha + tl.sum(b_p, 1), grow
