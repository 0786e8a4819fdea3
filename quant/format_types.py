"""What every cache format descriptor says about itself (the registry is quant/formats.py).

A descriptor is a frozen dataclass deriving from `CacheFormat`. Common to all of them:

    name                   openmla's canonical name, unique within its family
    family                 SPARSE_MLA (a latent cache read by the sparse MLA kernels), MHA
                           (paged K/V caches read by the paged attention kernels) or INDEXER
                           (the DSA indexer's K cache read by kernels/indexer/)
    kv_cache_dtypes        every name openmla accepts for it (the canonical one first)
    vllm_kv_cache_dtypes   the names vLLM's `kv_cache_dtype` uses for it (() when vLLM has none)
    about                  one line for people (tables, error messages)
    tensors                the tensors a cache in this format is made of (CacheTensor)
    scales                 its scale tensors and how they are applied (Scale)
    pack / unpack          the torch references: the byte-level truth writers and kernels equal

Writers and kernels take a descriptor and read their constexprs off it (widths, offsets, which
operands are quantized); nothing below the boundary looks at names or sniffs dtypes.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["CacheFormat", "CacheTensor", "Scale", "SPARSE_MLA", "MHA", "INDEXER", "FAMILIES",
           "PER_TILE", "PER_TENSOR", "PER_TOKEN_HEAD", "PER_CHANNEL", "SCALE_KINDS"]

SPARSE_MLA = "sparse_mla"
MHA = "mha"
INDEXER = "dsa_indexer"  # the DSA lightning indexer's fp8 K cache (quant/indexer_format.py)
FAMILIES = (SPARSE_MLA, MHA, INDEXER)

# Scale kinds: what one fp32 scale covers.
PER_TILE = "per_tile"  # a tile of one token's row, stored inside the row (fp8_ds_mla)
PER_TENSOR = "per_tensor"  # a whole cache, one [1] scale given by the caller (fp8 per tensor)
PER_TOKEN_HEAD = "per_token_head"  # one (token, head), computed when written (int8 K, Q)
PER_CHANNEL = "per_channel"  # one (head, channel), static, calibrated (int8 V)
SCALE_KINDS = (PER_TILE, PER_TENSOR, PER_TOKEN_HEAD, PER_CHANNEL)


@dataclass(frozen=True)
class CacheTensor:
    """One tensor of a cache. dtype None: the model's dtype (bf16 or fp16)."""

    name: str
    shape: str
    dtype: Optional[torch.dtype]


@dataclass(frozen=True)
class Scale:
    """One scale of a format: what it scales, its kind (SCALE_KINDS), where it lives, its shape."""

    of: str
    kind: str
    where: str
    shape: str
    dtype: torch.dtype = torch.float32

    def __post_init__(self):
        if self.kind not in SCALE_KINDS:
            raise ValueError(f"kind: expected one of {SCALE_KINDS}, got {self.kind!r}")


class CacheFormat(ABC):
    """Base of every cache format descriptor (frozen dataclasses; see the module docstring)."""

    name: str
    family: str
    kv_cache_dtypes: tuple
    vllm_kv_cache_dtypes: tuple
    about: str

    @property
    @abstractmethod
    def tensors(self) -> tuple:
        """The CacheTensors a cache in this format is made of."""

    @property
    @abstractmethod
    def scales(self) -> tuple:
        """The Scales of this format (() for an unscaled one)."""

    @abstractmethod
    def pack(self, *args, **kwargs):
        """Torch reference quantizer: model values -> cache contents."""

    @abstractmethod
    def unpack(self, *args, **kwargs):
        """Torch reference dequantizer: cache contents -> fp32 values."""

    def __str__(self) -> str:
        return f"{self.family}:{self.name}"
