"""vLLM attention backend OPENMLA_ATTN: the general MHA/GQA path through openmla's kernels.

    pip install .        # openmla, at its root: openmla.mla.vllm.register registers it
    vllm serve <model> --attention-backend OPENMLA_ATTN

Written against vLLM 0.32, following its FlashAttention and Triton backends' interfaces
(`vllm/v1/attention/backends/flash_attn.py`, `triton_attn.py`). vLLM is imported lazily, as in
mla/vllm/sparse.py (whose shared helpers this module uses).

Thin adapter, no kernel logic:
    OpenMLAAttentionBackend          capabilities, declared statically: bf16/fp16 activations;
                                     caches auto/bfloat16/float16 and fp8/fp8_e4m3 (per-tensor
                                     scales); head sizes multiples of 8 up to 256; any block size;
                                     sinks, sliding window, ALiBi, softcap; decoder, encoder and
                                     encoder-only attention.
    OpenMLAAttentionMetadataBuilder  CommonAttentionMetadata -> openmla's AttentionPlan
                                     (mla.mha.plan.build_attention_plan), once per step.
                                     CUDA graphs: UNIFORM_BATCH (below).
    OpenMLAAttentionImpl             forward: mla.mha.impl.PagedAttentionImpl.forward writes the
                                     step's keys and values into the layer's cache and attends
                                     (forward_includes_kv_cache_update = True).

vLLM's cache for one layer is the logical [num_blocks, H_kv, block_size, 2 * D] tensor (keys then
values along the last axis; its physical order is the engine's KVCacheLayout, uint8 storage for
fp8). The impl views it as NHD key and value caches, which openmla's kernels read through their
strides, whatever the layout.

CUDA graphs: UNIFORM_BATCH. A decode-only step (every query <= reorder_batch_threshold, 1 +
num_speculative_tokens) is one paged_attention launch over all T rows whose grid, tile class and
split count come from T, the padded request count, the block table's width and vLLM's
max_query_len, all fixed for one capture size; the plan holds views of vLLM's persistent tensors
only (query_start_loc, seq_lens, block_table, slot_mapping) and the kernels read no value back to
the host, so a replay reads each new step at the captured addresses. vLLM's padding (requests of
no tokens and seq_len 0, slot -1) writes nothing and gives 0 rows. Not ALWAYS: a batch with
prefills runs as two launches (decodes, then prefills) over token ranges taken from its host
lengths, and max_query_len picks the tile class, so a graph captured for one mix would replay
the wrong split and tiles for another (vLLM captures its mixed-batch graphs with dummy batches of
short queries).

Decode context parallelism (`--decode-context-parallel-size N`): supports_dcp, with vLLM's
FlashAttention scheme (mla/mha/impl.py): the rank's cache holds its share of every request's
tokens (vLLM's slot mapping skips the others); the impl gathers the query heads of vLLM's DCP
group, attends them to the rank's context tokens, merges the ranks' partials over the group's
device process group (torch.distributed), and merges that with the new tokens' causal attention.
The builder keeps the local context lengths in a persistent buffer (CUDA graphs). Not with
ALiBi, a sliding window or a layer sharing another layer's cache (NotImplementedError).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from openmla.mla.vllm.common import attention_plan, dcp_of, lazy_classes
from openmla.quant.format_types import MHA
from openmla.quant.formats import cache_format, kv_cache_dtype_names
from openmla.quant.validate import fail

__all__ = ["BACKEND_NAME", "cache_format_of"]

BACKEND_NAME = "OPENMLA_ATTN"
_ATTN_TYPES = ("decoder", "encoder", "encoder_only")
_CLASS_NAMES = ("OpenMLAAttentionBackend", "OpenMLAAttentionMetadata",
                "OpenMLAAttentionMetadataBuilder", "OpenMLAAttentionImpl")


def cache_format_of(kv_cache_dtype: str):
    """The quant descriptor of vLLM's kv_cache_dtype name: "auto" (MHA_AUTO), "bfloat16",
    "float16", "fp8"/"fp8_e4m3" (FP8_PER_TENSOR: "fp8" is vLLM's alias of fp8_e4m3, per-tensor
    k_scale / v_scale); NotImplementedError otherwise. No int8: openmla's int8_qkv / int8_qk have
    no vLLM name (the registry lists none), and vLLM's "int8_per_token_head" is another format."""
    return cache_format(kv_cache_dtype, MHA, vllm=True, who=BACKEND_NAME)


