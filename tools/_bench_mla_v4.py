"""DeepSeek-V4 (FlashMLA's MODEL1) sparse decode in tools/bench.py: sparse_mla_decode_v4, a sliding
window cache and a compressed (extra) cache in one softmax, with FlashMLA beside it when it is
importable (tools/_bench_peer.py DECODE_V4_PEER).

The cases are FlashMLA's MODEL1 decode perf cases (tests/test_flash_mla_sparse_decoding.py at
9241ae3): s_q = 2 tokens a request, 16384 cache tokens a request in each cache, a per-head sink;
config 1 H64 topk 128 (block 256) + extra 512 (block 64); config 2 H128 128 + 1024 (256 / 64);
config 4 H128 128 + 1024 (256 / 2) with extra_topk_length; issue 25's bar at batch 64 / 128 /
256. Indices are distinct random positions of the request's own tokens; FlashMLA's per-request
lengths are given to openmla as the same length on each of the request's tokens.
"""
from __future__ import annotations

import torch

from openmla.kernels import reference
from openmla.quant import FP8_MODEL1
from openmla.tools._bench_core import Op, register, rel_l2
from openmla.tools._bench_mla import CHECK_TOKENS, torch_sparse_attention
from openmla.tools._bench_peer import DECODE_V4_PEER

SEQ = 16384  # cache tokens a request, in each cache (FlashMLA's s_k and extra_s_k)


