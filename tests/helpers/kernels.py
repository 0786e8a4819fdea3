"""paged_attention batches for the kernel tests (tests/kernels): requests (q_len, kv_len) over
NaN-filled strided paged caches with shuffled block tables, invalid ids in unused columns, a
strided q and padding rows."""
import math

import torch

from tests.helpers import DEVICE, INT32_MAX, INTERPRET, put_rows

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def kv_len(n: int) -> int:
    """kv length of a case: as written on the GPU, cut to <= 300 under the interpreter."""
    return n if not INTERPRET else min(n, 300 + n % 7)


def paged_caches(num_blocks, bs, H_kv, D, cache_dtype, layout, *, extra_rows=1, used_blocks=None):
    """K and V caches as strided views of NaN-filled backings with hidden rows in every block.

    With used_blocks (a huge cache), only those blocks are filled: the rest of the backing stays
    untouched virtual memory, so a 2^31-element cache costs a few pages."""
    rows = bs + extra_rows
    shape = (num_blocks, rows, H_kv, D) if layout == "NHD" else (num_blocks, H_kv, rows, D)
    out = []
    for _ in range(2):
        backing = torch.empty(shape, dtype=cache_dtype, device=DEVICE)
        region = backing if used_blocks is None else backing[used_blocks]
        region.view(torch.uint8).fill_(0x7F) if cache_dtype == torch.float8_e4m3fn else region.fill_(float("nan"))
        if used_blocks is not None:
            backing[used_blocks] = region
        out.append(backing[:, :bs] if layout == "NHD" else backing[:, :, :bs])
    return out


def build(seqs, H, H_kv, D, bs, *, dtype="bf16", cache="same", layout="NHD", pad_rows=2,
          big_cache=False, q_mult=1.0, seed=0):
    """A batch: requests (q_len, kv_len), paged caches with their K/V written, q, metadata."""
    g = torch.Generator().manual_seed(seed)
    qdt = DTYPES[dtype]
    cdt = torch.float8_e4m3fn if cache == "fp8" else qdt
    R = len(seqs)
    nblk = [math.ceil(kv / bs) for _, kv in seqs]
    M = max(nblk + [0]) + 1  # one column more than any request needs
    need = sum(nblk)
    if big_cache:  # block ids at the top of a 32768-block cache: block * stride overflows int32
        num_blocks = 32768
        ids = num_blocks - 1 - torch.randperm(need, generator=g)
    else:
        num_blocks = need + 3  # spare blocks nobody references (NaN)
        ids = torch.randperm(num_blocks, generator=g)[:need]
    table = torch.empty(R, M, dtype=torch.int32)
    table[:, 0::2], table[:, 1::2] = INT32_MAX, -7  # unused entries: invalid, never to be read
    pos = 0
    for r, n in enumerate(nblk):
        table[r, :n] = ids[pos:pos + n].to(torch.int32)
        pos += n
    used = ids.to(DEVICE) if big_cache else None
    # A big cache's blocks are 65600+ elements apart (as if 60 layers were interleaved).
    extra = max(1, math.ceil(65600 / (H_kv * D)) - bs) if big_cache else 1
    kc, vc = paged_caches(num_blocks, bs, H_kv, D, cdt, layout, extra_rows=extra, used_blocks=used)
    k_scale = v_scale = None
    if cache == "fp8":
        # Stored values span the e4m3 range (x 40); the scales bring them back to model scale.
        k_scale = torch.tensor([0.027], device=DEVICE)
        v_scale = torch.tensor([0.019], device=DEVICE)
    for r, (_, kv) in enumerate(seqs):
        p = torch.arange(kv)
        blk, off = table[r, p // bs].long().to(DEVICE), (p % bs).to(DEVICE)
        k = torch.randn(kv, H_kv, D, generator=g).to(DEVICE)
        v = torch.randn(kv, H_kv, D, generator=g).to(DEVICE)
        if cache == "fp8":  # values spread over the e4m3 range before the per-tensor scale
            k, v = k * 40, v * 40
        put_rows(kc, layout, blk, off, k.to(cdt))
        put_rows(vc, layout, blk, off, v.to(cdt))
    T = sum(q for q, _ in seqs)
    wide = torch.randn(T + pad_rows, H, D + 24, generator=g) * q_mult
    q = wide.to(qdt).to(DEVICE)[:, :, 8:8 + D]  # token and head strides of a wider tensor
    cu = torch.tensor([0] + [q for q, _ in seqs], dtype=torch.int32).cumsum(0).to(torch.int32)
    lens = torch.tensor([kv for _, kv in seqs], dtype=torch.int32)
    return dict(q=q, k_cache=kc, v_cache=vc, block_table=table.to(DEVICE), cu_seqlens_q=cu.to(DEVICE),
                seq_lens=lens.to(DEVICE), k_scale=k_scale, v_scale=v_scale, layout=layout)
