"""KV cache formats of the general MHA/GQA path: one frozen descriptor per format.

Every format is a pair of paged caches [num_blocks, block_size, H_kv, D] ("NHD"; "HND" is a
permuted view), K and V, plus what its quantization needs (DESIGN.md, General MHA path):

    auto       K, V in the model's dtype (bf16 or fp16, whichever the queries are)
    bf16       K, V bfloat16                     fp16   K, V float16
    fp8        K, V float8_e4m3fn, one fp32 scale per tensor each (k_scale, v_scale, [1]):
               fp8 = e4m3fn(rne(x_fp32 / scale)), saturating at +-448, NaN stays NaN
    int8_qkv   K int8 with a dynamic per-(token, head) fp32 scale in a K-scale cache
               [num_blocks, H_kv, block_size]; V int8 with a static per-channel scale [H_kv, D];
               Q quantized per (token, head) at attention time (quant/int8.py's rule)
    int8_qk    K and Q as int8_qkv; V in the model's dtype

`pack` / `unpack` are the torch references (token-major, not paged): the Triton cache writer
(quant/kv_cache.py) and the paged attention kernels equal them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from .format_types import MHA, PER_CHANNEL, PER_TENSOR, PER_TOKEN_HEAD, CacheFormat, CacheTensor, Scale
from .int8 import (dequantize_per_channel, dequantize_per_token_head, quantize_per_channel_ref,
                   quantize_per_token_head_ref)
from .mla_formats import FP8_E4M3_MAX
from .validate import check_tensor, fail

__all__ = ["MHAFormat", "MHA_AUTO", "MHA_BF16", "MHA_FP16", "FP8_PER_TENSOR", "INT8_QKV", "INT8_QK",
           "MODEL_DTYPES", "CACHE_DTYPES", "quantize_fp8_per_tensor", "mha_format_of"]

MODEL_DTYPES = (torch.bfloat16, torch.float16)
CACHE_DTYPES = MODEL_DTYPES + (torch.float8_e4m3fn, torch.int8)
_PAGES = "[num_blocks, block_size, H_kv, D]"


def quantize_fp8_per_tensor(x: torch.Tensor, scale) -> torch.Tensor:
    """The fp8 cache rule in torch (the byte-level truth the Triton writer equals):
    e4m3fn(rne(x_fp32 / scale)), saturating at +-448, NaN stays NaN. scale: float or 1-element tensor."""
    return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


@dataclass(frozen=True)
class MHAFormat(CacheFormat):
    """One MHA KV cache format.

    k_dtype, v_dtype: the caches' element dtypes; None means the model's dtype (bf16/fp16).
    k_scale_kind: None, PER_TENSOR (fp8) or PER_TOKEN_HEAD (int8 K, scales in k_scale_cache).
    v_scale_kind: None, PER_TENSOR (fp8) or PER_CHANNEL (int8 V, a static [H_kv, D] scale).
    """

    name: str
    kv_cache_dtypes: tuple
    vllm_kv_cache_dtypes: tuple
    about: str
    k_dtype: Optional[torch.dtype]
    v_dtype: Optional[torch.dtype]
    k_scale_kind: Optional[str] = None
    v_scale_kind: Optional[str] = None
    family: ClassVar[str] = MHA

    # What writers and kernels derive their constexprs from.
    @property
    def quantized(self) -> bool:
        return self.k_scale_kind is not None

    @property
    def fp8_per_tensor(self) -> bool:
        """K and V fp8 with per-tensor scales k_scale, v_scale [1] (kernel IS_FP8)."""
        return self.k_scale_kind == PER_TENSOR

    @property
    def k_int8(self) -> bool:
        """int8 K with per-(token, head) scales in a k_scale_cache; Q quantized alike (K_INT8)."""
        return self.k_scale_kind == PER_TOKEN_HEAD

    @property
    def v_int8(self) -> bool:
        """int8 V with a static per-channel scale [H_kv, D] (V_INT8)."""
        return self.v_scale_kind == PER_CHANNEL

    def k_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return self.k_dtype or model_dtype

    def v_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return self.v_dtype or model_dtype

    @property
    def tensors(self) -> tuple:
        out = (CacheTensor("k_cache", _PAGES, self.k_dtype), CacheTensor("v_cache", _PAGES, self.v_dtype))
        if self.k_int8:
            out += (CacheTensor("k_scale_cache", "[num_blocks, H_kv, block_size]", torch.float32),)
        return out

    @property
    def scales(self) -> tuple:
        if self.fp8_per_tensor:
            return (Scale("k", PER_TENSOR, "k_scale, given", "[1]"),
                    Scale("v", PER_TENSOR, "v_scale, given", "[1]"))
        out = ()
        if self.k_int8:
            out += (Scale("k", PER_TOKEN_HEAD, "k_scale_cache, written with K", "[num_blocks, H_kv, block_size]"),
                    Scale("q", PER_TOKEN_HEAD, "computed in the attention kernel", "[T, H]"))
        if self.v_int8:
            out += (Scale("v", PER_CHANNEL, "v_scale, given (calibrated, static)", "[H_kv, D]"),)
        return out

    def pack(self, key: torch.Tensor, value: torch.Tensor, *, k_scale=None, v_scale=None,
             model_dtype: Optional[torch.dtype] = None) -> dict:
        """key, value [..., H_kv, D] float -> the cache contents, token-major (not paged):
        {"k_cache", "v_cache"} plus "k_scale_cache" [..., H_kv] fp32 for an int8 K.

        fp8: k_scale, v_scale (floats or [1] tensors) required. int8_qkv: v_scale [H_kv, D]
        required. Model-dtype parts are cast to model_dtype (default: key's dtype)."""
        model_dtype = model_dtype or key.dtype
        if self.fp8_per_tensor:
            if k_scale is None or v_scale is None:
                fail("k_scale, v_scale", f"both given for the {self.name} format", (k_scale, v_scale))
            return {"k_cache": quantize_fp8_per_tensor(key, k_scale),
                    "v_cache": quantize_fp8_per_tensor(value, v_scale)}
        out = {}
        if self.k_int8:
            out["k_cache"], out["k_scale_cache"] = quantize_per_token_head_ref(key)
        else:
            out["k_cache"] = key.to(self.k_cache_dtype(model_dtype))
        if self.v_int8:
            if v_scale is None:
                fail("v_scale", f"a [H_kv, D] fp32 per-channel scale for the {self.name} format", None)
            out["v_cache"] = quantize_per_channel_ref(value, v_scale)
        else:
            out["v_cache"] = value.to(self.v_cache_dtype(model_dtype))
        return out

    def unpack(self, parts: dict, *, k_scale=None, v_scale=None) -> tuple:
        """pack's output -> (k, v) fp32: what attention over this cache computes with (int8
        formats also quantize q: `quant.int8.quantize_per_token_head_ref`)."""
        k, v = parts["k_cache"], parts["v_cache"]
        if self.fp8_per_tensor:
            return k.float() * k_scale, v.float() * v_scale
        k = dequantize_per_token_head(k, parts["k_scale_cache"]) if self.k_int8 else k.float()
        v = dequantize_per_channel(v, v_scale) if self.v_int8 else v.float()
        return k, v


MHA_AUTO = MHAFormat("auto", ("auto",), ("auto",), "K/V in the model's dtype (bf16 or fp16)", None, None)
MHA_BF16 = MHAFormat("bf16", ("bf16", "bfloat16"), ("bfloat16",), "bf16 K/V cache", torch.bfloat16,
                     torch.bfloat16)
MHA_FP16 = MHAFormat("fp16", ("fp16", "float16"), ("float16",), "fp16 K/V cache", torch.float16,
                     torch.float16)
# "fp8" is vLLM's alias of fp8_e4m3
FP8_PER_TENSOR = MHAFormat("fp8", ("fp8", "fp8_e4m3"), ("fp8", "fp8_e4m3"),
                           "e4m3fn K/V, per-tensor k_scale/v_scale", torch.float8_e4m3fn,
                           torch.float8_e4m3fn, PER_TENSOR, PER_TENSOR)
# No vLLM names: vLLM 0.32's "int8_per_token_head" is another format (scales packed inside each
# page, dynamic V scales).
INT8_QKV = MHAFormat("int8_qkv", ("int8_qkv",), (), "int8 Q, K (per token and head), V (per channel, "
                     "static)", torch.int8, torch.int8, PER_TOKEN_HEAD, PER_CHANNEL)
INT8_QK = MHAFormat("int8_qk", ("int8_qk",), (), "int8 Q, K (per token and head); V in the model's dtype",
                    torch.int8, None, PER_TOKEN_HEAD, None)


def mha_format_of(k_cache: torch.Tensor, v_cache: torch.Tensor) -> MHAFormat:
    """The format a pair of caches is in, from their dtypes: the default of the public ops
    (`write_kv_cache`, `paged_attention`, ...) when their caller passes no `fmt`. Layers hold
    their descriptor and pass it instead.

    k_cache bf16 -> MHA_BF16, fp16 -> MHA_FP16, float8_e4m3fn -> FP8_PER_TENSOR; int8 with an
    int8 v_cache -> INT8_QKV, with a bf16/fp16 one -> INT8_QK. ValueError for a cache of another
    dtype, NotImplementedError for other mixes with int8. Whether v_cache matches the returned
    format is the caller's check (`v_cache_dtype`)."""
    check_tensor("k_cache", k_cache, dtype=CACHE_DTYPES)
    check_tensor("v_cache", v_cache, dtype=CACHE_DTYPES)
    kd, vd = k_cache.dtype, v_cache.dtype
    if kd == torch.int8:
        if vd == torch.int8:
            return INT8_QKV
        if vd in MODEL_DTYPES:
            return INT8_QK
        raise NotImplementedError(
            f"an int8 k_cache with a {vd} v_cache (supported: int8 V (int8_qkv) or bf16/fp16 V "
            "(int8_qk))")
    if vd == torch.int8:
        raise NotImplementedError(
            f"an int8 v_cache with a {kd} k_cache (int8 V needs an int8 k_cache: the int8_qkv mode)")
    if kd == torch.float8_e4m3fn:
        return FP8_PER_TENSOR
    return MHA_BF16 if kd == torch.bfloat16 else MHA_FP16
