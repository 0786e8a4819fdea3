"""MLA latent cache formats: one frozen descriptor per format, and torch pack/unpack.

pack/unpack here are the byte-level truth (DESIGN.md, fp8_ds_mla); Triton writers and readers
in `quant/` and the kernels in `kernels/` are tested against them.

fp8_ds_mla token, 656 bytes (byte-compatible with FlashMLA and vLLM):
    [0, 512)    512 x float8_e4m3fn latent, tile t = elements 128t..128t+127
    [512, 528)  4 x float32 scale (little-endian), one per tile
    [528, 656)  64 x bfloat16 rope, copied verbatim
bf16 token, 576 x bfloat16: latent 512 | rope 64.

Both are `quant.format_types.CacheFormat`s of the SPARSE_MLA family, listed in the registry
(quant/formats.py) with their kv_cache_dtype names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .format_types import PER_TILE, SPARSE_MLA, CacheFormat, CacheTensor, Scale
from .validate import check_tensor, fail

FP8_E4M3_MAX = 448.0
_SCALE_RULES = ("pow2", "raw")


def _check_rows(name: str, t: torch.Tensor) -> None:
    """A tensor of rows [..., width] has at least one dimension (a 0-D tensor has no last dim)."""
    if t.dim() == 0:
        fail(f"{name}.dim()", ">= 1 ([..., width])", "0 (a scalar)")


def _check_pack_inputs(fmt, kv_c: torch.Tensor, k_pe: torch.Tensor) -> None:
    """kv_c [..., latent_dim] and k_pe [..., rope_dim] in a float dtype, same leading shape."""
    check_tensor("kv_c", kv_c, dtype=(torch.bfloat16, torch.float16, torch.float32))
    check_tensor("k_pe", k_pe, dtype=(torch.bfloat16, torch.float16, torch.float32))
    _check_rows("kv_c", kv_c)
    _check_rows("k_pe", k_pe)
    if kv_c.shape[-1] != fmt.latent_dim:
        fail("kv_c.shape[-1]", fmt.latent_dim, kv_c.shape[-1])
    if k_pe.shape[-1] != fmt.rope_dim:
        fail("k_pe.shape[-1]", fmt.rope_dim, k_pe.shape[-1])
    if kv_c.shape[:-1] != k_pe.shape[:-1]:
        fail("k_pe.shape[:-1]", tuple(kv_c.shape[:-1]), tuple(k_pe.shape[:-1]))


class _MLAFormat(CacheFormat):
    """What both sparse MLA formats share: one cache tensor of rows (latent | rope)."""

    family: ClassVar[str] = SPARSE_MLA
    # False: a cache row [.., row_width] is one token. True (FP8_MODEL1): bytes are laid out per
    # page block (all records, then all scales) and only whole blocks mean something.
    blocked: ClassVar[bool] = False

    @property
    def head_dim(self) -> int:
        return self.latent_dim + self.rope_dim

    @property
    def tensors(self) -> tuple:
        return (CacheTensor("cache", f"[num_blocks, block_size, {self.row_width}]", self.cache_dtype),)

    def check_cache(self, cache, name: str = "cache") -> None:
        """ValueError naming `name` unless `cache` is a [num_blocks, block_size, row_width]
        tensor of this format's dtype with contiguous rows (any block and row strides)."""
        check_tensor(name, cache, ndim=3, last_dim_contiguous=True)
        if cache.dtype != self.cache_dtype or cache.shape[-1] != self.row_width:
            fail(name, f"[num_blocks, block_size, {self.row_width}] {self.cache_dtype} (a {self.name} "
                 "cache)", f"{tuple(cache.shape)} {cache.dtype}")


