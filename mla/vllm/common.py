"""What both vLLM adapters share: lazily built classes, vLLM metadata -> openmla plans.
Imports nothing of vLLM (kv_cache_dtype names are resolved by quant.cache_format)."""

from typing import Any, Callable

__all__ = ["attention_plan", "lazy_classes", "plan_inputs", "sparse_mla_plan"]


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


def sparse_mla_plan(cm, *, block_size: int, num_heads: int, cache_format, max_model_len: int,
                    decode_threshold: int, req_id_out):
    """OPENMLA_SPARSE's plan of one step from vLLM's CommonAttentionMetadata `cm` (anything
    with its fields): vLLM's max_query_len bounds the decode-only check, and the request ids go
    into `req_id_out`, the builder's persistent buffer (CUDA graphs: mla/vllm/sparse.py)."""
    from openmla.mla.sparse.plan import build_sparse_mla_plan  # here: registering stays light
    args, host = plan_inputs(cm)
    return build_sparse_mla_plan(
        *args, block_size=block_size, num_heads=num_heads, kv_cache_dtype=cache_format,
        max_model_len=max_model_len, decode_threshold=decode_threshold,
        max_query_len=cm.max_query_len, req_id_out=req_id_out, **host)


def attention_plan(cm, *, block_size: int, num_heads: int, num_kv_heads: int,
                   decode_threshold: int):
    """OPENMLA_ATTN's plan of one step from vLLM's CommonAttentionMetadata `cm` (anything with
    its fields). No cascade (vLLM 0.32 passes no common prefix). A decode-only step's plan holds
    views of vLLM's tensors only (CUDA graphs: mla/vllm/attn.py)."""
    from openmla.mla.mha.plan import build_attention_plan
    args, host = plan_inputs(cm)
    return build_attention_plan(
        *args, max_query_len=cm.max_query_len, block_size=block_size, num_heads=num_heads,
        num_kv_heads=num_kv_heads, decode_threshold=decode_threshold, use_cascade=False, **host)
