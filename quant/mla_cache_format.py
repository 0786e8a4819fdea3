"""Which sparse MLA format a paged cache tensor is in, at the public ops' boundary: the V3.2
formats (quant/mla_formats.py) and DeepSeek-V4's (quant/model1_format.py), read from its dtype and
row width. A module of its own so that the format modules do not import each other both ways."""
from __future__ import annotations

import torch

from .mla_formats import BF16_MLA, FP8_DS_MLA, _MLAFormat
from .model1_format import FP8_MODEL1
from .validate import check_tensor, fail

__all__ = ["mla_format_of", "check_mla_format"]


def mla_format_of(cache: torch.Tensor, name: str = "cache"):
    """The format a paged MLA cache tensor is in, from its dtype and last dim: the default of
    the public ops (writer, gather, decode, reference) when their caller passes no `fmt`. Layers
    hold their descriptor and pass it instead.

    uint8 [..., 656] -> FP8_DS_MLA (reading does not depend on the scale rule);
    uint8 [..., 584] -> FP8_MODEL1 (DeepSeek-V4, quant/model1_format.py; [nb, bs, 1, 584] or
    [nb, bs, 584]); bf16 [..., 576] -> BF16_MLA. Anything else raises ValueError naming `name`.
    """
    check_tensor(name, cache, dtype=(torch.uint8, torch.bfloat16))
    if cache.dtype == torch.bfloat16:
        fmts = (BF16_MLA,)
    else:
        fmts = (FP8_DS_MLA, FP8_MODEL1)
    width = cache.shape[-1] if cache.dim() else None
    for fmt in fmts:
        if width == fmt.row_width:
            return fmt
    fail(f"{name}.shape[-1]", " or ".join(f"{f.row_width} for a {f.name} cache" for f in fmts)
         + f" of dtype {cache.dtype}", width)


def check_mla_format(cache: torch.Tensor, fmt=None, name: str = "cache"):
    """The format of a paged MLA cache at a public op's boundary: `fmt` (a sparse MLA
    descriptor) checked against the cache's dtype and row width, or without one
    `mla_format_of(cache)`. ValueError for a mismatch or something that is not a descriptor."""
    if fmt is None:
        return mla_format_of(cache, name)
    if not isinstance(fmt, _MLAFormat):
        fail("fmt", "a sparse MLA cache format (quant.FP8_DS_MLA, FP8_DS_MLA_RAW, BF16_MLA, FP8_MODEL1)",
             type(fmt).__name__)
    check_tensor(name, cache)
    if cache.dtype != fmt.cache_dtype or cache.shape[-1] != fmt.row_width:
        fail("fmt", f"a format of the {name} ({cache.dtype} rows of {cache.shape[-1]})",
             f"{fmt.name} (rows of {fmt.row_width} {fmt.cache_dtype})")
    return fmt
