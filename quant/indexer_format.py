"""The DSA lightning indexer's K cache format: one frozen descriptor per scale rule, and the torch
references (pack / unpack / read_ref / write_ref: the byte-level truth). The Triton writer is
quant/indexer_cache.py.

Byte layout (vLLM 0.32, `DeepseekV32IndexerCache` + `indexer_k_quant_and_cache`, which DeepGEMM's
paged MQA logits read). A cache is a uint8 tensor `[num_blocks, block_size, 132]` (132 = 128 fp8
bytes + one fp32 scale per 128 elements), but the shape is only an allocation: inside one page
block the bytes are NOT token rows of 132. Block b starts at byte `b * cache.stride(0)` (a layer's
view into an interleaved allocation may have a block stride above block_size * 132) and holds

    [0, block_size * 128)                     token o's 128 e4m3fn values at byte o * 128
    [block_size * 128, block_size * 132)      token o's fp32 scale(s) at byte block_size * 128
                                              + 4 * (o * scales_per_token + j), little-endian

Quantization of one token's group of `quant_block_size` (= 128) elements, as vLLM's CUDA writer:
    amax = max |x| over the group in fp32, NaN elements ignored (CUDA fmaxf drops NaN);
    s    = max(amax, 1e-4) / 448                  (fp32, correctly rounded)
    ue8m0 (DeepSeek-V3.2's scale_fmt): s = 2 ** ceil(log2(s)) with fp32 log2 (rounding just above
          2^k reproduced: the scale stays 2^k there and the largest element saturates);
    fp8  = e4m3fn(rne(x / s)), saturating at +-448, NaN stays NaN.
Dequantize: float(fp8) * s.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .format_types import INDEXER, PER_TOKEN_HEAD, CacheFormat, CacheTensor, Scale
from .validate import check_tensor, fail

__all__ = ["IndexerKFormat", "INDEXER_K_FP8", "INDEXER_K_FP8_RAW", "indexer_k_format_of", "FP8_MAX",
           "AMAX_FLOOR"]

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4  # vLLM's writer floors amax (not the scale) at 1e-4
_SCALE_FMTS = ("ue8m0", "raw")


@dataclass(frozen=True)
class IndexerKFormat(CacheFormat):
    """fp8 e4m3 indexer keys with an fp32 scale per `quant_block_size` elements of a token.

    scale_fmt: "ue8m0" (power-of-two scales, what DeepSeek-V3.2 uses) or "raw" (amax-derived
    scales; vLLM's writer does this for any scale_fmt other than "ue8m0").
    """

    scale_fmt: str = "ue8m0"
    head_dim: int = 128
    quant_block_size: int = 128
    name: str = "fp8_indexer"
    kv_cache_dtypes: tuple = ("fp8_indexer",)
    vllm_kv_cache_dtypes: tuple = ()  # vLLM allocates it beside the MLA cache, unnamed
    about: str = "132 B/token: 128 e4m3 + fp32 scale 2^ceil(log2(max(amax,1e-4)/448)), page-blocked"
    family: ClassVar[str] = INDEXER
    quantized: ClassVar[bool] = True

    def __post_init__(self):
        if self.scale_fmt not in _SCALE_FMTS:
            fail("scale_fmt", f"one of {_SCALE_FMTS}", repr(self.scale_fmt))
        if self.quant_block_size <= 0 or self.head_dim % self.quant_block_size:
            fail("quant_block_size", f"a positive divisor of head_dim {self.head_dim}",
                 self.quant_block_size)

    @property
    def ue8m0(self) -> bool:
        return self.scale_fmt == "ue8m0"

    @property
    def scales_per_token(self) -> int:
        return self.head_dim // self.quant_block_size

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes a token takes (the last dim of the cache tensor)."""
        return self.head_dim + 4 * self.scales_per_token

    row_width = bytes_per_token

    def scale_region(self, block_size: int) -> int:
        """Byte offset of the scales within a page block."""
        return block_size * self.head_dim

    @property
    def tensors(self) -> tuple:
        return (CacheTensor("cache", f"[num_blocks, block_size, {self.bytes_per_token}] (page-blocked: "
                            "values of all block_size tokens, then their scales)", torch.uint8),)

    @property
    def scales(self) -> tuple:
        return (Scale("k", PER_TOKEN_HEAD, "bytes [block_size * head_dim, block_size * row_width) of "
                      "each page block", f"[{self.scales_per_token}] per token", torch.float32),)

    def check_cache(self, cache, name: str = "cache") -> None:
        """ValueError unless `cache` is a [num_blocks, block_size, 132] uint8 tensor whose blocks
        are contiguous inside (any block stride, a multiple of 4 bytes for the fp32 scales)."""
        check_tensor(name, cache, dtype=torch.uint8, ndim=3)
        nb, bs, w = cache.shape
        if w != self.bytes_per_token:
            fail(f"{name}.shape[-1]", self.bytes_per_token, w)
        if cache.stride(2) != 1 or (bs > 1 and cache.stride(1) != w):
            fail(f"{name}.stride()", f"(*, {w}, 1): each page block contiguous", cache.stride())
        if cache.data_ptr() % 4 or cache.stride(0) % 4:
            fail(name, "4-byte aligned page blocks (data_ptr and stride(0) multiples of 4)",
                 f"data_ptr % 4 = {cache.data_ptr() % 4}, stride(0) = {cache.stride(0)}")

    # ------------------------------------------------------------------ torch references
    def group_scales(self, amax: torch.Tensor, *, amax_floor: float = AMAX_FLOOR) -> torch.Tensor:
        """fp32 scales from per-group fp32 abs-max values (NaN already dropped), by scale_fmt."""
        a = torch.clamp_min(amax.float(), amax_floor)
        s = a / torch.full_like(a, FP8_MAX)  # a tensor divisor: correctly rounded on CUDA too
        if self.ue8m0:
            s = torch.pow(2, s.log2().ceil()).float()
        return s

    def pack(self, k: torch.Tensor):
        """k [..., head_dim] bf16 / fp16 / fp32 -> (values [..., head_dim] uint8 e4m3fn bytes,
        scales [..., scales_per_token] fp32)."""
        check_tensor("k", k, dtype=(torch.bfloat16, torch.float16, torch.float32))
        if k.dim() == 0 or k.shape[-1] != self.head_dim:
            fail("k.shape[-1]", self.head_dim, tuple(k.shape))
        lead = k.shape[:-1]
        g = k.float().reshape(*lead, self.scales_per_token, self.quant_block_size)
        a = g.abs()
        amax = torch.where(torch.isnan(a), torch.zeros_like(a), a).amax(dim=-1)
        s = self.group_scales(amax)
        q = (g / s.unsqueeze(-1)).to(torch.float8_e4m3fn)  # torch's cast: RNE, saturating
        return q.view(torch.uint8).reshape(*lead, self.head_dim), s

    def unpack(self, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """(values [..., head_dim] uint8, scales [..., scales_per_token] fp32) -> fp32 keys."""
        check_tensor("values", values, dtype=torch.uint8)
        check_tensor("scales", scales, dtype=torch.float32)
        lead = values.shape[:-1]
        v = values.contiguous().view(torch.float8_e4m3fn).float()
        v = v.reshape(*lead, self.scales_per_token, self.quant_block_size) * scales.unsqueeze(-1)
        return v.reshape(*lead, self.head_dim)

    def read_ref(self, cache: torch.Tensor):
        """The parts of a paged cache, as views: (values [num_blocks, block_size, head_dim] uint8,
        scales [num_blocks, block_size, scales_per_token] fp32)."""
        self.check_cache(cache)
        nb, bs, _ = cache.shape
        flat = cache.as_strided((nb, bs * self.bytes_per_token), (cache.stride(0), 1))
        values = flat[:, : self.scale_region(bs)].unflatten(1, (bs, self.head_dim))
        sc = flat[:, self.scale_region(bs):]
        scales = sc.view(torch.float32).unflatten(1, (bs, self.scales_per_token))
        return values, scales

    def write_ref(self, k: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Torch reference writer, in place: token t to slot slot_mapping[t] (block slot //
        block_size, offset slot % block_size); slots < 0 or >= num_blocks * block_size are
        skipped. With duplicate slots the last token wins."""
        values, scales = self.read_ref(cache)
        nb, bs = values.shape[:2]
        slots = slot_mapping.long()
        keep = (slots >= 0) & (slots < nb * bs)
        q, s = self.pack(k)
        sel = keep.nonzero().flatten()
        b, o = slots[sel] // bs, slots[sel] % bs
        values[b, o] = q[sel]
        scales[b, o] = s[sel]


INDEXER_K_FP8 = IndexerKFormat()
INDEXER_K_FP8_RAW = IndexerKFormat(scale_fmt="raw", name="fp8_indexer_raw",
                                   kv_cache_dtypes=("fp8_indexer_raw",),
                                   about="as fp8_indexer with scale max(amax, 1e-4) / 448")


def indexer_k_format_of(scale_fmt) -> IndexerKFormat:
    """The descriptor for vLLM's `scale_fmt` argument ("ue8m0" -> INDEXER_K_FP8; any other value,
    None included, -> INDEXER_K_FP8_RAW, as vLLM's writer reads it); a descriptor is returned as is."""
    if isinstance(scale_fmt, IndexerKFormat):
        return scale_fmt
    return INDEXER_K_FP8 if scale_fmt == "ue8m0" else INDEXER_K_FP8_RAW
