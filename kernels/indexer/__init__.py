"""The DSA lightning indexer (DeepSeek-V3.2's sparse-attention token selection), in Triton.

    paged_mqa_logits     decode logits over the paged fp8 indexer K cache
    mqa_logits           ragged prefill logits over a contiguous fp8 K (rows see [ks, ke))
    topk_per_row         the k best columns of each logits row (ragged), -1 filled
    decode_topk          the same with decode row ends (context_lens, next_n)

The cache writer is quant.indexer_cache.write_indexer_k_cache; the oracles are in
kernels/reference/indexer.py, whose docstring states the semantics.
"""
from openmla.kernels.indexer.mqa_logits import mqa_logits
from openmla.kernels.indexer.paged_mqa_logits import paged_mqa_logits
from openmla.kernels.indexer.topk import decode_topk, topk_per_row

__all__ = ["mqa_logits", "paged_mqa_logits", "topk_per_row", "decode_topk"]
