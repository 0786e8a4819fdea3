"""The registry of cache formats, and the one place a `kv_cache_dtype` name is interpreted.

    CACHE_FORMATS            every format descriptor, in one tuple (quant/format_types.py says
                             what a descriptor holds)
    formats(family)          the formats of one family
    cache_format(name, family)
                             kv_cache_dtype name (openmla's or vLLM's) or descriptor -> descriptor

Layers, plans and the vLLM adapters call `cache_format` once, where a name comes in (their
constructors and builders), and hold the descriptor; writers and kernels take the descriptor.
A new format is one more descriptor in CACHE_FORMATS.
"""
from __future__ import annotations

from typing import Union

from .format_types import FAMILIES, INDEXER, MHA, SPARSE_MLA, CacheFormat
from .indexer_format import INDEXER_K_FP8, INDEXER_K_FP8_RAW
from .mha_formats import FP8_PER_TENSOR, INT8_QK, INT8_QKV, MHA_AUTO, MHA_BF16, MHA_FP16
from .mla_formats import BF16_MLA, FP8_DS_MLA, FP8_DS_MLA_RAW
from .model1_format import FP8_MODEL1
from .validate import fail

__all__ = ["CACHE_FORMATS", "formats", "cache_format", "kv_cache_dtype_names", "SPARSE_MLA", "MHA", "INDEXER"]

CACHE_FORMATS = (
    BF16_MLA, FP8_DS_MLA, FP8_DS_MLA_RAW, FP8_MODEL1,
    MHA_AUTO, MHA_BF16, MHA_FP16, FP8_PER_TENSOR, INT8_QKV, INT8_QK,
    INDEXER_K_FP8, INDEXER_K_FP8_RAW,
)


def _name_table(vllm: bool) -> dict:
    """{family: {name: descriptor}}; a name must not mean two formats of one family."""
    table = {fam: {} for fam in FAMILIES}
    for f in CACHE_FORMATS:
        for n in (f.vllm_kv_cache_dtypes if vllm else f.kv_cache_dtypes + f.vllm_kv_cache_dtypes):
            other = table[f.family].setdefault(n, f)
            assert other is f, f"kv_cache_dtype {n!r} names both {other} and {f}"
    return table


_NAMES = {False: _name_table(False), True: _name_table(True)}


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        fail("family", f"one of {FAMILIES}", repr(family))


def formats(family: str) -> tuple:
    """The descriptors of one family (SPARSE_MLA, MHA or INDEXER), in registry order."""
    _check_family(family)
    return tuple(f for f in CACHE_FORMATS if f.family == family)


def kv_cache_dtype_names(family: str, *, vllm: bool = False) -> list:
    """Every kv_cache_dtype name of a family: vLLM's (vllm=True) or all that openmla accepts
    (its own and vLLM's), in registry order."""
    _check_family(family)
    return list(_NAMES[bool(vllm)][family])


def cache_format(kv_cache_dtype: Union[str, CacheFormat], family: str, *, vllm: bool = False,
                 who: str = "openmla") -> CacheFormat:
    """The descriptor a kv_cache_dtype names in `family` (names differ between families: "auto"
    is a bf16 latent cache for SPARSE_MLA and the model's dtype for MHA; "fp8" is fp8_ds_mla for
    SPARSE_MLA, as vLLM has it, and per-tensor e4m3 for MHA).

    Args:
        kv_cache_dtype: a name (openmla's or vLLM's), or a descriptor of `family` (returned as is).
        family: SPARSE_MLA, MHA or INDEXER.
        vllm: accept vLLM's names only (the adapters: vLLM passes no other).
        who: the caller, for the error message.

    Raises NotImplementedError naming the supported names for an unknown name or a descriptor
    of another family; ValueError for something that is neither a name nor a descriptor.
    """
    _check_family(family)
    if isinstance(kv_cache_dtype, CacheFormat):
        if kv_cache_dtype.family != family:
            raise NotImplementedError(
                f"{who}: cache format {kv_cache_dtype} is a {kv_cache_dtype.family} format; "
                f"supported: the {family} formats {[f.name for f in formats(family)]}")
        return kv_cache_dtype
    if not isinstance(kv_cache_dtype, str):
        fail("kv_cache_dtype", "a name (str) or a quant cache format descriptor",
             type(kv_cache_dtype).__name__)
    fmt = _NAMES[bool(vllm)][family].get(kv_cache_dtype)
    if fmt is not None:
        return fmt
    raise NotImplementedError(
        f"{who}: kv_cache_dtype {kv_cache_dtype!r} is not supported; supported: "
        f"{kv_cache_dtype_names(family, vllm=vllm)}")
