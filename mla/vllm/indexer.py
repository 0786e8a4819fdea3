"""vLLM 0.32 hookup of the DSA lightning indexer: openmla's Triton indexer in place of DeepGEMM.

vLLM's DeepSeek-V3.2 `Indexer` (vllm/model_executor/models/deepseek_v2.py) builds a
`SparseAttnIndexer`, a CustomOp whose CUDA path calls DeepGEMM's fp8 MQA logits and vLLM's
top-k kernels, and whose constructor refuses a CUDA platform without DeepGEMM. `register()`
(called by `openmla.mla.vllm.register`, the plugin entry point) registers
`OpenMLASparseAttnIndexer` as its out-of-tree replacement through vLLM's own mechanism,
`CustomOp.register_oot`: CustomOp.__new__ then instantiates our class wherever the model
builds a SparseAttnIndexer. It takes the same constructor and forward arguments, so the model
code is unchanged; every platform's forward (CUDA, ROCm, XPU, CPU, out-of-tree, native) runs
openmla's op:

    write the step's indexer keys into the layer's index-K cache (quant.indexer_cache),
    then fill topk_indices_buffer[:T, :topk] with every token's top-k positions within its
    request, -1 filled (mla.sparse.indexer_step.indexer_topk over vLLM's indexer metadata).

The op reads vLLM's `DeepseekV32IndexerMetadata` (built by vLLM's indexer backend, which runs
without DeepGEMM) from the forward context, as vLLM's own op does, and turns it into one
IndexerPlan per step (`_plan`, shared by the layers): decode tokens as paged rows (per-token
requests and causal context lengths from the decode requests' lengths), prefill chunks on the
ragged path over vLLM's own row bounds (their keys gathered from the paged cache).

It runs inside its own torch custom op, `torch.ops.vllm.openmla_sparse_attn_indexer`
(opaque to torch.compile, mutating the top-k buffer, as vLLM's op), wrapped like vLLM's in
`eager_break_during_capture`. Piecewise CUDA graphs split at vLLM's indexer op; the
constructor adds ours to `compilation_config.splitting_ops` wherever vLLM's is listed there,
so graphs split at the same place.

OPENMLA_VLLM_INDEXER=0 in the environment keeps vLLM's own SparseAttnIndexer (DeepGEMM where
it has it): register() then registers nothing.

What openmla does not run stays vLLM's: a layer built with the MXFP4 cache (use_fp4_cache), KV
compression (compress_ratio > 1, DeepSeek-V4), V4.1 candidate blocks, decode or prefill context
parallelism, skipping the cache insert (prefill context parallelism) or another head_dim /
quant_block_size is constructed and run by vLLM's own SparseAttnIndexer code (`uses_openmla`
False, `unsupported` says why), exactly as without the plugin (DeepGEMM on CUDA).
"""
# no `from __future__ import annotations`: torch infers the custom op's schema from the hints
import dataclasses
import os
from typing import Optional

import torch

__all__ = ["OP_NAME", "register"]

OP_NAME = "openmla_sparse_attn_indexer"  # torch.ops.vllm.<OP_NAME>
_VLLM_OP = "vllm::sparse_attn_indexer"
_LAYERS: dict = {}  # k_cache prefix -> our layer (the op finds its layer's settings by name)


def register() -> None:
    """Register OpenMLASparseAttnIndexer as vLLM's out-of-tree SparseAttnIndexer (once per
    process; a second call keeps the first registration) and its custom op; nothing with
    OPENMLA_VLLM_INDEXER=0."""
    if os.environ.get("OPENMLA_VLLM_INDEXER", "1") == "0":
        return
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer

    if op_registry_oot.get(SparseAttnIndexer.__name__) is not None:
        return
    cls = _build_class(SparseAttnIndexer)
    SparseAttnIndexer.register_oot(cls)


def _register_op() -> None:
    from vllm.compilation.breakable_cudagraph import eager_break_during_capture
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import direct_register_custom_op

    if hasattr(torch.ops.vllm, OP_NAME):
        return
    direct_register_custom_op(op_name=OP_NAME, op_func=eager_break_during_capture(_indexer_op),
                              mutates_args=["topk_indices_buffer"], fake_impl=_indexer_op_fake,
                              dispatch_key=current_platform.dispatch_key)


def _indexer_op_fake(hidden_states: torch.Tensor, k_cache_prefix: str, kv_cache: torch.Tensor,
                     q_fp8: torch.Tensor, k: Optional[torch.Tensor], weights: torch.Tensor,
                     topk_indices_buffer: torch.Tensor) -> None:
    return None


