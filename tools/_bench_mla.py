"""Sparse MLA entries of tools/bench.py: sparse_mla_decode, sparse_mla_prefill (both with FlashMLA
beside them when it is importable), the same decode through the FlashMLA-compatible API
(flashmla_compat_decode) and through SparseMLAImpl.forward (sparse_mla_impl_decode), the MLA cache
writer (write_mla_cache) and gather (gather_upconvert), convert_req_index_to_global, and
head_matmul (the layer's absorption and output projection, torch.bmm timed beside).

The `host` shape sets (batch 1 and 32, 16 and 128 heads) are the decode entry points whose eager
time shows the host overhead of a call; tools/_bench_mha.py adds paged MHA decode to that set.

Each entry registers itself on import (tools/bench.py imports this module); see bench.py for
what a case measures and how it is checked.
"""
from __future__ import annotations

from typing import Callable

import torch

from openmla.tools._bench_core import Op, register, rel_l2
from openmla.tools._bench_peer import PREFILL_PEER, decode_peer
from openmla.kernels import reference
from openmla.quant import FP8_DS_MLA, SPARSE_MLA, cache_format


def _fmt(p):
    """The sparse MLA format a case's cache label names ("fp8": fp8_ds_mla, "bf16")."""
    return cache_format(p["cache"], SPARSE_MLA, who="bench")

CHECK_TOKENS = 8  # the oracle runs in float64: check a slice of the tokens, time them all


