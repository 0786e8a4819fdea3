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
`mla.attention_plan.build_attention_plan` does) and no longer than any request's context
(seq_len - q_len): the prefix keys are then visible to every query. Sliding windows and ALiBi
depend on each query's own position and are not supported (as in vLLM).

`use_cascade_attention` is vLLM's heuristic deciding when this pays off.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np
import torch
import triton

from openmla.kernels._device import num_sms
from openmla.kernels.merge import merge_attn_states
from openmla.kernels.paged_attention import SHORT_MAX_Q, SHORT_MAX_ROWS, paged_attention
from openmla.quant._validate import check_tensor, fail
from openmla.quant.kv_cache import LAYOUTS, cache_dims

__all__ = ["cascade_attention", "use_cascade_attention", "MIN_CASCADE_PREFIX", "MIN_CASCADE_REQS"]

# vLLM's thresholds (use_cascade_attention): shorter prefixes and smaller batches never pay off.
MIN_CASCADE_PREFIX = 256
MIN_CASCADE_REQS = 8
# vLLM's performance model assumes FlashAttention's default 128 x 128 tiles.
_Q_TILE = 128
_KV_TILE = 128
# Prefix pass of many rows (the kernel's long-query class, which never splits on its own): split
# its keys when the row blocks alone leave the GPU underfilled. Rows per program assumed 64 (the
# kernel's typical BLOCK_M); a split keeps >= 256 keys; at most 64 splits; 2 programs per SM.
_PREFIX_ROWS_PER_PROGRAM = 64
_PREFIX_MIN_KEYS_PER_SPLIT = 256
_PREFIX_MAX_SPLITS = 64
_PREFIX_WAVES = 2

HostInts = Union[Sequence[int], np.ndarray, torch.Tensor]


def use_cascade_attention(common_prefix_len: int, query_lens: HostInts, num_query_heads: int,
                          num_kv_heads: int, *, use_alibi: bool = False,
                          use_sliding_window: bool = False, use_local_attention: bool = False,
                          num_sms: int, dcp_world_size: int = 1) -> bool:
    """vLLM's decision (FlashAttention backend, `use_cascade_attention`): is cascade attention
    supported here and likely faster than plain attention? Host-only, no device access.

    Args:
        common_prefix_len: tokens shared by every request (already whole blocks and <= every
            request's context, as the engine computes it).
        query_lens: [R] host ints, query tokens per request.
        num_query_heads, num_kv_heads: H and H_kv of the layer.
        use_alibi, use_sliding_window, use_local_attention: layer features cascade does not
            support.
        num_sms: streaming multiprocessors of the GPU (`kernels._device.num_sms`).
        dcp_world_size: decode context parallelism; > 1 disables cascade (as vLLM).

    Rules, in order (vLLM's):
        1. common_prefix_len < 256: False (too short to pay off; the common case).
        2. ALiBi, sliding window or local attention: False (unsupported).
        3. fewer than 8 requests: False. 4. dcp_world_size > 1: False.
        5. Plain attention would not use FlashDecoding (GQA ratio 1, or some query_len != 1):
           True, cascade saves the repeated prefix reads.
        6. Otherwise compare a rough model: cascade runs H * cdiv(R, 128) CTAs per 128-key
           prefix tile in waves of num_sms; FlashDecoding runs R * H_kv * cdiv(H / H_kv, 128)
           CTAs per tile. True when cdiv(cascade CTAs, num_sms) * tiles <
           cdiv(FlashDecoding CTAs * tiles, num_sms).
    """
    if common_prefix_len < MIN_CASCADE_PREFIX:
        return False
    if use_alibi or use_sliding_window or use_local_attention:
        return False
    lens = np.asarray(query_lens.tolist() if isinstance(query_lens, torch.Tensor) else query_lens)
    num_reqs = int(lens.shape[0])
    if num_reqs < MIN_CASCADE_REQS:
        return False
    if dcp_world_size > 1:
        return False
    gqa = num_query_heads // num_kv_heads
    flash_decoding = gqa > 1 and bool(np.all(lens == 1))
    if not flash_decoding:
        return True
    tiles = triton.cdiv(common_prefix_len, _KV_TILE)
    cascade_ctas = num_query_heads * triton.cdiv(num_reqs, _Q_TILE)  # one token per request
    cascade_time = triton.cdiv(cascade_ctas, num_sms) * tiles
    decoding_ctas = num_reqs * num_kv_heads * triton.cdiv(gqa, _Q_TILE) * tiles
    decoding_time = triton.cdiv(decoding_ctas, num_sms)
    return cascade_time < decoding_time


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
                      k_smooth: Optional[torch.Tensor] = None,
                      out: Optional[torch.Tensor] = None, return_lse: bool = False,
                      layout: str = "NHD", max_query_len: Optional[int] = None,
                      prefix_cu_seqlens_q: Optional[torch.Tensor] = None,
                      prefix_seq_lens: Optional[torch.Tensor] = None,
                      suffix_seq_lens: Optional[torch.Tensor] = None):
    """Causal paged attention of a batch whose requests share their first common_prefix_len
    tokens, reading the shared prefix once (module docstring).

    Args:
        q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale, softcap, sinks,
        k_scale, v_scale, k_scale_cache, k_smooth, out, return_lse, layout: as
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
            Device tensors a plan builds once per step (mla.attention_plan.build_attention_plan);
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
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
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

    common = dict(scale=scale, softcap=softcap, k_scale=k_scale, v_scale=v_scale, layout=layout,
                  k_scale_cache=k_scale_cache, k_smooth=k_smooth, return_lse=True)
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
