"""topk_per_row / decode_topk: the k best columns of each indexer logits row, in Triton (vLLM's
top_k_per_row_prefill / top_k_per_row_decode contract; no torch.topk in the run path).

One program a row. A row of at most k columns lists them all. A longer row is a radix select
over the fp32 logits mapped to order-preserving uint32 keys (NaN mapped above +inf): up to four
passes of an 8-bit histogram narrow the key of the k-th largest logit down to a prefix inside
which every key is wanted, or to the exact key and how many of its ties are still to take; a last
pass writes every column above it and the first ones inside it, in column order. Each pass reads
the row once (a 64K-column row: 256 KiB a pass, from L2 after the first).
Semantics: kernels/reference/indexer.py (topk_per_row_ref); selected sets equal the oracle's up
to the choice among ties; the order within a row is not sorted by logit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from openmla.quant.validate import check_same_device, check_tensor, fail

__all__ = ["topk_per_row", "decode_topk"]


@triton.jit
def _order_key(x):
    """fp32 -> uint32 whose unsigned order is the float order; every NaN above +inf."""
    u = x.to(tl.uint32, bitcast=True)
    key = tl.where((u >> 31) != 0, u ^ 0xFFFFFFFF, u | 0x80000000)
    return tl.where(x != x, 0xFFFFFFFF, key)


@triton.jit
def topk_per_row_kernel(
    logits_ptr, starts_ptr, ends_ptr, out_ptr,
    stride_lr, stride_out, stride_end_b, L, K, next_n,
    ROW_ENDS: tl.constexpr, HAS_STARTS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64)
    if HAS_STARTS:
        start = tl.load(starts_ptr + i_r)
    else:
        start = 0
    if ROW_ENDS == 0:  # ends [R]
        end = tl.load(ends_ptr + i_r)
    elif ROW_ENDS == 1:  # decode: context_lens [B] (stride_end_b apart), row j of next_n
        end = tl.load(ends_ptr + (i_r // next_n) * stride_end_b) - next_n + 1 + (i_r % next_n)
    start = tl.minimum(tl.maximum(start, 0), L)
    end = tl.minimum(tl.maximum(end, start), L)
    n = end - start
    p_row = logits_ptr + i_r * stride_lr
    p_out = out_ptr + i_r * stride_out
    o_k = tl.arange(0, BLOCK_K)
    o_b = tl.arange(0, BLOCK)

    if n <= K:
        for k0 in range(0, K, BLOCK_K):
            o = k0 + o_k
            tl.store(p_out + o, tl.where(o < n, o, -1), mask=o < K)
    else:
        # Radix select, most significant byte first: `prefix` holds the bytes of the k-th key
        # found so far (the bits set in `known`), `want` how many keys inside that prefix are
        # still to be taken. Once every key inside it is wanted, the later bytes are not needed.
        prefix = tl.zeros([], tl.uint32)
        known = tl.zeros([], tl.uint32)
        want = K
        done = False
        o_bin = tl.arange(0, 256)
        for i_pass in tl.static_range(4):
            if not done:
                shift = 24 - 8 * i_pass
                hist = tl.zeros([256], tl.int32)
                for c0 in range(start, end, BLOCK):
                    o_c = c0 + o_b
                    m_c = o_c < end
                    key = _order_key(tl.load(p_row + o_c, mask=m_c, other=0.0))
                    m_sel = m_c & ((key & known) == prefix)
                    hist += tl.histogram(((key >> shift) & 0xFF).to(tl.int32), 256, mask=m_sel)
                # the digit d of the k-th key: keys with a larger digit number < want <= those >= d
                ge = tl.cumsum(hist, axis=0, reverse=True)
                d = tl.max(tl.where(ge >= want, o_bin, -1), axis=0)
                want -= tl.sum(tl.where(o_bin > d, hist, 0), axis=0)
                done = want == tl.sum(tl.where(o_bin == d, hist, 0), axis=0)
                prefix |= d.to(tl.uint32) << shift
                known |= tl.full([], 0xFF, tl.uint32) << shift
        # Keys above the prefix go to [0, K - want), the first `want` inside it after them.
        n_gt = tl.zeros([], tl.int32)
        n_eq = tl.zeros([], tl.int32)
        for c0 in range(start, end, BLOCK):
            o_c = c0 + o_b
            m_c = o_c < end
            key = _order_key(tl.load(p_row + o_c, mask=m_c, other=0.0)) & known
            m_gt = m_c & (key > prefix)
            m_eq = m_c & (key == prefix)
            r_gt = n_gt + tl.cumsum(m_gt.to(tl.int32), axis=0) - 1
            r_eq = n_eq + tl.cumsum(m_eq.to(tl.int32), axis=0) - 1
            m_take = m_eq & (r_eq < want)
            slot = tl.where(m_gt, r_gt, K - want + r_eq)
            tl.store(p_out + slot, (o_c - start).to(tl.int32), mask=m_gt | m_take)
            n_gt += tl.sum(m_gt.to(tl.int32), axis=0)
            n_eq += tl.sum(m_eq.to(tl.int32), axis=0)


def _check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        fail("k", "an int >= 1", repr(k))
    return k


def _launch(logits, k, out, ends, starts, stride_end_b, next_n, row_ends, block):
    R, L = logits.shape
    if out is None:
        out = torch.empty(R, k, dtype=torch.int32, device=logits.device)
    else:
        check_tensor("out", out, dtype=torch.int32, shape=(R, k), last_dim_contiguous=True)
    check_same_device(logits=logits, ends=ends, starts=starts, out=out)
    if R == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    topk_per_row_kernel[(R,)](
        logits, starts if starts is not None else ends, ends, out,
        logits.stride(0), out.stride(0), stride_end_b, L, k, next_n,
        ROW_ENDS=row_ends, HAS_STARTS=starts is not None, BLOCK=block,
        BLOCK_K=min(1024, triton.next_power_of_2(k)), num_warps=8,
    )
    return out


def topk_per_row(logits: torch.Tensor, ends: torch.Tensor, k: int, *, starts: torch.Tensor = None,
                 out: torch.Tensor = None, block: int = 2048) -> torch.Tensor:
    """The k best columns of each row of [start, end) (prefill: vLLM's top_k_per_row_prefill).

    Args:
        logits: [R, L] fp32 (columns outside a row's [start, end) are never read).
        ends: [R] int32, exclusive end column of each row (clipped to [start, L]).
        k: int >= 1 (any; 2048 in DeepSeek-V3.2).
        starts: [R] int32 or None (0): first column of each row; results are relative to it
            (for prefill: ks, so the results are positions within the row's request).
        out: optional [R, k] int32 with a contiguous last dim (a slice of vLLM's
            topk_indices_buffer is fine).
        block: columns per pass step (a power of two).

    Returns [R, k] int32: rows with end - start <= k list 0 .. n-1 then -1; longer rows hold the
    columns (minus start) of their k largest logits, NaN ranking above +inf, ties in column order.
    """
    check_tensor("logits", logits, dtype=torch.float32, ndim=2)
    R = logits.shape[0]
    check_tensor("ends", ends, dtype=torch.int32, shape=(R,), contiguous=True)
    if starts is not None:
        check_tensor("starts", starts, dtype=torch.int32, shape=(R,), contiguous=True)
    return _launch(logits, _check_k(k), out, ends, starts, 0, 1, 0, block)


def decode_topk(logits: torch.Tensor, context_lens: torch.Tensor, next_n: int, k: int, *,
                out: torch.Tensor = None, block: int = 2048) -> torch.Tensor:
    """Decode top-k (vLLM's top_k_per_row_decode): row b * next_n + j of `logits` ([B * next_n,
    L] fp32, from paged_mqa_logits) selects among positions [0, row_end) with row_end =
    context_lens[b] - next_n + 1 + j for context_lens [B] / [B, 1], or context_lens[b, j] for
    [B, next_n] (int32). Results as topk_per_row's (positions within the request)."""
    check_tensor("logits", logits, dtype=torch.float32, ndim=2)
    if isinstance(next_n, bool) or not isinstance(next_n, int) or next_n < 1:
        fail("next_n", "an int >= 1", repr(next_n))
    R = logits.shape[0]
    check_tensor("context_lens", context_lens, dtype=torch.int32)
    B = R // next_n
    if R != B * next_n:
        fail("logits.shape[0]", f"a multiple of next_n = {next_n}", R)
    if context_lens.dim() == 2 and context_lens.shape == (B, next_n) and next_n > 1:
        if not context_lens.is_contiguous():
            context_lens = context_lens.contiguous()
        return _launch(logits, _check_k(k), out, context_lens.reshape(R), None, 0, 1, 0, block)
    if tuple(context_lens.shape) not in ((B,), (B, 1)):
        fail("context_lens.shape", f"({B},), ({B}, 1) or ({B}, {next_n})", tuple(context_lens.shape))
    return _launch(logits, _check_k(k), out, context_lens, None, context_lens.stride(0), next_n, 1, block)
