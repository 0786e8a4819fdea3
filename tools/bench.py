#!/usr/bin/env python3
"""Benchmarks: a registry of ops and named shape sets (STYLE.md 14).

For every case: build random inputs (never zeros), check the op against the fp32 oracle on a
slice of the tokens, then time the op and a torch reference (gather + matmul in bf16, SDPA for
the MHA path) as the median of CUDA-graph replays (`triton.testing.do_bench_cudagraph`: kernel
time, no host overhead), and report bytes/s and FLOP/s against the copy bandwidth and
bf16 matmul rate measured in the same run.

    PYTHONPATH=. python3 tools/bench.py --op sparse_mla_decode --shapes standard --out decode.json
    PYTHONPATH=. python3 tools/bench.py --op all --compare old.json
    python tools/bench.py --shapes small      # no GPU: Triton interpreter, timings meaningless

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1 is set here) and
only the `small` shape sets are accepted. The interpreter computes some things silently wrong
(bf16/fp8 tl.dot operands, float->bf16/fp8 rounding; tests/conftest.py corrects them for the
tests, tools do not use test code), so on a CPU an op's result is checked only where it does
not depend on those defects (each op's `interpreter_exact`); elsewhere the check reads
"n/a (interpreter)". The one change made to Triton here is that the autotuner, which would
time configs on a GPU driver, takes the first config its prune function keeps: that picks a
config, it never changes what a config computes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

# No GPU: run the kernels in Triton's interpreter (set before triton is imported).
GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from triton.runtime.errors import InterpreterError  # noqa: E402

from kernels import reference  # noqa: E402
from quant import BF16_MLA, FP8_DS_MLA, FP8_E4M3_MAX  # noqa: E402

CPU_WARNING = ("WARNING: no GPU: kernels ran in Triton's interpreter on the CPU. The times below "
               "measure the interpreter and the CPU, not the kernels: do not read them as speed.")


# --------------------------------------------------------------------------------------------
# Cases and the registry
@dataclass
class Case:
    """One timed configuration. `params` are the op's shape parameters (JSON-able)."""

    op: str
    name: str
    params: dict
    flops: float = 0.0
    bytes: float = 0.0
    # filled by the run
    ms: float = float("nan")
    ref_ms: float = float("nan")
    rel_err: float = float("nan")
    extra: dict = field(default_factory=dict)


@dataclass
class Op:
    """A benchmarked op: how to build a case's inputs, run it, run the torch reference, check it."""

    name: str
    shape_sets: dict  # set name -> list of params dicts
    build: Callable  # params, device -> inputs dict
    run: Callable  # inputs -> output tensor (the one checked)
    torch_ref: Callable  # inputs -> output tensor (bf16 gather + matmul)
    error: Callable  # inputs, op output -> relative error against the oracle (0 = exact)
    count: Callable  # params -> (flops, bytes)
    label: Callable  # params -> case name
    # params -> True when the op's result does not depend on the Triton interpreter's numeric
    # defects (integer work, fp32 math, plain copies), so a CPU run can check it
    interpreter_exact: Callable = lambda p: False


REGISTRY: dict[str, Op] = {}


def register(op: Op) -> Op:
    REGISTRY[op.name] = op
    return op


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
    fmt = FP8_DS_MLA if p["cache"] == "fp8" else BF16_MLA
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
    from kernels.sparse_mla_decode import sparse_mla_decode
    return sparse_mla_decode(x["q"], x["cache"], x["indices"], scale=x["scale"])[0]


def _decode_torch(x):
    fmt, cache = x["fmt"], x["cache"]
    flat = cache.reshape(-1, cache.shape[-1])
    # gather the 656-byte (or bf16) rows, then dequantize only what was gathered
    return torch_sparse_attention(x["q"], lambda idx: fmt.unpack(flat[idx]).to(torch.bfloat16),
                                  flat.shape[0], x["indices"], x["scale"])


CHECK_TOKENS = 8  # the oracle runs in float64: check a slice of the tokens, time them all


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def _decode_error(x, out):
    sl = slice(0, CHECK_TOKENS)
    want = reference.sparse_mla_decode_ref(x["q"][sl], x["cache"], x["indices"][sl], scale=x["scale"])[0]
    return rel_l2(out[sl], want)


