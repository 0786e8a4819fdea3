"""`varlen_attention`: varlen attention over contiguous keys and values, no cache (encoder
attention).

The kernel is `paged_attention`'s (kernel.py) with IS_PAGED off: request r's keys are rows
cu_seqlens_k[r]:cu_seqlens_k[r+1] of k and v; semantics (masks, softcap, ALiBi, sinks, lse) are
`paged_attention`'s, bottom-right aligned with context_len = k_len - q_len. Oracle:
`kernels.reference.attention_varlen_ref`.
"""
from __future__ import annotations

from typing import Optional

import torch

from openmla.kernels.paged_attention.checks import (check_q_out, check_score_options,
                                                    query_len_bound)
from openmla.kernels.paged_attention.launch import ScoreOptions, launch_varlen
from openmla.quant.validate import check_same_device, check_tensor, fail


@torch.library.custom_op("openmla::varlen_attention", mutates_args=("out", "lse"))
def _varlen_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                         out: torch.Tensor, lse: Optional[torch.Tensor], scale: float,
                         causal: bool, window_left: int, window_right: int, softcap: float,
                         alibi_slopes: Optional[torch.Tensor], alibi_sqrt: bool,
                         sinks: Optional[torch.Tensor], max_query_len: int, max_kv_len: int
                         ) -> None:
    opts = ScoreOptions(scale, causal, (window_left, window_right), softcap, alibi_slopes,
                        alibi_sqrt, sinks)
    launch_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, opts, max_q=max_query_len,
                  max_kv=max_kv_len)


@_varlen_attention_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, *args):
    return None


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *, scale: float,
                     causal: bool = False, window: tuple = (-1, -1), softcap: float = 0.0,
                     alibi_slopes: Optional[torch.Tensor] = None, alibi_sqrt: bool = False,
                     sinks: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                     return_lse: bool = False, max_query_len: Optional[int] = None,
                     max_kv_len: Optional[int] = None):
    """Varlen attention over contiguous keys and values, no cache (encoder attention).

    The kernel of `paged_attention` with keys of request r read from rows
    cu_seqlens_k[r]:cu_seqlens_k[r+1] of k and v.

    Args:
        q: [Tq, H, D] bf16/fp16, last dim contiguous, D in 1..256.
        k, v: [Tk, H_kv, D] in q's dtype, last dim contiguous; H % H_kv == 0.
        cu_seqlens_q, cu_seqlens_k: [R + 1] int32 row offsets of each request in q and in k/v.
        scale, window, softcap, alibi_slopes (+ alibi_sqrt), sinks, out, return_lse: as in
            `paged_attention`, with context_len = k_len - q_len (bottom-right aligned).
        causal: False by default (encoder attention).
        max_query_len: as in `paged_attention`.
        max_kv_len: optional python int >= every key length; only bounds the split count of
            short queries (None: Tk).

    Returns out [Tq, H, D] in q's dtype (and lse [Tq, H] fp32 with return_lse).
    """
    out, lse = check_q_out(q, out, return_lse)
    T, H, D = q.shape
    check_tensor("k", k, dtype=q.dtype, shape=(None, None, D), last_dim_contiguous=True)
    H_kv = k.shape[1]
    if H_kv == 0 or H % H_kv:
        fail("k.shape[1] (H_kv)", f"a divisor of H = {H}", H_kv)
    check_tensor("v", v, dtype=q.dtype, shape=tuple(k.shape), last_dim_contiguous=True)
    check_tensor("cu_seqlens_q", cu_seqlens_q, dtype=torch.int32, ndim=1, contiguous=True)
    R = cu_seqlens_q.shape[0] - 1
    if R < 0:
        fail("cu_seqlens_q.shape", "(R + 1,) with R >= 0", tuple(cu_seqlens_q.shape))
    check_tensor("cu_seqlens_k", cu_seqlens_k, dtype=torch.int32, shape=(R + 1,), contiguous=True)
    opts = check_score_options(H, scale, causal, window, softcap, alibi_slopes, alibi_sqrt, sinks)
    check_same_device(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      out=out, alibi_slopes=alibi_slopes, sinks=sinks)
    if T > 0:
        max_q = query_len_bound(max_query_len, cu_seqlens_q, T, R)
        max_kv = k.shape[0] if max_kv_len is None else int(max_kv_len)
        if torch.compiler.is_compiling():  # torch.compile traces the registered op
            _varlen_attention_op(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, opts.scale,
                                 opts.causal, opts.window[0], opts.window[1], opts.softcap,
                                 alibi_slopes, opts.alibi_sqrt, sinks, max_q, max_kv)
        else:  # eager and CUDA-graph capture: straight to the launch (paged.py says why)
            launch_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, opts, max_q=max_q,
                          max_kv=max_kv)
    return (out, lse) if return_lse else out
