"""MLA latent inputs for the cache-format tests (tests/quant): each returns (kv_c [N, 512],
k_pe [N, 64] bf16) on the CPU, seeded, with the value ranges that stress the fp8 scale rules."""
import numpy as np
import torch


def seeded(seed):
    return torch.Generator().manual_seed(seed)


def gaussian(n, dtype=torch.bfloat16, seed=0):
    g = seeded(seed)
    return torch.randn(n, 512, generator=g).to(dtype), torch.randn(n, 64, generator=g).to(torch.bfloat16)


def outlier_channels(n, dtype=torch.bfloat16, seed=1):
    kv, pe = gaussian(n, dtype, seed)
    kv = kv.float()
    kv[:, [3, 130, 131, 400]] *= 300.0  # a few channels carry huge values (real latents do this)
    kv[::3, 300] = -5e3
    return kv.to(dtype), pe


def tiny(n, dtype=torch.bfloat16, seed=2):
    kv, pe = gaussian(n, torch.float32, seed)
    kv = kv / kv.abs().amax() * 9e-7  # every |value| < 1e-6: all tiles hit the 1e-4 scale floor
    return kv.to(dtype), pe


def huge(n, dtype=torch.bfloat16, seed=3):
    kv, pe = gaussian(n, torch.float32, seed)
    kv = kv / kv.abs().amax(dim=1, keepdim=True) * 1e4
    return kv.to(dtype), pe


def near_pow2_amax(dtype=torch.float32):
    """Tiles whose amax is 448 * 2^k or a few fp32 ulps above it: the rule's ceil(log2(.)) edge.

    amax / 448 rounds to 2^k (1 + j 2^-23) for small j; fp32 log2 rounds those back to k, so the
    scale stays 2^k and the amax element saturates to 448 (FlashMLA does the same)."""
    g = seeded(4)
    ks = [-20, -14, -13, -12, -9, -7, -1, 0, 1, 3, 7, 20, 60]
    amaxes = []
    for k in ks:
        base = np.float32(448.0 * 2.0 ** k)
        for i in range(0, 12):
            amaxes.append(np.nextafter(base, np.float32(np.inf)) if i == 1 else
                          np.float32(base + np.float32(i) * np.spacing(base)))
    amaxes = torch.tensor(np.array(amaxes, dtype=np.float32))
    pad = (-amaxes.numel()) % 4
    amaxes = torch.cat([amaxes, amaxes[:pad]]).view(-1, 4)  # one edge case per tile
    n = amaxes.shape[0]
    kv = torch.rand(n, 4, 128, generator=g) * 2 - 1
    kv = kv * amaxes[:, :, None] * 0.999
    pos = torch.randint(0, 128, (n, 4), generator=g)
    kv.scatter_(2, pos[:, :, None], amaxes[:, :, None] * torch.where(pos[:, :, None] % 2 == 0, 1.0, -1.0))
    kv[:, :, 5] = amaxes * 0.75  # lands between fp8 codes differently on each side of the edge
    return kv.view(n, 512).to(dtype), torch.randn(n, 64, generator=g).to(torch.bfloat16)
