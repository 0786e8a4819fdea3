"""fp32 oracles of the DSA lightning indexer (vLLM 0.32's SparseAttnIndexer semantics).

The indexer scores every key a query may see and keeps the best `k` per query:

    logit[t, s] = k_scale[s] * sum_h weights[t, h] * relu(q[t, h] . k[s])

with q [T, H = 64, D = 128] e4m3fn (quantized per token and head, its scale folded into weights:
`indexer_q_quant_ref`), k [S, 128] e4m3fn with one fp32 scale per key (the indexer K cache,
quant/indexer_cache.py), weights [T, H] fp32. Sums are taken in float64 and returned as float32.

Visibility:
  * ragged prefill (`mqa_logits_ref`): query row t sees keys [ks[t], ke[t]) of a contiguous K;
  * paged decode (`paged_mqa_logits_ref`): request b has next_n query rows (the last token and
    its speculative successors); row j sees the request's token positions p < row_end(b, j) with
    row_end = context_lens[b] - next_n + 1 + j for context_lens [B] (or [B, 1]), and
    context_lens[b, j] for per-row lengths [B, next_n]; positions map to the page
    block_table[b, p // block_size], offset p % block_size.
Not visible -> -inf. A visible position whose page is invalid (block_table entry < 0 or
>= num_blocks, or p // block_size >= the table's width) holds no key: -inf, and it is never read.
Faults stay visible: a NaN or inf in q, weights or a visible key or scale gives that logit NaN
(or inf) exactly as the formula computes it; NaN in cache rows nobody sees never reaches a logit.

Top-k (`topk_per_row_ref`): among the columns [start, end) of a row, a row with at most k columns
selects all of them (ascending), padded with -1; a longer row selects the k largest logits
(NaN ranks above +inf, so a fault is selected and stays visible downstream; ties in any order).
Indices are relative to the row's start: per-request token positions, what the sparse MLA
kernels take through the index conversion (kernels/index.py).
"""
from __future__ import annotations

import torch

from openmla.quant.validate import check_tensor, fail
from openmla.quant.indexer_cache import INDEXER_K_FP8, indexer_k_format_of
from openmla.kernels.reference._common import _FLOATS, _INTS, _NEG_INF

__all__ = ["indexer_q_quant_ref", "mqa_logits_ref", "paged_mqa_logits_ref", "decode_row_ends_ref",
           "topk_per_row_ref", "indexer_topk_ref"]

_Q_DTYPES = _FLOATS + (torch.float8_e4m3fn,)
_CHUNK = 1 << 22  # float64 elements formed at once per score block


def indexer_q_quant_ref(q, weights, *, softmax_scale, head_scale):
    """The model's q quantization (vLLM `Indexer.forward`: per_token_group_quant_fp8 with ue8m0
    scales over each head's 128 values) and the weight folding the logits take.

    Args:
        q: [T, H, D] bf16 / fp16 / fp32 (after rope).
        weights: [T, H] any float (the weights_proj output).
        softmax_scale: D ** -0.5 in the model; head_scale: H ** -0.5 in the model.

    Returns (q_fp8 [T, H, D] float8_e4m3fn, weights_folded [T, H] fp32) with
        s[t, h] = 2 ** ceil(log2(max(amax(|q[t, h]|), 1e-10) / 448)) (NaN dropped from amax),
        q_fp8 = e4m3fn(rne(q / s)) saturating, weights_folded = weights * s * softmax_scale *
        head_scale (fp32, in that order).
    """
    check_tensor("q", q, dtype=_FLOATS, ndim=3)
    check_tensor("weights", weights, dtype=_FLOATS, shape=tuple(q.shape[:2]), device=q.device)
    a = q.float().abs()
    amax = torch.where(torch.isnan(a), torch.zeros_like(a), a).amax(dim=-1)
    s = INDEXER_K_FP8.group_scales(amax, amax_floor=1e-10)
    q_fp8 = (q.float() / s.unsqueeze(-1)).to(torch.float8_e4m3fn)
    w = weights.float() * s * float(softmax_scale) * float(head_scale)
    return q_fp8, w