def _decode_count(p):
    t, h, k = p["tokens"], p["heads"], p["topk"]
    row_bytes = 656 if p["cache"] == "fp8" else 1152
    return 2.0 * t * h * k * (576 + 512), float(t * k * row_bytes)


_DECODE_STANDARD = [
    dict(cache=c, tokens=t, heads=h, topk=2048, slots=262144, block_size=64)
    for c in ("fp8", "bf16") for t in (128, 32) for h in (16, 32, 64, 128)
]
register(Op(
    name="sparse_mla_decode",
    shape_sets={
        "standard": _DECODE_STANDARD,
        "fp8": [p for p in _DECODE_STANDARD if p["cache"] == "fp8"],
        "small": [dict(cache="fp8", tokens=4, heads=16, topk=128, slots=4096, block_size=64)],
    },
    build=_decode_build, run=_decode_run, torch_ref=_decode_torch, error=_decode_error,
    count=_decode_count,
    label=lambda p: f"{p['cache']}-T{p['tokens']}-H{p['heads']}-topk{p['topk']}",
))


# --------------------------------------------------------------------------------------------
# sparse MLA prefill
def _prefill_build(p, device):
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(p["tokens"], p["heads"], 576, device=device, generator=g).bfloat16()
    kv = torch.randn(p["kv_rows"], 576, device=device, generator=g).bfloat16()
    indices = random_topk_indices(p["tokens"], p["kv_rows"], p["topk"], device)
    return {"q": q, "kv": kv, "indices": indices, "scale": 576 ** -0.5}


def _prefill_run(x):
    from kernels.sparse_mla_prefill import sparse_mla_prefill
    return sparse_mla_prefill(x["q"], x["kv"], x["indices"], scale=x["scale"])[0]


def _prefill_torch(x):
    kv = x["kv"]
    return torch_sparse_attention(x["q"], lambda idx: kv[idx], kv.shape[0], x["indices"], x["scale"])


def _prefill_error(x, out):
    sl = slice(0, CHECK_TOKENS)
    return rel_l2(out[sl], reference.sparse_mla_ref(x["q"][sl], x["kv"], x["indices"][sl], scale=x["scale"])[0])


def _prefill_count(p):
    t, h, k = p["tokens"], p["heads"], p["topk"]
    return 2.0 * t * h * k * (576 + 512), float(t * k * 1152)


register(Op(
    name="sparse_mla_prefill",
    shape_sets={
        "standard": [dict(tokens=4096, heads=h, topk=2048, kv_rows=32768) for h in (16, 32, 64, 128)],
        "small": [dict(tokens=8, heads=16, topk=128, kv_rows=1024)],
    },
    build=_prefill_build, run=_prefill_run, torch_ref=_prefill_torch, error=_prefill_error,
    count=_prefill_count,
    label=lambda p: f"T{p['tokens']}-H{p['heads']}-topk{p['topk']}",
))


# --------------------------------------------------------------------------------------------
# MLA cache writer and gather (quant/): bytes must equal the torch packer's exactly
def _write_build(p, device):
    fmt = FP8_DS_MLA if p["cache"] == "fp8" else BF16_MLA
    nb = p["slots"] // p["block_size"]
    g = torch.Generator(device=device).manual_seed(0)
    cache = torch.empty(nb, p["block_size"], fmt.row_width, dtype=fmt.cache_dtype, device=device)
    return {"kv_c": torch.randn(p["tokens"], 512, device=device, generator=g).bfloat16(),
            "k_pe": torch.randn(p["tokens"], 64, device=device, generator=g).bfloat16(),
            "slots": torch.randperm(p["slots"], device=device)[:p["tokens"]].to(torch.int32),
            "cache": cache, "fmt": fmt}


def _write_run(x):
    from quant.mla_writer import write_mla_cache
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
    row = 656 if p["cache"] == "fp8" else 1152
    return 0.0, float(p["tokens"] * (1152 + row))  # read bf16 latent + rope, write the row


