"""fp32 oracles of sparse MLA (prefill over kv rows, decode over a paged MLA cache).

Conventions: kernels/reference/__init__.py."""
from __future__ import annotations

import torch

from openmla.quant.validate import check_tensor, fail
from openmla.quant.mla_cache_format import mla_format_of
from openmla.kernels.reference._common import (_CHUNK_ELEMS, _FLOATS, _INTS, _NEG_INF, _as_float,
                                               _nan_faults, _softmax)

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


def _slot_rows(cache, fmt, name: str):
    """A paged MLA cache -> (its format, fp32 rows [num_blocks * block_size, head_dim]); row
    slot = block * block_size + offset. [nb, bs, row] or FlashMLA's [nb, bs, 1, row]."""
    fmt = mla_format_of(cache, name) if fmt is None else fmt
    check_tensor(name, cache)
    if cache.dim() not in (3, 4) or (cache.dim() == 4 and cache.shape[2] != 1):
        fail(f"{name}.shape", "[num_blocks, block_size, row] or [num_blocks, block_size, 1, row]",
             tuple(cache.shape))
    nb, bs = cache.shape[:2]
    return fmt, fmt.unpack(cache).reshape(nb * bs, fmt.head_dim)


def _counted_slots(indices, num_slots: int, lengths, name: str, length_name: str):
    """indices [T, K] -> int64 [T, K] with every uncounted position -1: invalid slots (< 0 or
    >= num_slots) and positions at or past lengths[t] (lengths clamped to [0, K])."""
    check_tensor(name, indices, dtype=_INTS, ndim=2)
    idx = indices.long()
    keep = (idx >= 0) & (idx < num_slots)
    if lengths is not None:
        check_tensor(length_name, lengths, dtype=_INTS, shape=(idx.shape[0],), device=idx.device)
        n = lengths.long().clamp(0, idx.shape[1])
        keep &= torch.arange(idx.shape[1], device=idx.device)[None, :] < n[:, None]
    return torch.where(keep, idx, torch.full_like(idx, -1))


def sparse_mla_decode_ref(q, cache, indices, *, scale, topk_length=None, attn_sink=None, fmt=None,
                          extra_cache=None, extra_indices=None, extra_topk_length=None, extra_fmt=None):
    """Sparse MLA decode over a paged MLA cache, optionally with a second cache whose selected
    tokens join the same softmax (FlashMLA's extra_k_cache, DeepSeek-V4); indices are slots.

    Args:
        q: [T, H, D_qk] any float dtype; D_qk = the cache format's head_dim (576 for fp8_ds_mla
            and bf16, 512 for FP8_MODEL1).
        cache: [num_blocks, block_size, row] or [num_blocks, block_size, 1, row] paged MLA cache:
            uint8 fp8_ds_mla (row 656), uint8 FP8_MODEL1 (row 584, laid out per block) or bf16
            (row 576); strided views are fine.
        indices: [T, topk] int32/int64 slots block * block_size + offset; invalid = < 0 or
            >= num_blocks * block_size (skipped, never read).
        scale: softmax scale (float); s = scale * q . k over all D_qk.
        topk_length: [T] int or None: only the first topk_length[t] of indices[t] count (the
            first list only).
        attn_sink: [H] fp32 or None, applied once to the combined softmax:
            out *= exp(lse) / (exp(lse) + exp(sink[h])); lse unchanged by it.
        fmt: the cache's format descriptor, or None for mla_format_of(cache).
        extra_cache: None, or a second paged cache (own block size, own format; same head_dim
            and value width as `cache`).
        extra_indices: [T, extra_topk] slots into extra_cache (invalid: < 0 or >= its slots);
            given exactly when extra_cache is.
        extra_topk_length: [T] int or None: limits extra_indices as topk_length limits indices.
        extra_fmt: extra_cache's format, or None for mla_format_of(extra_cache).

    Both caches are unpacked with their fmt.unpack to fp32 rows; the counted keys of both lists
    form one softmax (a slot listed twice counts twice), V = the first latent_dim values of a
    key (512: the latent for V3.2, the whole token for MODEL1); then as sparse_mla_ref.

    Returns (out [T, H, d_v] fp32, lse [T, H] fp32 natural log, -inf for a row with no counted
    key). A counted key with a non-finite score or value makes its row NaN.
    """
    fmt, rows = _slot_rows(cache, fmt, "cache")
    if extra_cache is None:
        if extra_indices is not None or extra_topk_length is not None or extra_fmt is not None:
            fail("extra_cache", "a cache when extra_indices, extra_topk_length or extra_fmt is given", None)
        out, _, lse = sparse_mla_ref(q, rows, indices, scale=scale, topk_length=topk_length,
                                     attn_sink=attn_sink, d_v=fmt.latent_dim)
        return out, lse
    if extra_indices is None:
        fail("extra_indices", "[T, extra_topk] slots when extra_cache is given", None)
    extra_fmt, extra_rows = _slot_rows(extra_cache, extra_fmt, "extra_cache")
    for what in ("head_dim", "latent_dim"):
        if getattr(extra_fmt, what) != getattr(fmt, what):
            fail(f"extra_cache ({extra_fmt.name}) {what}", f"{getattr(fmt, what)} (the {what} of cache, "
                 f"{fmt.name})", getattr(extra_fmt, what))
    if extra_indices.shape[0] != indices.shape[0]:
        fail("extra_indices.shape[0]", f"{indices.shape[0]} (indices.shape[0])", extra_indices.shape[0])
    n0 = rows.shape[0]
    first = _counted_slots(indices, n0, topk_length, "indices", "topk_length")
    second = _counted_slots(extra_indices, extra_rows.shape[0], extra_topk_length, "extra_indices",
                            "extra_topk_length")
    # One table of rows, the extra cache's after the first's; uncounted positions stay -1.
    both = torch.cat([first, torch.where(second >= 0, second + n0, second)], dim=1)
    out, _, lse = sparse_mla_ref(q, torch.cat([rows, extra_rows.to(rows.device)]), both.to(q.device),
                                 scale=scale, attn_sink=attn_sink, d_v=fmt.latent_dim)
    return out, lse


def head_matmul_ref(x, w, tail=None):
    """The per-head projections around MLA's latent attention (kernels.head_matmul).

    x: [T, H, K], w: [H, K, N], tail: optional [T, H, R] (any float dtypes).
    Returns float32 [T, H, N (+ R)]: x[t, h] @ w[h] summed in float64, then tail[t, h] appended.
    """
    check_tensor("x", x, ndim=3)
    check_tensor("w", w, ndim=3)
    if tuple(w.shape[:2]) != tuple(x.shape[1:]):
        fail("w.shape", f"({x.shape[1]}, {x.shape[2]}, N)", tuple(w.shape))
    prod = torch.einsum("thk,hkn->thn", x.double(), w.double().to(x.device)).float()
    if tail is None:
        return prod
    return torch.cat([prod, tail.float()], dim=-1)
