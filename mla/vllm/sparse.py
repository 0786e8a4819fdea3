"""vLLM adapter OPENMLA_SPARSE (registered by `openmla.mla.vllm.register`):

    vllm serve <model> --attention-backend OPENMLA_SPARSE     # DeepSeek-V3.2-class sparse MLA

Written against vLLM 0.32 (`vllm.v1.attention.backend`). vLLM is imported lazily: importing this
module does not import vLLM; the classes are created on first attribute access
(`openmla.mla.vllm.sparse.OpenMLASparseBackend`, which is how vLLM resolves the registered class path).

OPENMLA_SPARSE, a thin adapter with no kernel logic:
    OpenMLASparseBackend          capabilities, declared statically (bf16 and fp8_ds_mla caches,
                                  head size 576, bf16 activations, MLA and sparse, any block size).
    OpenMLASparseMetadataBuilder  vLLM's CommonAttentionMetadata -> openmla's SparseMLAPlan
                                  (mla.sparse.plan.build_sparse_mla_plan), once per step.
                                  CUDA graphs: UNIFORM_BATCH (below).
    OpenMLASparseImpl             forward_mqa: absorbed q [T, H, 576] (or (ql_nope, q_pe)), the
                                  layer's cache and the indexer's top-k (positions within each
                                  request) -> mla.sparse.impl.SparseMLAImpl.forward_mqa -> [T, H, 512].
                                  do_kv_cache_update writes through quant.write_mla_cache.

The shared vLLM MLA layer routes tokens by num_decode_tokens: this backend reports every token
as a "decode" (num_prefills = 0), so the layer sends the whole batch to forward_mqa and openmla's
plan splits decode and prefill tokens itself (mla/sparse/plan.py), as vLLM's XPU sparse backend does.

CUDA graphs: UNIFORM_BATCH, as vLLM's FLASHMLA_SPARSE. vLLM captures FULL graphs of decode-only
batches (every request 1 + num_speculative_tokens query tokens, padded to a capture size with
requests of no tokens, seq_len 0 and slot -1), and replays one for every batch padded to its
size. A decode-only plan runs all rows through one decode launch whose shape depends on the
padded token count alone; the per-token request ids it computes go to a buffer the builder
allocates once (max_num_batched_tokens rows), and its other tensors are views of vLLM's
persistent ones, so a replay reads the new step's values at the captured addresses. Padding rows
map to no request: their indices are all invalid and their output is 0. Batches with prefills
are never replayed (the prefill chunks come from the batch's host lengths): vLLM runs them with
attention outside its piecewise graphs. Decode lengths may also vary per request (1 to
1 + num_speculative_tokens, from the device query_start_loc: vLLM's variable-length decode
graphs).

Decode context parallelism (`--decode-context-parallel-size N`): supports_dcp, as FLASHMLA_SPARSE.
Each rank's cache holds its share of every request's tokens (vLLM's slot mapping already skips
the others). vLLM's MLA layer gathers the query heads of the group (N * H heads reach
forward_mqa) and merges the ranks' partials by their lse (its DCP manager); forward_mqa maps the
indexer's top-k positions to this rank's local slots (openmla.mla.cp), bounded by vLLM's
dcp_local_seq_lens, runs every token through the decode kernel and returns (out, lse).
Speculative decodes stay decodes under DCP (supports_dcp_with_varlen) at interleave 1, as
FLASHMLA_SPARSE declares; the kernels' path is the same at any cp_kv_cache_interleave_size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from openmla.mla.vllm.common import dcp_of, lazy_classes, sparse_mla_plan
from openmla.quant.format_types import SPARSE_MLA
from openmla.quant.formats import cache_format, kv_cache_dtype_names
from openmla.quant.validate import fail

__all__ = ["BACKEND_NAME", "cache_format_of"]

BACKEND_NAME = "OPENMLA_SPARSE"
HEAD_SIZE = 576
_CLASS_NAMES = ("OpenMLASparseBackend", "OpenMLASparseMetadata", "OpenMLASparseMetadataBuilder",
                "OpenMLASparseImpl")


def cache_format_of(kv_cache_dtype: str):
    """The quant descriptor of vLLM's cache_dtype name ("auto"/"bfloat16": BF16_MLA;
    "fp8_ds_mla"/"fp8", vLLM's alias for sparse MLA: FP8_DS_MLA); NotImplementedError otherwise."""
    return cache_format(kv_cache_dtype, SPARSE_MLA, vllm=True, who=BACKEND_NAME)


