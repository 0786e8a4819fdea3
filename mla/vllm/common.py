"""What both vLLM adapters share: lazily built classes, vLLM metadata -> openmla plans.
Imports nothing of vLLM (kv_cache_dtype names are resolved by quant.cache_format)."""

from typing import Any, Callable

__all__ = ["attention_plan", "dcp_of", "lazy_classes", "plan_inputs", "sparse_mla_plan"]


def lazy_classes(module: str, names: tuple, build: Callable[[], tuple]) -> Callable[[str], Any]:
    """A PEP 562 module `__getattr__` serving `names`: the first access calls `build()` (which
    imports vLLM and returns the classes) and names each class `module.<name>`, the path vLLM
    resolves a registered backend by."""
    classes: dict = {}

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        if not classes:
            for c in build():
                c.__module__ = module
                c.__qualname__ = c.__name__
                classes[c.__name__] = c
        return classes[name]

    return __getattr__


def plan_inputs(cm) -> tuple:
    """vLLM's CommonAttentionMetadata -> (args, kwargs) that both openmla plan builders take:
    (query_start_loc, seq_lens, block_table, slot_mapping[:T]) with T = num_actual_tokens
    (padding rows included), and the host query lengths and sequence lengths (no device read;
    seq_lens_cpu_upper_bound is exact for prefill rows, the only rows the plans read it for)."""
    T = cm.num_actual_tokens
    qsl_cpu = cm.query_start_loc_cpu
    args = (cm.query_start_loc, cm.seq_lens, cm.block_table_tensor, cm.slot_mapping[:T])
    return args, dict(query_lens_cpu=qsl_cpu[1:] - qsl_cpu[:-1],
                      seq_lens_cpu=cm.seq_lens_cpu_upper_bound)


def dcp_of(parallel_config, *, enabled: bool = True):
    """This worker's place in vLLM's decode-context-parallel group as an openmla
    ContextParallel ("sharded" heads: vLLM's DCP ranks are tensor-parallel ranks; the group's
    device process group; parallel_config.cp_kv_cache_interleave_size), or None when DCP is off
    (decode_context_parallel_size 1, `enabled` False as for vLLM's unsharded caches, or no DCP
    group, as in unit tests)."""
    from vllm.distributed.parallel_state import get_dcp_group, get_dcp_world_size_and_rank

    from openmla.mla.cp import ContextParallel
    on = enabled and getattr(parallel_config, "decode_context_parallel_size", 1) > 1
    n, rank = get_dcp_world_size_and_rank(on)
    if n == 1:
        return None
    return ContextParallel(n, rank, getattr(parallel_config, "cp_kv_cache_interleave_size", 1),
                           group=get_dcp_group().device_group)


def sparse_mla_plan(cm, *, block_size: int, num_heads: int, cache_format, max_model_len: int,
                    decode_threshold: int, req_id_out, dcp=None):
    """OPENMLA_SPARSE's plan of one step from vLLM's CommonAttentionMetadata `cm` (anything
    with its fields): vLLM's max_query_len bounds the decode-only check, and the request ids go
    into `req_id_out`, the builder's persistent buffer (CUDA graphs: mla/vllm/sparse.py). Under
    DCP (`dcp`, dcp_of) the plan takes vLLM's dcp_local_seq_lens when it has them."""
    from openmla.mla.sparse.plan import build_sparse_mla_plan  # here: registering stays light
    args, host = plan_inputs(cm)
    if dcp is not None:
        host.update(dcp=dcp, dcp_local_seq_lens=getattr(cm, "dcp_local_seq_lens", None))
    return build_sparse_mla_plan(
        *args, block_size=block_size, num_heads=num_heads, kv_cache_dtype=cache_format,
        max_model_len=max_model_len, decode_threshold=decode_threshold,
        max_query_len=cm.max_query_len, req_id_out=req_id_out, **host)


def attention_plan(cm, *, block_size: int, num_heads: int, num_kv_heads: int,
                   decode_threshold: int, dcp=None, dcp_context_lens_out=None):
    """OPENMLA_ATTN's plan of one step from vLLM's CommonAttentionMetadata `cm` (anything with
    its fields). No cascade (vLLM 0.32 passes no common prefix). A decode-only step's plan holds
    views of vLLM's tensors only (CUDA graphs: mla/vllm/attn.py), and under DCP (`dcp`, dcp_of)
    its local context lengths go into the builder's persistent `dcp_context_lens_out`."""
    from openmla.mla.mha.plan import build_attention_plan
    args, host = plan_inputs(cm)
    return build_attention_plan(
        *args, max_query_len=cm.max_query_len, block_size=block_size, num_heads=num_heads,
        num_kv_heads=num_kv_heads, decode_threshold=decode_threshold, use_cascade=False, dcp=dcp,
        dcp_context_lens_out=dcp_context_lens_out, **host)