def _indexer_op(hidden_states: torch.Tensor, k_cache_prefix: str, kv_cache: torch.Tensor,
                q_fp8: torch.Tensor, k: Optional[torch.Tensor], weights: torch.Tensor,
                topk_indices_buffer: torch.Tensor) -> None:
    """One layer's indexer for the step in vLLM's forward context (module docstring)."""
    from vllm.forward_context import get_forward_context

    from openmla.mla.sparse.indexer_step import indexer_topk
    from openmla.quant.indexer_cache import write_indexer_k_cache

    layer = _LAYERS[k_cache_prefix]
    attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict) or kv_cache.numel() == 0:
        return None  # profiling / dummy run: no metadata or no cache yet, nothing to select
    md = attn_metadata[k_cache_prefix]
    slot_mapping = md.slot_mapping
    if k is not None:
        # k may be padded past the step's tokens (CUDA-graph batch sizes); slots cover the tokens
        write_indexer_k_cache(k[:slot_mapping.shape[0]], kv_cache, slot_mapping, fmt=layer.index_format,
                              check_slots=False)
    T = hidden_states.shape[0]
    indexer_topk(q_fp8[:T], weights[:T], kv_cache, _plan(md, T, layer.max_model_len),
                 topk=layer.topk_tokens, fmt=layer.index_format,
                 out=topk_indices_buffer[:T, :layer.topk_tokens])
    return None


_PLAN_CACHE: list = [None, None, None]  # (metadata, key, plan) of the last step: every layer's


def _plan(md, T: int, max_model_len: int):
    """The step's IndexerPlan from vLLM's DeepseekV32IndexerMetadata `md`, built by the first
    layer that sees `md` and reused by the others (they share the metadata object).

    Decode tokens (vLLM puts decode requests first) are paged rows: request b has
    per_req_decode_lens[b] query tokens, the last at position seq_lens[b] - 1 (the causal rule of
    build_indexer_plan over a query_start_loc of those lengths); tokens past their sum (CUDA-graph
    padding) belong to no request. An eager step of uniform speculative decodes (vLLM's host
    decode_is_uniform and write_max_decode_len = n) scores each request's n rows together; a
    captured one keeps one row per token, right for any decode lengths a replay brings. The
    logits are max_model_len wide while a graph may be captured, else the step's max_seq_len.
    Prefill chunks take the ragged path over vLLM's own bounds: chunk row i sees the gathered rows
    [ks[i], ke[i]); gathered row j is position j - cu_seq_lens[r] of the chunk's request r.
    """
    key = (T, max_model_len)
    if _PLAN_CACHE[0] is md and _PLAN_CACHE[1] == key:
        return _PLAN_CACHE[2]
    from openmla.mla.sparse.indexer_ragged import RaggedChunk
    from openmla.mla.sparse.indexer_step import build_indexer_plan, indexer_plan_from_tokens

    dev = md.slot_mapping.device
    chunks = []
    if md.num_prefills > 0 and md.prefill is not None:
        for ch in md.prefill.chunks:
            S = ch.total_seq_lens
            rows = torch.arange(S, dtype=torch.int32, device=dev)
            req = torch.searchsorted(ch.cu_seq_lens[1:], rows, right=True, out_int32=True)
            chunks.append(RaggedChunk(
                token_start=ch.token_start, token_end=ch.token_end, num_keys=S,
                ks=ch.cu_seqlen_ks.to(torch.int32), ke=ch.cu_seqlen_ke.to(torch.int32), key_req=req,
                key_pos=(rows - ch.cu_seq_lens[req.long()]).to(torch.int32), block_table=ch.block_table))
    B, Td = md.num_decodes, md.num_decode_tokens
    capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
    width = max_model_len if capturing else max(1, min(md.max_seq_len, max_model_len))
    if B > 0 and Td > 0:
        lens = md.decode.per_req_decode_lens[:B]
        qsl = torch.zeros(B + 1, dtype=torch.int32, device=dev)
        torch.cumsum(lens, 0, out=qsl[1:])
        plan = dataclasses.replace(
            build_indexer_plan(qsl, md.seq_lens[:B], md.block_table[:B], num_tokens=Td, max_context=width),
            num_tokens=T, ragged_chunks=tuple(chunks))
        n = md.decode.write_max_decode_len
        if not capturing and n > 1 and md.decode.decode_is_uniform and Td == B * n:
            # uniform speculative decodes, eager: each request's n rows read its keys once
            plan = dataclasses.replace(plan, paged_next_n=n, paged_block_table=md.block_table[:B],
                                       paged_context_lens=md.seq_lens[:B])
    else:
        empty = torch.empty(0, dtype=torch.int32, device=dev)
        plan = indexer_plan_from_tokens(empty, empty, md.block_table, max_context=width,
                                        ragged_chunks=tuple(chunks), num_tokens=T)
    _PLAN_CACHE[:] = [md, key, plan]
    return plan


