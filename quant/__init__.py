"""Cache formats and packers (the lowest layer: kernels and mla import from here)."""
from .mla_formats import (
    BF16_MLA,
    FP8_DS_MLA,
    FP8_DS_MLA_RAW,
    FP8_E4M3_MAX,
    MLA_FORMATS,
    BF16MLAFormat,
    FP8DSMLAFormat,
    mla_format_of,
)

__all__ = [
    "BF16_MLA", "FP8_DS_MLA", "FP8_DS_MLA_RAW", "FP8_E4M3_MAX", "MLA_FORMATS",
    "BF16MLAFormat", "FP8DSMLAFormat", "mla_format_of",
]
