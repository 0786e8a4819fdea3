"""Cache formats and packers (the lowest layer: kernels and mla import from here)."""
from .format_types import FAMILIES, INDEXER, MHA, SPARSE_MLA, CacheFormat, CacheTensor, Scale
from .mla_formats import (
    BF16_MLA,
    FP8_DS_MLA,
    FP8_DS_MLA_RAW,
    FP8_E4M3_MAX,
    BF16MLAFormat,
    FP8DSMLAFormat,
)
from .model1_format import FP8_MODEL1, Model1Format
from .mla_cache_format import check_mla_format, mla_format_of
from .mha_formats import (
    FP8_PER_TENSOR,
    INT8_QK,
    INT8_QKV,
    MHA_AUTO,
    MHA_BF16,
    MHA_FP16,
    MHAFormat,
    mha_format_of,
)
from .formats import CACHE_FORMATS, cache_format, formats, kv_cache_dtype_names

__all__ = [
    "FAMILIES", "INDEXER", "MHA", "SPARSE_MLA", "CacheFormat", "CacheTensor", "Scale",
    "BF16_MLA", "FP8_DS_MLA", "FP8_DS_MLA_RAW", "FP8_E4M3_MAX",
    "BF16MLAFormat", "FP8DSMLAFormat", "mla_format_of", "check_mla_format", "FP8_MODEL1", "Model1Format",
    "FP8_PER_TENSOR", "INT8_QK", "INT8_QKV", "MHA_AUTO", "MHA_BF16", "MHA_FP16", "MHAFormat",
    "mha_format_of", "CACHE_FORMATS", "cache_format", "formats", "kv_cache_dtype_names",
]

from .mla_gather import gather_upconvert  # noqa: E402  (Triton cache reader)
from .mla_writer import write_mla_cache  # noqa: E402  (Triton cache writer)
from .model1_writer import write_model1_cache  # noqa: E402  (DeepSeek-V4 cache writer)

__all__ += ["write_mla_cache", "gather_upconvert", "write_model1_cache"]

from .kv_cache import write_kv_cache  # noqa: E402  (MHA paged KV cache writer)

__all__ += ["write_kv_cache"]

from .int8 import (  # noqa: E402  (int8 quantizers, V scale calibration and files)
    INT8_MAX,
    INT8_SCALE_FLOOR,
    calibrate_v_scale,
    dequantize_per_channel,
    dequantize_per_token_head,
    load_v_scales,
    quantize_per_channel,
    quantize_per_channel_ref,
    quantize_per_token_head,
    quantize_per_token_head_ref,
    save_v_scales,
)

__all__ += [
    "INT8_MAX", "INT8_SCALE_FLOOR", "calibrate_v_scale", "dequantize_per_channel",
    "dequantize_per_token_head", "load_v_scales", "quantize_per_channel", "quantize_per_channel_ref",
    "quantize_per_token_head", "quantize_per_token_head_ref", "save_v_scales",
]

from .indexer_format import INDEXER_K_FP8, INDEXER_K_FP8_RAW, IndexerKFormat, indexer_k_format_of  # noqa: E402
from .indexer_cache import write_indexer_k_cache  # noqa: E402  (DSA indexer K cache writer)

__all__ += ["INDEXER_K_FP8", "INDEXER_K_FP8_RAW", "IndexerKFormat", "indexer_k_format_of",
            "write_indexer_k_cache"]
