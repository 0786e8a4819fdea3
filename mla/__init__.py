"""openmla layer level: dimensions, plans, impl classes, the vLLM adapters.

    sparse/           the sparse MLA layer: plan.py (per-step plan), impl.py (SparseMLAImpl);
                      DeepSeek-V4's window + compressed cache layer: v4_plan.py, v4_impl.py
    mha/              the general MHA/GQA layer: plan.py, impl.py (PagedAttentionImpl),
                      local.py (chunked local attention), cascade.py (vLLM's cascade heuristic)
    vllm/             the vLLM 0.32 backends OPENMLA_SPARSE (sparse.py) and OPENMLA_ATTN (attn.py)
    flashmla_compat   FlashMLA's sparse API over openmla's ops
    absorb            weight absorption (W_UK / W_UV) on checkpoints

Dimension glossary (DESIGN.md; every module uses these names):

    T           query tokens in a batch (decode: one per request, or several with
                speculative decoding; prefill: all new tokens)
    H           query heads, any 1..128, never padded
    D_QK  576   absorbed query/key width = KV_LORA_RANK (latent, "nope") + ROPE_DIM
    D_V   512   value width = KV_LORA_RANK (the latent is also the value)
    KV_LORA_RANK 512, ROPE_DIM 64
    topk        indices per query token, any positive count
    block_size  cache page size in tokens, any positive (vLLM uses 64 for MLA)
    slot        global cache position: block * block_size + offset
"""

from openmla.quant.mla_formats import FP8_DS_MLA as _FMT

# The numbers are the format's (quant/ owns byte layouts); this is where the layer names them.
KV_LORA_RANK = _FMT.latent_dim
ROPE_DIM = _FMT.rope_dim
D_QK = KV_LORA_RANK + ROPE_DIM
D_V = KV_LORA_RANK

__all__ = ["KV_LORA_RANK", "ROPE_DIM", "D_QK", "D_V"]

from .sparse.plan import (  # noqa: E402  (sparse MLA per-step plan)
    PrefillChunk,
    SparseMLAPlan,
    build_sparse_mla_plan,
    split_prefill_chunks,
)
from .sparse.impl import SparseMLAImpl  # noqa: E402  (sparse MLA layer)

__all__ += ["PrefillChunk", "SparseMLAPlan", "build_sparse_mla_plan", "split_prefill_chunks",
            "SparseMLAImpl"]

from .sparse.v4_plan import V4PlanBuffers, SparseMLAV4Plan, build_sparse_mla_v4_plan  # noqa: E402
from .sparse.v4_impl import SparseMLAV4Impl  # noqa: E402  (DeepSeek-V4: window + compressed cache)

__all__ += ["V4PlanBuffers", "SparseMLAV4Plan", "build_sparse_mla_v4_plan", "SparseMLAV4Impl"]

from .mha.local import (  # noqa: E402  (chunked local attention virtual batches)
    LocalAttentionBatch,
    make_local_attention_virtual_batches,
)
from .mha.plan import (  # noqa: E402  (general MHA/GQA per-step plan)
    AttentionPlan,
    AttentionSubPlan,
    CascadePlan,
    build_attention_plan,
)
from .mha.impl import PagedAttentionImpl  # noqa: E402  (general MHA/GQA layer over a paged cache)

__all__ += ["LocalAttentionBatch", "make_local_attention_virtual_batches", "AttentionPlan",
            "AttentionSubPlan", "CascadePlan", "PagedAttentionImpl", "build_attention_plan"]
