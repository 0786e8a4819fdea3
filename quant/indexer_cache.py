"""The DSA lightning indexer's K cache: format descriptor, torch reference writer, Triton writer.

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

`IndexerKFormat.pack` / `unpack` / `write_ref` / `read_ref` are the byte-level truth; the Triton
writer `write_indexer_k_cache` is tested byte for byte against `write_ref`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import triton
import triton.language as tl

from openmla.kernels.device import arch_of

from .e4m3 import f32_to_e4m3
from .format_types import PER_TOKEN_HEAD, CacheFormat, CacheTensor, Scale
from .mla_writer import check_slot_range, tile_scale
from .validate import check_same_device, check_tensor, fail

__all__ = ["INDEXER", "IndexerKFormat", "INDEXER_K_FP8", "INDEXER_K_FP8_RAW", "write_indexer_k_cache",
           "indexer_k_format_of"]

INDEXER = "dsa_indexer"  # the family of the indexer's K cache (quant/format_types.py)
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


# ---------------------------------------------------------------------------------- Triton writer
@triton.jit
def write_indexer_k_cache_kernel(
    k_ptr, cache_ptr, slot_ptr,
    stride_k_t, stride_cache_block, block_size, num_slots,
    GROUPS: tl.constexpr, GROUP: tl.constexpr, UE8M0: tl.constexpr,
    FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr, E4M3: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + i_t).to(tl.int64)
    # Skipped (< 0) and out-of-range slots write nothing: never a wild write, even unchecked.
    m_slot = (slot >= 0) & (slot < num_slots)
    slot = tl.where(m_slot, slot, 0)
    i_b, i_o = slot // block_size, slot % block_size
    p_block = cache_ptr + i_b * stride_cache_block

    o_k = tl.arange(0, GROUPS)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    b_x = tl.load(k_ptr + i_t * stride_k_t + o_k, mask=m_slot, other=0.0).to(tl.float32)
    # max.f32 drops NaN, as CUDA's fmaxf in vLLM's writer: a NaN element does not poison the scale.
    b_amax = tl.max(tl.abs(b_x), axis=1)
    # The floor applies to amax here (vLLM's rule), so the scale rule's own floor is 0.
    b_s = tile_scale(tl.maximum(b_amax, AMAX_FLOOR), UE8M0, FP8_MAX, 0.0)
    b_q = f32_to_e4m3(tl.math.div_rn(b_x, b_s[:, None]), E4M3)
    tl.store(p_block + i_o * (GROUPS * GROUP) + o_k, b_q, mask=m_slot)
    p_scale = (p_block + block_size * (GROUPS * GROUP)).to(tl.pointer_type(tl.float32))
    tl.store(p_scale + i_o * GROUPS + tl.arange(0, GROUPS), b_s, mask=m_slot)


def write_indexer_k_cache(k: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                          fmt=INDEXER_K_FP8, check_slots: bool = True) -> None:
    """Quantize T new indexer keys into the paged indexer K cache, in place (vLLM's
    `indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, scale_fmt)`).

    Args:
        k: [T, 128] bf16 (fp16 / fp32 accepted), last dim contiguous, any token stride.
        cache: [num_blocks, block_size, 132] uint8 in the page-blocked layout of this module's
            docstring; any block stride (a multiple of 4), each block contiguous inside.
        slot_mapping: [T] int32 / int64, slot = block * block_size + offset; < 0 skips the token
            (padding). Distinct slots expected (duplicates: which token lands is unspecified).
        fmt: an IndexerKFormat (INDEXER_K_FP8: ue8m0 scales, default; INDEXER_K_FP8_RAW), or
            vLLM's scale_fmt string (`indexer_k_format_of`).
        check_slots: raise ValueError when some slot >= num_blocks * block_size (reads
            slot_mapping.max() back: a device sync; pass False under CUDA-graph capture). Either way
            the kernel skips out-of-range slots instead of writing out of bounds.

    The bytes written equal `fmt.write_ref(k, cache, slot_mapping)` exactly.
    """
    fmt = indexer_k_format_of(fmt)
    check_tensor("k", k, dtype=(torch.bfloat16, torch.float16, torch.float32), ndim=2,
                 last_dim_contiguous=True)
    T = k.shape[0]
    if k.shape[1] != fmt.head_dim:
        fail("k.shape", f"(T, {fmt.head_dim})", tuple(k.shape))
    check_tensor("slot_mapping", slot_mapping, dtype=(torch.int32, torch.int64), shape=(T,))
    fmt.check_cache(cache)
    if fmt.quant_block_size & (fmt.quant_block_size - 1) or fmt.scales_per_token & (fmt.scales_per_token - 1):
        raise NotImplementedError(f"write_indexer_k_cache: {fmt} needs power-of-two group sizes "
                                  "(the kernel's block shapes)")
    check_same_device(k=k, cache=cache, slot_mapping=slot_mapping)
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    num_slots = num_blocks * block_size
    if T == 0:
        return
    if check_slots:
        check_slot_range(slot_mapping, num_slots)  # device sync, documented above
    if slot_mapping.stride(0) != 1:
        slot_mapping = slot_mapping.contiguous()
    write_indexer_k_cache_kernel[(T,)](
        k, cache, slot_mapping, k.stride(0), cache.stride(0), block_size, num_slots,
        GROUPS=fmt.scales_per_token, GROUP=fmt.quant_block_size, UE8M0=fmt.ue8m0,
        FP8_MAX=FP8_MAX, AMAX_FLOOR=AMAX_FLOOR, E4M3=arch_of(cache.device).e4m3_plain, num_warps=4,
    )
