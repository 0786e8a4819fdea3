"""topk_per_row / decode_topk: the k best columns of each indexer logits row, in Triton (vLLM's
top_k_per_row_prefill / top_k_per_row_decode contract; no torch.topk in the run path).

A row of at most k columns lists them all. A longer row is a radix select over the fp32 logits
mapped to order-preserving uint32 keys (NaN mapped above +inf): up to four passes of an 8-bit
histogram narrow the key of the k-th largest logit down to a prefix inside which every key is
wanted, or to the exact key and how many of its ties are still to take; a last pass writes every
column above it and the first ones inside it, in column order.

Two ways to run it, one result:
  * one program a row (topk_per_row_kernel), when the rows alone fill the GPU (prefill chunks):
    the passes run inside the program, each reading the row once (from L2 after the first);
  * a row split over P programs (decode, where a batch has few rows): one launch per pass, each
    program adding its part's histogram into the row's (global atomics, 256 a program), every
    program narrowing the state the kernel before it stored by that kernel's histogram (one
    256-bin scan; program 0 stores the result for the next); then a launch counting each part's
    keys above / inside the final prefix, and one writing them, each part at the offsets the
    counts of the parts before it give (column order, as one program would).
    Passes after the narrowing is done exit at once; no host read anywhere (CUDA-graph safe).
Semantics: kernels/reference/indexer.py (topk_per_row_ref); selected sets equal the oracle's up
to the choice among ties; the order within a row is not sorted by logit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from openmla.kernels.device import num_sms
from openmla.quant.validate import check_same_device, check_tensor, fail

__all__ = ["topk_per_row", "decode_topk"]

_BINS = 256  # 8-bit digits, four passes over the 32-bit keys
_PASSES = 4
# Programs per row for the split path: about this many programs per SM over the whole batch
# (a sweep of 1 / 4 / 16 / 64 programs a row: docs/notes/indexer.md).
_PROGRAMS_PER_SM = 8
_SPLIT_BLOCK = 1024
_SPLIT_MIN_COLUMNS = 8192


@triton.jit
def _order_key(x):
    """fp32 -> uint32 whose unsigned order is the float order; every NaN above +inf."""
    u = x.to(tl.uint32, bitcast=True)
    key = tl.where((u >> 31) != 0, u ^ 0xFFFFFFFF, u | 0x80000000)
    return tl.where(x != x, 0xFFFFFFFF, key)


@triton.jit
def _row_bounds(i_r, starts_ptr, ends_ptr, stride_end_b, L, next_n,
                ROW_ENDS: tl.constexpr, HAS_STARTS: tl.constexpr):
    """[start, end) of row i_r, clipped to [0, L]."""
    if HAS_STARTS:
        start = tl.load(starts_ptr + i_r)
    else:
        start = 0
    if ROW_ENDS == 0:  # ends [R]
        end = tl.load(ends_ptr + i_r)
    else:  # decode: context_lens [B] (stride_end_b apart), row j of next_n
        end = tl.load(ends_ptr + (i_r // next_n) * stride_end_b) - next_n + 1 + (i_r % next_n)
    start = tl.minimum(tl.maximum(start, 0), L)
    end = tl.minimum(tl.maximum(end, start), L)
    return start, end


@triton.jit
def _narrow(hist, prefix, known, want, shift):
    """One pass's step: `hist` [256] counts the digit at `shift` of the keys inside `prefix`
    (the bits set in `known`), of which `want` are still to be taken. Returns the prefix grown
    by the digit of the k-th key, the keys still wanted inside it, and whether they are all of
    its keys (then the later digits are not needed)."""
    o_bin = tl.arange(0, 256)
    # the digit d of the k-th key: keys with a larger digit number < want <= those >= d
    ge = tl.cumsum(hist, axis=0, reverse=True)
    d = tl.max(tl.where(ge >= want, o_bin, -1), axis=0)
    want -= tl.sum(tl.where(o_bin > d, hist, 0), axis=0)
    done = want == tl.sum(tl.where(o_bin == d, hist, 0), axis=0)
    prefix |= d.to(tl.uint32) << shift
    known |= tl.full([], 0xFF, tl.uint32) << shift
    return prefix, known, want, done


@triton.jit
def _histogram(p_row, lo, hi, prefix, known, shift, BLOCK: tl.constexpr):
    """[256] counts of the digit at `shift` of the keys of columns [lo, hi) inside `prefix`."""
    o_b = tl.arange(0, BLOCK)
    hist = tl.zeros([256], tl.int32)
    for c0 in range(lo, hi, BLOCK):
        o_c = c0 + o_b
        m_c = o_c < hi
        key = _order_key(tl.load(p_row + o_c, mask=m_c, other=0.0))
        m_sel = m_c & ((key & known) == prefix)
        hist += tl.histogram(((key >> shift) & 0xFF).to(tl.int32), 256, mask=m_sel)
    return hist


@triton.jit
def _write_selected(p_row, p_out, lo, hi, start, prefix, known, want, K, n_gt, n_eq,
                    BLOCK: tl.constexpr):
    """Columns [lo, hi) of keys above the prefix go to slots n_gt.. of [0, K - want), the first
    of those inside it (their rank among the row's from n_eq) to [K - want, K)."""
    o_b = tl.arange(0, BLOCK)
    for c0 in range(lo, hi, BLOCK):
        o_c = c0 + o_b
        m_c = o_c < hi
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


@triton.jit
def _write_all(p_out, n, K, BLOCK_K: tl.constexpr):
    """A row of n <= K columns: 0 .. n-1, then -1."""
    o_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        o = k0 + o_k
        tl.store(p_out + o, tl.where(o < n, o, -1), mask=o < K)


@triton.jit
def topk_per_row_kernel(
    logits_ptr, starts_ptr, ends_ptr, out_ptr,
    stride_lr, stride_out, stride_end_b, L, K, next_n,
    ROW_ENDS: tl.constexpr, HAS_STARTS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64)
    start, end = _row_bounds(i_r, starts_ptr, ends_ptr, stride_end_b, L, next_n, ROW_ENDS, HAS_STARTS)
    n = end - start
    p_row = logits_ptr + i_r * stride_lr
    p_out = out_ptr + i_r * stride_out
    if n <= K:
        _write_all(p_out, n, K, BLOCK_K)
    else:
        prefix = tl.zeros([], tl.uint32)
        known = tl.zeros([], tl.uint32)
        want = K
        done = False
        for i_pass in tl.static_range(4):
            if not done:
                shift = 24 - 8 * i_pass
                hist = _histogram(p_row, start, end, prefix, known, shift, BLOCK)
                prefix, known, want, done = _narrow(hist, prefix, known, want, shift)
        _write_selected(p_row, p_out, start, end, start, prefix, known, want, K,
                        tl.zeros([], tl.int32), tl.zeros([], tl.int32), BLOCK)


@triton.jit
def _state_after(p_hist, p_state, K, J: tl.constexpr):
    """The narrowing state after pass J of a row: the state after pass J - 1 (stored by pass J's
    kernel, slot J - 1) narrowed by pass J's histogram, unless it was done already."""
    o_bin = tl.arange(0, 256)
    if J == 0:
        prefix, known, want, done = _narrow(tl.load(p_hist + o_bin), tl.zeros([], tl.uint32),
                                            tl.zeros([], tl.uint32), K, 24)
    else:
        p = p_state + (J - 1) * 4
        prefix = tl.load(p).to(tl.uint32, bitcast=True)
        known = tl.load(p + 1).to(tl.uint32, bitcast=True)
        want = tl.load(p + 2)
        done = tl.load(p + 3) != 0
        if not done:
            prefix, known, want, done = _narrow(tl.load(p_hist + J * 256 + o_bin), prefix, known,
                                                want, 24 - 8 * J)
    return prefix, known, want, done


@triton.jit
def _part(start, end, i_p, P, BLOCK: tl.constexpr):
    """Columns [lo, hi) of part i_p of P of [start, end) (parts of whole BLOCKs)."""
    chunk = tl.cdiv(tl.cdiv(end - start, P), BLOCK) * BLOCK
    lo = tl.minimum(start + i_p * chunk, end)
    return lo, tl.minimum(end, lo + chunk)


@triton.jit
def topk_split_hist_kernel(
    logits_ptr, starts_ptr, ends_ptr, hist_ptr, state_ptr,
    stride_lr, stride_end_b, L, K, next_n, P,
    PASS: tl.constexpr, ROW_ENDS: tl.constexpr, HAS_STARTS: tl.constexpr, BLOCK: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64)
    i_p = tl.program_id(1)
    start, end = _row_bounds(i_r, starts_ptr, ends_ptr, stride_end_b, L, next_n, ROW_ENDS, HAS_STARTS)
    if end - start > K:
        p_hist = hist_ptr + i_r * (4 * 256)
        if PASS == 0:
            prefix = tl.zeros([], tl.uint32)
            known = tl.zeros([], tl.uint32)
            done = False
        else:
            p_state = state_ptr + i_r * (3 * 4)
            prefix, known, want, done = _state_after(p_hist, p_state, K, PASS - 1)
            if i_p == 0:  # for the next kernels: the state after pass PASS - 1
                p = p_state + (PASS - 1) * 4
                tl.store(p, prefix.to(tl.int32, bitcast=True))
                tl.store(p + 1, known.to(tl.int32, bitcast=True))
                tl.store(p + 2, want)
                tl.store(p + 3, done.to(tl.int32))
        if not done:
            lo, hi = _part(start, end, i_p, P, BLOCK)
            hist = _histogram(logits_ptr + i_r * stride_lr, lo, hi, prefix, known, 24 - 8 * PASS, BLOCK)
            tl.atomic_add(p_hist + PASS * 256 + tl.arange(0, 256), hist, mask=hist != 0, sem="relaxed")


@triton.jit
def topk_split_count_kernel(
    logits_ptr, starts_ptr, ends_ptr, hist_ptr, state_ptr, count_ptr,
    stride_lr, stride_end_b, L, K, next_n, P,
    ROW_ENDS: tl.constexpr, HAS_STARTS: tl.constexpr, BLOCK: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64)
    i_p = tl.program_id(1)
    start, end = _row_bounds(i_r, starts_ptr, ends_ptr, stride_end_b, L, next_n, ROW_ENDS, HAS_STARTS)
    n_gt = tl.zeros([], tl.int32)
    n_eq = tl.zeros([], tl.int32)
    if end - start > K:
        prefix, known, want, done = _state_after(hist_ptr + i_r * (4 * 256), state_ptr + i_r * (3 * 4),
                                                 K, 3)
        lo, hi = _part(start, end, i_p, P, BLOCK)
        p_row = logits_ptr + i_r * stride_lr
        o_b = tl.arange(0, BLOCK)
        for c0 in range(lo, hi, BLOCK):
            o_c = c0 + o_b
            m_c = o_c < hi
            key = _order_key(tl.load(p_row + o_c, mask=m_c, other=0.0)) & known
            n_gt += tl.sum((m_c & (key > prefix)).to(tl.int32), axis=0)
            n_eq += tl.sum((m_c & (key == prefix)).to(tl.int32), axis=0)
    p_count = count_ptr + (i_r * P + i_p) * 2
    tl.store(p_count, n_gt)
    tl.store(p_count + 1, n_eq)


@triton.jit
def topk_split_write_kernel(
    logits_ptr, starts_ptr, ends_ptr, hist_ptr, state_ptr, count_ptr, out_ptr,
    stride_lr, stride_out, stride_end_b, L, K, next_n, P,
    ROW_ENDS: tl.constexpr, HAS_STARTS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64)
    i_p = tl.program_id(1)
    start, end = _row_bounds(i_r, starts_ptr, ends_ptr, stride_end_b, L, next_n, ROW_ENDS, HAS_STARTS)
    p_out = out_ptr + i_r * stride_out
    if end - start <= K:
        if i_p == 0:
            _write_all(p_out, end - start, K, BLOCK_K)
    else:
        prefix, known, want, done = _state_after(hist_ptr + i_r * (4 * 256), state_ptr + i_r * (3 * 4),
                                                 K, 3)
        lo, hi = _part(start, end, i_p, P, BLOCK)
        # this part's first slots: the keys above / inside the prefix of the parts before it
        o_q = tl.arange(0, BLOCK_P)
        p_count = count_ptr + (i_r * P + o_q) * 2
        m_q = o_q < i_p
        n_gt = tl.sum(tl.load(p_count, mask=m_q, other=0), axis=0)
        n_eq = tl.sum(tl.load(p_count + 1, mask=m_q, other=0), axis=0)
        _write_selected(logits_ptr + i_r * stride_lr, p_out, lo, hi, start, prefix, known, want, K,
                        n_gt, n_eq, BLOCK)


def _check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        fail("k", "an int >= 1", repr(k))
    return k


def _row_programs(device, R: int, L: int) -> int:
    """Programs per row: one when the rows fill the GPU or are short (below _SPLIT_MIN_COLUMNS
    the launches' latency outweighs the split), else enough parts of whole blocks to fill it."""
    if L < _SPLIT_MIN_COLUMNS:
        return 1
    return max(1, min(triton.cdiv(L, _SPLIT_BLOCK), triton.cdiv(_PROGRAMS_PER_SM * num_sms(device), R)))


def _launch(logits, k, out, ends, starts, stride_end_b, next_n, row_ends, block, row_programs):
    R, L = logits.shape
    if out is None:
        out = torch.empty(R, k, dtype=torch.int32, device=logits.device)
    else:
        check_tensor("out", out, dtype=torch.int32, shape=(R, k), last_dim_contiguous=True)
    check_same_device(logits=logits, ends=ends, starts=starts, out=out)
    if row_programs is not None and (isinstance(row_programs, bool) or not isinstance(row_programs, int)
                                     or row_programs < 1):
        fail("row_programs", "None or an int >= 1", repr(row_programs))
    if R == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    starts_arg = starts if starts is not None else ends
    block_k = min(1024, triton.next_power_of_2(k))
    P = row_programs if row_programs is not None else _row_programs(logits.device, R, L)
    if P == 1:
        topk_per_row_kernel[(R,)](
            logits, starts_arg, ends, out,
            logits.stride(0), out.stride(0), stride_end_b, L, k, next_n,
            ROW_ENDS=row_ends, HAS_STARTS=starts is not None, BLOCK=block, BLOCK_K=block_k, num_warps=8,
        )
        return out
    block = min(block, _SPLIT_BLOCK)
    hist = torch.zeros(R, _PASSES, _BINS, dtype=torch.int32, device=logits.device)
    state = torch.empty(R, _PASSES - 1, 4, dtype=torch.int32, device=logits.device)
    counts = torch.empty(R, P, 2, dtype=torch.int32, device=logits.device)
    common = dict(ROW_ENDS=row_ends, HAS_STARTS=starts is not None, BLOCK=block, num_warps=4)
    for i_pass in range(_PASSES):
        topk_split_hist_kernel[(R, P)](logits, starts_arg, ends, hist, state, logits.stride(0),
                                       stride_end_b, L, k, next_n, P, PASS=i_pass, **common)
    topk_split_count_kernel[(R, P)](logits, starts_arg, ends, hist, state, counts, logits.stride(0),
                                    stride_end_b, L, k, next_n, P, **common)
    topk_split_write_kernel[(R, P)](logits, starts_arg, ends, hist, state, counts, out, logits.stride(0),
                                    out.stride(0), stride_end_b, L, k, next_n, P, BLOCK_K=block_k,
                                    BLOCK_P=triton.next_power_of_2(P), **common)
    return out


def topk_per_row(logits: torch.Tensor, ends: torch.Tensor, k: int, *, starts: torch.Tensor = None,
                 out: torch.Tensor = None, block: int = 2048, row_programs: int = None) -> torch.Tensor:
    """The k best columns of each row of [start, end) (prefill: vLLM's top_k_per_row_prefill).

    Args:
        logits: [R, L] fp32 (columns outside a row's [start, end) are never read).
        ends: [R] int32, exclusive end column of each row (clipped to [start, L]).
        k: int >= 1 (any; 2048 in DeepSeek-V3.2).
        starts: [R] int32 or None (0): first column of each row; results are relative to it
            (for prefill: ks, so the results are positions within the row's request).
        out: optional [R, k] int32 with a contiguous last dim (a slice of vLLM's
            topk_indices_buffer is fine).
        block: columns per pass step (a power of two; at most 1024 when rows are split).
        row_programs: programs per row (None: one when the rows fill the GPU, else enough to
            fill it; see the module docstring). The result does not depend on it.

    Returns [R, k] int32: rows with end - start <= k list 0 .. n-1 then -1; longer rows hold the
    columns (minus start) of their k largest logits, NaN ranking above +inf, ties in column order.
    """
    check_tensor("logits", logits, dtype=torch.float32, ndim=2)
    R = logits.shape[0]
    check_tensor("ends", ends, dtype=torch.int32, shape=(R,), contiguous=True)
    if starts is not None:
        check_tensor("starts", starts, dtype=torch.int32, shape=(R,), contiguous=True)
    return _launch(logits, _check_k(k), out, ends, starts, 0, 1, 0, block, row_programs)


def decode_topk(logits: torch.Tensor, context_lens: torch.Tensor, next_n: int, k: int, *,
                out: torch.Tensor = None, block: int = 2048, row_programs: int = None) -> torch.Tensor:
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
        return _launch(logits, _check_k(k), out, context_lens.reshape(R), None, 0, 1, 0, block,
                       row_programs)
    if tuple(context_lens.shape) not in ((B,), (B, 1)):
        fail("context_lens.shape", f"({B},), ({B}, 1) or ({B}, {next_n})", tuple(context_lens.shape))
    return _launch(logits, _check_k(k), out, context_lens, None, context_lens.stride(0), next_n, 1, block,
                   row_programs)
