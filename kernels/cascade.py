"""Cascade attention: a prefix shared by every request attended once for all queries, then merged.

When all R requests of a batch start with the same `common_prefix_len` cached tokens (same
physical blocks: a shared system prompt, parallel sampling), plain attention reads those blocks
R times. Cascade attention (vLLM's FlashAttention backend, FlashInfer's cascade) reads them once:

    prefix:  every query token of the batch as ONE pseudo-request, non-causal over the prefix
             keys (positions < common_prefix_len, all of them context of every query, so no mask
             applies), through the first request's block table. Sinks join here (they count
             once per row and the prefix lse carries them into the merge).
    suffix:  each request, causal, over its own keys past the prefix: seq_len - common_prefix_len
             keys through block_table[:, common_prefix_len // block_size:].
    merge:   `kernels.merge.merge_attn_states` of the two (out, lse) pairs.

The result equals `paged_attention` over the whole context. The prefix must be whole blocks
(vLLM asserts it; its model runner rounds the shared prefix down to whole blocks, as
`mla.mha.plan.build_attention_plan` does) and no longer than any request's context
(seq_len - q_len): the prefix keys are then visible to every query. Sliding windows and ALiBi
depend on each query's own position and are not supported (as in vLLM).

When it pays off is vLLM's heuristic, at the layer level: `mla.mha.cascade.use_cascade_attention`.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton

from openmla.kernels.device import num_sms
from openmla.kernels.merge import merge_attn_states
from openmla.kernels.paged_attention import paged_attention
from openmla.kernels.paged_attention.launch import SHORT_MAX_Q, SHORT_MAX_ROWS
from openmla.quant.validate import check_out, check_scale, check_tensor, fail
from openmla.quant.kv_cache import LAYOUTS, cache_dims
from openmla.quant.mha_formats import mha_format_of

__all__ = ["cascade_attention"]

# Prefix pass of many rows (the kernel's long-query class, which never splits on its own): split
# its keys when the row blocks alone leave the GPU underfilled. Rows per program assumed 64 (the
# kernel's typical BLOCK_M); a split keeps >= 256 keys; at most 64 splits; 2 programs per SM.
_PREFIX_ROWS_PER_PROGRAM = 64
_PREFIX_MIN_KEYS_PER_SPLIT = 256
_PREFIX_MAX_SPLITS = 64
_PREFIX_WAVES = 2

def _prefix_num_splits(rows: int, tokens: int, h_kv: int, prefix_len: int,
                       device: torch.device) -> Optional[int]:
    """Split count forced on the prefix pass, or None to leave it to paged_attention.

    Short pseudo-requests (<= SHORT_MAX_Q tokens, <= SHORT_MAX_ROWS packed rows) already get
    split-KV from the kernel. A long one would run cdiv(rows, 64) * H_kv programs over the whole
    prefix: with a decode batch of, say, 64 requests that is a handful of programs on a GPU of 132
    SMs, each reading the entire prefix. Splitting the prefix keys fills the GPU."""
    if tokens <= SHORT_MAX_Q and rows <= SHORT_MAX_ROWS:
        return None
    programs = triton.cdiv(rows, _PREFIX_ROWS_PER_PROGRAM) * h_kv
    want = triton.cdiv(_PREFIX_WAVES * num_sms(device), programs)
    splits = min(want, _PREFIX_MAX_SPLITS, triton.cdiv(prefix_len, _PREFIX_MIN_KEYS_PER_SPLIT))
    return splits if splits > 1 else None


def cascade_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      seq_lens: torch.Tensor, *, common_prefix_len: int, scale: float,
                      softcap: float = 0.0, sinks: Optional[torch.Tensor] = None,
                      k_scale: Optional[torch.Tensor] = None,
                      v_scale: Optional[torch.Tensor] = None,
                      k_scale_cache: Optional[torch.Tensor] = None,
                      k_smooth: Optional[torch.Tensor] = None, fmt=None,
                      out: Optional[torch.Tensor] = None, return_lse: bool = False,
                      layout: str = "NHD", max_query_len: Optional[int] = None,
                      prefix_cu_seqlens_q: Optional[torch.Tensor] = None,
                      prefix_seq_lens: Optional[torch.Tensor] = None,
                      suffix_seq_lens: Optional[torch.Tensor] = None):
    """Causal paged attention of a batch whose requests share their first common_prefix_len
    tokens, reading the shared prefix once (module docstring).

    Args:
        q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale, softcap, sinks,
        k_scale, v_scale, k_scale_cache, k_smooth, fmt, out, return_lse, layout: as
            `kernels.paged_attention.paged_attention` (any cache format it takes, int8 included)
            (causal; no window, no ALiBi). Every request's first common_prefix_len // block_size
            block table entries must be the same blocks (what makes the prefix shared); the
            prefix is read through row 0.
        common_prefix_len: a positive multiple of the cache's block_size, <= every request's
            context length seq_len - q_len (neither is checked on the device: a sync). ValueError
            otherwise (vLLM asserts the same).
        max_query_len: python int >= every query length (picks tile shapes of the suffix pass);
            None: as paged_attention (may read cu_seqlens_q once).
        prefix_cu_seqlens_q: [2] int32 = [0, cu_seqlens_q[R]]; prefix_seq_lens: [1] int32 =
            [common_prefix_len]; suffix_seq_lens: [R] int32 = seq_lens - common_prefix_len.
            Device tensors a plan builds once per step (mla.mha.plan.build_attention_plan);
            computed here on the device when None (no host sync either way).

    Returns out [T, H, D] in q's dtype (and lse [T, H] fp32 with return_lse), equal to
    paged_attention(..., causal=True) over the full context. Rows past cu_seqlens_q[R] get 0 and
    lse -inf.
    """
    check_tensor("q", q, ndim=3)
    check_tensor("k_cache", k_cache, ndim=4)
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2)
    check_tensor("cu_seqlens_q", cu_seqlens_q, dtype=torch.int32, ndim=1)
    if layout not in LAYOUTS:
        fail("layout", "'NHD' or 'HND'", repr(layout))
    T, H, D = q.shape
    R, M = block_table.shape
    _, page, h_kv, _ = cache_dims(k_cache, layout)
    if (isinstance(common_prefix_len, bool) or not isinstance(common_prefix_len, int)
            or common_prefix_len <= 0 or common_prefix_len % page):
        fail("common_prefix_len", f"a positive multiple of block_size = {page} (whole shared "
             "blocks; round down to whole blocks before choosing cascade)", repr(common_prefix_len))
    num_prefix_blocks = common_prefix_len // page
    if num_prefix_blocks > M:
        fail("common_prefix_len", f"<= block_table columns * block_size = {M * page}",
             common_prefix_len)
    # Checked here too: an empty batch returns before paged_attention would check them.
    scale = check_scale("scale", scale)
    out = check_out(out, q, D)
    lse = torch.empty((T, H), dtype=torch.float32, device=q.device) if return_lse else None
    if R == 0 or T == 0:
        out.zero_()
        if lse is not None:
            lse.fill_(float("-inf"))
        return (out, lse) if return_lse else out
    if prefix_cu_seqlens_q is None:
        prefix_cu_seqlens_q = cu_seqlens_q[::R].contiguous()  # [cu[0] = 0, cu[R]], no sync
    if prefix_seq_lens is None:
        prefix_seq_lens = torch.full((1,), common_prefix_len, dtype=torch.int32, device=q.device)
    if suffix_seq_lens is None:
        suffix_seq_lens = seq_lens - common_prefix_len
    check_tensor("prefix_cu_seqlens_q", prefix_cu_seqlens_q, dtype=torch.int32, shape=(2,))
    check_tensor("prefix_seq_lens", prefix_seq_lens, dtype=torch.int32, shape=(1,))
    check_tensor("suffix_seq_lens", suffix_seq_lens, dtype=torch.int32, shape=(R,))
    if fmt is None:  # resolved once for both passes
        fmt = mha_format_of(k_cache, v_cache)

    common = dict(scale=scale, softcap=softcap, k_scale=k_scale, v_scale=v_scale, layout=layout,
                  k_scale_cache=k_scale_cache, k_smooth=k_smooth, return_lse=True, fmt=fmt)
    prefix_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    splits = _prefix_num_splits(T * (H // max(h_kv, 1)), T, h_kv, common_prefix_len, q.device)
    _, prefix_lse = paged_attention(
        q, k_cache, v_cache, block_table[:1, :num_prefix_blocks], prefix_cu_seqlens_q,
        prefix_seq_lens, causal=False, sinks=sinks, out=prefix_out, max_query_len=T,
        num_splits=splits, **common)
    suffix_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    _, suffix_lse = paged_attention(
        q, k_cache, v_cache, block_table[:, num_prefix_blocks:], cu_seqlens_q, suffix_seq_lens,
        causal=True, out=suffix_out, max_query_len=max_query_len, **common)
    merge_attn_states(out, prefix_out, prefix_lse, suffix_out, suffix_lse, lse)
    return (out, lse) if return_lse else out