def _cache(requests: int, block_size: int, device, g) -> torch.Tensor:
    """A MODEL1 cache of requests * SEQ tokens ([nb, bs, 1, 584], FlashMLA's padded blocks),
    keys N(0, 1) / 10 clamped to [-1, 1] (FlashMLA's generator), packed in pieces."""
    nb = requests * SEQ // block_size
    cache = FP8_MODEL1.empty_cache(nb, block_size, device=device)
    step = max(1, (1 << 19) // block_size)  # ~1 GB of fp32 keys a piece
    for b0 in range(0, nb, step):
        b1 = min(nb, b0 + step)
        k = (torch.randn(b1 - b0, block_size, 1, 512, device=device, generator=g) / 10).clamp(-1, 1)
        cache[b0:b1] = FP8_MODEL1.pack(k.bfloat16())
    return cache


def _indices(tokens: int, s_q: int, topk: int, device) -> torch.Tensor:
    """[tokens, topk] int32: distinct random tokens of each request's own SEQ (request t // s_q)."""
    out = torch.empty(tokens, topk, dtype=torch.int32, device=device)
    for t0 in range(0, tokens, 256):
        t1 = min(tokens, t0 + 256)
        pos = torch.rand(t1 - t0, SEQ, device=device).topk(topk, dim=-1).indices
        req = torch.arange(t0, t1, device=device) // s_q
        out[t0:t1] = (pos + req[:, None] * SEQ).to(torch.int32)
    return out


def _build(p, device):
    T, H, s_q = p["tokens"], p["heads"], p["s_q"]
    b = T // s_q
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(T, H, 512, device=device, generator=g).clamp(-1, 1).bfloat16()
    x = {"q": q, "s_q": s_q, "scale": 512 ** -0.55,
         "cache": _cache(b, p["block_size"], device, g), "indices": _indices(T, s_q, p["topk"], device),
         "attn_sink": torch.randn(H, device=device, generator=g), "topk_length": None,
         "extra_cache": _cache(b, p["extra_block_size"], device, g),
         "extra_indices": _indices(T, s_q, p["extra_topk"], device), "extra_topk_length": None}
    if p.get("extra_len"):
        n = torch.randint(0, p["extra_topk"] + 1, (b,), device=device, generator=g, dtype=torch.int32)
        x["extra_topk_length"] = n.repeat_interleave(s_q)
    x["kwargs"] = {k: x[k] for k in ("scale", "topk_length", "attn_sink", "extra_cache", "extra_indices",
                                     "extra_topk_length")}
    return x


def _run(x):
    from openmla.kernels.sparse_mla_decode import sparse_mla_decode
    return sparse_mla_decode(x["q"], x["cache"], x["indices"], **x["kwargs"])[0]


def _rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Dequantized bf16 tokens [..., 512] of a MODEL1 cache at (valid) slots [...]."""
    nb, bs = cache.shape[:2]
    blocks = FP8_MODEL1.block_view(cache)
    rec = blocks[:, :FP8_MODEL1.scales_offset(bs)].unflatten(1, (bs, FP8_MODEL1.record_bytes))
    sc = blocks[:, FP8_MODEL1.scales_offset(bs):].unflatten(1, (bs, FP8_MODEL1.scale_stride))
    blk, row = slots // bs, slots % bs
    r, s = rec[blk, row], sc[blk, row, :FP8_MODEL1.num_tiles]
    nope = r[..., :FP8_MODEL1.nope_dim].contiguous().view(torch.float8_e4m3fn).float()
    scale = s.contiguous().view(torch.float8_e8m0fnu).float()
    nope = (nope.unflatten(-1, (FP8_MODEL1.num_tiles, FP8_MODEL1.tile_size)) * scale[..., None]).flatten(-2)
    rope = r[..., FP8_MODEL1.rope_offset:].contiguous().view(torch.bfloat16)
    return torch.cat([nope.bfloat16(), rope], dim=-1)


def _torch(x):
    """Gather both lists' rows (the extra list's slots offset past the main cache's), bf16 matmuls.
    (Lengths and the sink's factor, one multiply per output row, are left out of the baseline.)"""
    main, extra = x["cache"], x["extra_cache"]
    n_main = main.shape[0] * main.shape[1]
    idx = torch.cat([x["indices"], x["extra_indices"] + n_main], dim=1)
    n_all = n_main + extra.shape[0] * extra.shape[1]

    def gather(i):
        is_main = i < n_main
        rows = _rows(main, torch.where(is_main, i, 0))
        return torch.where(is_main[..., None], rows, _rows(extra, torch.where(is_main, 0, i - n_main)))

    return torch_sparse_attention(x["q"], gather, n_all, idx, x["scale"], chunk=64)


def _error(x, out):
    sl = slice(0, CHECK_TOKENS)
    kw = {k: (v[sl] if k in ("topk_length", "extra_indices", "extra_topk_length") and v is not None else v)
          for k, v in x["kwargs"].items()}
    return rel_l2(out[sl], reference.sparse_mla_decode_ref(x["q"][sl], x["cache"], x["indices"][sl], **kw)[0])


def _count(p):
    """FLOPs over every listed key (lengths not counted), bytes of one 584-byte token each."""
    keys = p["tokens"] * (p["topk"] + p["extra_topk"])
    return 2.0 * keys * p["heads"] * (512 + 512), float(keys * FP8_MODEL1.bytes_per_token)


def _label(p):
    return (f"T{p['tokens']}-H{p['heads']}-topk{p['topk']}+{p['extra_topk']}-bs{p['block_size']}/"
            f"{p['extra_block_size']}" + ("-xlen" if p.get("extra_len") else ""))


_CONFIGS = {  # FlashMLA's MODEL1 perf configs: heads, topk, extra topk, block sizes, extra lengths
    1: dict(heads=64, topk=128, extra_topk=512, block_size=256, extra_block_size=64),
    2: dict(heads=128, topk=128, extra_topk=1024, block_size=256, extra_block_size=64),
    3: dict(heads=64, topk=128, extra_topk=1024, block_size=256, extra_block_size=2, extra_len=True),
    4: dict(heads=128, topk=128, extra_topk=1024, block_size=256, extra_block_size=2, extra_len=True),
}
_STANDARD = [dict(_CONFIGS[c], tokens=2 * b, s_q=2) for c in (1, 2, 4) for b in (64, 128, 256)]
# the head counts FlashMLA pads to 64 (issue 25: faster than FlashMLA padded), config 1's lists
_SMALL_HEADS = [dict(_CONFIGS[1], heads=h, tokens=2 * b, s_q=2) for h in (16, 32) for b in (64, 128, 256)]

register(Op(
    name="sparse_mla_decode_v4",
    shape_sets={
        "standard": _STANDARD + _SMALL_HEADS,
        "model1": [dict(_CONFIGS[c], tokens=2 * b, s_q=2) for c in _CONFIGS for b in (2, 64, 74, 128, 148, 256)],
        # small batches: the split rule's regime (the tokens alone leave SMs idle)
        "batch": [dict(_CONFIGS[c], tokens=2 * b, s_q=2) for c in (1, 2) for b in (1, 2, 4, 8)],
        "small": [dict(heads=16, topk=16, extra_topk=24, block_size=64, extra_block_size=2, extra_len=True,
                       tokens=4, s_q=2)],
    },
    build=_build, run=_run, torch_ref=_torch, error=_error, count=_count, label=_label, peer=DECODE_V4_PEER,
))
