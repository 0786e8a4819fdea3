"""fp32 torch oracles for openmla's ops, written straight from the maths (STYLE.md 2).

No tiling and no online softmax: every oracle forms the full score row of a query in float64
(queries are taken in bounded chunks only to cap memory) and returns float32. Tests and tools
import these functions; they are never copied.

Conventions shared by every oracle here:
  * `lse` is the natural log of the softmax denominator. A row with nothing in its denominator
    (no counted key, no sink) has out = 0 and lse = -inf, never NaN.
  * Cache rows that no counted index / in-range position selects are never used, so NaN in
    unused cache rows (the tests' adversarial fill) cannot reach a result.
  * Faults stay visible (DESIGN.md): a NaN or inf in a score or value of a key a row counts (q or
    the key itself) makes that row's out, lse (and max_logits) NaN; a row that counts no key is
    empty whatever its q holds.
  * Host syncs are fine here (these are oracles, not run paths): lengths are read with .tolist().

One module a family: sparse.py (sparse MLA), mha.py (MHA / GQA), merge.py (merging partial results,
index conversion), indexer.py (the DSA lightning indexer: logits, top-k); _common.py holds the
softmax with a sink and the fault marking they share.
"""
from openmla.kernels.reference.sparse import head_matmul_ref, sparse_mla_ref, sparse_mla_decode_ref
from openmla.kernels.reference.mha import attention_varlen_ref, local_attention_ref, paged_attention_ref
from openmla.kernels.reference.merge import convert_req_index_ref, merge_attn_states_ref, merge_project_ref
from openmla.kernels.reference.indexer import (decode_row_ends_ref, indexer_q_quant_ref, indexer_topk_ref,
                                              mqa_logits_ref, paged_mqa_logits_ref, topk_per_row_ref)

__all__ = [
    "sparse_mla_ref",
    "sparse_mla_decode_ref",
    "head_matmul_ref",
    "paged_attention_ref",
    "attention_varlen_ref",
    "local_attention_ref",
    "merge_attn_states_ref",
    "merge_project_ref",
    "convert_req_index_ref",
    "indexer_q_quant_ref",
    "mqa_logits_ref",
    "paged_mqa_logits_ref",
    "decode_row_ends_ref",
    "topk_per_row_ref",
    "indexer_topk_ref",
]
