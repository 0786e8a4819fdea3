"""topk_per_row / decode_topk: the k best columns of each indexer logits row, in Triton (vLLM's
top_k_per_row_prefill / top_k_per_row_decode contract; no torch.topk in the run path).

A row of at most k columns lists them all. A longer row (n columns) is selected in four stages
over the fp32 logits and their order-preserving uint32 keys (NaN above +inf):
  1. a lower bound t of the k-th key: the smallest maximum over groups of g columns, g the
     largest power of two <= n // k (and 32), so that at least n / g >= k keys are >= t; and
     the largest / smallest finite logit;
  2. one histogram of the keys >= t over _BUCKETS buckets linear in the logit between t (or the
     smallest finite logit when t is -inf) and the largest finite one; NaN and +inf in the top
     bucket. The bucket is a non-decreasing function of the key, so every key in a bucket above
     the k-th key's is wanted, none below it;
  3. the keys of the buckets above go to the output in column order; the k-th key's bucket goes
     whole to the output when all its keys are wanted, else to a candidate list (column order),
     or nowhere when it holds more than _CANDIDATES keys;
  4. the bucket's keys still wanted: a list of at most _PAIRWISE keys ranked by comparing all
     pairs (one step), else an 8-bit radix select over their 32-bit keys (from the list, or from
     the row when it did not fit); those above the k-th key and the first of its ties in column
     order are written.
With the bound from stage 1 the k-th key's bucket holds tens to hundreds of keys for logits rows
without heavy ties, so stages 2-4 read the row twice (one histogram pass, one write pass).

Two ways to run it, one result (slot for slot):
  * one program a row (topk_per_row_kernel), when the rows alone fill the GPU (prefill chunks)
    or are short: the stages in sequence inside the program;
  * a row split over P programs (decode, where a batch has few rows): a launch per stage, parts
    of whole blocks; stage 1 stores each part's bound and range, stage 2 adds each part's
    histogram into the row's (atomics) and stores its suffix sums, stage 3 places each part's
    keys at the offsets the parts before it give, stage 4 runs one program a row (when the
    grid is one wave: in stage 3's launch, in the row's last part to finish it, counted by an
    atomic; and on sm_90+ the launches use programmatic dependent launch). No host read
    anywhere (CUDA-graph safe).
Semantics: kernels/reference/indexer.py (topk_per_row_ref); selected sets equal the oracle's up
to the choice among ties; the order within a row is not sorted by logit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from openmla.kernels.device import arch_of, num_sms
from openmla.kernels.launch import cdiv, next_pow2
from openmla.quant.validate import check_same_device, check_tensor, fail

__all__ = ["topk_per_row", "decode_topk"]

# Buckets of the one histogram over a whole row (linear in the logit over the row's range)
_BUCKETS = 128
# Lists of at most this many keys are ranked by comparing all pairs (one step; half-size tiles for
# lists of at most half), longer ones by radix
_PAIRWISE = 256
_RANK_CHUNK = tl.constexpr(32)
# The K-th key's bucket is listed for the last stage when it holds at most this many keys, else
# that stage reads the row again (correct for any row; slower for rows of many equal keys).
_CANDIDATES = 2048
_PROGRAMS_PER_SM = 8
# Split rows (see _split): one-wave grids take parts of one block, the smallest of these sizes
# that keeps one wave, preferring parts that number at most _ONE_WAVE_PARTS a row; larger grids
# take parts of whole _PART_UNIT columns walked in blocks of _SPLIT_BLOCK.
_ONE_WAVE_BLOCKS = (256, 512, 1024)
_ONE_WAVE_PARTS = 32
_PART_UNIT = 1024
_SPLIT_BLOCK = 512
_SPLIT_MIN_COLUMNS = 8192
# Warps of the program that ranks the K-th key's bucket in the split path (its own launch, or the
# write launch when that also finishes the row)
_FINISH_WARPS = 8


@triton.jit
def _after_previous_grid(PDL: tl.constexpr):
    """Under programmatic dependent launch: wait for the stream's previous kernel (its stores
    visible, its loads done) before this program touches memory, then let the next kernel launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _order_key(x):
    """fp32 -> uint32 whose unsigned order is the float order; every NaN above +inf."""
    u = x.to(tl.uint32, bitcast=True)
    key = tl.where((u >> 31) != 0, u ^ 0xFFFFFFFF, u | 0x80000000)
    return tl.where(x != x, 0xFFFFFFFF, key)


