"""General MHA entries of tools/bench.py: paged_attention, merge_attn_states, write_kv_cache and
varlen_attention.

Each entry registers itself on import (tools/bench.py imports this module); see bench.py for
what a case measures and how it is checked.
"""
from __future__ import annotations

import torch

from openmla.tools._bench_core import Op, register, rel_l2
from openmla.kernels import reference
from openmla.quant import FP8_E4M3_MAX, MHA, cache_format
from openmla.quant.kv_cache import quantize_fp8_per_tensor as fp8_per_tensor


def _fmt(p):
    """The MHA format a case's cache label names ("bf16", "fp8", "int8_qkv", "int8_qk")."""
    return cache_format(p["cache"], MHA, who="bench")


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
    from openmla.kernels.paged_attention import paged_attention
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
        # paged MHA decode beside the sparse decode entry points' `host` set (tools/_bench_mla.py)
        "host": [dict(batch=b, q_len=1, context=32768, **_PAGED) for b in (1, 32)],
        "small": [dict(batch=2, q_len=1, context=256, **_PAGED)],
    },
    build=_paged_build, run=_paged_run, torch_ref=_paged_torch, error=_paged_error, count=_paged_count,
    label=lambda p: f"B{p['batch']}-q{p['q_len']}-ctx{p['context']}-H{p['heads']}/{p['kv_heads']}",
))


# --------------------------------------------------------------------------------------------
# paged_attention over int8 caches (issue 8): the decode shapes of paged_attention, int8_qkv and
# int8_qk, next to the same bf16 rows above (speed ratio) and the memory roofline of their bytes
def _int8_build(p, device):
    # the torch quantizers (byte-equal to the Triton ones; the build is not timed)
    from openmla.quant.int8 import calibrate_v_scale, quantize_per_channel_ref, quantize_per_token_head_ref
    x = _paged_build(p, device)
    nb, bs, Hkv, D = x["k"].shape
    k8, ks = quantize_per_token_head_ref(x["k"].view(nb * bs, Hkv, D))
    x["k_bf16"], x["v_bf16"] = x["k"], x["v"]
    x["k"], x["ksc"] = k8.view(nb, bs, Hkv, D), ks.view(nb, bs, Hkv).transpose(1, 2).contiguous()
    x["v_scale"] = None
    if _fmt(p).v_int8:
        x["v_scale"] = calibrate_v_scale(x["v"].view(nb * bs, Hkv, D))
        x["v"] = quantize_per_channel_ref(x["v"].view(nb * bs, Hkv, D), x["v_scale"]).view(nb, bs, Hkv, D)
    return x


def _int8_run(x):
    from openmla.kernels.paged_attention import paged_attention
    return paged_attention(x["q"], x["k"], x["v"], x["table"], x["cu"], x["lens"], scale=x["scale"],
                           causal=True, max_query_len=x["ql"], k_scale_cache=x["ksc"], v_scale=x["v_scale"])


def _int8_torch(x):
    """Dequantize the int8 caches to bf16 in torch, then the SDPA reference of paged_attention."""
    k = (x["k"].float() * x["ksc"].transpose(1, 2)[..., None]).bfloat16()
    v = x["v"] if x["v_scale"] is None else (x["v"].float() * x["v_scale"]).bfloat16()
    return _paged_torch({**x, "k": k, "v": v})


def _int8_error(x, out):
    ql = x["ql"]
    want = reference.paged_attention_ref(x["q"][:ql], x["k"], x["v"], x["table"][:1], x["cu"][:2], x["lens"][:1],
                                         scale=x["scale"], causal=True, k_scale_cache=x["ksc"],
                                         v_scale=x["v_scale"])[0]
    return rel_l2(out[:ql], want)


def _int8_count(p):
    R, ctx, Hkv, D = p["batch"], p["context"], p["kv_heads"], 128
    flops = _paged_count(p)[0]
    v_bytes = D if _fmt(p).v_int8 else 2 * D
    return flops, float(R * ctx * Hkv * (D + 4 + v_bytes))  # int8 K, its fp32 scale, V


register(Op(
    name="paged_attention_int8",
    shape_sets={
        "standard": [dict(batch=b, q_len=1, context=32768, cache=c, **_PAGED)
                     for c in ("int8_qkv", "int8_qk") for b in (1, 8, 32, 128)],
        "decode": [dict(batch=b, q_len=1, context=32768, cache="int8_qkv", **_PAGED) for b in (1, 8, 32, 128)],
        "small": [dict(batch=2, q_len=1, context=256, cache=c, **_PAGED) for c in ("int8_qkv", "int8_qk")],
    },
    build=_int8_build, run=_int8_run, torch_ref=_int8_torch, error=_int8_error, count=_int8_count,
    label=lambda p: f"{p['cache']}-B{p['batch']}-q{p['q_len']}-ctx{p['context']}-H{p['heads']}/{p['kv_heads']}",
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
    from openmla.kernels.merge import merge_attn_states
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
# write_kv_cache (MHA paged cache writer, bf16 or fp8 per-tensor)
def _kvw_build(p, device):
    T, H, D, bs = p["tokens"], p["kv_heads"], p["head_dim"], p["block_size"]
    nb = p["slots"] // bs
    fmt = _fmt(p)
    dt = fmt.k_cache_dtype(torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(0)
    k = torch.randn(T, H, D, device=device, generator=g).bfloat16()
    v = torch.randn(T, H, D, device=device, generator=g).bfloat16()
    fp8 = fmt.fp8_per_tensor
    return {"k": k, "v": v, "kc": torch.empty(nb, bs, H, D, device=device, dtype=dt),
            "vc": torch.empty(nb, bs, H, D, device=device, dtype=dt),
            "slots": torch.randperm(p["slots"], device=device)[:T].to(torch.int32),
            "k_scale": (k.float().abs().amax() / FP8_E4M3_MAX).reshape(1) if fp8 else None,
            "v_scale": (v.float().abs().amax() / FP8_E4M3_MAX).reshape(1) if fp8 else None}


def _kvw_run(x):
    from openmla.quant.kv_cache import write_kv_cache
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
    cache_elt = _fmt(p).k_cache_dtype(torch.bfloat16).itemsize
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
    interpreter_exact=lambda p: not _fmt(p).quantized,  # bf16 in, bf16 out: a copy
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
    from openmla.kernels.paged_attention import varlen_attention
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
