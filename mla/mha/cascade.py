"""vLLM's cascade heuristic: when attending a prefix shared by every request once
(`kernels.cascade.cascade_attention`) is supported and likely faster than plain attention."""
from __future__ import annotations

from typing import Sequence, Union

import numpy as np
import torch
import triton

__all__ = ["use_cascade_attention", "MIN_CASCADE_PREFIX", "MIN_CASCADE_REQS"]

# vLLM's thresholds (use_cascade_attention): shorter prefixes and smaller batches never pay off.
MIN_CASCADE_PREFIX = 256
MIN_CASCADE_REQS = 8
# vLLM's performance model assumes FlashAttention's default 128 x 128 tiles.
_Q_TILE = 128
_KV_TILE = 128

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
        num_sms: streaming multiprocessors of the GPU (`kernels.device.num_sms`).
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