@triton.jit
def _row_bounds(i_r, starts_ptr, ends_ptr, stride_end_b, L, next_n,
                ROW_ENDS: tl.constexpr, HAS_STARTS: tl.constexpr):
    """[start, end) of row i_r, clipped to [0, L] (int32: every column index of a row is)."""
    i_r = i_r.to(tl.int32)
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
def _key_value(key):
    """The fp32 of an order key (_order_key's inverse; the NaN key gives a NaN)."""
    u = tl.where(key >= 0x80000000, key ^ 0x80000000, key ^ 0xFFFFFFFF)
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _group_log(n, K, BLOCK: tl.constexpr):
    """log2 of the group size g for the lower bound: the largest power of two <= n // K, 32 and
    BLOCK, so that a row of n > K columns has at least n / g >= K groups."""
    q = n // K
    lg = tl.zeros([], tl.int32)
    for j in tl.static_range(1, 6):
        if (1 << j) <= BLOCK:
            lg += (q >= (1 << j)).to(tl.int32)
    return lg


@triton.jit
def _part_stats(p_row, lo, hi, lg, BLOCK: tl.constexpr):
    """Over columns [lo, hi): the smallest maximum of the groups of 2^lg columns (each block cut
    into groups; a group holding no column of [lo, hi) does not count), and the largest and
    smallest key of a finite logit (0 and 0xFFFFFFFF when there is none). Elementwise running
    values, reduced once at the end; a loop per group size so the accumulator's shape is static."""
    o_b = tl.arange(0, BLOCK)
    t = tl.full([], 0xFFFFFFFF, tl.uint32)
    acc_max = tl.zeros([BLOCK], tl.uint32)
    acc_min = tl.full([BLOCK], 0xFFFFFFFF, tl.uint32)
    for j in tl.static_range(0, 6):
        if (1 << j) <= BLOCK:
            if lg == j:
                acc_t = tl.full([BLOCK >> j], 0xFFFFFFFF, tl.uint32)
                for c0 in range(lo, hi, BLOCK):
                    o_c = c0 + o_b
                    m_c = o_c < hi
                    key = tl.where(m_c, _order_key(tl.load(p_row + o_c, mask=m_c, other=0.0)), 0)  # 0: none
                    fin = (key > 0x007FFFFF) & (key < 0xFF800000)
                    acc_max = tl.maximum(acc_max, tl.where(fin, key, 0))
                    acc_min = tl.minimum(acc_min, tl.where(fin, key, 0xFFFFFFFF))
                    if j == 0:
                        gmax = key
                    else:
                        gmax = tl.max(tl.reshape(key, [BLOCK >> j, 1 << j]), axis=1)
                    acc_t = tl.minimum(acc_t, tl.where(gmax == 0, 0xFFFFFFFF, gmax))
                t = tl.min(acc_t, axis=0)
    return t, tl.max(acc_max, axis=0), tl.min(acc_min, axis=0)


@triton.jit
def _bucket_range(t, k_max, k_min, NBINS: tl.constexpr):
    """The buckets' origin and scale: linear in the logit over [lo, the largest finite logit],
    lo the lower bound t or, when t is -inf, the smallest finite logit."""
    k_lo = tl.where(t > 0x007FFFFF, t, k_min)
    lo = _key_value(k_lo)
    hi = _key_value(k_max)
    ok = (k_max != 0) & (k_lo < 0xFF800000) & (hi > lo)
    # finite, so that (x - lo) * scale is never NaN (0 * inf); a range below 2^-100 is one bucket
    scale = tl.where(ok, NBINS / tl.maximum(tl.where(ok, hi - lo, 1.0), 7.9e-31), 0.0)
    return lo, scale


