"""fp32 torch oracles for openmla's ops, written straight from the maths (STYLE.md 2).

No tiling and no online softmax: every oracle forms the full score row of a query in float64
(queries are taken in bounded chunks only to cap memory) and returns float32. Tests and tools
import these functions; they are never copied.

Conventions shared by every oracle here:
  * `lse` is the natural log of the softmax denominator. A row with nothing in its denominator
    (no counted key, no sink) has out = 0 and lse = -inf, never NaN.
  * Cache rows that no counted index / in-range position selects are never used, so NaN in
    unused cache rows (the tests' adversarial fill) cannot reach a result.
  * Faults stay visible (DESIGN.md): a NaN or inf in a score or value of a key a row counts (q or
    the key itself) makes that row's out, lse (and max_logits) NaN; a row that counts no key is
    empty whatever its q holds.
  * Host syncs are fine here (these are oracles, not run paths): lengths are read with .tolist().
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from openmla.quant.validate import check_tensor, fail
from openmla.quant.int8 import dequantize_per_token_head, quantize_per_token_head_ref
from openmla.quant.mla_formats import mla_format_of

__all__ = [
    "sparse_mla_ref",
    "sparse_mla_decode_ref",
    "paged_attention_ref",
    "attention_varlen_ref",
    "local_attention_ref",
    "merge_attn_states_ref",
    "convert_req_index_ref",
]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INTS = (torch.int32, torch.int64)
_NEG_INF = float("-inf")
# Largest float64 score/gather block formed at once (elements): 2**24 * 8 B = 128 MiB.
_CHUNK_ELEMS = 1 << 24


def _softmax(s: torch.Tensor, sink: Optional[torch.Tensor] = None):
    """Softmax weights of scores with an optional value-less sink logit.

    s: [..., K] float64, -inf where a key is not counted. sink: broadcastable to s[..., 0]
    (float64) or None.
    Returns (p [..., K] = exp(s) / (sum_k exp(s_k) + exp(sink)),
             lse_keys [...] = log sum_k exp(s_k), natural log, -inf for a row with no key).
    A row whose whole denominator is 0 gets p = 0 (every s there is -inf, so exp(s - 0) = 0).
    """
    lse_keys = torch.logsumexp(s, dim=-1)  # handles all -inf and K = 0 rows: -inf
    denom = lse_keys if sink is None else torch.logaddexp(lse_keys, sink)
    denom = torch.where(denom == _NEG_INF, torch.zeros_like(denom), denom)
    return torch.exp(s - denom.unsqueeze(-1)), lse_keys


def _nan_faults(bad: torch.Tensor, *outs: torch.Tensor) -> None:
    """Set the rows where bad [...] is True to NaN in each output ([...] or [..., D]), in place."""
    for o in outs:
        o.masked_fill_(bad.unsqueeze(-1) if o.dim() > bad.dim() else bad, float("nan"))


def _as_float(name: str, x) -> float:
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            fail(f"{name}.numel()", 1, x.numel())
        return float(x.reshape(()).item())
    return float(x)


# ---------------------------------------------------------------------------------------------
# Sparse MLA
# ---------------------------------------------------------------------------------------------

def sparse_mla_ref(q, kv, indices, *, scale, topk_length=None, attn_sink=None, d_v=512):
    """Sparse MLA attention over explicitly indexed kv rows (prefill and decode semantics).

    Args:
        q: [T, H, D_qk] any float dtype (D_qk = 576 for DeepSeek: 512 latent | 64 rope).
        kv: [N, D_qk] any float dtype; one row per token (an unpacked paged cache reshaped to
            [num_blocks * block_size, 576], or the bf16 prefill workspace).
        indices: [T, topk] int32/int64 row numbers into kv. Invalid = < 0 or >= N: skipped,
            never read. A valid row listed several times counts each time.
        scale: softmax scale (float); score s = scale * q . k over all D_qk.
        topk_length: [T] int32/int64 or None. Only the first topk_length[t] indices of row t
            count (values > topk count as topk, values < 0 as 0).
        attn_sink: [H] float (fp32) or None. out *= exp(lse) / (exp(lse) + exp(sink[h]));
            lse and max_logits are unchanged by it.
        d_v: value width; v = kv[:, :d_v] (512: the latent is also the value).

    Returns (all float32, on q's device):
        out: [T, H, d_v] softmax(s) @ v; 0 for a row with no counted valid index.
        max_logits: [T, H] max of s over the counted indices; -inf for an empty row.
        lse: [T, H] natural log of sum_k exp(s_k) over the counted indices; -inf when empty.
        A row where some counted index has a non-finite score or value (NaN or inf in q or in
        the row) gets NaN in all three.
    """
    check_tensor("q", q, dtype=_FLOATS, ndim=3)
    T, H, D = q.shape
    check_tensor("kv", kv, dtype=_FLOATS, shape=(None, D), device=q.device)
    check_tensor("indices", indices, dtype=_INTS, ndim=2, device=q.device)
    if indices.shape[0] != T:
        fail("indices.shape[0]", f"{T} (q.shape[0])", indices.shape[0])
    if not 0 < d_v <= D:
        fail("d_v", f"an int in [1, {D}]", d_v)
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtype=_INTS, shape=(T,), device=q.device)
    if attn_sink is not None:
        check_tensor("attn_sink", attn_sink, dtype=_FLOATS, shape=(H,), device=q.device)
    scale = _as_float("scale", scale)
    N, K = kv.shape[0], indices.shape[1]

    idx = indices.long()
    counted = (idx >= 0) & (idx < N)
    if topk_length is not None:
        n = topk_length.long().clamp(0, K)
        counted &= torch.arange(K, device=q.device)[None, :] < n[:, None]
    safe = torch.where(counted, idx, torch.zeros_like(idx))
    src = kv if N > 0 else kv.new_zeros(1, D)
    sink = None if attn_sink is None else attn_sink.double()

    out = torch.empty(T, H, d_v, dtype=torch.float32, device=q.device)
    max_logits = torch.empty(T, H, dtype=torch.float32, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    rows = max(1, _CHUNK_ELEMS // max(1, K * max(D, H)))
    for t0 in range(0, T, rows):
        sl = slice(t0, t0 + rows)
        m = counted[sl]
        # Uncounted positions gather row 0 as a placeholder: zero it so NaN there cannot leak.
        k = torch.where(m.unsqueeze(-1), src[safe[sl]].double(), 0.0)  # [t, K, D]
        s = scale * torch.einsum("thd,tkd->thk", q[sl].double(), k)
        bad = ((~torch.isfinite(s) | ~torch.isfinite(k[..., :d_v]).all(-1).unsqueeze(1))
               & m.unsqueeze(1)).any(-1)  # [t, H]
        s = s.masked_fill(~m.unsqueeze(1), _NEG_INF)
        p, lse_c = _softmax(s, sink)
        out[sl] = torch.einsum("thk,tkd->thd", p, k[..., :d_v]).float()
        max_logits[sl] = (s.amax(-1) if K > 0 else torch.full_like(lse_c, _NEG_INF)).float()
        lse[sl] = lse_c.float()
        _nan_faults(bad, out[sl], max_logits[sl], lse[sl])
    return out, max_logits, lse


def sparse_mla_decode_ref(q, cache, indices, *, scale, topk_length=None, attn_sink=None, fmt=None):
    """Sparse MLA decode over a paged MLA cache; indices are global slots.

    Args:
        q: [T, H, 576] any float dtype.
        cache: [num_blocks, block_size, row] paged MLA cache, uint8 fp8_ds_mla (row 656) or bf16
            (row 576); may be a strided view (block stride > block_size rows).
        indices: [T, topk] int32/int64 slots block * block_size + offset; invalid = < 0 or
            >= num_blocks * block_size (skipped, never read).
        scale, topk_length, attn_sink: as in sparse_mla_ref.
        fmt: a quant.mla_formats descriptor, or None for mla_format_of(cache).

    The cache is unpacked with fmt.unpack to fp32 [num_blocks, block_size, 576] and reshaped to
    [num_blocks * block_size, 576] (slot -> (slot // block_size, slot % block_size)); then
    sparse_mla_ref with d_v = 512.

    Returns (out [T, H, 512] fp32, lse [T, H] fp32 natural log, -inf for an empty row).
    """
    fmt = mla_format_of(cache, "cache") if fmt is None else fmt
    check_tensor("cache", cache, ndim=3)
    nb, bs = cache.shape[:2]
    rows = fmt.unpack(cache).reshape(nb * bs, fmt.head_dim)
    out, _, lse = sparse_mla_ref(q, rows, indices, scale=scale, topk_length=topk_length,
                                 attn_sink=attn_sink, d_v=fmt.latent_dim)
    return out, lse


# ---------------------------------------------------------------------------------------------
# General MHA / GQA
# ---------------------------------------------------------------------------------------------

def _check_mha_options(H, device, window, softcap, alibi_slopes, sinks):
    if not (isinstance(window, Sequence) and len(window) == 2
            and all(isinstance(w, int) and w >= -1 for w in window)):
        fail("window", "(left, right) ints >= -1 (-1: unbounded)", window)
    if softcap < 0:
        fail("softcap", ">= 0 (0: off)", softcap)
    if alibi_slopes is not None:
        check_tensor("alibi_slopes", alibi_slopes, dtype=_FLOATS, shape=(H,), device=device)
    if sinks is not None:
        check_tensor("sinks", sinks, dtype=_FLOATS, shape=(H,), device=device)


def _mha_core(q, k, v, context_len, *, scale, causal, window, softcap, alibi_slopes, alibi_sqrt,
              sinks):
    """One request's attention, from the maths. The one masking/softmax core of the MHA oracles.

    q: [Lq, H, D], k: [Lk, H_kv, D], v: [Lk, H_kv, Dv] float64; query i sits at absolute key
    position context_len + i (bottom-right aligned). Returns (out [Lq, H, Dv], lse [Lq, H]) float64.
    Per query i (p = context_len + i), key j, head h:
        s = scale * q.k;  if softcap: s = softcap * tanh(s / softcap)
        masked (s = -inf) unless: (not causal or j <= p) and (left < 0 or j >= p - left)
                                  and (right < 0 or j <= p + right)
        ALiBi: s += slope[h] * (j - context_len), or with alibi_sqrt
               s += slope[h] * (-sqrt(p - j) if j <= p else 0)
        sinks: the denominator gains exp(sinks[h]) (no value vector) and lse includes it.
    A query whose unmasked keys include a non-finite raw score (before softcap) or value gets NaN
    out and lse; a bad value that a query does not attend leaves it clean here (the paged kernel
    may turn such a query NaN too when it shares a masked tile with one that attends the value:
    kernels/paged_attention/tile.py).
    """
    Lq, H, _ = q.shape
    Lk, H_kv = k.shape[:2]
    group = H // H_kv
    k = k.repeat_interleave(group, dim=1)  # query head h reads kv head h // group
    v = v.repeat_interleave(group, dim=1)
    left, right = window
    kpos = torch.arange(Lk, device=q.device)
    out = torch.empty(Lq, H, v.shape[-1], dtype=torch.float64, device=q.device)
    lse = torch.empty(Lq, H, dtype=torch.float64, device=q.device)
    sink = None if sinks is None else sinks.double()[:, None]  # [H, 1]
    rows = max(1, _CHUNK_ELEMS // max(1, H * Lk))
    for i0 in range(0, Lq, rows):
        i1 = min(Lq, i0 + rows)
        qpos = context_len + torch.arange(i0, i1, device=q.device)
        s = scale * torch.einsum("qhd,khd->hqk", q[i0:i1], k)  # [H, q, Lk]
        bad = ~torch.isfinite(s) | ~torch.isfinite(v).all(-1).T[:, None, :]  # [H, q, Lk]
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        allowed = torch.ones(i1 - i0, Lk, dtype=torch.bool, device=q.device)
        if causal:
            allowed &= kpos[None, :] <= qpos[:, None]
        if left >= 0:
            allowed &= kpos[None, :] >= qpos[:, None] - left
        if right >= 0:
            allowed &= kpos[None, :] <= qpos[:, None] + right
        s = s.masked_fill(~allowed, _NEG_INF)
        if alibi_slopes is not None:
            if alibi_sqrt:
                dist = (qpos[:, None] - kpos[None, :]).double()  # p - j, > 0 for past keys
                bias = torch.where(dist >= 0, -dist.clamp_min(0).sqrt(), 0.0)
            else:
                bias = (kpos - context_len).double()[None, :]
            s = s + alibi_slopes.double()[:, None, None] * bias
        p, lse_keys = _softmax(s, sink)
        # bad values as 0 in the dot (p = 0 there would still give 0 * NaN); the rows that attend
        # them turn NaN below
        v_ok = torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
        out[i0:i1] = torch.einsum("hqk,khd->qhd", p, v_ok)
        lse[i0:i1] = (lse_keys if sink is None else torch.logaddexp(lse_keys, sink)).T
        _nan_faults((bad & allowed[None]).any(-1).T, out[i0:i1], lse[i0:i1])
    return out, lse


def attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale, causal=False,
                         window=(-1, -1), softcap=0.0, alibi_slopes=None, alibi_sqrt=False,
                         sinks=None):
    """Contiguous (no cache) varlen attention, e.g. encoder attention (causal=False by default).

    Args:
        q: [Tq, H, D] any float dtype; k: [Tk, H_kv, D], v: [Tk, H_kv, Dv] any float dtype.
            GQA: query head h uses kv head h // (H // H_kv); H % H_kv must be 0.
        cu_seqlens_q: [R + 1] int, request r owns q rows cu_seqlens_q[r]:cu_seqlens_q[r+1].
        cu_seqlens_k: [R + 1] int, likewise for k/v rows.
        scale: softmax scale. causal, window (left, right; -1 unbounded), softcap (0 off),
            alibi_slopes [H] (+ alibi_sqrt), sinks [H]: as in paged_attention_ref, with
            context_len = k_len - q_len per request (bottom-right aligned).

    Returns (out [Tq, H, Dv] fp32, lse [Tq, H] fp32 natural log). An all-masked row: out = 0,
    lse = -inf (lse = sinks[h] when sinks are given). Rows past cu_seqlens_q[-1] belong to no
    request: out 0, lse -inf.
    """
    check_tensor("q", q, dtype=_FLOATS, ndim=3)
    Tq, H, D = q.shape
    check_tensor("k", k, dtype=_FLOATS, shape=(None, None, D), device=q.device)
    check_tensor("v", v, dtype=_FLOATS, shape=(k.shape[0], k.shape[1], None), device=q.device)
    H_kv = k.shape[1]
    if H_kv == 0 or H % H_kv:
        fail("k.shape[1] (H_kv)", f"a divisor of H = {H}", H_kv)
    check_tensor("cu_seqlens_q", cu_seqlens_q, dtype=_INTS, ndim=1)
    check_tensor("cu_seqlens_k", cu_seqlens_k, dtype=_INTS, shape=(cu_seqlens_q.shape[0],))
    _check_mha_options(H, q.device, window, softcap, alibi_slopes, sinks)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for name, cu, total in (("cu_seqlens_q", cq, Tq), ("cu_seqlens_k", ck, k.shape[0])):
        if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] > total:
            fail(name, f"non-decreasing from 0 to at most {total}", cu)
    out = torch.zeros(Tq, H, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((Tq, H), _NEG_INF, dtype=torch.float32, device=q.device)
    for r in range(len(cq) - 1):
        q_len, k_len = cq[r + 1] - cq[r], ck[r + 1] - ck[r]
        o, l = _mha_core(q[cq[r]:cq[r + 1]].double(), k[ck[r]:ck[r + 1]].double(),
                         v[ck[r]:ck[r + 1]].double(), k_len - q_len, scale=_as_float("scale", scale),
                         causal=causal, window=tuple(window), softcap=float(softcap),
                         alibi_slopes=alibi_slopes, alibi_sqrt=alibi_sqrt, sinks=sinks)
        out[cq[r]:cq[r + 1]] = o.float()
        lse[cq[r]:cq[r + 1]] = l.float()
    return out, lse


def _gather_paged(cache, blocks, offsets, layout, kv_scale, name):
    """Tokens (blocks[i], offsets[i]) of a paged cache -> [L, H_kv, D] float64, dequantized."""
    rows = cache[blocks, offsets] if layout == "NHD" else cache[blocks, :, offsets]
    if cache.dtype == torch.float8_e4m3fn:
        return rows.float().double() * (1.0 if kv_scale is None else _as_float(name, kv_scale))
    if kv_scale is not None and _as_float(name, kv_scale) != 1.0:
        fail(name, f"None or 1.0 for a {cache.dtype} cache (scales dequantize fp8 only)",
             _as_float(name, kv_scale))
    return rows.double()


def paged_attention_ref(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, *, scale,
                        causal=True, window=(-1, -1), softcap=0.0, alibi_slopes=None,
                        alibi_sqrt=False, sinks=None, k_scale=None, v_scale=None, layout="NHD",
                        k_scale_cache=None, k_smooth=None):
    """Attention of varlen queries over a paged KV cache (vLLM's FlashAttention semantics).

    Args:
        q: [T, H, D] any float dtype.
        k_cache, v_cache: [num_blocks, block_size, H_kv, D] ("NHD") or
            [num_blocks, H_kv, block_size, D] ("HND"); bf16/fp16/fp32, or float8_e4m3fn
            dequantized as float(fp8) * k_scale / v_scale (per-tensor; floats or 1-element
            tensors; None = 1.0; a non-fp8 cache accepts only None or 1.0). May be strided views.
            GQA: query head h uses kv head h // (H // H_kv).
            int8 caches (DESIGN.md; `quant/int8.py`): an int8 k_cache needs k_scale_cache
            [num_blocks, H_kv, block_size] fp32 (key = int8 * k_scale_cache[block, head, offset])
            and makes q quantized per (token, head) by `quantize_per_token_head_ref` and
            dequantized, as the kernels see it; an int8 v_cache (int8_qkv, only with an int8 K)
            takes v_scale [H_kv, D] fp32 per channel (value = int8 * v_scale[head, channel]);
            a bf16/fp16 v_cache beside an int8 K is int8_qk. k_smooth [H_kv, D] fp32 (int8 K
            only): the cache holds K / k_smooth, so q is multiplied by k_smooth (fp32) per
            channel of its KV head before it is quantized.
        block_table: [R, M] int32; token p of request r is at block block_table[r, p // block_size],
            offset p % block_size. Only positions p < seq_lens[r] are read.
        cu_seqlens_q: [R + 1] int; request r owns q rows cu_seqlens_q[r]:cu_seqlens_q[r+1].
        seq_lens: [R] int, total kv length of request r including its new tokens, so
            context_len = seq_len - q_len and query i sits at position context_len + i.
        scale: softmax scale; s = scale * q.k.
        causal: keys j <= context_len + i (bottom-right aligned).
        window: (left, right), -1 = unbounded: context_len + i - left <= j <= context_len + i + right
            (vLLM maps sliding_window w to (w - 1, 0)).
        softcap: c > 0: s = c * tanh(s / c), after scaling, before masking and bias.
        alibi_slopes: [H] float: s += slope[h] * (j - context_len); with alibi_sqrt,
            s += slope[h] * -sqrt(context_len + i - j) for j <= context_len + i, else + 0
            (vLLM's Triton unified attention).
        sinks: [H] float: the softmax denominator gains exp(sinks[h]) (no value vector); lse
            includes it.
        layout: "NHD" or "HND".

    Returns (out [T, H, D] fp32, lse [T, H] fp32 natural log). An all-masked row (possible when
    seq_len < q_len): out = 0, lse = -inf (lse = sinks[h] with sinks). Rows past
    cu_seqlens_q[-1] belong to no request: out 0, lse -inf.
    """
    check_tensor("q", q, dtype=_FLOATS, ndim=3)
    T, H, D = q.shape
    if layout not in ("NHD", "HND"):
        fail("layout", "'NHD' or 'HND'", repr(layout))
    cache_dtypes = _FLOATS + (torch.float8_e4m3fn, torch.int8)
    check_tensor("k_cache", k_cache, dtype=cache_dtypes, ndim=4, device=q.device)
    nb, H_kv = k_cache.shape[0], k_cache.shape[2 if layout == "NHD" else 1]
    bs = k_cache.shape[1 if layout == "NHD" else 2]
    want = (nb, bs, H_kv, D) if layout == "NHD" else (nb, H_kv, bs, D)
    check_tensor("k_cache", k_cache, shape=want)
    check_tensor("v_cache", v_cache, dtype=cache_dtypes, shape=want, device=q.device)
    if H_kv == 0 or H % H_kv:
        fail("H_kv (k_cache heads)", f"a divisor of H = {H}", H_kv)
    k_int8, v_int8 = k_cache.dtype == torch.int8, v_cache.dtype == torch.int8
    if v_int8 and not k_int8:
        fail("v_cache", "an int8 V only beside an int8 K (int8_qkv)", v_cache.dtype)
    if k_int8:
        check_tensor("k_scale_cache", k_scale_cache, dtype=torch.float32, shape=(nb, H_kv, bs),
                     device=q.device)
        if k_scale is not None:
            fail("k_scale", "None for an int8 k_cache (its scales are k_scale_cache)", k_scale)
        if k_smooth is not None:
            check_tensor("k_smooth", k_smooth, dtype=torch.float32, shape=(H_kv, D), device=q.device)
            q = q.float() * k_smooth.repeat_interleave(H // H_kv, dim=0)[None]
        q_i8, q_s = quantize_per_token_head_ref(q)
        q = dequantize_per_token_head(q_i8, q_s)
    elif k_scale_cache is not None or k_smooth is not None:
        fail("k_scale_cache, k_smooth", "None unless k_cache is int8", "a tensor")
    if v_int8:
        check_tensor("v_scale", v_scale, dtype=torch.float32, shape=(H_kv, D), device=q.device)
    check_tensor("block_table", block_table, dtype=_INTS, ndim=2, device=q.device)
    R = block_table.shape[0]
    check_tensor("cu_seqlens_q", cu_seqlens_q, dtype=_INTS, shape=(R + 1,))
    check_tensor("seq_lens", seq_lens, dtype=_INTS, shape=(R,))
    _check_mha_options(H, q.device, window, softcap, alibi_slopes, sinks)
    cq, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    if cq[0] != 0 or any(b < a for a, b in zip(cq, cq[1:])) or cq[-1] > T:
        fail("cu_seqlens_q", f"non-decreasing from 0 to at most {T}", cq)
    M = block_table.shape[1]
    out = torch.zeros(T, H, D, dtype=torch.float32, device=q.device)
    lse = torch.full((T, H), _NEG_INF, dtype=torch.float32, device=q.device)
    for r in range(R):
        L = lens[r]
        if not 0 <= L <= M * bs:
            fail(f"seq_lens[{r}]", f"in [0, {M * bs}] (block_table columns * block_size)", L)
        pos = torch.arange(L, device=q.device)
        blocks = block_table[r, pos // bs].long()
        if L and (int(blocks.min()) < 0 or int(blocks.max()) >= nb):
            fail(f"block_table[{r}] (used entries)", f"in [0, {nb})", blocks.tolist())
        if k_int8:
            k = _gather_paged(k_cache, blocks, pos % bs, layout, None, "k_scale")
            k = k * k_scale_cache[blocks, :, pos % bs].double()[:, :, None]
        else:
            k = _gather_paged(k_cache, blocks, pos % bs, layout, k_scale, "k_scale")
        if v_int8:
            v = _gather_paged(v_cache, blocks, pos % bs, layout, None, "v_scale")
            v = v * v_scale.double()[None]
        else:
            v = _gather_paged(v_cache, blocks, pos % bs, layout, v_scale, "v_scale")
        q_len = cq[r + 1] - cq[r]
        o, l = _mha_core(q[cq[r]:cq[r + 1]].double(), k, v, L - q_len,
                         scale=_as_float("scale", scale), causal=causal, window=tuple(window),
                         softcap=float(softcap), alibi_slopes=alibi_slopes, alibi_sqrt=alibi_sqrt,
                         sinks=sinks)
        out[cq[r]:cq[r + 1]] = o.float()
        lse[cq[r]:cq[r + 1]] = l.float()
    return out, lse


def local_attention_ref(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, *,
                        attn_chunk_size, scale, softcap=0.0, sinks=None, k_scale=None,
                        v_scale=None, layout="NHD"):
    """Chunked local attention (Llama 4's iRoPE layers) over a paged KV cache, from the maths.

    Positions are cut into chunks of C = attn_chunk_size: the query at position p (context_len + i,
    bottom-right aligned as in paged_attention_ref) attends causally within its own chunk, keys
    p - p % C .. p. Each query token is computed alone as paged_attention_ref with window
    (p % C, 0) over its request's real block table: nothing here knows of vLLM's virtual batches
    (`mla.local_attention`), which is what makes this an oracle for them.

    Args:
        q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale, softcap, sinks,
            k_scale, v_scale, layout: as paged_attention_ref (seq_lens[r] >= its query length).
        attn_chunk_size: C, a positive int.

    Returns (out [T, H, D] fp32, lse [T, H] fp32 natural log). Rows past cu_seqlens_q[-1] belong
    to no request: out 0, lse -inf.
    """
    check_tensor("q", q, dtype=_FLOATS, ndim=3)
    T, H, D = q.shape
    if (isinstance(attn_chunk_size, bool) or not isinstance(attn_chunk_size, int)
            or attn_chunk_size < 1):
        fail("attn_chunk_size", "a positive int", repr(attn_chunk_size))
    check_tensor("block_table", block_table, dtype=_INTS, ndim=2, device=q.device)
    R = block_table.shape[0]
    check_tensor("cu_seqlens_q", cu_seqlens_q, dtype=_INTS, shape=(R + 1,))
    check_tensor("seq_lens", seq_lens, dtype=_INTS, shape=(R,))
    cq, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    if cq[0] != 0 or any(b < a for a, b in zip(cq, cq[1:])) or cq[-1] > T:
        fail("cu_seqlens_q", f"non-decreasing from 0 to at most {T}", cq)
    out = torch.zeros(T, H, D, dtype=torch.float32, device=q.device)
    lse = torch.full((T, H), _NEG_INF, dtype=torch.float32, device=q.device)
    one = torch.tensor([0, 1], dtype=torch.int32, device=q.device)
    for r in range(R):
        ctx = lens[r] - (cq[r + 1] - cq[r])
        if ctx < 0:
            fail(f"seq_lens[{r}]", f">= its query length {cq[r + 1] - cq[r]}", lens[r])
        for i, t in enumerate(range(cq[r], cq[r + 1])):
            p = ctx + i
            o, l = paged_attention_ref(
                q[t:t + 1], k_cache, v_cache, block_table[r:r + 1], one,
                torch.tensor([p + 1], dtype=torch.int32, device=q.device),
                scale=scale, window=(p % attn_chunk_size, 0), softcap=softcap, sinks=sinks,
                k_scale=k_scale, v_scale=v_scale, layout=layout)
            out[t], lse[t] = o[0], l[0]
    return out, lse


# ---------------------------------------------------------------------------------------------
# Merging partial results
# ---------------------------------------------------------------------------------------------

def merge_attn_states_ref(a_out, a_lse, b_out, b_lse):
    """Merge two partial attention results over disjoint key sets.

    Args:
        a_out, b_out: [T, H, D] any float dtype, each normalized over its own keys.
        a_lse, b_lse: [T, H] natural-log denominators of a and b. +inf or -inf means that part
            is empty (FlashAttention reports +inf for an empty split): it is ignored, whatever its
            out holds (NaN included).

    Returns (out [T, H, D] fp32, lse [T, H] fp32):
        lse = log(exp(a_lse) + exp(b_lse)),
        out = exp(a_lse - lse) * a_out + exp(b_lse - lse) * b_out;
        both empty -> out 0, lse -inf. A non-empty part with a NaN lse or a NaN or inf in its
        out makes the row's out and lse NaN; otherwise never NaN.
    """
    check_tensor("a_out", a_out, dtype=_FLOATS, ndim=3)
    check_tensor("b_out", b_out, dtype=_FLOATS, shape=tuple(a_out.shape), device=a_out.device)
    check_tensor("a_lse", a_lse, dtype=_FLOATS, shape=tuple(a_out.shape[:2]), device=a_out.device)
    check_tensor("b_lse", b_lse, dtype=_FLOATS, shape=tuple(a_out.shape[:2]), device=a_out.device)
    la, lb = a_lse.double(), b_lse.double()
    a_empty, b_empty = torch.isinf(la), torch.isinf(lb)
    la = la.masked_fill(a_empty, _NEG_INF)
    lb = lb.masked_fill(b_empty, _NEG_INF)
    lse = torch.logaddexp(la, lb)
    ref = lse.masked_fill(lse == _NEG_INF, 0.0)
    wa = torch.exp(la - ref).unsqueeze(-1)
    wb = torch.exp(lb - ref).unsqueeze(-1)
    out = (torch.where(a_empty.unsqueeze(-1), 0.0, wa * a_out.double())
           + torch.where(b_empty.unsqueeze(-1), 0.0, wb * b_out.double()))
    bad = ((~a_empty & (torch.isnan(la) | ~torch.isfinite(a_out).all(-1)))
           | (~b_empty & (torch.isnan(lb) | ~torch.isfinite(b_out).all(-1))))
    out, lse = out.float(), lse.float()
    _nan_faults(bad, out, lse)
    return out, lse


# ---------------------------------------------------------------------------------------------
# Index conversion
# ---------------------------------------------------------------------------------------------

def convert_req_index_ref(req_id, block_table, token_indices, block_size, *, workspace=None,
                          seq_lens=None):
    """Per-request token index -> global slot (DESIGN.md, Index conversion), vectorized torch.

    req_id [T], block_table [R, M], token_indices [T, K], block_size > 0; workspace optional
    (request_ids [T], -1 for decode tokens; starts [R_prefill]); seq_lens optional [R]. Returns
    int32 [T, K]: -1 where idx < 0, idx >= seq_lens[req] (when given, on both paths; a req_id
    outside [0, R) has length 0 then), idx // block_size >= M, req_id outside [0, R), the block
    table entry < 0, or the result exceeds int32; else block_table[req, idx // bs] * bs + idx % bs,
    or for a token with request_ids[t] >= 0: starts[request_ids[t]] + idx (-1 if idx < 0 or the
    id >= R_prefill).
    """
    idx = token_indices.long()
    R, M = block_table.shape
    req = req_id.long()[:, None].expand_as(idx)
    if seq_lens is not None:
        in_req = (req >= 0) & (req < R)
        n_len = torch.where(in_req, seq_lens.long()[req.clamp(0, max(R - 1, 0))] if R else 0, 0)
        idx = torch.where(idx < n_len, idx, -1)  # past its request: invalid like a negative index
    blk = torch.where(idx >= 0, idx // block_size, 0)
    ok = (idx >= 0) & (blk < M) & (req >= 0) & (req < R)
    entry = block_table.long()[req.clamp(0, max(R - 1, 0)), blk.clamp(0, max(M - 1, 0))] if R * M else \
        torch.full_like(idx, -1)
    slot = entry * block_size + idx % block_size
    ok &= (entry >= 0) & (slot <= 2**31 - 1)
    out = torch.where(ok, slot, -1)
    if workspace is not None:
        rid, starts = workspace[0].long()[:, None].expand_as(idx), workspace[1].long()
        pf = rid >= 0
        has = pf & (rid < starts.numel())
        row = (starts[rid.clamp(0, max(starts.numel() - 1, 0))] if starts.numel() else torch.zeros_like(idx)) + idx
        pf_out = torch.where(has & (idx >= 0) & (row <= 2**31 - 1), row, -1)
        out = torch.where(pf, pf_out, out)
    return out.to(torch.int32)