@dataclass(frozen=True)
class FP8DSMLAFormat(_MLAFormat):
    """fp8_ds_mla: per-128-element-tile fp32 scales, fp8 e4m3fn latent, bf16 rope.

    scale_rule:
      "pow2" (default, current FlashMLA and vLLM writers):
          s = 2 ** ceil(log2(max(amax / 448, 1e-4))), fp32 throughout.
      "raw" (older vLLM writers): s = max(amax / 448, FLT_MIN).
    Quantize: fp8 = e4m3fn(rne(x_fp32 / s)), saturating at +-448. Dequantize: float(fp8) * s.
    """

    scale_rule: str = "pow2"
    latent_dim: int = 512
    rope_dim: int = 64
    tile_size: int = 128
    name: str = "fp8_ds_mla"
    kv_cache_dtypes: tuple = ("fp8_ds_mla",)
    # "fp8" is vLLM's alias of fp8_ds_mla for sparse MLA (FlashMLASparseBackend accepts it)
    vllm_kv_cache_dtypes: tuple = ("fp8_ds_mla", "fp8")
    about: str = "656 B/token, e4m3 latent, 4 fp32 tile scales 2^ceil(log2(amax/448)), bf16 rope"
    quantized: ClassVar[bool] = True

    def __post_init__(self):
        if self.scale_rule not in _SCALE_RULES:
            raise ValueError(f"scale_rule: expected one of {_SCALE_RULES}, got {self.scale_rule!r}")

    # Layout, in bytes within one token row. Kernels take these as constexprs.
    @property
    def num_tiles(self) -> int:
        return self.latent_dim // self.tile_size

    @property
    def latent_offset(self) -> int:
        return 0

    @property
    def scale_offset(self) -> int:
        return self.latent_dim

    @property
    def rope_offset(self) -> int:
        return self.latent_dim + 4 * self.num_tiles

    @property
    def bytes_per_token(self) -> int:
        return self.rope_offset + 2 * self.rope_dim

    @property
    def row_width(self) -> int:
        """Last dim of the cache tensor, in elements of `cache_dtype`."""
        return self.bytes_per_token

    @property
    def cache_dtype(self) -> torch.dtype:
        return torch.uint8

    @property
    def pow2(self) -> bool:
        """Scales are powers of two (the "pow2" rule)."""
        return self.scale_rule == "pow2"

    @property
    def scale_floor(self) -> float:
        """The smallest scale the rule gives: 1e-4 before rounding up (pow2), FLT_MIN (raw)."""
        return 1e-4 if self.pow2 else torch.finfo(torch.float32).tiny

    @property
    def scales(self) -> tuple:
        return (Scale("latent", PER_TILE, f"bytes [{self.scale_offset}, {self.rope_offset}) of each row",
                      f"[{self.num_tiles}] per token", torch.float32),)

    def tile_scales(self, amax: torch.Tensor) -> torch.Tensor:
        """Per-tile scale from the tile's fp32 abs-max, by this format's rule (fp32 out)."""
        amax = amax.float()
        # Divide by a tensor: torch on CUDA turns `tensor / python_float` into a multiply by the
        # rounded reciprocal, one ulp off the true quotient for about half of all amax values.
        s = amax / torch.full_like(amax, FP8_E4M3_MAX)
        if self.pow2:
            # Same expression as FlashMLA's reference quantizer, so packs are byte-identical
            # (including its fp32 log2 rounding just above powers of two).
            return torch.pow(2, torch.clamp_min(s, self.scale_floor).log2().ceil()).float()
        return torch.clamp_min(s, self.scale_floor)

    def pack(self, kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        """kv_c [..., 512] and k_pe [..., 64] (bf16, or fp32 for the latent) -> [..., 656] uint8.

        The rope bytes are k_pe converted to bf16 (verbatim when it is bf16).
        """
        _check_pack_inputs(self, kv_c, k_pe)
        lead = kv_c.shape[:-1]
        tiles = kv_c.reshape(*lead, self.num_tiles, self.tile_size)
        amax = tiles.abs().amax(dim=-1).float()  # exact in the input dtype, then widened
        scale = self.tile_scales(amax)  # [..., num_tiles] fp32
        q = (tiles.float() / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
        out = torch.empty(*lead, self.bytes_per_token, dtype=torch.uint8, device=kv_c.device)
        out[..., : self.latent_dim] = q.reshape(*lead, self.latent_dim).view(torch.uint8)
        out[..., self.scale_offset : self.rope_offset] = scale.contiguous().view(torch.uint8).reshape(
            *lead, 4 * self.num_tiles
        )
        rope = k_pe.to(torch.bfloat16).contiguous()
        out[..., self.rope_offset :] = rope.view(torch.uint8).reshape(*lead, 2 * self.rope_dim)
        return out

    def unpack_parts(self, cache: torch.Tensor):
        """[..., 656] uint8 -> (fp8 latent as fp32 [..., 512], scales fp32 [..., 4], rope bf16 [..., 64])."""
        check_tensor("cache", cache, dtype=torch.uint8)
        _check_rows("cache", cache)
        if cache.shape[-1] != self.bytes_per_token:
            fail("cache.shape[-1]", self.bytes_per_token, cache.shape[-1])
        c = cache.contiguous()
        lat = c[..., : self.latent_dim].view(torch.float8_e4m3fn).float()
        scale = c[..., self.scale_offset : self.rope_offset].contiguous().view(torch.float32)
        rope = c[..., self.rope_offset :].contiguous().view(torch.bfloat16)
        return lat, scale, rope

    def unpack(self, cache: torch.Tensor) -> torch.Tensor:
        """[..., 656] uint8 -> [..., 576] fp32: dequantized latent (fp8 * scale) | rope."""
        lat, scale, rope = self.unpack_parts(cache)
        lead = lat.shape[:-1]
        deq = lat.reshape(*lead, self.num_tiles, self.tile_size) * scale.unsqueeze(-1)
        return torch.cat([deq.reshape(*lead, self.latent_dim), rope.float()], dim=-1)


@dataclass(frozen=True)
class BF16MLAFormat(_MLAFormat):
    """bf16 MLA cache: [num_blocks, block_size, 576] bfloat16, latent 512 | rope 64."""

    latent_dim: int = 512
    rope_dim: int = 64
    name: str = "bf16"
    kv_cache_dtypes: tuple = ("bf16", "auto", "bfloat16")
    vllm_kv_cache_dtypes: tuple = ("auto", "bfloat16")
    about: str = "bf16 latent cache, 1152 B/token"
    quantized: ClassVar[bool] = False

    @property
    def rope_offset(self) -> int:
        """Where the rope starts in a row, in elements (bf16)."""
        return self.latent_dim

    @property
    def scales(self) -> tuple:
        return ()

    @property
    def row_width(self) -> int:
        return self.head_dim

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.head_dim

    @property
    def cache_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def pack(self, kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        """kv_c [..., 512], k_pe [..., 64] -> [..., 576] bf16 (rounded to nearest even)."""
        _check_pack_inputs(self, kv_c, k_pe)
        return torch.cat([kv_c.to(torch.bfloat16), k_pe.to(torch.bfloat16)], dim=-1)

    def unpack(self, cache: torch.Tensor) -> torch.Tensor:
        """[..., 576] bf16 -> [..., 576] fp32."""
        check_tensor("cache", cache, dtype=torch.bfloat16)
        _check_rows("cache", cache)
        if cache.shape[-1] != self.head_dim:
            fail("cache.shape[-1]", self.head_dim, cache.shape[-1])
        return cache.float()


FP8_DS_MLA = FP8DSMLAFormat()
# Written by older vLLM writers; vLLM has no name for it (its caches are read as fp8_ds_mla).
FP8_DS_MLA_RAW = FP8DSMLAFormat(scale_rule="raw", name="fp8_ds_mla_raw",
                                kv_cache_dtypes=("fp8_ds_mla_raw",), vllm_kv_cache_dtypes=(),
                                about="as fp8_ds_mla with scale amax/448 (older vLLM writers)")
BF16_MLA = BF16MLAFormat()
