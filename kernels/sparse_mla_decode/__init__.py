"""Sparse MLA decode over a paged bf16, fp8_ds_mla or MODEL1 cache (optionally joined by an extra
cache): the public op `sparse_mla_decode`.

    op.py       the public op, its dispatch and launch plans
    config.py   the Triton kernels' launch configs and the topk split count
    model1_kernel.py  the MODEL1 (DeepSeek-V4) kernel (any GPU): main + extra list in one softmax
    sm90_model1.py    its Hopper Gluon counterpart, every head count (64-head blocks, bf16 K dequantized once)
    triton_kernel.py  the portable Triton kernel (any GPU) and the split merge
    sm90.py     Gluon kernel for Hopper, > 32 heads: 64-head wgmma tiles
    sm90_kn.py  Gluon kernel for Hopper, <= 32 heads: keys on the wgmma M, a producer warpgroup
    sm90_bf16.py  Gluon kernel for Hopper, bf16 cache, > 32 heads: 64-head tiles
    sm90_bf16_kn.py  Gluon kernel for Hopper, bf16 cache, <= 32 heads: keys on the wgmma M
    shared.py   the layout-free pieces the kernels compile (split ranges, row finish, sinks)
"""
from .op import sparse_mla_decode

__all__ = ["sparse_mla_decode"]
