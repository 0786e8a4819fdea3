"""DeepSeek-V4 ("MODEL1" in FlashMLA) fp8 sparse cache: the descriptor and its torch pack/unpack.

As FlashMLA 9241ae3 defines it (tests/quant.py, `FP8KVCacheLayout.MODEL1_FP8Sparse`). A token
is d_qk = 512 values: 448 "nope" values quantized to fp8 e4m3fn in 7 tiles of 64, each tile with
one power-of-two scale stored as a ue8m0 byte (float8_e8m0fnu: the byte e means 2^(e - 127)), and
64 rope values in bf16. V is the whole dequantized 512-wide token (d_v = 512, rope included).

A page block is NOT laid out token by token. With bs = block_size, one block's bytes are

    [0, bs * 576)                record r at r * 576: 448 e4m3 nope bytes | 64 bf16 rope (128 B)
    [bs * 576, bs * 584)         scales of record r at bs * 576 + r * 8: 7 ue8m0 bytes | 1 pad (0)
    [bs * 584, padded)           padding to a multiple of 576 bytes (FlashMLA's block stride)

The cache tensor a user holds is FlashMLA's `[num_blocks, bs, 1, 584]` uint8 view over that
(`[num_blocks, bs, 584]` is accepted too): its rows are NOT tokens, only its block stride and
`bs` mean something. Row stride is 584 (a block's bytes are contiguous); the block stride may be
anything >= bs * 584 that keeps 2-byte alignment (FlashMLA pads to a multiple of 576; engines
may interleave layers).

Scale rule (FlashMLA's `_cast_scale_inv_to_ue8m0`, the same pow2 rule as fp8_ds_mla, see
FP8DSMLAFormat.tile_scales): s = 2 ** ceil(log2(max(amax / 448, 1e-4))) in fp32, amax over the
tile's 64 values; fp8 = e4m3fn(rne(x / s)), saturating at +-448. Dequantize: float(fp8) * s
(exact in bf16 and fp32: s is a power of two in [2^-13, 2^127]).

Kernels compute addresses from the descriptor (FP8_MODEL1), never from literals:
    record_bytes (576), nope_offset (0), rope_offset (448, bytes within a record),
    scale_stride (8), num_tiles (7), tile_size (64), scale_bias (127),
    scales_offset(bs), record_offset(row), token_scale_offset(bs, row),
    block_bytes(bs), padded_block_bytes(bs), block_view(cache).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .format_types import PER_TILE, CacheTensor, Scale
from .mla_formats import FP8_DS_MLA, _MLAFormat
from .validate import check_tensor, fail

__all__ = ["Model1Format", "FP8_MODEL1"]


@dataclass(frozen=True)
class Model1Format(_MLAFormat):
    """The MODEL1 (DeepSeek-V4) fp8 sparse cache: 448 e4m3 nope in 7 ue8m0-scaled tiles of 64,
    64 bf16 rope, laid out per page block (module docstring). head_dim = latent_dim = 512."""

    nope_dim: int = 448
    rope_dim: int = 64
    tile_size: int = 64
    scale_stride: int = 8  # scale bytes per token: num_tiles ue8m0 bytes, then one pad byte
    block_align: int = 576  # a block's bytes are padded to a multiple of this (FlashMLA's TMA stride)
    name: str = "fp8_model1"
    kv_cache_dtypes: tuple = ("fp8_model1", "fp8_ds_mla_v4", "model1_fp8_sparse")
    # vLLM 0.32 calls this layout "fp8_ds_mla" when the model is DeepSeek-V4; the name means the
    # 656-byte V3.2 format otherwise, so it stays fp8_ds_mla's and the adapter picks by model.
    vllm_kv_cache_dtypes: tuple = ()
    about: str = ("584 B/token (DeepSeek-V4, FlashMLA MODEL1): e4m3 nope 448 in 7 tiles with ue8m0 "
                  "scales 2^ceil(log2(amax/448)), bf16 rope 64, laid out per block")
    quantized: ClassVar[bool] = True
    # Bytes are laid out per page block (records, then scales): a cache row is not a token.
    blocked: ClassVar[bool] = True
    pow2: ClassVar[bool] = True
    scale_bias: ClassVar[int] = 127  # ue8m0 byte e <-> scale 2^(e - 127)

    def __post_init__(self):
        if self.nope_dim % self.tile_size or self.scale_stride <= self.num_tiles - 1:
            raise ValueError(f"{self.name}: nope_dim {self.nope_dim} must be tiles of {self.tile_size} "
                             f"and scale_stride {self.scale_stride} >= num_tiles {self.num_tiles}")

    # --- dimensions -----------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        """d_qk: nope + rope (512)."""
        return self.nope_dim + self.rope_dim

    @property
    def latent_dim(self) -> int:
        """d_v: V is the whole dequantized token, rope included (512)."""
        return self.head_dim

    @property
    def num_tiles(self) -> int:
        return self.nope_dim // self.tile_size

    # --- bytes ----------------------------------------------------------------------------
    @property
    def nope_offset(self) -> int:
        """Byte offset of the e4m3 nope within a record."""
        return 0

    @property
    def rope_offset(self) -> int:
        """Byte offset of the bf16 rope within a record."""
        return self.nope_dim

    @property
    def record_bytes(self) -> int:
        """Bytes of one token's record (nope | rope), the record stride within a block (576)."""
        return self.nope_dim + 2 * self.rope_dim

    @property
    def bytes_per_token(self) -> int:
        return self.record_bytes + self.scale_stride

    @property
    def row_width(self) -> int:
        """Last dim of the cache tensor (uint8): 584."""
        return self.bytes_per_token

    @property
    def cache_dtype(self) -> torch.dtype:
        return torch.uint8

    @property
    def scale_floor(self) -> float:
        return FP8_DS_MLA.scale_floor

    def record_offset(self, row: int) -> int:
        """Byte offset of row `row`'s record within its block."""
        return row * self.record_bytes

    def scales_offset(self, block_size: int) -> int:
        """Byte offset of a block's scale area (block_size records come first)."""
        return block_size * self.record_bytes

    def token_scale_offset(self, block_size: int, row: int) -> int:
        """Byte offset of row `row`'s first ue8m0 scale byte within its block."""
        return self.scales_offset(block_size) + row * self.scale_stride

    def block_bytes(self, block_size: int) -> int:
        """Bytes of a block that hold data: block_size * 584."""
        return block_size * self.bytes_per_token

    def padded_block_bytes(self, block_size: int) -> int:
        """FlashMLA's block stride: block_bytes rounded up to a multiple of 576."""
        return -(-self.block_bytes(block_size) // self.block_align) * self.block_align

    # --- descriptor ------------------------------------------------------------------------
    @property
    def tensors(self) -> tuple:
        return (CacheTensor("cache", f"[num_blocks, block_size, 1, {self.row_width}] (a view over blocks of "
                            f"block_size * {self.row_width} bytes, stride a multiple of {self.block_align})",
                            torch.uint8),)

    @property
    def scales(self) -> tuple:
        return (Scale("nope", PER_TILE, f"ue8m0 bytes [block_size * {self.record_bytes} + {self.scale_stride} "
                      f"* row, + {self.num_tiles}) of each block", f"[{self.num_tiles}] per token",
                      torch.float8_e8m0fnu),)

    def tile_scales(self, amax: torch.Tensor) -> torch.Tensor:
        """Per-tile scale (fp32, a power of two) from the tile's fp32 abs-max: fp8_ds_mla's pow2
        rule, which is FlashMLA's `_cast_scale_inv_to_ue8m0` for both layouts."""
        return FP8_DS_MLA.tile_scales(amax)

    def check_cache(self, cache, name: str = "cache") -> None:
        """ValueError naming `name` unless `cache` is a MODEL1 cache: uint8 [num_blocks, bs, 584]
        or [num_blocks, bs, 1, 584], row stride 584 (each block's bytes contiguous), blocks not
        overlapping, 2-byte aligned (the rope is bf16)."""
        check_tensor(name, cache, dtype=torch.uint8, last_dim_contiguous=True)
        want = f"[num_blocks, block_size, 1, {self.row_width}] or [num_blocks, block_size, {self.row_width}]"
        if cache.dim() not in (3, 4) or cache.shape[-1] != self.row_width or (
                cache.dim() == 4 and cache.shape[2] != 1):
            fail(f"{name}.shape", f"{want} uint8 (a {self.name} cache)", tuple(cache.shape))
        nb, bs = cache.shape[0], cache.shape[1]
        if bs > 1 and cache.stride(1) != self.row_width:
            fail(f"{name}.stride(1)", f"{self.row_width} (a block's bytes are contiguous)", cache.stride(1))
        if nb > 1 and cache.stride(0) < self.block_bytes(bs):
            fail(f"{name}.stride(0)", f">= block_size * {self.row_width} = {self.block_bytes(bs)} "
                 "(blocks must not overlap)", cache.stride(0))
        if cache.data_ptr() % 2 or (nb > 1 and cache.stride(0) % 2):
            fail(name, "a 2-byte aligned start and block stride (the rope is bf16)",
                 f"data_ptr % 2 = {cache.data_ptr() % 2}, stride(0) = {cache.stride(0)}")

    def block_view(self, cache: torch.Tensor, name: str = "cache") -> torch.Tensor:
        """A checked MODEL1 cache as [num_blocks, block_size * 584] uint8: each row one block's
        data bytes (records, then scales), the cache's own block stride."""
        self.check_cache(cache, name)
        nb, bs = cache.shape[0], cache.shape[1]
        return cache.as_strided((nb, self.block_bytes(bs)), (cache.stride(0), 1))

    def empty_cache(self, num_blocks: int, block_size: int, *, device=None,
                    block_stride: int | None = None) -> torch.Tensor:
        """A zero-filled cache [num_blocks, block_size, 1, 584] uint8 whose blocks lie
        `block_stride` bytes apart (default padded_block_bytes(block_size), as FlashMLA)."""
        stride = self.padded_block_bytes(block_size) if block_stride is None else int(block_stride)
        if stride < self.block_bytes(block_size) or stride % 2:
            fail("block_stride", f"an even number >= {self.block_bytes(block_size)}", stride)
        store = torch.zeros(num_blocks, stride, dtype=torch.uint8, device=device)
        return store[:, : self.block_bytes(block_size)].view(num_blocks, block_size, 1, self.row_width)

    # --- pack / unpack ---------------------------------------------------------------------
    def pack(self, k: torch.Tensor, *, block_stride: int | None = None) -> torch.Tensor:
        """Quantize whole page blocks: k [num_blocks, bs, 512] or [num_blocks, bs, 1, 512] (bf16;
        fp16 / fp32 accepted: nope quantized from the values, rope converted to bf16 round to
        nearest even) -> a cache of the same rank ending in 584 (uint8), blocks `block_stride`
        bytes apart (default padded_block_bytes(bs); the padding and each pad byte are 0).

        Byte-identical to FlashMLA's quantize_k_cache(MODEL1_FP8Sparse) on the bytes it defines
        (records and the 7 scale bytes; FlashMLA leaves the pad byte and the padding unset). A
        tile holding NaN gets a NaN scale byte (0xFF) and NaN fp8 bytes, as FlashMLA's does.
        """
        check_tensor("k", k, dtype=(torch.bfloat16, torch.float16, torch.float32))
        if k.dim() not in (3, 4) or k.shape[-1] != self.head_dim or (k.dim() == 4 and k.shape[2] != 1):
            fail("k.shape", f"[num_blocks, block_size, {self.head_dim}] or [num_blocks, block_size, 1, "
                 f"{self.head_dim}]", tuple(k.shape))
        nb, bs = k.shape[0], k.shape[1]
        cache = self.empty_cache(nb, bs, device=k.device, block_stride=block_stride)
        k3 = k.reshape(nb, bs, self.head_dim)
        tiles = k3[..., : self.nope_dim].reshape(nb, bs, self.num_tiles, self.tile_size)
        scale = self.tile_scales(tiles.abs().amax(dim=-1).float())  # [nb, bs, 7], exact amax
        q = (tiles.float() / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
        blocks = cache.as_strided((nb, self.block_bytes(bs)), (cache.stride(0), 1))
        rec = blocks[:, : self.scales_offset(bs)].view(nb, bs, self.record_bytes)
        rec[..., : self.nope_dim] = q.view(torch.uint8).reshape(nb, bs, self.nope_dim)
        rope = k3[..., self.nope_dim:].to(torch.bfloat16).contiguous()
        rec[..., self.rope_offset:] = rope.view(torch.uint8).reshape(nb, bs, 2 * self.rope_dim)
        sc = blocks[:, self.scales_offset(bs):].view(nb, bs, self.scale_stride)
        sc[..., : self.num_tiles] = scale.to(torch.float8_e8m0fnu).view(torch.uint8)
        return cache if k.dim() == 4 else cache.squeeze(2)

    def unpack_parts(self, cache: torch.Tensor):
        """A MODEL1 cache -> (nope e4m3 values as fp32 [nb, bs, 448], scales fp32 [nb, bs, 7],
        rope bf16 [nb, bs, 64]); block size and block stride from the cache tensor."""
        blocks = self.block_view(cache)
        nb, bs = cache.shape[0], cache.shape[1]
        rec = blocks[:, : self.scales_offset(bs)].reshape(nb, bs, self.record_bytes)
        nope = rec[..., : self.nope_dim].contiguous().view(torch.float8_e4m3fn).float()
        rope = rec[..., self.rope_offset:].contiguous().view(torch.bfloat16)
        sc = blocks[:, self.scales_offset(bs):].reshape(nb, bs, self.scale_stride)[..., : self.num_tiles]
        scale = sc.contiguous().view(torch.float8_e8m0fnu).float()
        return nope, scale, rope

    def unpack(self, cache: torch.Tensor) -> torch.Tensor:
        """A MODEL1 cache [nb, bs, (1,) 584] -> fp32 [nb, bs, (1,) 512]: nope fp8 * scale | rope.
        Equals FlashMLA's dequantize_k_cache (which rounds to bf16: exact here) as fp32."""
        nope, scale, rope = self.unpack_parts(cache)
        nb, bs = nope.shape[:2]
        deq = (nope.view(nb, bs, self.num_tiles, self.tile_size) * scale.unsqueeze(-1)).view(nb, bs, -1)
        return torch.cat([deq, rope.float()], dim=-1).view(*cache.shape[:-1], self.head_dim)


FP8_MODEL1 = Model1Format()
