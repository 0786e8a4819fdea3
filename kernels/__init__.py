"""Triton kernels, one public op per module, and `kernels.reference` (fp32 torch oracles)."""