def _build_classes() -> tuple:
    from vllm.model_executor.layers.attention.sparse_mla_attention import SharedTopkIndicesBuffer
    from vllm.v1.attention.backend import (
        AttentionBackend, AttentionCGSupport, AttentionMetadata, AttentionMetadataBuilder,
        CommonAttentionMetadata, MLAAttentionImpl, MultipleOf, max_decode_query_len,
    )

    from openmla.mla.sparse.impl import SparseMLAImpl
    from openmla.mla.sparse.plan import SparseMLAPlan
    from openmla.quant.mla_writer import write_mla_cache

    class OpenMLASparseBackend(AttentionBackend):
        """Sparse MLA (DeepSeek-V3.2 DSA) on openmla's Triton kernels; any GPU Triton runs on."""

        supported_dtypes = [torch.bfloat16]
        supported_kv_cache_dtypes = kv_cache_dtype_names(SPARSE_MLA, vllm=True)

        @staticmethod
        def get_supported_kernel_block_sizes(kv_cache_spec=None):
            return [MultipleOf(1)]  # the kernels take any page size and strided blocks

        @staticmethod
        def get_name() -> str:
            return BACKEND_NAME

        @staticmethod
        def get_metadata_cls():
            return OpenMLASparseMetadata

        @staticmethod
        def get_builder_cls():
            return OpenMLASparseMetadataBuilder

        @staticmethod
        def get_impl_cls():
            return OpenMLASparseImpl

        @classmethod
        def get_supported_head_sizes(cls) -> list[int]:
            return [HEAD_SIZE]  # 512 latent + 64 rope

        @classmethod
        def is_mla(cls) -> bool:
            return True

        @classmethod
        def is_sparse(cls) -> bool:
            return True

    @dataclass
    class OpenMLASparseMetadata(AttentionMetadata):
        """Per-step metadata: openmla's plan plus the fields vLLM's shared MLA layer reads."""

        plan: SparseMLAPlan
        num_reqs: int
        num_actual_tokens: int
        max_query_len: int
        max_seq_len: int
        query_start_loc: torch.Tensor
        slot_mapping: torch.Tensor
        block_table: torch.Tensor
        seq_lens: torch.Tensor
        block_size: int
        # every token goes to forward_mqa (module docstring)
        num_decodes: int = 0
        num_prefills: int = 0
        num_decode_tokens: int = 0
        prefill: Any = None
        decode: Any = None

    class OpenMLASparseMetadataBuilder(AttentionMetadataBuilder[OpenMLASparseMetadata]):
        """CommonAttentionMetadata -> SparseMLAPlan (mla.sparse.plan.build_sparse_mla_plan).

        Reads from vllm_config: model_config.get_num_attention_heads(parallel_config) (heads per
        rank), model_config.max_model_len, cache_config.cache_dtype,
        scheduler_config.max_num_batched_tokens (the request-id buffer). Decodes (query_len <=
        reorder_batch_threshold, raised to the speculative length) are put first by vLLM."""

        # decode-only batches replay in FULL graphs (module docstring)
        _cudagraph_support = AttentionCGSupport.UNIFORM_BATCH

        def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
            model_config = vllm_config.model_config
            self.num_heads = model_config.get_num_attention_heads(vllm_config.parallel_config)
            self.max_model_len = model_config.max_model_len
            self.cache_format = cache_format_of(vllm_config.cache_config.cache_dtype)
            # DCP: the top-k, not the kernel, makes attention causal, so spec decodes may stay
            # decodes; as FLASHMLA_SPARSE, only at interleave 1 (what vLLM's DCP indexer path is
            # validated with), else vLLM drops the threshold to 1
            self._init_reorder_batch_threshold(
                1, supports_spec_as_decode=True, supports_dcp_with_varlen=getattr(
                    vllm_config.parallel_config, "cp_kv_cache_interleave_size", 1) == 1)
            self.dcp = dcp_of(vllm_config.parallel_config)
            # forward_mqa sees the DCP group's gathered heads
            self.attn_heads = self.num_heads if self.dcp is None else self.dcp.attn_heads(self.num_heads)
            # the plan's req_id_per_token, at one address for every step (CUDA graph replays)
            self.req_id_buffer = torch.empty(vllm_config.scheduler_config.max_num_batched_tokens,
                                             dtype=torch.int32, device=device)

        @classmethod
        def get_varlen_cudagraph_max_query_len(cls, vllm_config, kv_cache_spec) -> int:
            # decode rows find their request in the device query_start_loc (module docstring)
            return max_decode_query_len(vllm_config)

        def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata
                                        ) -> OpenMLASparseMetadata:
            """The capture batch's metadata: a decode-only batch (as vLLM captures FULL graphs
            for UNIFORM_BATCH backends), else ValueError (a graph of a prefill would replay the
            prefill chunks of the capture batch)."""
            cm = common_attn_metadata
            threshold = self.reorder_batch_threshold or 1
            if cm.max_query_len > threshold:
                fail("max_query_len of a CUDA graph capture batch",
                     f"<= {threshold} (decode-only: {BACKEND_NAME} graphs replay decode batches)",
                     cm.max_query_len)
            md = self.build(0, cm)
            assert md.plan.is_decode_only and md.plan.num_decode_tokens == md.plan.num_tokens
            return md

        def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
                  fast_build: bool = False) -> OpenMLASparseMetadata:
            cm = common_attn_metadata
            T = cm.num_actual_tokens
            plan = sparse_mla_plan(
                cm, block_size=self.kv_cache_spec.block_size, num_heads=self.attn_heads,
                cache_format=self.cache_format, max_model_len=self.max_model_len,
                decode_threshold=self.reorder_batch_threshold or 1, req_id_out=self.req_id_buffer,
                dcp=self.dcp)
            return OpenMLASparseMetadata(
                plan=plan, num_reqs=cm.num_reqs, num_actual_tokens=T,
                max_query_len=cm.max_query_len, max_seq_len=cm.max_seq_len,
                query_start_loc=cm.query_start_loc, slot_mapping=cm.slot_mapping,
                block_table=cm.block_table_tensor, seq_lens=cm.seq_lens,
                block_size=self.kv_cache_spec.block_size, num_decodes=cm.num_reqs,
                num_prefills=0, num_decode_tokens=T)

    class OpenMLASparseImpl(MLAAttentionImpl[OpenMLASparseMetadata], SharedTopkIndicesBuffer):
        """forward_mqa through mla.sparse.impl.SparseMLAImpl; the cache write through quant."""

        is_sparse = True
        # DCP (module docstring): vLLM's layer gathers the heads and merges by the lse returned
        can_return_lse_for_decode = True
        supports_dcp = True
        supports_mtp_with_cp_non_trivial_interleave_size = True

        def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                     kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name,
                     topk_indices_buffer=None, indexer=None, **mla_args):
            unsupported = [name for name, val in (
                ("alibi_slopes", alibi_slopes), ("sliding_window", sliding_window),
                ("logits_soft_cap", logits_soft_cap)) if val is not None]
            if unsupported:
                raise NotImplementedError(f"{BACKEND_NAME}: {', '.join(unsupported)} not supported")
            if head_size != HEAD_SIZE:
                raise NotImplementedError(f"{BACKEND_NAME}: head_size {head_size}, supported: {HEAD_SIZE}")
            self.num_heads = num_heads
            self.head_size = head_size
            self.scale = float(scale)
            self.num_kv_heads = num_kv_heads
            self.kv_cache_dtype = kv_cache_dtype
            self.kv_lora_rank = mla_args["kv_lora_rank"]
            self._mla_args = mla_args
            self.cache_format = cache_format_of(kv_cache_dtype)
            self._openmla: Optional[SparseMLAImpl] = None
            self.init_topk_indices_buffer(indexer, topk_indices_buffer)

        def _layer(self, plan: SparseMLAPlan) -> SparseMLAImpl:
            # Created on first use: the plan carries the workspace size (from max_model_len,
            # which vLLM gives the builder, not the impl).
            if self._openmla is None or self._openmla.workspace_rows < plan.workspace_rows:
                a = self._mla_args
                self._openmla = SparseMLAImpl(
                    self.num_heads, self.scale, self.cache_format,
                    kv_lora_rank=a["kv_lora_rank"], qk_rope_head_dim=a["qk_rope_head_dim"],
                    qk_nope_head_dim=a["qk_nope_head_dim"], v_head_dim=a["v_head_dim"],
                    max_model_len=plan.workspace_rows, workspace_rows=plan.workspace_rows,
                    dcp=plan.dcp)
            return self._openmla

        def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
            """q: [T, H, 576] bf16 or (ql_nope [T, H, 512], q_pe [T, H, 64]); cache [blocks,
            block_size, 576] bf16 or [blocks, block_size, 656] uint8. Returns ([T, H, 512], None);
            under DCP H is the group's gathered heads and it returns (this rank's partial, its lse
            [T, H] fp32) for vLLM's merge."""
            plan = attn_metadata.plan
            if isinstance(q, tuple):
                if q[0].shape[0] == plan.num_tokens and q[0].dtype == torch.bfloat16:
                    # into the step's scratch: no allocation per layer
                    q = torch.cat(q, dim=-1, out=plan.buffer(
                        "q", (plan.num_tokens, q[0].shape[1], HEAD_SIZE), torch.bfloat16))
                else:  # forward_mqa says what is wrong with it
                    q = torch.cat(q, dim=-1)
            topk = self.topk_indices_buffer
            if topk is None:
                raise RuntimeError(f"{BACKEND_NAME}: no top-k indices buffer (indexer) for this layer")
            cache = kv_c_and_k_pe_cache
            if cache.dtype == torch.float8_e4m3fn:  # vLLM's layer hands a cache named "fp8"
                cache = cache.view(torch.uint8)      # viewed as e4m3: the same fp8_ds_mla bytes
            if plan.dcp is not None:
                return self._layer(plan).forward_mqa(q, cache, topk[:q.shape[0]], plan, return_lse=True)
            out = self._layer(plan).forward_mqa(q, cache, topk[:q.shape[0]], plan)
            return out, None

        def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype,
                               k_scale) -> None:
            """kv_c_normed [T, 512], k_pe [T, 1, 64] or [T, 64]; slots < 0 are skipped. The
            cache is in the format resolved at construction (vLLM passes the layer's same
            kv_cache_dtype here)."""
            if kv_cache.numel() == 0:
                return
            write_mla_cache(kv_c_normed, k_pe.reshape(k_pe.shape[0], -1), kv_cache,
                            slot_mapping.flatten(), fmt=self.cache_format, check_slots=False)

    return (OpenMLASparseBackend, OpenMLASparseMetadata, OpenMLASparseMetadataBuilder,
            OpenMLASparseImpl)


__getattr__ = lazy_classes(__name__, _CLASS_NAMES, _build_classes)