def random_topk_indices(tokens: int, slots: int, topk: int, device) -> torch.Tensor:
    """[tokens, topk] int32 distinct slots per token, uniformly random over all slots."""
    out = torch.empty(tokens, topk, dtype=torch.int32, device=device)
    step = max(1, (1 << 27) // slots)  # keep the random matrix under ~512 MB
    for t0 in range(0, tokens, step):
        t1 = min(tokens, t0 + step)
        out[t0:t1] = torch.rand(t1 - t0, slots, device=device).topk(topk, dim=-1).indices.to(torch.int32)
    return out


def torch_sparse_attention(q: torch.Tensor, gather: Callable, num_rows: int, indices: torch.Tensor,
                           scale: float, chunk: int = 256) -> torch.Tensor:
    """The torch reference baseline: gather rows, bf16 matmuls, fp32 softmax, chunked over tokens.

    gather(idx [t, topk] int64, clamped valid) -> [t, topk, 576] bf16 rows."""
    out = torch.empty(q.shape[0], q.shape[1], 512, dtype=q.dtype, device=q.device)
    for t0 in range(0, q.shape[0], chunk):
        idx = indices[t0:t0 + chunk].long()
        kv = gather(idx.clamp(0, num_rows - 1))  # [t, topk, 576]
        s = torch.matmul(q[t0:t0 + chunk], kv.transpose(1, 2)).float() * scale  # [t, H, topk]
        s.masked_fill_(((idx < 0) | (idx >= num_rows))[:, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1).to(q.dtype)
        out[t0:t0 + chunk] = torch.matmul(p, kv[..., :512])
    return out


# --------------------------------------------------------------------------------------------
# sparse MLA decode
def _decode_build(p, device):
    fmt = _fmt(p)
    slots, bs = p["slots"], p["block_size"]
    nb = slots // bs
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(p["tokens"], p["heads"], 576, device=device, generator=g).bfloat16()
    cache = torch.empty(nb, bs, fmt.row_width, dtype=fmt.cache_dtype, device=device)
    for b0 in range(0, nb, 1024):  # pack in pieces to bound temporary memory
        b1 = min(nb, b0 + 1024)
        kv_c = torch.randn(b1 - b0, bs, 512, device=device, generator=g).bfloat16()
        k_pe = torch.randn(b1 - b0, bs, 64, device=device, generator=g).bfloat16()
        cache[b0:b1] = fmt.pack(kv_c, k_pe)
    indices = random_topk_indices(p["tokens"], slots, p["topk"], device)
    return {"q": q, "cache": cache, "indices": indices, "scale": 576 ** -0.5, "fmt": fmt}


def _decode_run(x):
    from openmla.kernels.sparse_mla_decode import sparse_mla_decode
    return sparse_mla_decode(x["q"], x["cache"], x["indices"], scale=x["scale"])[0]


def _decode_torch(x):
    fmt, cache = x["fmt"], x["cache"]
    flat = cache.reshape(-1, cache.shape[-1])
    # gather the 656-byte (or bf16) rows, then dequantize only what was gathered
    return torch_sparse_attention(x["q"], lambda idx: fmt.unpack(flat[idx]).to(torch.bfloat16),
                                  flat.shape[0], x["indices"], x["scale"])


def _decode_error(x, out):
    sl = slice(0, CHECK_TOKENS)
    want = reference.sparse_mla_decode_ref(x["q"][sl], x["cache"], x["indices"][sl], scale=x["scale"])[0]
    return rel_l2(out[sl], want)


def _decode_count(p):
    t, h, k = p["tokens"], p["heads"], p["topk"]
    row_bytes = _fmt(p).bytes_per_token
    return 2.0 * t * h * k * (576 + 512), float(t * k * row_bytes)


_DECODE_STANDARD = [
    dict(cache=c, tokens=t, heads=h, topk=2048, slots=262144, block_size=64)
    for c in ("fp8", "bf16") for t in (128, 32) for h in (16, 32, 64, 128)
]
# decode entry points at batch 1 and 32: the eager time is mostly host time there
_DECODE_HOST = [dict(cache="fp8", tokens=t, heads=h, topk=2048, slots=262144, block_size=64)
                for t in (1, 32) for h in (16, 128)]
_DECODE_SMALL = [dict(cache="fp8", tokens=4, heads=16, topk=128, slots=4096, block_size=64)]
# small batches (1-16 tokens): the split rule's regime, where the tokens alone leave SMs idle
_DECODE_BATCH = [dict(cache="fp8", tokens=t, heads=h, topk=2048, slots=262144, block_size=64)
                 for t in (1, 2, 4, 8, 16) for h in (16, 32, 64, 128)]
# issue 23's decode table (fp8, FlashMLA's shapes): 128 / 32 tokens at 64 and 128 heads, 8 tokens at
# 128, topk 1024 and 16384 at 128 heads, one token at 16
_DECODE_ISSUE23 = [dict(cache="fp8", tokens=t, heads=h, topk=k, slots=262144, block_size=64)
                   for t, h, k in ((128, 64, 2048), (32, 64, 2048), (128, 128, 2048), (32, 128, 2048),
                                   (8, 128, 2048), (64, 128, 1024), (148, 128, 16384), (1, 16, 2048))]
_decode_label = lambda p: f"{p['cache']}-T{p['tokens']}-H{p['heads']}-topk{p['topk']}"  # noqa: E731
register(Op(
    name="sparse_mla_decode",
    shape_sets={
        "standard": _DECODE_STANDARD,
        "fp8": [p for p in _DECODE_STANDARD if _fmt(p).quantized],
        "host": _DECODE_HOST,
        "batch": _DECODE_BATCH,
        "small": _DECODE_SMALL,
        "issue23": _DECODE_ISSUE23,
    },
    build=_decode_build, run=_decode_run, torch_ref=_decode_torch, error=_decode_error,
    count=_decode_count, label=_decode_label, peer=decode_peer(),
))


# --------------------------------------------------------------------------------------------
# the same decode through mla.flashmla_compat.flash_mla_with_kvcache (FlashMLA's API and shapes)
def _compat_build(p, device):
    from openmla.mla.flashmla_compat import get_mla_metadata
    x = _decode_build(p, device)
    T, H, _ = x["q"].shape
    x["compat"] = {"q": x["q"].view(T, 1, H, 576), "k_cache": x["cache"].unsqueeze(2),
                   "indices": x["indices"].unsqueeze(1), "meta": get_mla_metadata()[0],
                   "fp8": _fmt(p).quantized}
    return x


def _compat_call(x):
    from openmla.mla.flashmla_compat import flash_mla_with_kvcache
    c = x["compat"]
    return flash_mla_with_kvcache(c["q"], c["k_cache"], None, None, 512, c["meta"], None, softmax_scale=x["scale"],
                                  causal=False, is_fp8_kvcache=c["fp8"], indices=c["indices"])


def _compat_run(x):
    out, _ = _compat_call(x)
    return out.view(x["q"].shape[0], x["q"].shape[1], 512)


def _compat_ours(x):
    """(out [T, H, 512], lse [T, H]) with openmla's -inf for an empty row (the API returns +inf)."""
    out, lse = _compat_call(x)
    lse = lse[:, :, 0]
    return out[:, 0], lse.masked_fill(lse == float("inf"), float("-inf"))


register(Op(
    name="flashmla_compat_decode",
    shape_sets={"standard": _DECODE_HOST, "host": _DECODE_HOST, "small": _DECODE_SMALL},
    build=_compat_build, run=_compat_run, torch_ref=_decode_torch, error=_decode_error,
    count=_decode_count, label=_decode_label, peer=decode_peer(ours=_compat_ours),
))


# --------------------------------------------------------------------------------------------
# the same decode through SparseMLAImpl.forward (one layer: absorb q, convert the per-request
# indices, decode, project out), a decode-only step whose plan is built once, outside the timing
_NOPE, _V = 128, 128  # DeepSeek's qk_nope_head_dim and v_head_dim


def _impl_build(p, device):
    from openmla.mla.sparse.impl import SparseMLAImpl
    T, H, slots, bs = p["tokens"], p["heads"], p["slots"], p["block_size"]
    x = _decode_build(p, device)  # the cache and scale; the layer absorbs its own query
    del x["q"], x["indices"]
    seq = slots // T  # T requests, one query token each, over shuffled blocks of the whole cache
    per_req = -(-seq // bs)
    if T * per_req > slots // bs:
        raise ValueError(f"sparse_mla_impl_decode: {T} requests of {seq} tokens do not fit {slots} slots")
    g = torch.Generator(device=device).manual_seed(1)
    table = torch.randperm(slots // bs, device=device, generator=g)[:T * per_req].view(T, per_req).to(torch.int32)
    impl = SparseMLAImpl(H, x["scale"], _fmt(p), max_model_len=seq,
                         qk_nope_head_dim=_NOPE, v_head_dim=_V)
    impl.load_kv_b_proj((torch.randn(H * (_NOPE + _V), 512, device=device, generator=g) * 512 ** -0.5).bfloat16())
    last = seq - 1  # this step's token of each request is its last
    plan = impl.build_plan(torch.arange(T + 1, device=device, dtype=torch.int32),
                           torch.full((T,), seq, device=device, dtype=torch.int32), table,
                           table[:, last // bs] * bs + last % bs, block_size=bs,
                           query_lens_cpu=[1] * T, seq_lens_cpu=[seq] * T)
    return {**x, "impl": impl, "plan": plan, "table": table,
            "req_id": torch.arange(T, device=device, dtype=torch.int32),
            "positions": random_topk_indices(T, seq, p["topk"], device),  # within each request
            "q_nope": torch.randn(T, H, _NOPE, device=device, generator=g).bfloat16(),
            "q_pe": torch.randn(T, H, 64, device=device, generator=g).bfloat16()}


def _impl_run(x):
    return x["impl"].forward(x["q_nope"], x["q_pe"], x["cache"], x["positions"], x["plan"])


def _impl_torch(x):
    """The layer in torch: bf16 absorption, gather + matmul attention, bf16 projection."""
    w_uk, w_uv, bs = x["impl"].W_UK, x["impl"].W_UV, x["cache"].shape[1]
    q = torch.cat([torch.bmm(x["q_nope"].transpose(0, 1), w_uk).transpose(0, 1), x["q_pe"]], -1)
    pos = x["positions"].long()
    slots = x["table"].long().gather(1, pos // bs) * bs + pos % bs  # token t is request t's query
    o = _decode_torch({**x, "q": q, "indices": slots})
    return torch.bmm(o.transpose(0, 1), w_uv).transpose(0, 1)


def _impl_error(x, out):
    sl = slice(0, CHECK_TOKENS)
    impl = x["impl"]
    q = torch.cat([torch.einsum("thn,hnl->thl", x["q_nope"][sl].double(), impl.W_UK.double()),
                   x["q_pe"][sl].double()], -1)
    slots = reference.convert_req_index_ref(x["req_id"][sl], x["table"], x["positions"][sl], x["cache"].shape[1])
    o_lat, _ = reference.sparse_mla_decode_ref(q, x["cache"], slots, scale=x["scale"])
    return rel_l2(out[sl], torch.einsum("thl,hlv->thv", o_lat.double(), impl.W_UV.double()))


def _impl_count(p):
    flops, nbytes = _decode_count(p)
    t, h = p["tokens"], p["heads"]
    return flops + 2.0 * t * h * 512 * (_NOPE + _V), nbytes + float(h * (_NOPE + _V) * 512 * 2)  # + W_UK, W_UV


register(Op(
    name="sparse_mla_impl_decode",
    shape_sets={"standard": _DECODE_HOST, "host": _DECODE_HOST,
                "small": [dict(cache="fp8", tokens=2, heads=16, topk=128, slots=4096, block_size=64)]},
    build=_impl_build, run=_impl_run, torch_ref=_impl_torch, error=_impl_error, count=_impl_count,
    label=_decode_label,
))


# --------------------------------------------------------------------------------------------
# sparse MLA prefill: d_qk 576 (V3.2) and 512 (V4 / MODEL1: the value is the whole row, FlashMLA's
# MODEL1 perf cases run with a per-head sink)
def _prefill_build(p, device):
    d = p.get("d_qk", 576)
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(p["tokens"], p["heads"], d, device=device, generator=g).bfloat16()
    kv = torch.randn(p["kv_rows"], d, device=device, generator=g).bfloat16()
    indices = random_topk_indices(p["tokens"], p["kv_rows"], p["topk"], device)
    sink = torch.randn(p["heads"], device=device, generator=g) if p.get("sink") else None
    return {"q": q, "kv": kv, "indices": indices, "scale": d ** -0.5, "attn_sink": sink}


def _prefill_run(x):
    from openmla.kernels.sparse_mla_prefill import sparse_mla_prefill
    return sparse_mla_prefill(x["q"], x["kv"], x["indices"], scale=x["scale"], attn_sink=x["attn_sink"])[0]


def _prefill_torch(x):
    """(The sink's factor, one multiply per output row, is left out of the torch baseline.)"""
    kv = x["kv"]
    return torch_sparse_attention(x["q"], lambda idx: kv[idx], kv.shape[0], x["indices"], x["scale"])


def _prefill_error(x, out):
    sl = slice(0, CHECK_TOKENS)
    return rel_l2(out[sl], reference.sparse_mla_ref(x["q"][sl], x["kv"], x["indices"][sl], scale=x["scale"],
                                                    attn_sink=x["attn_sink"])[0])


def _prefill_count(p):
    t, h, k, d = p["tokens"], p["heads"], p["topk"], p.get("d_qk", 576)
    return 2.0 * t * h * k * (d + 512), float(t * k * 2 * d)


def _prefill_label(p):
    return f"T{p['tokens']}-H{p['heads']}-topk{p['topk']}" + ("-sink" if p.get("sink") else "")


register(Op(
    name="sparse_mla_prefill",
    shape_sets={
        "standard": [dict(tokens=4096, heads=h, topk=2048, kv_rows=32768) for h in (16, 32, 64, 128)],
        # issue 23's prefill table (FlashMLA's sm90 head counts)
        "issue23": [dict(tokens=4096, heads=64, topk=2048, kv_rows=32768),
                    dict(tokens=4096, heads=128, topk=2048, kv_rows=32768),
                    dict(tokens=8192, heads=128, topk=2048, kv_rows=131072),
                    dict(tokens=4096, heads=128, topk=512, kv_rows=32768)],
        # short prefills, one to three rounds of programs: where the last round is split (64-head
        # and keys-on-M programs)
        "short": [dict(tokens=t, heads=h, topk=k, kv_rows=32768)
                  for h, t, k in ((64, 1, 2048), (64, 16, 2048), (64, 64, 2048), (64, 133, 2048), (64, 300, 2048),
                                  (128, 8, 2048), (128, 140, 2048), (64, 1, 512), (64, 64, 512),
                                  (16, 1, 2048), (16, 16, 2048), (16, 64, 2048), (16, 133, 2048), (32, 1, 2048),
                                  (32, 16, 2048), (32, 64, 2048), (16, 16, 512))],
        "small": [dict(tokens=8, heads=16, topk=128, kv_rows=1024)],
    },
    build=_prefill_build, run=_prefill_run, torch_ref=_prefill_torch, error=_prefill_error,
    count=_prefill_count, label=_prefill_label, peer=PREFILL_PEER,
))

# FlashMLA's MODEL1 prefill perf cases (tests/test_flash_mla_sparse_prefill.py: s_q 4096, sink; config
# 1 H64 topk 512, config 2 H128 topk 1024; issue 25's bar at 32768 kv rows) and the head counts
# FlashMLA pads to 64.
register(Op(
    name="sparse_mla_prefill_v4",
    shape_sets={
        "standard": [dict(tokens=4096, heads=h, topk=k, kv_rows=32768, d_qk=512, sink=True)
                     for h, k in ((64, 512), (128, 1024), (16, 512), (32, 512))],
        "model1": [dict(tokens=4096, heads=h, topk=k, kv_rows=n, d_qk=512, sink=True)
                   for h, k in ((64, 512), (128, 1024)) for n in (8192, 32768, 49152, 65536)],
        "small": [dict(tokens=8, heads=16, topk=128, kv_rows=1024, d_qk=512, sink=True)],
    },
    build=_prefill_build, run=_prefill_run, torch_ref=_prefill_torch, error=_prefill_error,
    count=_prefill_count, label=_prefill_label, peer=PREFILL_PEER,
))


# --------------------------------------------------------------------------------------------
# MLA cache writer and gather (quant/): bytes must equal the torch packer's exactly
def _write_build(p, device):
    fmt = _fmt(p)
    nb = p["slots"] // p["block_size"]
    g = torch.Generator(device=device).manual_seed(0)
    cache = torch.empty(nb, p["block_size"], fmt.row_width, dtype=fmt.cache_dtype, device=device)
    return {"kv_c": torch.randn(p["tokens"], 512, device=device, generator=g).bfloat16(),
            "k_pe": torch.randn(p["tokens"], 64, device=device, generator=g).bfloat16(),
            "slots": torch.randperm(p["slots"], device=device)[:p["tokens"]].to(torch.int32),
            "cache": cache, "fmt": fmt}


def _write_run(x):
    from openmla.quant.mla_writer import write_mla_cache
    write_mla_cache(x["kv_c"], x["k_pe"], x["cache"], x["slots"], check_slots=False)
    return x["cache"]


def _write_torch(x):  # pack, then scatter the rows
    flat = x["cache"].view(-1, x["cache"].shape[-1])
    flat.index_copy_(0, x["slots"].long(), x["fmt"].pack(x["kv_c"], x["k_pe"]))
    return x["cache"]


def _write_error(x, cache):
    rows = cache.view(-1, cache.shape[-1])[x["slots"].long()]
    want = x["fmt"].pack(x["kv_c"], x["k_pe"])
    return float((rows.view(torch.uint8) != want.view(torch.uint8)).any())  # 0 = byte-identical


def _write_count(p):
    row = _fmt(p).bytes_per_token
    return 0.0, float(p["tokens"] * (1152 + row))  # read bf16 latent + rope, write the row


register(Op(
    name="write_mla_cache",
    shape_sets={"standard": [dict(cache=c, tokens=t, slots=262144, block_size=64)
                             for c in ("fp8", "bf16") for t in (128, 32768)],
                "small": [dict(cache=c, tokens=16, slots=1024, block_size=64) for c in ("fp8", "bf16")]},
    build=_write_build, run=_write_run, torch_ref=_write_torch, error=_write_error, count=_write_count,
    label=lambda p: f"{p['cache']}-T{p['tokens']}",
    interpreter_exact=lambda p: not _fmt(p).quantized,  # bf16 in, bf16 out: a copy
))


def _gather_build(p, device):
    bs, reqs, seq = p["block_size"], p["requests"], p["seq_len"]
    per_req = -(-seq // bs)
    nb = reqs * per_req + 16
    g = torch.Generator(device=device).manual_seed(0)
    cache = torch.empty(nb, bs, 656, dtype=torch.uint8, device=device)
    cache.copy_(FP8_DS_MLA.pack(torch.randn(nb, bs, 512, device=device, generator=g).bfloat16(),
                                torch.randn(nb, bs, 64, device=device, generator=g).bfloat16()))
    table = torch.randperm(nb, device=device)[:reqs * per_req].view(reqs, per_req).to(torch.int32)
    seq_lens = torch.full((reqs,), seq, dtype=torch.int32, device=device)
    starts = torch.arange(reqs, device=device, dtype=torch.int32) * seq
    dst = torch.empty(reqs * seq, 576, dtype=torch.bfloat16, device=device)
    return {"cache": cache, "dst": dst, "table": table, "seq_lens": seq_lens, "starts": starts, "seq": seq}


def _gather_run(x):
    from openmla.quant.mla_gather import gather_upconvert
    gather_upconvert(x["cache"], x["dst"], x["table"], x["seq_lens"], x["starts"], max_seq_len=x["seq"])
    return x["dst"]


def _gather_rows(x):
    bs = x["cache"].shape[1]
    pos = torch.arange(x["seq"], device=x["dst"].device)
    slots = (x["table"].long()[:, pos // bs] * bs + pos % bs).reshape(-1)
    return x["cache"].view(-1, 656)[slots]


def _gather_torch(x):
    x["dst"].copy_(FP8_DS_MLA.unpack(_gather_rows(x)))
    return x["dst"]


def _gather_error(x, dst):
    return rel_l2(dst.float(), FP8_DS_MLA.unpack(_gather_rows(x)).bfloat16().float())


register(Op(
    name="gather_upconvert",
    shape_sets={"standard": [dict(requests=r, seq_len=s, block_size=64) for r, s in ((1, 32768), (4, 8192))],
                "small": [dict(requests=2, seq_len=100, block_size=64)]},
    build=_gather_build, run=_gather_run, torch_ref=_gather_torch, error=_gather_error,
    count=lambda p: (0.0, float(p["requests"] * p["seq_len"] * (656 + 1152))),
    label=lambda p: f"R{p['requests']}-seq{p['seq_len']}",
))


# --------------------------------------------------------------------------------------------
# convert_req_index_to_global (sparse MLA: per-request top-k token index -> global cache slot)
def _convert_build(p, device):
    T, K, R, M, bs = p["tokens"], p["topk"], p["requests"], p["max_blocks"], p["block_size"]
    g = torch.Generator(device=device).manual_seed(0)
    idx = torch.randint(0, M * bs, (T, K), device=device, generator=g, dtype=torch.int32)
    idx[torch.rand(T, K, device=device, generator=g) < 0.05] = -1  # topk padding
    return {"req_id": (torch.arange(T, device=device) % R).to(torch.int32),
            "table": torch.randperm(R * M + 7, device=device)[:R * M].view(R, M).to(torch.int32),
            "idx": idx, "bs": bs}


def _convert_run(x):
    from openmla.kernels.index import convert_req_index_to_global
    return convert_req_index_to_global(x["req_id"], x["table"], x["idx"], x["bs"])


def _convert_torch(x):
    return reference.convert_req_index_ref(x["req_id"], x["table"], x["idx"], x["bs"])


def _convert_error(x, out):
    return float(not torch.equal(out, reference.convert_req_index_ref(x["req_id"], x["table"], x["idx"], x["bs"])))


register(Op(
    name="convert_req_index_to_global",
    shape_sets={"standard": [dict(tokens=t, topk=2048, requests=r, max_blocks=512, block_size=64)
                             for t, r in ((128, 128), (4096, 4))],
                "small": [dict(tokens=8, topk=100, requests=2, max_blocks=8, block_size=16)]},
    build=_convert_build, run=_convert_run, torch_ref=_convert_torch, error=_convert_error,
    count=lambda p: (0.0, float(p["tokens"] * p["topk"] * 4 * 3)),  # index in, table entry, slot out
    label=lambda p: f"T{p['tokens']}-topk{p['topk']}-R{p['requests']}",
    interpreter_exact=lambda p: True,  # integer work only
))


# --------------------------------------------------------------------------------------------
# head_matmul (SparseMLAImpl's absorption with the rope tail, and its output projection); the
# torch reference is what the layer ran before: torch.bmm over head-major views, plus the copy of
# the rope part for the absorption
def _head_matmul_build(p, device):
    T, H, K, N, R = p["tokens"], p["heads"], p["k"], p["n"], p["tail"]
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(T, H, K, device=device, generator=g).bfloat16()
    w = (torch.randn(H, K, N, device=device, generator=g) * K ** -0.5).bfloat16()
    tail = torch.randn(T, H, R, device=device, generator=g).bfloat16() if R else None
    return {"x": x, "w": w, "tail": tail,
            "out": torch.empty(T, H, N + R, device=device, dtype=torch.bfloat16)}


def _head_matmul_run(x):
    from openmla.kernels.head_matmul import head_matmul
    return head_matmul(x["x"], x["w"], tail=x["tail"], out=x["out"])


def _head_matmul_torch(x):
    N = x["w"].shape[2]
    out = x["out"]
    torch.bmm(x["x"].transpose(0, 1), x["w"], out=out[..., :N].transpose(0, 1))
    if x["tail"] is not None:
        out[..., N:].copy_(x["tail"])
    return out


def _head_matmul_error(x, out):
    return rel_l2(out, reference.head_matmul_ref(x["x"], x["w"], x["tail"]))


_HEAD_MATMUL = [dict(tokens=t, heads=h, k=k, n=n, tail=r)
                for t in (1, 32, 128) for h in (16, 128) for k, n, r in ((128, 512, 64), (512, 128, 0))]
register(Op(
    name="head_matmul",
    shape_sets={"standard": _HEAD_MATMUL,
                "small": [dict(tokens=3, heads=2, k=128, n=512, tail=64), dict(tokens=3, heads=2, k=512, n=128, tail=0)]},
    build=_head_matmul_build, run=_head_matmul_run, torch_ref=_head_matmul_torch, error=_head_matmul_error,
    count=lambda p: (2.0 * p["tokens"] * p["heads"] * p["k"] * p["n"],
                     2.0 * p["heads"] * (p["k"] * p["n"] + p["tokens"] * (p["k"] + 2 * p["tail"] + p["n"]))),
    label=lambda p: f"T{p['tokens']}-H{p['heads']}-{'absorb' if p['tail'] else 'project'}",
))
