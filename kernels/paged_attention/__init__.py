"""Attention of varlen queries over a paged KV cache (general MHA/GQA path), and the same kernel
over contiguous keys: the public ops `paged_attention` and `varlen_attention`.

    paged.py    `paged_attention`: keys in a paged cache (bf16/fp16, fp8 per-tensor, int8_qkv,
                int8_qk; NHD or HND)
    varlen.py   `varlen_attention`: keys in contiguous rows of k and v (encoder attention)
    checks.py   the boundary checks both ops share (q / out, score options, query-length bound)
    launch.py   host side: tile class and split count from shapes, one launch per op
                (`launch_paged`, `launch_varlen`, each with its own arguments), planned once
                per call signature
    kernel.py   the Triton kernel, its split-KV reduction and their autotune configs
    tile.py     the kernel's device functions (one key tile of the online softmax, key bounds)
"""
from .paged import paged_attention
from .varlen import varlen_attention

__all__ = ["paged_attention", "varlen_attention"]
