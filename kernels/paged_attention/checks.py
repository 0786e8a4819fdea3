"""Boundary checks shared by `paged_attention` and `varlen_attention`: q and out, the score
options, and the query-length bound that picks the tile class."""
from __future__ import annotations

import math

import torch

from openmla.kernels.paged_attention.launch import SHORT_MAX_Q, ScoreOptions
from openmla.quant.validate import check_out, check_scale, check_tensor, fail

MAX_HEAD_DIM = 256
_Q_DTYPES = (torch.bfloat16, torch.float16)


def check_score_options(H, scale, causal, window, softcap, alibi_slopes, alibi_sqrt,
                        sinks) -> ScoreOptions:
    """The score options of an op over H query heads, checked and normalised."""
    scale = check_scale("scale", scale)
    if not (isinstance(window, (tuple, list)) and len(window) == 2
            and all(isinstance(w, int) and w >= -1 for w in window)):
        fail("window", "(left, right) ints >= -1 (-1: unbounded)", window)
    softcap = float(softcap)
    if not (math.isfinite(softcap) and softcap >= 0):
        fail("softcap", "a finite float >= 0 (0: off)", softcap)
    if alibi_slopes is not None:
        check_tensor("alibi_slopes", alibi_slopes, dtype=torch.float32, shape=(H,), contiguous=True)
    if sinks is not None:
        check_tensor("sinks", sinks, dtype=torch.float32, shape=(H,), contiguous=True)
    return ScoreOptions(scale, bool(causal), (int(window[0]), int(window[1])), softcap,
                        alibi_slopes, bool(alibi_sqrt), sinks)


def check_q_out(q, out, return_lse):
    """q [T, H, D] and the outputs: out (`quant.validate.check_out`, D wide) and lse [T, H] fp32
    when return_lse (else None: the kernel skips its store)."""
    check_tensor("q", q, dtype=_Q_DTYPES, ndim=3, last_dim_contiguous=True)
    T, H, D = q.shape
    if not 1 <= D <= MAX_HEAD_DIM:
        raise NotImplementedError(f"head size {D}: supported are 1..{MAX_HEAD_DIM}")
    out = check_out(out, q, D)
    lse = torch.empty((T, H), dtype=torch.float32, device=q.device) if return_lse else None
    return out, lse


def query_len_bound(max_query_len, cu_seqlens_q, T, R):
    """A python int bounding every query length (only picks tile shapes and splits)."""
    if max_query_len is not None:
        if not (isinstance(max_query_len, int) and max_query_len >= 0):
            fail("max_query_len", "None or an int >= 0", max_query_len)
        return max_query_len
    # With at least one token per request no query exceeds T - R + 1: decode batches are
    # recognised with no device read. Only longer bounds pay one sync for the true maximum.
    bound = max(T - R + 1, 1)
    if bound <= SHORT_MAX_Q or R == 0:
        return bound
    return int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
