"""Triton kernels, one public op per module or family folder, and `kernels.reference` (fp32 torch
oracles of every op).

    sparse_mla_decode/     sparse_mla_decode: top-k MLA decode over a paged bf16 / fp8_ds_mla cache
    sparse_mla_prefill/    sparse_mla_prefill: top-k MLA prefill over a bf16 workspace
    paged_attention/       paged_attention (paged MHA/GQA cache), varlen_attention (contiguous k, v)
    cascade.py             cascade_attention: paged attention reading a shared prefix once
    merge.py               merge_attn_states: two partial results into one (vLLM's signature)
    head_matmul.py         head_matmul: MLA's per-head projections (absorption, output)
    merge_project.py       merge_project: a split decode's partials merged and projected (one launch)
    index.py               convert_req_index_to_global: per-request token indices -> cache slots
    indexer/               the DSA lightning indexer: paged_mqa_logits (decode), mqa_logits (ragged
                           prefill), topk_per_row / decode_topk (top-k per row, -1 filled)
    configs.py             how every op chooses its launch config (one mechanism, documented there)
    device.py, launch.py   device facts for the dispatch; the low-overhead launch path

Conventions of the attention ops (sparse_mla_decode, sparse_mla_prefill, paged_attention,
varlen_attention, cascade_attention); their docstrings give the shapes:

- Arguments: the tensors the op reads are positional, q first; everything else is keyword-only.
- `scale` (required): the softmax scale, s = scale * q.k. Any finite real number (a Python or
  NumPy number; not a bool, string or tensor), checked by `quant.validate.check_scale(...,
  positive=False)` in every op; anything else raises ValueError naming `scale`.
- `out=` (optional): [T, H, D_v] in q's dtype, last dim contiguous, other strides free, on q's
  device, checked by `quant.validate.check_out` in every op; the op writes it in place and returns
  it as its first result. None: the op allocates it.
- Results, in this order: out [T, H, D_v] in q's dtype; lse [T, H] fp32, the natural log of the
  softmax denominator; then an op's own extras (sparse_mla_prefill: max_logits [T, H] fp32, the
  largest scale * q.k of the row). The sparse MLA ops always return the tuple (out, lse[,
  max_logits]). The MHA ops (paged_attention, varlen_attention, cascade_attention) write lse only
  when asked: with return_lse=True they return (out, lse), by default out alone (the MHA layer
  does not read lse, and the kernel then skips its store).
- A row with no key to attend to: out = 0, lse = -inf (max_logits = -inf).
- Faults stay visible and invalid indices are never read (DESIGN.md).

The FlashMLA-compatible API (`mla.flashmla_compat`) is a facade with FlashMLA's conventions
instead: flash_mla_with_kvcache returns (out, lse) and flash_mla_sparse_fwd (out, max_logits,
lse), in FlashMLA's shapes, with lse = +inf for an empty row.
"""
