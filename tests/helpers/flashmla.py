"""FlashMLA-shaped decode inputs (tests/mla/test_flashmla_compat*.py): global slots made from
per-request token positions through a shuffled block table (FlashMLA's
abs_indices2indices_in_kvcache) with every kind of invalid index mixed in, and MODEL1 (DeepSeek-V4)
caches whose unselected tokens are NaN."""
from __future__ import annotations

import torch

from openmla.quant import FP8_MODEL1
from tests.helpers import DEVICE, invalid_indices, shuffled_block_table


def flashmla_slots(b, s_q, topk, num_blocks, block_size, g, *, empty=(), invalid=0.25):
    """indices [b, s_q, topk] int64 (CPU) of a batch of b requests over num_blocks blocks: each
    request owns num_blocks // b shuffled blocks and seq_len = its blocks' rows - 3 tokens; a
    fraction `invalid` of the indices is replaced by invalid values of every kind, and the queries
    listed in `empty` (flat b * s_q positions) get only invalid ones.
    Returns (slots, block_table [b, num_blocks // b] int32 CPU, seq_len)."""
    blocks_per_req = num_blocks // b
    table = shuffled_block_table(b, blocks_per_req, num_blocks, generator=g, device="cpu")
    seqlen = blocks_per_req * block_size - 3
    pos = torch.randint(0, seqlen, (b, s_q, topk), generator=g)
    slots = (table.long().gather(1, (pos // block_size).view(b, -1)).view(b, s_q, topk) * block_size
             + pos % block_size)
    bad = torch.tensor(invalid_indices(num_blocks * block_size))
    mask = torch.rand(b, s_q, topk, generator=g) < invalid
    slots[mask] = bad[torch.randint(0, len(bad), (int(mask.sum()),), generator=g)]
    flat = slots.view(b * s_q, topk)
    for i in empty:
        flat[i] = bad[torch.arange(topk) % len(bad)]
    return slots, table, seqlen


def model1_scope(b, s_q, topk, num_blocks, block_size, *, seed, empty=(), dtype=torch.uint8):
    """A MODEL1 cache [num_blocks, block_size, 1, 584] (FP8_MODEL1.pack of N(0, 1) tokens, FlashMLA's
    block stride; every token no index selects is NaN, so a read of it shows) viewed as `dtype`
    (uint8, float8_e4m3fn or int8: the bytes FlashMLA accepts), and its indices [b, s_q, topk]
    int32 (flashmla_slots), both on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    slots, _, _ = flashmla_slots(b, s_q, topk, num_blocks, block_size, g, empty=empty)
    used = torch.unique(slots[(slots >= 0) & (slots < num_blocks * block_size)])
    k = torch.full((num_blocks * block_size, 512), float("nan"))
    k[used] = torch.randn(len(used), 512, generator=g)
    cache = FP8_MODEL1.pack(k.view(num_blocks, block_size, 1, 512).to(torch.bfloat16).to(DEVICE))
    return cache.view(dtype), slots.to(torch.int32).to(DEVICE)