@triton.jit
def _bucket(key, x, k_max, lo, scale, NBINS: tl.constexpr):
    """A bucket in [0, NBINS), non-decreasing in the key: NaN / +inf (keys above the largest
    finite one) in the top bucket, a logit <= lo in bucket 0."""
    # x <= lo: v <= 0 -> bucket 0; the product is +inf when it overflows; NaN takes the key's branch
    v = tl.maximum(tl.minimum(x - lo, 3.0e38) * scale, 0.0)
    return tl.where(key > k_max, NBINS - 1, tl.minimum(v, NBINS - 1).to(tl.int32))  # trunc == floor


@triton.jit
def _row_buckets(p_row, lo_c, hi_c, t, k_max, lo, scale, NBINS: tl.constexpr, BLOCK: tl.constexpr):
    """[NBINS] counts of the buckets of the keys >= t of columns [lo_c, hi_c)."""
    o_b = tl.arange(0, BLOCK)
    hist = tl.zeros([NBINS], tl.int32)
    for c0 in range(lo_c, hi_c, BLOCK):
        o_c = c0 + o_b
        m_c = o_c < hi_c
        x = tl.load(p_row + o_c, mask=m_c, other=0.0)
        key = _order_key(x)
        hist += tl.histogram(_bucket(key, x, k_max, lo, scale, NBINS), NBINS, mask=m_c & (key >= t))
    return hist


@triton.jit
def _pick(hist, K, NBINS: tl.constexpr):
    """The bucket d of the K-th largest key, the keys still wanted from it, and its count."""
    o_bin = tl.arange(0, NBINS)
    ge = tl.cumsum(hist, axis=0, reverse=True)
    d = tl.max(tl.where(ge >= K, o_bin, -1), axis=0)
    want = K - tl.sum(tl.where(o_bin > d, hist, 0), axis=0)
    return d, want, tl.sum(tl.where(o_bin == d, hist, 0), axis=0)


@triton.jit
def _narrow(hist, prefix, known, want, shift):
    """One radix step: `hist` [256] counts the digit at `shift` of the keys inside `prefix` (the
    bits set in `known`), of which `want` are still to be taken. Returns the prefix grown by the
    digit of the k-th key, the keys still wanted inside it, and whether they are all of its keys
    (then the later digits are not needed)."""
    d, want, n_d = _pick(hist, want, 256)
    prefix |= d.to(tl.uint32) << shift
    known |= tl.full([], 0xFF, tl.uint32) << shift
    return prefix, known, want, want == n_d


@triton.jit
def _bucket_write(p_row, p_out, p_cand, CAND, lo_c, hi_c, start, t, k_max, lo, scale, d, want, K,
                  n_gt, n_eq, TO: tl.constexpr, NBINS: tl.constexpr, BLOCK: tl.constexpr):
    """Columns [lo_c, hi_c) of keys >= t: those in buckets above d to output slots n_gt.., those in
    bucket d (their rank among the row's from n_eq) to slots K - want + rank when TO == 1 (the
    bucket is taken whole), to the candidate list when TO == 2 (columns, then their keys CAND
    further), nowhere when TO == 0."""
    o_b = tl.arange(0, BLOCK)
    for c0 in range(lo_c, hi_c, BLOCK):
        o_c = c0 + o_b
        m_c = o_c < hi_c
        x = tl.load(p_row + o_c, mask=m_c, other=0.0)
        key = _order_key(x)
        b = _bucket(key, x, k_max, lo, scale, NBINS)
        m_in = m_c & (key >= t)
        m_gt = m_in & (b > d)
        m_eq = m_in & (b == d)
        col = (o_c - start).to(tl.int32)
        # one scan ranks both: keys above in the low 16 bits, the bucket's in the high
        both = tl.cumsum(m_gt.to(tl.int32) + (m_eq.to(tl.int32) << 16), axis=0)
        tl.store(p_out + n_gt + (both & 0xFFFF) - 1, col, mask=m_gt)
        tot = tl.max(both, axis=0)  # the scan's last value: both counts, one reduction
        n_gt += tot & 0xFFFF
        if TO != 0:
            r_eq = n_eq + (both >> 16) - 1
            if TO == 1:
                tl.store(p_out + K - want + r_eq, col, mask=m_eq)
            else:
                tl.store(p_cand + r_eq, col, mask=m_eq)
                tl.store(p_cand + CAND + r_eq, key.to(tl.int32, bitcast=True), mask=m_eq)
            n_eq += tot >> 16


