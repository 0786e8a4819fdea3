"""What both vLLM adapters share: lazily built classes, vLLM metadata -> plan-builder inputs.
Imports nothing of vLLM (kv_cache_dtype names are resolved by quant.cache_format)."""

from typing import Any, Callable

__all__ = ["lazy_classes", "plan_inputs"]


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