def _scores(q, weights, k, k_scale):
    """q [T, H, D], weights [T, H], k [S, D], k_scale [S] -> [T, S] float64 logits (no mask)."""
    T, H, D = q.shape
    S = k.shape[0]
    out = torch.empty(T, S, dtype=torch.float64, device=q.device)
    qd, kd = q.double(), k.double()
    wd, sd = weights.double(), k_scale.double()
    step = max(1, _CHUNK // max(1, H * S))
    for t0 in range(0, T, step):
        s = torch.einsum("thd,sd->ths", qd[t0:t0 + step], kd).relu()
        out[t0:t0 + step] = (s * wd[t0:t0 + step, :, None]).sum(1) * sd[None, :]
    return out


def _check_q_weights(q, weights, rows):
    check_tensor("q", q, dtype=_Q_DTYPES)
    check_tensor("weights", weights, dtype=_FLOATS, shape=(rows, q.shape[-2]), device=q.device)


def mqa_logits_ref(q, weights, k, k_scale, ks, ke):
    """Ragged prefill logits over a contiguous K (DeepGEMM's fp8_mqa_logits).

    Args:
        q: [T, H, D] float8_e4m3fn (any float accepted: its values are used).
        weights: [T, H] fp32, the folded weights.
        k: [S, D] float8_e4m3fn (or any float); k_scale: [S] fp32.
        ks, ke: [T] int32 / int64; row t sees keys [ks[t], ke[t]) (clipped to [0, S]).

    Returns logits [T, S] fp32, -inf where a key is not visible.
    """
    check_tensor("q", q, dtype=_Q_DTYPES, ndim=3)
    T, H, D = q.shape
    _check_q_weights(q, weights, T)
    check_tensor("k", k, dtype=_Q_DTYPES, shape=(None, D), device=q.device)
    S = k.shape[0]
    check_tensor("k_scale", k_scale, dtype=torch.float32, shape=(S,), device=q.device)
    check_tensor("ks", ks, dtype=_INTS, shape=(T,), device=q.device)
    check_tensor("ke", ke, dtype=_INTS, shape=(T,), device=q.device)
    cols = torch.arange(S, device=q.device)
    vis = (cols[None, :] >= ks.long()[:, None]) & (cols[None, :] < ke.long()[:, None])
    # Keys nobody sees are zeroed before the product so that NaN there cannot reach a logit.
    seen = vis.any(0)
    kk = torch.where(seen[:, None], k.double(), 0.0)
    sc = torch.where(seen, k_scale.double(), 0.0)
    logits = _scores(q, weights, kk, sc)
    return logits.masked_fill(~vis, _NEG_INF).float()


def decode_row_ends_ref(context_lens, next_n):
    """Per-row visible length [B * next_n] int64 of paged decode (see the module docstring):
    context_lens [B] or [B, 1] -> context_lens[b] - next_n + 1 + j; [B, next_n] -> as given.
    Negative results are clamped to 0."""
    check_tensor("context_lens", context_lens, dtype=_INTS)
    cl = context_lens.long()
    if cl.dim() == 2 and cl.shape[1] == next_n and next_n != 1:
        ends = cl.reshape(-1)
    elif cl.dim() == 1 or (cl.dim() == 2 and cl.shape[1] == 1):
        j = torch.arange(next_n, device=cl.device)
        ends = (cl.reshape(-1, 1) - next_n + 1 + j[None, :]).reshape(-1)
    else:
        fail("context_lens.shape", f"(B,), (B, 1) or (B, {next_n})", tuple(context_lens.shape))
    return ends.clamp_min(0)


def paged_mqa_logits_ref(q, weights, cache, context_lens, block_table, *, max_model_len, fmt=None):
    """Paged decode logits over the indexer K cache (DeepGEMM's fp8_paged_mqa_logits).

    Args:
        q: [B, next_n, H, D] float8_e4m3fn (any float accepted).
        weights: [B * next_n, H] fp32, the folded weights, row b * next_n + j.
        cache: [num_blocks, block_size, 132] uint8 indexer K cache (quant/indexer_cache.py).
        context_lens: [B], [B, 1] or [B, next_n] int32 (see the module docstring).
        block_table: [B, M] int32.
        max_model_len: width of the returned logits.
        fmt: the cache's IndexerKFormat (either scale rule reads the same); default INDEXER_K_FP8.

    Returns logits [B * next_n, max_model_len] fp32, -inf past each row's end and at positions
    whose page is invalid.
    """
    fmt = INDEXER_K_FP8 if fmt is None else indexer_k_format_of(fmt)
    check_tensor("q", q, dtype=_Q_DTYPES, ndim=4)
    B, N, H, D = q.shape
    _check_q_weights(q, weights, B * N)
    if D != fmt.head_dim:
        fail("q.shape[-1]", fmt.head_dim, D)
    check_tensor("block_table", block_table, dtype=_INTS, ndim=2, device=q.device)
    if block_table.shape[0] != B:
        fail("block_table.shape[0]", B, block_table.shape[0])
    values, scales = fmt.read_ref(cache)
    nb, bs = values.shape[:2]
    M = block_table.shape[1]
    ends = decode_row_ends_ref(context_lens, N).clamp_max(max_model_len)
    logits = torch.full((B * N, max_model_len), _NEG_INF, dtype=torch.float32, device=q.device)
    for b in range(B):
        rows = slice(b * N, (b + 1) * N)
        L = int(ends[rows].max()) if N else 0
        if L == 0:
            continue
        pos = torch.arange(L, device=q.device)
        page_idx = pos // bs
        page = torch.full_like(pos, -1)
        in_table = page_idx < M
        page[in_table] = block_table[b, page_idx[in_table]].long()
        ok = (page >= 0) & (page < nb)
        kv = torch.zeros(L, D, dtype=torch.float64, device=q.device)
        ksc = torch.zeros(L, dtype=torch.float64, device=q.device)
        p_ok, o_ok = page[ok], (pos % bs)[ok]
        kv[ok] = values[p_ok, o_ok].view(torch.float8_e4m3fn).double()
        ksc[ok] = scales[p_ok, o_ok, 0].double()  # one group per token (head_dim == quant block)
        if fmt.scales_per_token != 1:
            raise NotImplementedError("paged_mqa_logits_ref: one scale per key (quant_block_size "
                                      "== head_dim) is what the logits read")
        s = _scores(q[b].reshape(N, H, D), weights[rows], kv, ksc)
        vis = (pos[None, :] < ends[rows, None]) & ok[None, :]
        logits[rows, :L] = s.masked_fill(~vis, _NEG_INF).float()
    return logits


def topk_per_row_ref(logits, ends, k, *, starts=None):
    """Top-k columns of each row (vLLM's top_k_per_row_prefill / _decode contract).

    Args:
        logits: [R, L] fp32.
        ends: [R] int (exclusive end column of each row, clipped to [start, L]).
        k: int >= 1.
        starts: [R] int or None (0): first column of each row.

    Returns [R, k] int32 of column - start: rows with end - start <= k list every column in
    order, then -1; longer rows the columns of their k largest logits, NaN ranking above +inf,
    sorted by descending logit (ties in any order; callers compare sets).
    """
    check_tensor("logits", logits, dtype=_FLOATS, ndim=2)
    R, L = logits.shape
    check_tensor("ends", ends, dtype=_INTS, shape=(R,), device=logits.device)
    if starts is not None:
        check_tensor("starts", starts, dtype=_INTS, shape=(R,), device=logits.device)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        fail("k", "an int >= 1", repr(k))
    st = torch.zeros(R, dtype=torch.long, device=logits.device) if starts is None else starts.long()
    st = st.clamp(0, L)
    en = torch.maximum(ends.long().clamp(0, L), st)
    out = torch.full((R, k), -1, dtype=torch.int32, device=logits.device)
    for r, (a, e) in enumerate(zip(st.tolist(), en.tolist())):
        n = e - a
        if n <= k:
            out[r, :n] = torch.arange(n, dtype=torch.int32, device=logits.device)
            continue
        # torch.topk ranks NaN above every number, +inf included (as sort does).
        idx = torch.topk(logits[r, a:e].double(), k).indices
        out[r] = idx.to(torch.int32)
    return out


def indexer_topk_ref(logits, context_lens, next_n, k):
    """Decode top-k: `topk_per_row_ref(logits, decode_row_ends_ref(context_lens, next_n), k)`."""
    return topk_per_row_ref(logits, decode_row_ends_ref(context_lens, next_n), k)