def _build_class(SparseAttnIndexer):
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.custom_op import CustomOp

    from openmla.quant.indexer_cache import indexer_k_format_of

    _register_op()

    class OpenMLASparseAttnIndexer(SparseAttnIndexer):
        """vLLM's SparseAttnIndexer on openmla's Triton indexer (module docstring); the same
        constructor and forward arguments. A configuration openmla does not run (`uses_openmla`
        False) is vLLM's own class: its constructor and its forwards."""

        def __init__(self, k_cache, quant_block_size: int, scale_fmt: Optional[str], topk_tokens: int,
                     head_dim: int, max_model_len: int, max_total_seq_len: int,
                     topk_indices_buffer: torch.Tensor, skip_k_cache_insert: bool = False,
                     use_fp4_cache: bool = False, compress_ratio: int = 1,
                     candidate_blocks: Optional[torch.Tensor] = None, candidate_block_size: int = 0,
                     candidate_write: bool = False):
            config = get_current_vllm_config()
            fmt = indexer_k_format_of(scale_fmt)
            self.unsupported = [what for what, bad in (
                ("use_fp4_cache (the MXFP4 indexer cache)", use_fp4_cache),
                (f"compress_ratio={compress_ratio} (KV compression)", compress_ratio != 1),
                ("candidate_blocks (two-level selection)", candidate_blocks is not None),
                ("skip_k_cache_insert (prefill context parallelism)", skip_k_cache_insert),
                ("decode context parallelism", config.parallel_config.decode_context_parallel_size > 1),
                ("prefill context parallelism", config.parallel_config.prefill_context_parallel_size > 1),
                (f"head_dim={head_dim}, quant_block_size={quant_block_size}",
                 (head_dim, quant_block_size) != (fmt.head_dim, fmt.quant_block_size)),
            ) if bad]
            self.uses_openmla = not self.unsupported
            if not self.uses_openmla:  # vLLM's own indexer (DeepGEMM on CUDA, as without openmla)
                SparseAttnIndexer.__init__(
                    self, k_cache, quant_block_size, scale_fmt, topk_tokens, head_dim, max_model_len,
                    max_total_seq_len, topk_indices_buffer, skip_k_cache_insert, use_fp4_cache,
                    compress_ratio, candidate_blocks, candidate_block_size, candidate_write)
                return
            # not SparseAttnIndexer.__init__: it refuses CUDA without DeepGEMM
            CustomOp.__init__(self)
            self.k_cache = k_cache
            self.quant_block_size = quant_block_size
            self.scale_fmt = scale_fmt
            self.index_format = fmt
            self.topk_tokens = topk_tokens
            self.head_dim = head_dim
            self.max_model_len = max_model_len
            self.max_total_seq_len = max_total_seq_len
            self.topk_indices_buffer = topk_indices_buffer
            self.skip_k_cache_insert = skip_k_cache_insert
            self.use_fp4_cache = use_fp4_cache
            self.compress_ratio = compress_ratio
            self.candidate_blocks = candidate_blocks
            self.candidate_block_size = candidate_block_size
            self.candidate_write = candidate_write
            self.dense_mha_metadata_layer_name = ""
            self.dcp_world_size, self.dcp_rank, self.use_pcp = 1, 0, False
            _LAYERS[k_cache.prefix] = self
            splitting = config.compilation_config.splitting_ops
            name = f"vllm::{OP_NAME}"
            if isinstance(splitting, list) and _VLLM_OP in splitting and name not in splitting:
                splitting.append(name)

        def _openmla(self, hidden_states: torch.Tensor, q_quant, k: Optional[torch.Tensor],
                     weights: torch.Tensor) -> torch.Tensor:
            """hidden_states [T, *] (its length is the step's token count), q_quant [T, H, 128]
            float8_e4m3fn, k [>= T, 128] bf16 (the step's new keys; None: already written),
            weights [T, H] fp32 (q's per-token scale, softmax scale and H^-0.5 folded in, as the
            model's Indexer computes them). Returns topk_indices_buffer, rows [:T] filled."""
            if isinstance(q_quant, tuple):
                raise NotImplementedError("openmla sparse_attn_indexer: an fp4 (values, scales) query")
            torch.ops.vllm.openmla_sparse_attn_indexer(
                hidden_states, self.k_cache.prefix, self.k_cache.kv_cache, q_quant, k, weights,
                self.topk_indices_buffer)
            return self.topk_indices_buffer

    def _forward(name):
        def forward(self, *args, **kwargs):
            if self.uses_openmla:
                return self._openmla(*args, **kwargs)
            return getattr(SparseAttnIndexer, name)(self, *args, **kwargs)
        forward.__name__ = name
        forward.__doc__ = (f"openmla's indexer (_openmla) where it runs this layer, else vLLM's "
                           f"SparseAttnIndexer.{name}")
        return forward

    for name in ("forward_native", "forward_cuda", "forward_hip", "forward_xpu", "forward_cpu",
                 "forward_tpu", "forward_oot"):
        setattr(OpenMLASparseAttnIndexer, name, _forward(name))
    OpenMLASparseAttnIndexer.__module__ = __name__
    OpenMLASparseAttnIndexer.__qualname__ = OpenMLASparseAttnIndexer.__name__
    return OpenMLASparseAttnIndexer