def _build_classes() -> tuple:
    from vllm.v1.attention.backend import (
        AttentionBackend, AttentionCGSupport, AttentionImpl, AttentionMetadata,
        AttentionMetadataBuilder, CommonAttentionMetadata, MultipleOf, max_decode_query_len,
    )
    from vllm.v1.attention.backends.utils import get_num_attention_heads_from_layers

    from openmla.mla.mha.impl import MAX_HEAD_SIZE, PagedAttentionImpl
    from openmla.mla.mha.plan import AttentionPlan

    class OpenMLAAttentionBackend(AttentionBackend):
        """MHA/GQA over a paged KV cache on openmla's Triton kernels; any GPU Triton runs on."""

        supported_dtypes = [torch.float16, torch.bfloat16]
        supported_kv_cache_dtypes = kv_cache_dtype_names(MHA, vllm=True)
        # vLLM's layer calls forward only; forward writes the cache first (PagedAttentionImpl).
        forward_includes_kv_cache_update = True

        @staticmethod
        def get_supported_kernel_block_sizes(kv_cache_spec=None):
            return [MultipleOf(1)]  # the kernels take any page size and strided blocks

        @staticmethod
        def get_name() -> str:
            return BACKEND_NAME

        @staticmethod
        def get_metadata_cls():
            return OpenMLAAttentionMetadata

        @staticmethod
        def get_builder_cls():
            return OpenMLAAttentionMetadataBuilder

        @staticmethod
        def get_impl_cls():
            return OpenMLAAttentionImpl

        @classmethod
        def supports_head_size(cls, head_size: int) -> bool:
            # DESIGN.md's contract (the kernel also runs other sizes up to 256, untuned)
            return head_size % 8 == 0 and 8 <= head_size <= MAX_HEAD_SIZE

        @classmethod
        def supports_sink(cls) -> bool:
            return True

        @classmethod
        def supports_sliding_window(cls) -> bool:
            return True

        @classmethod
        def supports_attn_type(cls, attn_type: str) -> bool:
            return attn_type in _ATTN_TYPES  # not encoder_decoder (cross-attention)

        @classmethod
        def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla,
                                 has_sink, use_sparse, use_mm_prefix, device_capability):
            try:
                fmt = cache_format_of(kv_cache_dtype)
            except NotImplementedError:
                return None  # the kv_cache_dtype check (supported_kv_cache_dtypes) reports it
            if not fmt.quantized and fmt.k_dtype not in (None, dtype):
                return (f"kv_cache_dtype {kv_cache_dtype} with {dtype} activations: a 16-bit "
                        "cache is read in the model's dtype")
            return None

    @dataclass
    class OpenMLAAttentionMetadata(AttentionMetadata):
        """Per-step metadata: openmla's plan plus the engine's fields (as vLLM's backends)."""

        plan: AttentionPlan
        num_actual_tokens: int
        max_query_len: int
        max_seq_len: int
        query_start_loc: torch.Tensor
        seq_lens: torch.Tensor
        block_table: torch.Tensor
        slot_mapping: torch.Tensor
        causal: Any = True

    class OpenMLAAttentionMetadataBuilder(AttentionMetadataBuilder[OpenMLAAttentionMetadata]):
        """CommonAttentionMetadata -> AttentionPlan (mla.mha.plan.build_attention_plan).

        Heads per rank from the layers of this group (vLLM's get_num_attention_heads_from_layers,
        else model_config.get_num_attention_heads), KV heads and block size from kv_cache_spec.
        Decodes (query_len <= reorder_batch_threshold, raised to the speculative length) are
        put first by vLLM and run as one short-query launch; the rest as one prefill launch.
        common_prefix_len is ignored (vLLM 0.32 always passes 0: no cascade attention)."""

        # decode-only batches replay in FULL graphs (module docstring)
        _cudagraph_support = AttentionCGSupport.UNIFORM_BATCH

        def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
            self.num_heads = (get_num_attention_heads_from_layers(vllm_config, layer_names)
                              or vllm_config.model_config.get_num_attention_heads(
                                  vllm_config.parallel_config))
            self.num_kv_heads = kv_cache_spec.num_kv_heads
            # DCP: any query length (the new tokens attend to their own keys causally)
            self._init_reorder_batch_threshold(1, supports_spec_as_decode=True,
                                               supports_dcp_with_varlen=True)
            self.dcp = dcp_of(vllm_config.parallel_config,
                              enabled=getattr(kv_cache_spec, "dcp_sharded", True))
            self.dcp_context_lens = None if self.dcp is None else torch.zeros(
                vllm_config.scheduler_config.max_num_seqs, dtype=torch.int32, device=device)

        @classmethod
        def get_varlen_cudagraph_max_query_len(cls, vllm_config, kv_cache_spec) -> int:
            # the decode launch reads each request's length from the device query_start_loc;
            # the captured max_query_len (1 + num_speculative_tokens) bounds every one of them
            return max_decode_query_len(vllm_config)

        def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata
                                        ) -> OpenMLAAttentionMetadata:
            """The capture batch's metadata: a decode-only batch (as vLLM captures FULL graphs
            for UNIFORM_BATCH backends), else ValueError (module docstring: not ALWAYS)."""
            cm = common_attn_metadata
            threshold = self.reorder_batch_threshold or 1
            if cm.max_query_len > threshold:
                fail("max_query_len of a CUDA graph capture batch",
                     f"<= {threshold} (decode-only: {BACKEND_NAME} graphs replay decode batches)",
                     cm.max_query_len)
            md = self.build(0, cm)
            assert md.plan.prefill is None and md.plan.cascade is None
            return md

        def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
                  fast_build: bool = False) -> OpenMLAAttentionMetadata:
            cm = common_attn_metadata
            plan = attention_plan(cm, block_size=self.kv_cache_spec.block_size,
                                  num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                  decode_threshold=self.reorder_batch_threshold or 1,
                                  dcp=self.dcp, dcp_context_lens_out=self.dcp_context_lens)
            return OpenMLAAttentionMetadata(
                plan=plan, num_actual_tokens=cm.num_actual_tokens, max_query_len=cm.max_query_len,
                max_seq_len=cm.max_seq_len, query_start_loc=cm.query_start_loc,
                seq_lens=cm.seq_lens, block_table=cm.block_table_tensor,
                slot_mapping=cm.slot_mapping, causal=cm.causal)

    class OpenMLAAttentionImpl(AttentionImpl[OpenMLAAttentionMetadata]):
        """vLLM's AttentionImpl over mla.mha.impl.PagedAttentionImpl (same constructor arguments
        as vLLM's FlashAttentionImpl)."""

        # DCP (module docstring): the impl merges the ranks' partials itself
        can_return_lse_for_decode = True
        supports_dcp = True
        supports_mtp_with_cp_non_trivial_interleave_size = True

        def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                     sliding_window, kv_cache_dtype, logits_soft_cap=None, attn_type="decoder",
                     kv_sharing_target_layer_name=None, sinks=None):
            attn_type = getattr(attn_type, "value", attn_type)  # vLLM's AttentionType (a str Enum)
            self.num_heads = num_heads
            self.head_size = head_size
            self.scale = float(scale)
            self.num_kv_heads = num_kv_heads
            self.kv_cache_dtype = kv_cache_dtype
            self.cache_format = cache_format_of(kv_cache_dtype)
            self.attn_type = attn_type
            self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
            self.sinks = sinks
            dcp = None
            if self.dcp_world_size > 1:  # set by vLLM's AttentionImplBase.__new__
                from vllm.config import get_current_vllm_config_or_none
                config = get_current_vllm_config_or_none()
                dcp = dcp_of(config.parallel_config if config is not None else SimpleNamespace(
                    decode_context_parallel_size=self.dcp_world_size))
            self._openmla = PagedAttentionImpl(
                num_heads, head_size, scale, num_kv_heads, sliding_window=sliding_window,
                softcap=logits_soft_cap or None, alibi_slopes=alibi_slopes, sinks=sinks,
                kv_cache_dtype=self.cache_format, attn_type=attn_type, dcp=dcp)

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                    output_scale=None, output_block_scale=None):
            """query [T, H, D], key/value [T, H_kv, D] (rows past the plan's tokens are
            padding), kv_cache [num_blocks, H_kv, block_size, 2 * D] (vLLM's logical layout),
            output [T, H, D], written and returned. layer._k_scale / _v_scale: fp8 scales."""
            if output_scale is not None or output_block_scale is not None:
                raise NotImplementedError(f"{BACKEND_NAME}: fused output quantization")
            if attn_metadata is None:  # vLLM's profiling run
                return output.fill_(0)
            plan = attn_metadata.plan
            n = plan.num_tokens
            impl = self._openmla
            if self.attn_type != "decoder":  # non-causal over the step's own keys, no cache
                impl.forward(query[:n], key[:n], value[:n], None, plan, output[:n])
                return output
            if attn_metadata.causal is not True:
                raise NotImplementedError(f"{BACKEND_NAME}: non-causal decoder attention")
            if self.kv_sharing_target_layer_name is not None:  # another layer writes the cache
                key = value = None
            if self.cache_format.fp8_per_tensor:  # vLLM's layer names its scales _k_scale, _v_scale
                impl.set_kv_scales(layer._k_scale, layer._v_scale)
            caches = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
            impl.forward(query if query.shape[0] == n else query[:n], key, value, caches, plan,
                         output if output.shape[0] == n else output[:n])
            return output

    return (OpenMLAAttentionBackend, OpenMLAAttentionMetadata, OpenMLAAttentionMetadataBuilder,
            OpenMLAAttentionImpl)


__getattr__ = lazy_classes(__name__, _CLASS_NAMES, _build_classes)
