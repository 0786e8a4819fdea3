"""fp32 oracles of sparse MLA (prefill over kv rows, decode over a paged MLA cache).

Conventions: kernels/reference/__init__.py."""
from __future__ import annotations

import torch

from openmla.quant.validate import check_tensor, fail
from openmla.quant.mla_formats import mla_format_of
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
