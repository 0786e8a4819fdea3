"""fp32 oracles of general MHA / GQA: varlen, paged (bf16, fp8, int8 caches), local attention.

Conventions: kernels/reference/__init__.py."""
from __future__ import annotations

from typing import Sequence

import torch

from openmla.quant.validate import check_tensor, fail
from openmla.quant.int8 import dequantize_per_token_head, quantize_per_token_head_ref
from openmla.kernels.reference._common import (_CHUNK_ELEMS, _FLOATS, _INTS, _NEG_INF, _as_float,
                                               _nan_faults, _softmax)

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
    # query head h = g * group + j reads kv head g: q as [Lq, H_kv, group, D], no copies of k, v
    q = q.reshape(Lq, H_kv, group, q.shape[-1])
    # keys with a non-finite value vector, [H, 1, Lk]; the values with those as 0 for the dot
    # (p = 0 there would still give 0 * NaN): the rows that attend them turn NaN below
    v_bad = (~torch.isfinite(v).all(-1)).repeat_interleave(group, dim=1).T[:, None, :]
    v_ok = torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
    left, right = window
    kpos = torch.arange(Lk, device=q.device)
    out = torch.empty(Lq, H, v.shape[-1], dtype=torch.float64, device=q.device)
    lse = torch.empty(Lq, H, dtype=torch.float64, device=q.device)
    sink = None if sinks is None else sinks.double()[:, None]  # [H, 1]
    rows = max(1, _CHUNK_ELEMS // max(1, H * Lk))
    for i0 in range(0, Lq, rows):
        i1 = min(Lq, i0 + rows)
        qpos = context_len + torch.arange(i0, i1, device=q.device)
        s = scale * torch.einsum("qgjd,kgd->gjqk", q[i0:i1], k).reshape(H, i1 - i0, Lk)  # [H, q, Lk]
        bad = ~torch.isfinite(s) | v_bad  # [H, q, Lk]
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
        out[i0:i1] = torch.einsum("gjqk,kgd->qgjd", p.reshape(H_kv, group, i1 - i0, Lk),
                                  v_ok).reshape(i1 - i0, H, -1)
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
