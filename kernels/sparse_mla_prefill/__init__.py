"""Sparse MLA prefill over a bf16 workspace: the public op `sparse_mla_prefill`.

    op.py       the public op, its dispatch and the portable Triton kernel (any GPU; d_qk 576
                and V4's 512)
    sm90.py     Gluon kernel for Hopper, 64-head blocks (d_qk 576 only, as sm90_kn.py)
    sm90_kn.py  Gluon kernel for Hopper, <= 32 heads: keys on the wgmma M, a producer warpgroup
    shared.py   the row finish (1/sum, lse, sink share) all three compile
    tail.py     the split last round of sm90.py's short grids: the rule and the pieces' merge
"""
from .op import sparse_mla_prefill

__all__ = ["sparse_mla_prefill"]