@triton.jit
def _candidates(p_row, p_cand, CAND, i0, c, listed, start, end, t, k_max, lo, scale, d,
                NBINS: tl.constexpr, BLOCK: tl.constexpr):
    """Block i0 of the bucket-d keys: from the candidate list (listed) or from the row (bucket
    recomputed; more keys than the list holds). Returns (column - start, key, mask)."""
    o_i = i0 + tl.arange(0, BLOCK)
    if listed:
        m = o_i < c
        col = tl.load(p_cand + o_i, mask=m, other=0)
        key = tl.load(p_cand + CAND + o_i, mask=m, other=0).to(tl.uint32, bitcast=True)
    else:
        o_c = start + o_i
        m_c = o_c < end
        x = tl.load(p_row + o_c, mask=m_c, other=0.0)
        key = _order_key(x)
        m = m_c & (key >= t) & (_bucket(key, x, k_max, lo, scale, NBINS) == d)
        col = o_i.to(tl.int32)
    return col, key, m


@triton.jit
def _finish(p_row, p_out, p_cand, start, end, t, k_max, lo, scale, d, want, c, K, CAND,
            NBINS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
    """Bucket d holds c keys of which `want` are taken. A list of at most BLOCK_C: each key's rank
    (keys above it, ties before it in column order) by comparing all pairs, rank r < want to
    slot K - want + r. Else a radix select over their 32-bit keys (8 bits a pass): those above
    the k-th key to slots K - want.., the first of its ties (column order) to the last slots."""
    listed = c <= CAND
    if listed & (c <= BLOCK_C // 2):  # the usual list: a tile of half the size costs half
        _pairwise(p_out, p_cand, CAND, want, c, K, BLOCK_C // 2)
    elif listed & (c <= BLOCK_C):
        _pairwise(p_out, p_cand, CAND, want, c, K, BLOCK_C)
    else:
        _radix_finish(p_row, p_out, p_cand, CAND, listed, start, end, t, k_max, lo, scale, d, want, c,
                      K, NBINS, BLOCK)


@triton.jit
def _pairwise(p_out, p_cand, CAND, want, c, K, BLOCK_C: tl.constexpr):
    """The c <= BLOCK_C listed keys ranked by comparing all pairs; rank r < want to K - want + r.
    The other side of each pair in chunks of _RANK_CHUNK up to c (a [BLOCK_C, chunk] tile at a
    time: a whole [BLOCK_C, BLOCK_C] tile does not fit in registers)."""
    o = tl.arange(0, BLOCK_C)
    m = o < c
    col = tl.load(p_cand + o, mask=m, other=0)
    key = tl.load(p_cand + CAND + o, mask=m, other=0).to(tl.uint32, bitcast=True)
    rank = tl.zeros([BLOCK_C], tl.int32)
    for j0 in range(0, c, _RANK_CHUNK):
        o_j = j0 + tl.arange(0, _RANK_CHUNK)
        m_j = o_j < c
        key_j = tl.load(p_cand + CAND + o_j, mask=m_j, other=0).to(tl.uint32, bitcast=True)
        above = (key_j[None, :] > key[:, None]) | \
            ((key_j[None, :] == key[:, None]) & (o_j[None, :] < o[:, None]))
        rank += tl.sum((above & m_j[None, :]).to(tl.int32), axis=1)
    tl.store(p_out + K - want + rank, col, mask=m & (rank < want))


@triton.jit
def _radix_finish(p_row, p_out, p_cand, CAND, listed, start, end, t, k_max, lo, scale, d, want, c, K,
                  NBINS: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.where(listed, c, end - start)
    prefix = tl.zeros([], tl.uint32)
    known = tl.zeros([], tl.uint32)
    w = want
    done = False
    for i_pass in tl.static_range(4):
        if not done:
            shift = 24 - 8 * i_pass
            hist = tl.zeros([256], tl.int32)
            for i0 in range(0, n, BLOCK):
                col, key, m = _candidates(p_row, p_cand, CAND, i0, c, listed, start, end, t, k_max, lo, scale,
                                          d, NBINS, BLOCK)
                m &= (key & known) == prefix
                hist += tl.histogram(((key >> shift) & 0xFF).to(tl.int32), 256, mask=m)
            prefix, known, w, done = _narrow(hist, prefix, known, w, shift)
    n_gt = K - want
    n_eq = tl.zeros([], tl.int32)
    for i0 in range(0, n, BLOCK):
        col, key, m = _candidates(p_row, p_cand, CAND, i0, c, listed, start, end, t, k_max, lo, scale, d,
                                  NBINS, BLOCK)
        key &= known
        m_gt = m & (key > prefix)
        m_eq = m & (key == prefix)
        r_eq = n_eq + tl.cumsum(m_eq.to(tl.int32), axis=0) - 1
        tl.store(p_out + n_gt + tl.cumsum(m_gt.to(tl.int32), axis=0) - 1, col, mask=m_gt)
        tl.store(p_out + K - w + r_eq, col, mask=m_eq & (r_eq < w))
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
    logits_ptr, starts_ptr, ends_ptr, out_ptr, cand_ptr,
    stride_lr, stride_out, stride_end_b, L, K, next_n, CAND,
    ROW_ENDS: tl.constexpr, HAS_STARTS: tl.constexpr, NBINS: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One program a row: the four stages of the split path in sequence, nothing stored between
    them but the candidate list."""
    i_r = tl.program_id(0).to(tl.int64)
    start, end = _row_bounds(i_r, starts_ptr, ends_ptr, stride_end_b, L, next_n, ROW_ENDS, HAS_STARTS)
    n = end - start
    p_row = logits_ptr + i_r * stride_lr
    p_out = out_ptr + i_r * stride_out
    p_cand = cand_ptr + i_r * (2 * CAND)
    if n <= K:
        _write_all(p_out, n, K, BLOCK_K)
    else:
        t, k_max, k_min = _part_stats(p_row, start, end, _group_log(n, K, BLOCK), BLOCK)
        lo, scale = _bucket_range(t, k_max, k_min, NBINS)
        hist = _row_buckets(p_row, start, end, t, k_max, lo, scale, NBINS, BLOCK)
        d, want, c = _pick(hist, K, NBINS)
        zero = tl.zeros([], tl.int32)
        if c == want:
            _bucket_write(p_row, p_out, p_cand, CAND, start, end, start, t, k_max, lo, scale, d, want, K,
                          zero, zero, 1, NBINS, BLOCK)
        else:
            if c <= CAND:
                _bucket_write(p_row, p_out, p_cand, CAND, start, end, start, t, k_max, lo, scale, d, want,
                              K, zero, zero, 2, NBINS, BLOCK)
            else:
                _bucket_write(p_row, p_out, p_cand, CAND, start, end, start, t, k_max, lo, scale, d, want,
                              K, zero, zero, 0, NBINS, BLOCK)
            tl.debug_barrier()  # the candidate list, written by every thread, read by every thread
            _finish(p_row, p_out, p_cand, start, end, t, k_max, lo, scale, d, want, c, K, CAND,
                    NBINS, BLOCK, BLOCK_C)


@triton.jit
def _row_range(stats_ptr, i_r, P, BLOCK_P: tl.constexpr, NBINS: tl.constexpr):
    """The row's lower bound, largest finite key and bucket range from its parts' stats."""
    o_q = tl.arange(0, BLOCK_P)
    p = stats_ptr + (i_r * P + o_q) * 3
    m = o_q < P
    t = tl.min(tl.load(p, mask=m, other=-1).to(tl.uint32, bitcast=True), axis=0)
    k_max = tl.max(tl.load(p + 1, mask=m, other=0).to(tl.uint32, bitcast=True), axis=0)
    k_min = tl.min(tl.load(p + 2, mask=m, other=-1).to(tl.uint32, bitcast=True), axis=0)
    lo, scale = _bucket_range(t, k_max, k_min, NBINS)
    return t, k_max, lo, scale


@triton.jit
def topk_split_stats_kernel(
    logits_ptr, starts_ptr, ends_ptr, stats_ptr, hist_ptr, done_ptr,
    stride_lr, stride_end_b, L, K, next_n, P,
    ROW_ENDS: tl.constexpr, HAS_STARTS: tl.constexpr, NBINS: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Stage 1 of a row split over P programs: each part's lower bound and finite key range;
    part 0 zeroes the row's bucket counts (stage 2 adds into them) and its count of parts done
    with stage 3."""
    _after_previous_grid(PDL)
    i_r = tl.program_id(0).to(tl.int64)
    i_p = tl.program_id(1)
    start, end = _row_bounds(i_r, starts_ptr, ends_ptr, stride_end_b, L, next_n, ROW_ENDS, HAS_STARTS)
    if end - start > K:
        lo_c, hi_c = _part(start, end, i_p, P, BLOCK)
        lg = _group_log(end - start, K, BLOCK)
        t, k_max, k_min = _part_stats(logits_ptr + i_r * stride_lr, lo_c, hi_c, lg, BLOCK)
        p = stats_ptr + (i_r * P + i_p) * 3
        tl.store(p, t.to(tl.int32, bitcast=True))
        tl.store(p + 1, k_max.to(tl.int32, bitcast=True))
        tl.store(p + 2, k_min.to(tl.int32, bitcast=True))
        if i_p == 0:
            tl.store(hist_ptr + i_r * NBINS + tl.arange(0, NBINS), tl.zeros([NBINS], tl.int32))
            tl.store(done_ptr + i_r, 0)


@triton.jit
def topk_split_bucket_kernel(
    logits_ptr, starts_ptr, ends_ptr, stats_ptr, hist_ptr, suffix_ptr,
    stride_lr, stride_end_b, L, K, next_n, P,
    ROW_ENDS: tl.constexpr, HAS_STARTS: tl.constexpr, NBINS: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Stage 2: each part's bucket counts, added into the row's, and stored as suffix sums
    (keys in buckets >= b) for stage 3's offsets."""
    _after_previous_grid(PDL)
    i_r = tl.program_id(0).to(tl.int64)
    i_p = tl.program_id(1)
    start, end = _row_bounds(i_r, starts_ptr, ends_ptr, stride_end_b, L, next_n, ROW_ENDS, HAS_STARTS)
    if end - start > K:
        t, k_max, lo, scale = _row_range(stats_ptr, i_r, P, BLOCK_P, NBINS)
        lo_c, hi_c = _part(start, end, i_p, P, BLOCK)
        hist = _row_buckets(logits_ptr + i_r * stride_lr, lo_c, hi_c, t, k_max, lo, scale, NBINS, BLOCK)
        o_bin = tl.arange(0, NBINS)
        tl.atomic_add(hist_ptr + i_r * NBINS + o_bin, hist, mask=hist != 0, sem="relaxed")
        tl.store(suffix_ptr + (i_r * P + i_p) * NBINS + o_bin, tl.cumsum(hist, axis=0, reverse=True))


@triton.jit
def topk_split_write_kernel(
    logits_ptr, starts_ptr, ends_ptr, stats_ptr, hist_ptr, suffix_ptr, done_ptr, out_ptr, cand_ptr,
    stride_lr, stride_out, stride_end_b, L, K, next_n, P, CAND,
    ROW_ENDS: tl.constexpr, HAS_STARTS: tl.constexpr, NBINS: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, LAST_FINISHES: tl.constexpr,
):
    """Stage 3: each part writes its keys above the K-th key's bucket, and that bucket's keys (to
    the output when all are taken, else to the candidate list), from the offsets the parts
    before it give, so the row reads as one program would write it. With LAST_FINISHES, stage 4
    (the K-th key's bucket when only part of it is taken) runs in the row's last part to get
    here: each part counts itself done with an acq_rel atomic after its stores, so the one that
    counts P sees every part's candidates."""
    _after_previous_grid(PDL)
    i_r = tl.program_id(0).to(tl.int64)
    i_p = tl.program_id(1)
    start, end = _row_bounds(i_r, starts_ptr, ends_ptr, stride_end_b, L, next_n, ROW_ENDS, HAS_STARTS)
    p_out = out_ptr + i_r * stride_out
    if end - start <= K:
        if i_p == 0:
            _write_all(p_out, end - start, K, BLOCK_K)
    else:
        t, k_max, lo, scale = _row_range(stats_ptr, i_r, P, BLOCK_P, NBINS)
        d, want, c = _pick(tl.load(hist_ptr + i_r * NBINS + tl.arange(0, NBINS)), K, NBINS)
        o_q = tl.arange(0, BLOCK_P)
        p_suf = suffix_ptr + (i_r * P + o_q) * NBINS
        m_q = o_q < i_p
        ge_d = tl.sum(tl.load(p_suf + d, mask=m_q, other=0), axis=0)
        n_gt = tl.sum(tl.load(p_suf + d + 1, mask=m_q & (d + 1 < NBINS), other=0), axis=0)
        lo_c, hi_c = _part(start, end, i_p, P, BLOCK)
        p_row = logits_ptr + i_r * stride_lr
        p_cand = cand_ptr + i_r * (2 * CAND)
        if c == want:
            _bucket_write(p_row, p_out, p_cand, CAND, lo_c, hi_c, start, t, k_max, lo, scale, d, want, K,
                          n_gt, ge_d - n_gt, 1, NBINS, BLOCK)
        elif c <= CAND:
            _bucket_write(p_row, p_out, p_cand, CAND, lo_c, hi_c, start, t, k_max, lo, scale, d, want, K,
                          n_gt, ge_d - n_gt, 2, NBINS, BLOCK)
        else:
            _bucket_write(p_row, p_out, p_cand, CAND, lo_c, hi_c, start, t, k_max, lo, scale, d, want, K,
                          n_gt, ge_d - n_gt, 0, NBINS, BLOCK)
        if LAST_FINISHES and c != want:
            tl.debug_barrier()  # every thread's stores before the count
            if tl.atomic_add(done_ptr + i_r, 1, sem="acq_rel") == P - 1:
                _finish(p_row, p_out, p_cand, start, end, t, k_max, lo, scale, d, want, c, K, CAND,
                        NBINS, BLOCK, BLOCK_C)


@triton.jit
def topk_split_finish_kernel(
    logits_ptr, starts_ptr, ends_ptr, stats_ptr, hist_ptr, out_ptr, cand_ptr,
    stride_lr, stride_out, stride_end_b, L, K, next_n, P, CAND,
    ROW_ENDS: tl.constexpr, HAS_STARTS: tl.constexpr, NBINS: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Stage 4 in a launch of its own (grids of more than one wave: see _launch), one program a
    row: the K-th key's bucket when only part of it is taken."""
    i_r = tl.program_id(0).to(tl.int64)
    start, end = _row_bounds(i_r, starts_ptr, ends_ptr, stride_end_b, L, next_n, ROW_ENDS, HAS_STARTS)
    if end - start > K:
        d, want, c = _pick(tl.load(hist_ptr + i_r * NBINS + tl.arange(0, NBINS)), K, NBINS)
        if c != want:
            t, k_max, lo, scale = _row_range(stats_ptr, i_r, P, BLOCK_P, NBINS)
            _finish(logits_ptr + i_r * stride_lr, out_ptr + i_r * stride_out, cand_ptr + i_r * (2 * CAND),
                    start, end, t, k_max, lo, scale, d, want, c, K, CAND, NBINS, BLOCK, BLOCK_C)


@triton.jit
def _part(start, end, i_p, P, BLOCK: tl.constexpr):
    """Columns [lo, hi) of part i_p of P of [start, end) (parts of whole BLOCKs)."""
    chunk = tl.cdiv(tl.cdiv(end - start, P), BLOCK) * BLOCK
    lo = tl.minimum(start + i_p * chunk, end)
    return lo, tl.minimum(end, lo + chunk)


def _check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        fail("k", "an int >= 1", repr(k))
    return k


def _split(device, R: int, L: int, k: int):
    """(programs per row, columns a pass step) for rows of L columns; one program (and the
    caller's block) when rows are not split.
    - A grid of one wave (rows x parts <= SMs) is possible: parts of one block each (its launches
      then overlap under programmatic dependent launch and the write launch finishes the rows),
      the smallest of _ONE_WAVE_BLOCKS that keeps one wave with at most _ONE_WAVE_PARTS parts a
      row, else the smallest that keeps one wave.
    - Else rows of at least _SPLIT_MIN_COLUMNS: enough parts of whole _PART_UNIT columns to fill
      the GPU _PROGRAMS_PER_SM times (one when the rows fill it), walked in _SPLIT_BLOCK steps.
    - Else one program a row (parts of several blocks, or a second wave, were slower there).
    Rows no longer than k or than _PART_UNIT take one program. Measured: docs/notes/indexer.md."""
    sms = num_sms(device)
    if L > k and L > _PART_UNIT:
        fits = [b for b in _ONE_WAVE_BLOCKS if R * cdiv(L, b) <= sms]
        if fits:
            b = next((b for b in fits if cdiv(L, b) <= _ONE_WAVE_PARTS), fits[0])
            return cdiv(L, b), b
    if L < _SPLIT_MIN_COLUMNS:
        return 1, None
    return max(1, min(cdiv(L, _PART_UNIT), cdiv(_PROGRAMS_PER_SM * sms, R))), _SPLIT_BLOCK


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
    block_k = min(1024, next_pow2(k))
    if row_programs is not None:
        P, split_block = row_programs, _PART_UNIT
    else:
        P, split_block = _split(logits.device, R, L, k)
    cand_len = max(1, min(L, _CANDIDATES))
    cand = torch.empty(R, 2, cand_len, dtype=torch.int32, device=logits.device)
    common = dict(ROW_ENDS=row_ends, HAS_STARTS=starts is not None, NBINS=_BUCKETS)
    block_c = _PAIRWISE
    if P == 1:
        topk_per_row_kernel[(R,)](
            logits, starts_arg, ends, out, cand,
            logits.stride(0), out.stride(0), stride_end_b, L, k, next_n, cand_len,
            BLOCK=block, BLOCK_K=block_k, BLOCK_C=block_c, num_warps=8, **common,
        )
        return out
    # A split grid of one wave (rows x parts <= SMs) runs stage 4 in the write launch (one launch
    # less) and, on sm_90+, its three launches under programmatic dependent launch (each start
    # overlaps the previous kernel's end; each kernel waits for that kernel before touching
    # memory). Past one wave neither pays: the finishes would queue behind the wave's tail, and
    # waiting programs would hold SM slots the wave's later programs need (docs/notes/indexer.md).
    one_wave = R * P <= num_sms(logits.device)
    arch = arch_of(logits.device)
    pdl = one_wave and arch.ptx and arch.arch >= 90
    common.update(BLOCK=min(block, split_block), num_warps=4)
    staged = dict(common, PDL=pdl, **(dict(launch_pdl=True) if pdl else {}))
    block_p = next_pow2(P)
    stats = torch.empty(R, P, 3, dtype=torch.int32, device=logits.device)
    hist = torch.empty(R, _BUCKETS, dtype=torch.int32, device=logits.device)
    done = torch.empty(R, dtype=torch.int32, device=logits.device)
    suffix = torch.empty(R, P, _BUCKETS, dtype=torch.int32, device=logits.device)
    row_args = (stride_end_b, L, k, next_n, P)
    topk_split_stats_kernel[(R, P)](logits, starts_arg, ends, stats, hist, done, logits.stride(0),
                                    *row_args, **staged)
    topk_split_bucket_kernel[(R, P)](logits, starts_arg, ends, stats, hist, suffix, logits.stride(0),
                                     *row_args, BLOCK_P=block_p, **staged)
    topk_split_write_kernel[(R, P)](logits, starts_arg, ends, stats, hist, suffix, done, out, cand,
                                    logits.stride(0), out.stride(0), *row_args, cand_len,
                                    BLOCK_K=block_k, BLOCK_P=block_p, BLOCK_C=block_c,
                                    LAST_FINISHES=one_wave,
                                    **dict(staged, num_warps=_FINISH_WARPS if one_wave else 4))
    if not one_wave:
        topk_split_finish_kernel[(R,)](logits, starts_arg, ends, stats, hist, out, cand,
                                       logits.stride(0), out.stride(0), *row_args, cand_len,
                                       BLOCK_P=block_p, BLOCK_C=block_c,
                                       **dict(common, num_warps=_FINISH_WARPS))
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
        row_programs: programs per row (None: `_split`'s rule: parts of one block when the grid
            can be one wave, else for rows of at least _SPLIT_MIN_COLUMNS parts that fill the GPU,
            else one). The result does not depend on it.

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