register(Op(
    name="write_mla_cache",
    shape_sets={"standard": [dict(cache=c, tokens=t, slots=262144, block_size=64)
                             for c in ("fp8", "bf16") for t in (128, 32768)],
                "small": [dict(cache=c, tokens=16, slots=1024, block_size=64) for c in ("fp8", "bf16")]},
    build=_write_build, run=_write_run, torch_ref=_write_torch, error=_write_error, count=_write_count,
    label=lambda p: f"{p['cache']}-T{p['tokens']}",
    interpreter_exact=lambda p: p["cache"] == "bf16",  # bf16 in, bf16 out: a copy
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
    from quant.mla_gather import gather_upconvert
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
# General MHA path: paged prefill (next to SDPA) and paged decode (next to the memory roofline)
def _paged_build(p, device):
    R, ql, ctx, H, Hkv, D, bs = p["batch"], p["q_len"], p["context"], p["heads"], p["kv_heads"], 128, p["block_size"]
    per_req = -(-ctx // bs)
    g = torch.Generator(device=device).manual_seed(0)
    k_cache = torch.randn(R * per_req, bs, Hkv, D, device=device, generator=g, dtype=torch.bfloat16)
    v_cache = torch.randn(R * per_req, bs, Hkv, D, device=device, generator=g, dtype=torch.bfloat16)
    table = torch.randperm(R * per_req, device=device).view(R, per_req).to(torch.int32)
    q = torch.randn(R * ql, H, D, device=device, generator=g).bfloat16()
    cu = torch.arange(R + 1, device=device, dtype=torch.int32) * ql
    lens = torch.full((R,), ctx, device=device, dtype=torch.int32)
    return {"q": q, "k": k_cache, "v": v_cache, "table": table, "cu": cu, "lens": lens, "ql": ql, "ctx": ctx,
            "scale": D ** -0.5}


def _paged_run(x):
    from kernels.paged_attention import paged_attention
    return paged_attention(x["q"], x["k"], x["v"], x["table"], x["cu"], x["lens"], scale=x["scale"],
                           causal=True, max_query_len=x["ql"])


def _paged_torch(x):
    """SDPA over each request's K/V gathered out of the cache (the torch reference)."""
    R, ql = x["lens"].shape[0], x["ql"]
    ctx, H = x["ctx"], x["q"].shape[1]
    out = torch.empty_like(x["q"])
    for r0 in range(0, R, 8):
        rows = x["table"][r0:r0 + 8].long()
        k = x["k"][rows].flatten(1, 2)[:, :ctx].transpose(1, 2)  # [r, Hkv, ctx, D]
        v = x["v"][rows].flatten(1, 2)[:, :ctx].transpose(1, 2)
        q = x["q"][r0 * ql:(r0 + rows.shape[0]) * ql].view(rows.shape[0], ql, H, -1).transpose(1, 2)
        # bottom-right causal: query i sees keys <= ctx - ql + i
        # (no mask for a single query; is_causal, which SDPA's flash path takes, when ql == ctx)
        mask = None if ql in (1, ctx) else torch.ones(ql, ctx, dtype=torch.bool, device=q.device).tril(ctx - ql)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=ql == ctx > 1,
                                                             scale=x["scale"], enable_gqa=True)
        out[r0 * ql:(r0 + rows.shape[0]) * ql] = o.transpose(1, 2).reshape(-1, H, q.shape[-1])
    return out


def _paged_error(x, out):
    ql = x["ql"]
    want = reference.paged_attention_ref(x["q"][:ql], x["k"], x["v"], x["table"][:1], x["cu"][:2], x["lens"][:1],
                                         scale=x["scale"], causal=True)[0]
    return rel_l2(out[:ql], want)


def _paged_count(p):
    R, ql, ctx, H, Hkv, D = p["batch"], p["q_len"], p["context"], p["heads"], p["kv_heads"], 128
    visible = ql * ctx - ql * (ql - 1) / 2  # causal, bottom-right: query i sees ctx - ql + 1 + i keys
    return 4.0 * R * H * D * visible, float(R * ctx * Hkv * D * 2 * 2)  # K and V read once, bf16


_PAGED = dict(heads=32, kv_heads=8, block_size=16)
register(Op(
    name="paged_attention",
    shape_sets={
        "standard": [dict(batch=b, q_len=1, context=32768, **_PAGED) for b in (1, 8, 32, 128)]
        + [dict(batch=b, q_len=4, context=32768, **_PAGED) for b in (8, 32)]
        + [dict(batch=1, q_len=8192, context=8192, **_PAGED)],
        "decode": [dict(batch=b, q_len=1, context=32768, **_PAGED) for b in (1, 8, 32, 128)],
        "small": [dict(batch=2, q_len=1, context=256, **_PAGED)],
    },
    build=_paged_build, run=_paged_run, torch_ref=_paged_torch, error=_paged_error, count=_paged_count,
    label=lambda p: f"B{p['batch']}-q{p['q_len']}-ctx{p['context']}-H{p['heads']}/{p['kv_heads']}",
))


# --------------------------------------------------------------------------------------------
# merge_attn_states (cascade attention, split-KV merges)
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _merge_build(p, device):
    T, H, D, dt = p["tokens"], p["heads"], p["head_dim"], _DTYPES[p["dtype"]]
    g = torch.Generator(device=device).manual_seed(0)
    x = {n: torch.randn(T, H, D, device=device, generator=g).to(dt) for n in ("a", "b")}
    for n in ("a_lse", "b_lse"):  # spread so that both parts dominate somewhere
        x[n] = torch.randn(T, H, device=device, generator=g) * 3 + 5
    x["out"] = torch.empty(T, H, D, device=device, dtype=dt)
    x["out_lse"] = torch.empty(T, H, device=device)
    return x


def _merge_run(x):
    from kernels.merge import merge_attn_states
    merge_attn_states(x["out"], x["a"], x["a_lse"], x["b"], x["b_lse"], out_lse=x["out_lse"])
    return x["out"]


def _merge_torch(x):  # what a torch fallback does: fp32 weights from the two lse
    lse = torch.logaddexp(x["a_lse"], x["b_lse"])
    wa, wb = (x["a_lse"] - lse).exp().unsqueeze(-1), (x["b_lse"] - lse).exp().unsqueeze(-1)
    x["out"].copy_(x["a"].float() * wa + x["b"].float() * wb)
    x["out_lse"].copy_(lse)
    return x["out"]


def _merge_error(x, out):
    return rel_l2(out, reference.merge_attn_states_ref(x["a"], x["a_lse"], x["b"], x["b_lse"])[0])


def _merge_count(p):
    elt = 2 if p["dtype"] == "bf16" else 4
    return 0.0, float(p["tokens"] * p["heads"] * (3 * p["head_dim"] * elt + 3 * 4))  # 2 in + out, 3 lse


register(Op(
    name="merge_attn_states",
    shape_sets={"standard": [dict(tokens=t, heads=h, head_dim=d, dtype="bf16")
                             for t, h, d in ((4096, 32, 128), (65536, 32, 128), (128, 128, 512), (4096, 16, 512))],
                "small": [dict(tokens=8, heads=4, head_dim=64, dtype="fp32")]},
    build=_merge_build, run=_merge_run, torch_ref=_merge_torch, error=_merge_error, count=_merge_count,
    label=lambda p: f"T{p['tokens']}-H{p['heads']}-D{p['head_dim']}-{p['dtype']}",
    interpreter_exact=lambda p: p["dtype"] == "fp32",  # fp32 loads, math and stores
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
    from kernels.index import convert_req_index_to_global
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
# write_kv_cache (MHA paged cache writer, bf16 or fp8 per-tensor)
from quant.kv_cache import quantize_fp8_per_tensor as fp8_per_tensor  # noqa: E402


def _kvw_build(p, device):
    T, H, D, bs = p["tokens"], p["kv_heads"], p["head_dim"], p["block_size"]
    nb = p["slots"] // bs
    dt = torch.float8_e4m3fn if p["cache"] == "fp8" else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    k = torch.randn(T, H, D, device=device, generator=g).bfloat16()
    v = torch.randn(T, H, D, device=device, generator=g).bfloat16()
    fp8 = p["cache"] == "fp8"
    return {"k": k, "v": v, "kc": torch.empty(nb, bs, H, D, device=device, dtype=dt),
            "vc": torch.empty(nb, bs, H, D, device=device, dtype=dt),
            "slots": torch.randperm(p["slots"], device=device)[:T].to(torch.int32),
            "k_scale": (k.float().abs().amax() / FP8_E4M3_MAX).reshape(1) if fp8 else None,
            "v_scale": (v.float().abs().amax() / FP8_E4M3_MAX).reshape(1) if fp8 else None}


def _kvw_run(x):
    from quant.kv_cache import write_kv_cache
    write_kv_cache(x["k"], x["v"], x["kc"], x["vc"], x["slots"], k_scale=x["k_scale"], v_scale=x["v_scale"],
                   check_slots=False)
    return x["kc"]


def _kvw_quant(x, name):
    t, s = x[name], x[name[0] + "_scale"]
    return t.to(x["kc"].dtype) if s is None else fp8_per_tensor(t, s)


def _kvw_torch(x):  # quantize, then scatter the rows
    for name, cache in (("k", x["kc"]), ("v", x["vc"])):
        flat, rows = cache.view(-1, *cache.shape[2:]), _kvw_quant(x, name)
        if flat.dtype == torch.float8_e4m3fn:  # no fp8 index_copy on the CPU: copy the bytes
            flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
        flat.index_copy_(0, x["slots"].long(), rows)
    return x["kc"]


def _kvw_error(x, kc):
    for name, cache in (("k", kc), ("v", x["vc"])):
        rows = cache.view(-1, *cache.shape[2:])[x["slots"].long()]
        if not torch.equal(rows.view(torch.uint8), _kvw_quant(x, name).view(torch.uint8)):
            return 1.0
    return 0.0  # byte-identical


def _kvw_count(p):
    cache_elt = 1 if p["cache"] == "fp8" else 2
    return 0.0, float(2 * p["tokens"] * p["kv_heads"] * p["head_dim"] * (2 + cache_elt))  # K and V: bf16 in, cache out


register(Op(
    name="write_kv_cache",
    shape_sets={"standard": [dict(cache=c, tokens=t, kv_heads=8, head_dim=128, slots=65536, block_size=16)
                             for c in ("bf16", "fp8") for t in (128, 8192)],
                "small": [dict(cache=c, tokens=16, kv_heads=2, head_dim=64, slots=256, block_size=16)
                          for c in ("bf16", "fp8")]},
    build=_kvw_build, run=_kvw_run, torch_ref=_kvw_torch, error=_kvw_error,
    count=_kvw_count,
    label=lambda p: f"{p['cache']}-T{p['tokens']}-Hkv{p['kv_heads']}-D{p['head_dim']}",
    interpreter_exact=lambda p: p["cache"] == "bf16",  # bf16 in, bf16 out: a copy
))


# --------------------------------------------------------------------------------------------
# varlen_attention (contiguous K/V, no cache: prefill without a cache, encoder attention), next to SDPA
def _varlen_build(p, device):
    R, L, H, Hkv, D = p["batch"], p["seq"], p["heads"], p["kv_heads"], p["head_dim"]
    g = torch.Generator(device=device).manual_seed(0)
    cu = torch.arange(R + 1, device=device, dtype=torch.int32) * L
    return {"q": torch.randn(R * L, H, D, device=device, generator=g).bfloat16(),
            "k": torch.randn(R * L, Hkv, D, device=device, generator=g).bfloat16(),
            "v": torch.randn(R * L, Hkv, D, device=device, generator=g).bfloat16(),
            "cu": cu, "R": R, "L": L, "causal": p["causal"], "scale": D ** -0.5}


def _varlen_run(x):
    from kernels.paged_attention import varlen_attention
    return varlen_attention(x["q"], x["k"], x["v"], x["cu"], x["cu"], scale=x["scale"], causal=x["causal"],
                            max_query_len=x["L"], max_kv_len=x["L"])


def _varlen_torch(x):
    R, L = x["R"], x["L"]
    q, k, v = (x[n].view(R, L, x[n].shape[1], -1).transpose(1, 2) for n in ("q", "k", "v"))
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=x["causal"], scale=x["scale"],
                                                         enable_gqa=True)
    return o.transpose(1, 2).reshape(R * L, q.shape[1], -1)


def _varlen_error(x, out):
    # The last CHECK_ROWS queries of the first request (they see the most keys when causal).
    L = x["L"]
    n = min(L, CHECK_ROWS)
    cu_q = torch.tensor([0, n], dtype=torch.int32, device=out.device)
    cu_k = torch.tensor([0, L], dtype=torch.int32, device=out.device)
    want = reference.attention_varlen_ref(x["q"][L - n:L], x["k"][:L], x["v"][:L], cu_q, cu_k, scale=x["scale"],
                                          causal=x["causal"])[0]
    return rel_l2(out[L - n:L], want)


CHECK_ROWS = 256


def _varlen_count(p):
    R, L, H, Hkv, D = p["batch"], p["seq"], p["heads"], p["kv_heads"], p["head_dim"]
    pairs = L * (L + 1) / 2 if p["causal"] else L * L
    return 4.0 * R * H * D * pairs, float(R * L * (2 * H + 2 * Hkv) * D * 2)  # q, k, v in, out; bf16


register(Op(
    name="varlen_attention",
    shape_sets={"standard": [dict(batch=1, seq=8192, heads=32, kv_heads=8, head_dim=128, causal=True),
                             dict(batch=8, seq=2048, heads=32, kv_heads=8, head_dim=128, causal=True),
                             dict(batch=16, seq=1024, heads=16, kv_heads=16, head_dim=64, causal=False)],
                "small": [dict(batch=2, seq=64, heads=4, kv_heads=2, head_dim=64, causal=True)]},
    build=_varlen_build, run=_varlen_run, torch_ref=_varlen_torch, error=_varlen_error, count=_varlen_count,
    label=lambda p: f"B{p['batch']}-L{p['seq']}-H{p['heads']}/{p['kv_heads']}-D{p['head_dim']}"
                    f"{'-causal' if p['causal'] else ''}",
))


# --------------------------------------------------------------------------------------------
# Ceilings measured in the same run, and the timing loop
def measure_ceilings(device) -> dict:
    """Copy bandwidth (bytes read + written per second) and bf16 matmul FLOP/s, on random data."""
    if device.type != "cuda":  # the CPU's own, for the record (interpreter runs are not compared to it)
        a = torch.randn(1 << 24, dtype=torch.bfloat16)
        b = torch.empty_like(a)
        copy_s = _cpu_seconds(lambda: b.copy_(a), 5)
        x = torch.randn(512, 512, dtype=torch.bfloat16)
        mm_s = _cpu_seconds(lambda: x @ x, 5)
        return {"copy_bytes_per_s": 2 * a.numel() * 2 / copy_s, "bf16_matmul_flops": 2 * 512**3 / mm_s}
    from triton.testing import do_bench
    n = 1 << 29  # 1 GiB of bf16 per buffer: several times the L2
    a = torch.randn(n, device=device, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), quantiles=[0.5])
    copy_bps = 2 * a.numel() * a.element_size() / (ms * 1e-3)
    del a, b
    m = 8192
    x = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    y = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    ms = do_bench(lambda: x @ y, quantiles=[0.5])
    return {"copy_bytes_per_s": copy_bps, "bf16_matmul_flops": 2 * m**3 / (ms * 1e-3)}


def _cpu_seconds(fn, reps: int) -> float:
    """Median wall time of reps calls (CPU: no device to synchronize)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def kernel_time(fn) -> tuple[float, str]:
    """Median ms of fn's GPU work: replays of a captured CUDA graph, so host overhead (validation,
    dispatch, launches) is not counted, as DESIGN.md asks for kernel time. Falls back to plain
    do_bench (host overhead included) for code that cannot be captured, and says which was used."""
    from triton.testing import do_bench, do_bench_cudagraph
    fn()  # compile / autotune outside the capture
    try:
        return do_bench_cudagraph(fn, quantiles=[0.5]), "cuda-graph"
    except Exception as e:  # e.g. a host sync inside fn
        print(f"    (graph capture failed: {type(e).__name__}; timing eagerly)", file=sys.stderr)
        torch.cuda.synchronize()
        return do_bench(fn, quantiles=[0.5]), "eager"


def _interpreter_autotune() -> None:
    """Under the interpreter, Triton 3.6's autotuner would time every config that pruning keeps,
    which needs a GPU driver. Report equal times: min() then keeps the first config the kernel's
    prune function keeps. This picks a config; it changes nothing a config computes."""
    from triton.runtime import autotuner
    if not hasattr(autotuner.Autotuner, "_bench"):
        raise RuntimeError("bench.py: triton.runtime.autotuner.Autotuner._bench is gone (Triton upgrade?); "
                           "the interpreter runs need a new way to skip config timing")
    autotuner.Autotuner._bench = lambda self, *args, config, **meta: [0.0, 0.0, 0.0]


def run_case(op: Op, params: dict, device, skip_ref: bool = False) -> Case:
    flops, nbytes = op.count(params)
    case = Case(op=op.name, name=op.label(params), params=params, flops=flops, bytes=nbytes)
    x = op.build(params, device)
    if device.type == "cuda":
        out = op.run(x)
        check = True
    else:  # interpreter: one run is both the check and the (meaningless) time
        check = op.interpreter_exact(params)
        t0 = time.perf_counter()
        try:
            out = op.run(x)
        except InterpreterError as e:
            if check:
                raise
            # e.g. libdevice calls, which Triton 3.6's interpreter does not implement
            case.extra["check"] = f"not run (the interpreter raised {str(e).split('(')[0]})"
            return case
        case.ms, case.extra["timing"] = (time.perf_counter() - t0) * 1e3, "interpreter, 1 run"
    if check:
        case.rel_err = op.error(x, out)
        case.extra["check"] = "oracle"
        if not math.isfinite(case.rel_err) or case.rel_err > 2e-2:
            raise RuntimeError(f"{op.name} {case.name}: relative L2 error {case.rel_err:.3g} against the "
                               f"fp32 oracle; refusing to time a wrong result")
    else:
        case.extra["check"] = "n/a (interpreter)"
    if device.type == "cuda":
        case.ms, case.extra["timing"] = kernel_time(lambda: op.run(x))
    if not skip_ref:
        if device.type == "cuda":
            case.ref_ms, case.extra["ref_timing"] = kernel_time(lambda: op.torch_ref(x))
        else:
            case.ref_ms, case.extra["ref_timing"] = _cpu_seconds(lambda: op.torch_ref(x), 3) * 1e3, "cpu, median of 3"
    del x
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return case


def git_revision() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except Exception:  # not a git checkout (e.g. a copied tree on the GPU machine)
        return os.environ.get("OPENMLA_REV", "unknown")


# FlashMLA on the same GPU model (DESIGN.md, Performance): fp8 decode and bf16 prefill, ms.
FLASHMLA_MS = {
    ("sparse_mla_decode", "fp8", 128): {128: 0.187, 64: 0.117, 32: 0.117, 16: 0.117},
    ("sparse_mla_decode", "fp8", 32): {128: 0.067, 64: 0.051, 32: 0.051, 16: 0.051},
    ("sparse_mla_prefill", None, 4096): {128: 4.19, 64: 2.17, 32: 2.17, 16: 2.33},
}


def flashmla_ms(c: dict) -> float:
    p = c["params"]
    return FLASHMLA_MS.get((c["op"], p.get("cache"), p.get("tokens")), {}).get(p.get("heads"), float("nan"))


def _err(c: dict) -> str:
    """The check column: the relative error, or why there is none."""
    check = c.get("extra", {}).get("check", "oracle")
    return f"{c['rel_err']:.1e}" if check == "oracle" else check


def _row(c: dict, ceil: dict, flash: str = "") -> str:
    """The numeric columns after the case name: ms, [FlashMLA], ref, ratio, bytes/s, FLOP/s, check
    ('–' where the case did not run)."""
    if not math.isfinite(c["ms"]):
        return f" – |{flash} – | – | – | – | – | – | {_err(c)} |"
    bps, fps = c["bytes"] / (c["ms"] * 1e-3), c["flops"] / (c["ms"] * 1e-3)
    return (f" {c['ms']:.4f} |{flash} {c['ref_ms']:.4f} | {c['ref_ms'] / c['ms']:.1f}x | {bps / 1e9:.0f} | "
            f"{100 * bps / ceil['copy_bytes_per_s']:.0f}% | {fps / 1e12:.1f} | "
            f"{100 * fps / ceil['bf16_matmul_flops']:.0f}% | {_err(c)} |")


def report(result: dict) -> str:
    """Markdown for docs/benchmarks.md from a bench JSON: header, then one table per op, each with
    the device, date and command above it."""
    ceil = result["ceilings"]
    out = [f"{result['device']}, {result['date']}, torch {result['torch']}, triton {result['triton']}, "
           f"git {result['git']}. Copy bandwidth {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
           f"{ceil['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s (measured in the same run).",
           f"Command: `PYTHONPATH=. python3 {result['command']}`", ""]
    if result.get("warning"):
        out += [f"**{result['warning']}**", ""]
    caption = f"_{result['device']}, {result['date']}: `{result['command']}`_"
    ops = sorted({c["op"] for c in result["cases"]})
    for op in ops:
        cases = [c for c in result["cases"] if c["op"] == op]
        has_flash = any(math.isfinite(flashmla_ms(c)) for c in cases)
        out.append(f"### {op}\n")
        out.append(caption + "\n")
        out.append("| case | ms | FlashMLA ms | FlashMLA / ours | torch ref ms | ref / ours | GB/s | % copy BW "
                   "| TFLOP/s | % matmul | rel err |" if has_flash else
                   "| case | ms | torch ref ms | ref / ours | GB/s | % copy BW | TFLOP/s | % matmul | rel err |")
        out.append("|" + "---|" * (11 if has_flash else 9))
        for c in cases:
            fm = flashmla_ms(c)
            flash = f" {fm:.3f} | {fm / c['ms']:.2f}x |" if math.isfinite(fm) else " – | – |"
            out.append(f"| {c['name']} |" + _row(c, ceil, flash if has_flash else ""))
        out.append("")
    return "\n".join(out)


def table(cases: list[Case], ceil: dict) -> str:
    lines = ["| op | case | ms | torch ref ms | speedup vs ref | GB/s | % copy BW | TFLOP/s | % matmul | rel err |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        lines.append(f"| {c.op} | {c.name} |" + _row(asdict(c), ceil))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", default="all", help=f"'all', or one or more (comma-separated) of {sorted(REGISTRY)}")
    ap.add_argument("--shapes", default=None, help="shape set name (standard, small, ...); default: standard "
                    "on a GPU, small without one")
    ap.add_argument("--heads", type=int, nargs="*", help="only these head counts")
    ap.add_argument("--no-ref", action="store_true", help="skip timing the torch reference")
    ap.add_argument("--out", help="write JSON here")
    ap.add_argument("--compare", help="a previous JSON: print time ratios old/new")
    ap.add_argument("--report", metavar="JSON", help="print markdown for docs/benchmarks.md from a saved run; no GPU")
    args = ap.parse_args(argv)
    if args.report:
        with open(args.report) as f:
            print(report(json.load(f)))
        return 0
    shapes = args.shapes or ("standard" if GPU else "small")
    if not GPU and shapes != "small":
        ap.error(f"--shapes {shapes}: without a GPU only the 'small' shape sets run (Triton's interpreter)")
    names = sorted(REGISTRY) if args.op == "all" else args.op.split(",")
    for n in names:
        if n not in REGISTRY:
            ap.error(f"--op: expected 'all' or names from {sorted(REGISTRY)}, got {n!r}")
        if shapes not in REGISTRY[n].shape_sets:
            ap.error(f"--shapes: {n} has {sorted(REGISTRY[n].shape_sets)}, got {shapes!r}")
    import triton
    if GPU:
        device, device_name = torch.device("cuda"), torch.cuda.get_device_name()
    else:
        device, device_name = torch.device("cpu"), "cpu (Triton interpreter)"
        print(CPU_WARNING, file=sys.stderr, flush=True)
        _interpreter_autotune()
    ceil = measure_ceilings(device)
    print(f"# {device_name} | copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s | "
          f"bf16 matmul {ceil['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s", flush=True)
    if not GPU:
        print(f"# {CPU_WARNING}", flush=True)
    cases = []
    for n in names:
        op = REGISTRY[n]
        for p in op.shape_sets[shapes]:
            if args.heads and p.get("heads") not in args.heads:
                continue
            c = run_case(op, p, device, skip_ref=args.no_ref)
            print(f"  {c.op} {c.name}: {c.ms:.4f} ms (torch ref {c.ref_ms:.4f} ms), rel err {_err(asdict(c))}",
                  file=sys.stderr if not GPU else sys.stdout, flush=True)
            cases.append(c)
    print(table(cases, ceil))
    result = {
        "device": device_name, "date": datetime.date.today().isoformat(),
        "torch": torch.__version__, "triton": triton.__version__, "git": git_revision(),
        "command": " ".join(["tools/bench.py"] + (argv if argv is not None else sys.argv[1:])),
        "ceilings": ceil, "cases": [asdict(c) for c in cases],
    }
    if not GPU:
        result["warning"] = CPU_WARNING
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.compare:
        with open(args.compare) as f:
            old = {(c["op"], c["name"]): c for c in json.load(f)["cases"]}
        print("\n| op | case | old ms | new ms | old/new |\n|---|---|---|---|---|")
        for c in cases:
            o = old.get((c.op, c.name))
            if o:
                print(f"| {c.op} | {c.name} | {o['ms']:.4f} | {c.ms:.4f} | {o['ms'] / c.ms:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
