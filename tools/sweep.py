#!/usr/bin/env python3
"""Accuracy sweep: what each KV cache format costs in ATTENTION OUTPUTS, against bf16 and fp32.

For every cache format of the registry (quant.CACHE_FORMATS: sparse MLA bf16, fp8_ds_mla with
pow2 and raw scales, DeepSeek-V4's fp8_model1 (family mla_v4: d_qk 512); MHA bf16, fp8
per-tensor, int8_qkv / int8_qk with and without K smoothing; not the model-dtype caches of other models: the sweep's model is bf16, so `auto` is its bf16 row
and an fp16 cache belongs to fp16 models), a grid of shapes and data
kinds (gaussian; outlier channels; heavy-tailed Student-t(3)), it reports the error of the
attention output and lse against

  * bf16 attention: the fp32 oracle (kernels/reference/, float64 inside) on the unquantized
    bf16 inputs (q and the cache contents rounded to bf16: what a bf16 cache gives), and
  * fp32 attention: the same oracle on the fp32 inputs before any rounding,

as relative L2, max abs, the smallest cosine over (token, head) rows and the max abs lse error.
The error is split into format error (oracle on the dequantized cache vs oracle on the bf16
inputs) and kernel error (our Triton kernel vs oracle on the dequantized cache).

What is measured ('measured' column): on a GPU, the kernel's output (sparse_mla_decode,
paged_attention). On a CPU the kernels are NOT run: both attention kernels feed bf16 operands to
tl.dot, which Triton 3.6's interpreter multiplies as raw uint16 bit patterns (tests/conftest.py
corrects that for the tests only, and tools must not depend on test code), so an interpreter
number would measure the interpreter. On a CPU the measured output is therefore the oracle over
the dequantized cache (exactly the format's contribution) and kernel error reads "n/a (CPU)".

    python tools/sweep.py                          # default grid; CPU: about 20 s on 2 cores
    python tools/sweep.py --out sweep.json --out sweep.csv --plot sweep.png
    python tools/sweep.py --full --out docs/accuracy/h200-DATE-full.json     # on a GPU

Markdown on stdout, progress on stderr.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import sys
import time
import zlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch

# No GPU: anything that does launch a Triton kernel goes through the interpreter (set before
# triton is imported). The sweep itself runs no kernel without a GPU (see the module docstring).
GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"


from openmla.kernels import reference  # noqa: E402
from openmla.quant import CACHE_FORMATS, FP8_E4M3_MAX, INDEXER, SPARSE_MLA  # noqa: E402
from openmla.quant import formats as family_formats  # noqa: E402
from openmla.tools.bench import fp8_per_tensor, git_revision  # noqa: E402  (bench imports no sweep)

DATA_KINDS = ("gaussian", "outliers", "heavy_tailed")
MLA_SCALE = 192 ** -0.5  # DeepSeek V2/V3: 1/sqrt(qk_nope_head_dim + qk_rope_head_dim), no mscale
D_LATENT, D_ROPE = 512, 64
D_V4 = 512  # DeepSeek-V4 (FlashMLA MODEL1): d_qk = d_v = 448 nope + 64 rope
V4_SCALE = D_V4 ** -0.5


# --------------------------------------------------------------------------------------------
# Data kinds
def sample(kind: str, shape: tuple, gen: torch.Generator, device):
    """(x fp32 of `shape`, gain [channels] fp32): one data kind; channels are the trailing dims
    after the first, flattened.

    gaussian: N(0, 1). outliers: N(0, 1) with 1 channel in 64 multiplied by U(50, 200) (`gain`
    holds the factors, 1 elsewhere), as seen in MLA latents and LLM keys: they set the
    quantization scale of whatever shares it. heavy_tailed: Student-t with 3 degrees of freedom
    (finite variance, occasional 10-30 sigma values)."""
    x = torch.randn(shape, generator=gen, device=device)
    channels = x[0].numel()
    gain = torch.ones(channels, device=device)
    if kind == "outliers":
        n = max(1, channels // 64)
        chans = torch.randperm(channels, generator=gen, device=device)[:n]
        gain[chans] = torch.empty(n, device=device).uniform_(50, 200, generator=gen)
        x = x * gain.view(x.shape[1:])
    elif kind == "heavy_tailed":
        chi2 = torch.randn((3,) + tuple(shape), generator=gen, device=device).square().sum(0)
        x = x / (chi2 / 3).sqrt()
    elif kind != "gaussian":
        raise ValueError(f"kind: expected one of {DATA_KINDS}, got {kind!r}")
    return x, gain


def make_latents(kind: str, tokens: int, gen: torch.Generator):
    """(kv_c [tokens, 512] bf16 of `kind`, k_pe [tokens, 64] bf16 gaussian), on the CPU."""
    return sample(kind, (tokens, D_LATENT), gen, "cpu")[0].bfloat16(), \
        torch.randn(tokens, D_ROPE, generator=gen).bfloat16()


def round_trip_errors(fmt, kv_c: torch.Tensor, k_pe: torch.Tensor) -> dict:
    """Errors of unpack(pack(x)) against x (the bf16 input, taken as exact), over all head_dim
    dims (576; DeepSeek-V4's 512 = the first 448 latent dims as its nope | the rope, packed one
    token a block); "latent" is the quantized part (latent, or V4's nope)."""
    if fmt.head_dim == D_V4:
        k = torch.cat([kv_c[:, : D_V4 - D_ROPE], k_pe], dim=-1)
        ref, got = k.double(), fmt.unpack(fmt.pack(k.unsqueeze(1))).squeeze(1).double()
    else:
        ref = torch.cat([kv_c, k_pe], dim=-1).double()
        got = fmt.unpack(fmt.pack(kv_c, k_pe)).double()
    diff = got - ref
    q = ref.shape[-1] - D_ROPE
    return {
        "rel_l2": float(diff.norm() / ref.norm()),
        "max_abs": float(diff.abs().max()),
        "cosine": float((got * ref).sum() / (got.norm() * ref.norm())),
        "latent_rel_l2": float(diff[:, :q].norm() / ref[:, :q].norm()),
        "rope_exact": bool(torch.equal(got[:, q:], ref[:, q:])),
    }


# --------------------------------------------------------------------------------------------
# Error metrics
def compare(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor) -> dict:
    """Errors of (out [T, H, Dv], lse [T, H]) against a reference, in float64.

    rel_l2 = ||out - ref|| / ||ref|| over everything; max_abs = max |out - ref|; cosine over
    everything and cosine_min = the smallest cosine of one (token, head) output row;
    lse_abs = max |lse - ref_lse| (natural log)."""
    o, r = out.double(), ref_out.double()
    d = o - r
    row_cos = (o * r).sum(-1) / (o.norm(dim=-1) * r.norm(dim=-1)).clamp_min(1e-300)
    return {
        "rel_l2": float(d.norm() / r.norm()),
        "max_abs": float(d.abs().max()),
        "cosine": float((o * r).sum() / (o.norm() * r.norm()).clamp_min(1e-300)),
        "cosine_min": float(row_cos.min()),
        "lse_abs": float((lse.double() - ref_lse.double()).abs().max()),
    }


# --------------------------------------------------------------------------------------------
# The swept cases: every format of the registry (quant.CACHE_FORMATS), each turned into the
# sweep's case by what its descriptor says (cases_of). A case turns the bf16 inputs into the
# format's cache (quantize), says what the oracle reads from that cache (dequantize: fp32
# tensors, the query included so that formats that quantize q at attention time, like
# int8_qkv, fit), and runs the library's kernel on it.
SWEEP_DTYPE = torch.bfloat16  # the model dtype of the sweep's inputs


@dataclass(frozen=True)
class Case:
    """One swept variant of a registry format, in one family ("mla": sparse MLA decode; "mha":
    paged attention).

    quantize(inputs) -> state; dequantize(inputs, state) -> dict of the family oracle's tensors;
    kernel(inputs, state) -> (out, lse) through openmla's kernel (GPU only). A case with
    `pending` set is listed in the output with that reason and not swept."""

    name: str
    family: str
    about: str
    quantize: Optional[Callable] = None
    dequantize: Optional[Callable] = None
    kernel: Optional[Callable] = None
    pending: Optional[str] = None


def _mla_case(fmt) -> Case:
    def quantize(x):
        n, bs = x["kv_c"].shape[0], x["block_size"]
        return fmt.pack(x["kv_c"], x["k_pe"]).view(n // bs, bs, fmt.row_width)

    def dequantize(x, cache):
        return {"q": x["q"], "kv": fmt.unpack(cache).reshape(-1, fmt.head_dim)}

    def kernel(x, cache):
        from openmla.kernels.sparse_mla_decode import sparse_mla_decode
        return sparse_mla_decode(x["q"], cache, x["indices"], scale=x["scale"], fmt=fmt)

    return Case(fmt.name, "mla", fmt.about, quantize, dequantize, kernel)


def _mla_v4_case(fmt) -> Case:
    """DeepSeek-V4 (d_qk 512, FP8_MODEL1): the cache is packed a page block at a time."""
    def quantize(x):
        return fmt.pack(x["k"].view(-1, x["block_size"], D_V4))

    def dequantize(x, cache):
        return {"q": x["q"], "kv": fmt.unpack(cache).reshape(-1, D_V4)}

    def kernel(x, cache):
        from openmla.kernels.sparse_mla_decode import sparse_mla_decode
        return sparse_mla_decode(x["q"], cache, x["indices"], scale=x["scale"], fmt=fmt)

    return Case(fmt.name, "mla_v4", fmt.about, quantize, dequantize, kernel)


def _mha_bf16_quantize(x):
    return {"k": x["k"], "v": x["v"], "k_scale": None, "v_scale": None}


def _mha_fp8_quantize(x):
    # Per-tensor scales from the data (amax / 448), as a calibrated deployment would use.
    ks = (x["k"].float().abs().amax() / FP8_E4M3_MAX).reshape(1)
    vs = (x["v"].float().abs().amax() / FP8_E4M3_MAX).reshape(1)
    return {"k": fp8_per_tensor(x["k"], ks), "v": fp8_per_tensor(x["v"], vs), "k_scale": ks, "v_scale": vs}


def _mha_dequantize(x, st):
    ks = 1.0 if st["k_scale"] is None else st["k_scale"]
    vs = 1.0 if st["v_scale"] is None else st["v_scale"]
    return {"q": x["q"], "k": st["k"].float() * ks, "v": st["v"].float() * vs}


def _paged(t: torch.Tensor, table: torch.Tensor, bs: int, num_blocks: int) -> torch.Tensor:
    """Contiguous [R * ctx, H_kv, D] -> NHD paged cache [num_blocks, bs, H_kv, D] via table [R, M]."""
    R, M = table.shape
    ctx = t.shape[0] // R
    cache = torch.zeros(num_blocks, bs, *t.shape[1:], dtype=t.dtype, device=t.device)
    pos = torch.arange(ctx, device=t.device)
    slots = (table.long()[:, pos // bs] * bs + pos % bs).reshape(-1)
    # scatter the bytes: index_put has no fp8 kernel on every device
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    cache.view(bits).view(num_blocks * bs, *t.shape[1:])[slots] = t.view(bits)
    return cache


def _mha_kernel(x, st, fmt):
    from openmla.kernels.paged_attention import paged_attention
    nb = x["num_blocks"]
    kc = _paged(st["k"], x["table"], x["block_size"], nb)
    vc = _paged(st["v"], x["table"], x["block_size"], nb)
    return paged_attention(x["q"], kc, vc, x["table"], x["cu_q"], x["seq_lens"], scale=x["scale"],
                           causal=True, k_scale=st["k_scale"], v_scale=st["v_scale"],
                           return_lse=True, max_query_len=1, fmt=fmt)


def _int8_quantize(x, *, v_int8: bool, smooth: bool = False):
    """int8 K per (token, head); int8_qkv: V per channel with the abs-max calibrated on this V;
    smooth: K / f first, f = calibrate_k_smooth(these keys, these queries)."""
    from openmla.quant.int8 import (calibrate_k_smooth, calibrate_v_scale, quantize_per_channel_ref,
                            quantize_per_token_head_ref)
    f = calibrate_k_smooth(x["k"], x["q"]) if smooth else None
    k8, ks = quantize_per_token_head_ref(x["k"] if f is None else x["k"].float() / f)
    st = {"k": k8, "k_scales": ks, "v": x["v"], "v_scale": None, "k_smooth": f}
    if v_int8:
        st["v_scale"] = calibrate_v_scale(x["v"])
        st["v"] = quantize_per_channel_ref(x["v"], st["v_scale"])
    return st


def _int8_dequantize(x, st):
    """What the kernel computes with: q quantized per (token, head) at attention time, too."""
    from openmla.quant.int8 import dequantize_per_token_head, quantize_per_token_head_ref
    q = x["q"]
    if st["k_smooth"] is not None:  # the kernel quantizes q * f (q.k unchanged before rounding)
        q = q.float() * st["k_smooth"].repeat_interleave(q.shape[1] // st["k_smooth"].shape[0], 0)
    q = dequantize_per_token_head(*quantize_per_token_head_ref(q))
    v = st["v"].float() if st["v_scale"] is None else st["v"].float() * st["v_scale"]
    return {"q": q, "k": dequantize_per_token_head(st["k"], st["k_scales"]), "v": v}


def _int8_kernel(x, st, fmt):
    from openmla.kernels.paged_attention import paged_attention
    nb, bs = x["num_blocks"], x["block_size"]
    kc = _paged(st["k"], x["table"], bs, nb)
    vc = _paged(st["v"], x["table"], bs, nb)
    ksc = _paged(st["k_scales"][..., None], x["table"], bs, nb)[..., 0].transpose(1, 2).contiguous()
    return paged_attention(x["q"], kc, vc, x["table"], x["cu_q"], x["seq_lens"], scale=x["scale"],
                           causal=True, k_scale_cache=ksc, v_scale=st["v_scale"], return_lse=True,
                           max_query_len=1, k_smooth=st["k_smooth"], fmt=fmt)


def cases_of(fmt) -> list:
    """The sweep's cases of one registry format, chosen by what its descriptor says."""
    if fmt.family == INDEXER:  # not an attention cache: its rows are the --indexer table
        return []
    if fmt.family == SPARSE_MLA:
        return [_mla_v4_case(fmt) if fmt.head_dim == D_V4 else _mla_case(fmt)]
    if fmt.k_int8:  # with and without per-channel K smoothing (calibrate_k_smooth)
        about = fmt.about + ("; V scale: abs-max of the values" if fmt.v_int8 else "")
        return [Case(fmt.name + ("_smooth" if smooth else ""), "mha",
                     about + ("; K smoothing" if smooth else ""),
                     lambda x, v8=fmt.v_int8, sm=smooth: _int8_quantize(x, v_int8=v8, smooth=sm),
                     _int8_dequantize, lambda x, st, f=fmt: _int8_kernel(x, st, f))
                for smooth in (False, True)]
    if fmt.fp8_per_tensor:
        return [Case(fmt.name, "mha", fmt.about + " = amax/448", _mha_fp8_quantize, _mha_dequantize,
                     lambda x, st, f=fmt: _mha_kernel(x, st, f))]
    if fmt.k_dtype == SWEEP_DTYPE:
        return [Case(fmt.name, "mha", fmt.about, _mha_bf16_quantize, _mha_dequantize,
                     lambda x, st, f=fmt: _mha_kernel(x, st, f))]
    # the model's dtype (auto: for the sweep's bf16 model, the bf16 row) or another model's
    # 16-bit cache (a 16-bit cache is read in the model's dtype): nothing of a bf16 model's
    return []


FORMATS: list[Case] = [c for f in CACHE_FORMATS for c in cases_of(f)]


# --------------------------------------------------------------------------------------------
# Families: inputs of one case and the family's oracle
def _mla_inputs(shape: dict, kind: str, gen, device) -> tuple[dict, dict]:
    """(fp32 inputs, bf16 inputs) of one sparse MLA decode case."""
    T, H, K, N, bs = shape["tokens"], shape["heads"], shape["topk"], shape["slots"], shape["block_size"]
    kv_c, gain = sample(kind, (N, D_LATENT), gen, device)
    # The query is divided by the key's channel gain: outlier channels then add to the scores
    # as much as any other, so the scores keep the spread of the gaussian case and what the
    # outliers change is the scale they set for their neighbours (in trained models they do not
    # decide every score either). The values (the latent itself) keep their outliers.
    q = torch.randn(T, H, D_LATENT + D_ROPE, generator=gen, device=device)
    q[..., :D_LATENT] /= gain
    k_pe = torch.randn(N, D_ROPE, generator=gen, device=device)
    # topk distinct slots per token, uniformly over the cache
    indices = torch.rand(T, N, generator=gen, device=device).argsort(dim=1)[:, :K].to(torch.int32)
    common = {"indices": indices, "scale": MLA_SCALE, "block_size": bs}
    fp32 = {"q": q, "kv_c": kv_c, "k_pe": k_pe, **common}
    bf16 = {"q": q.bfloat16(), "kv_c": kv_c.bfloat16(), "k_pe": k_pe.bfloat16(), **common}
    return fp32, bf16


def _mla_oracle(x: dict, t: dict):
    kv = t["kv"] if "kv" in t else torch.cat([t["kv_c"], t["k_pe"]], dim=-1)
    out, _, lse = reference.sparse_mla_ref(t["q"], kv, x["indices"], scale=x["scale"], d_v=D_LATENT)
    return out, lse


def _mla_v4_inputs(shape: dict, kind: str, gen, device) -> tuple[dict, dict]:
    """(fp32 inputs, bf16 inputs) of one DeepSeek-V4 sparse decode case: the MLA case's data with
    the token cut to 448 nope (of the data kind) | 64 rope, q likewise, scale 1/sqrt(512)."""
    pair = []
    for x in _mla_inputs(shape, kind, gen, device):
        q, nope = x["q"], D_V4 - D_ROPE
        pair.append({"q": torch.cat([q[..., :nope], q[..., D_LATENT:]], dim=-1),
                     "k": torch.cat([x["kv_c"][:, :nope], x["k_pe"]], dim=-1),
                     "indices": x["indices"], "scale": V4_SCALE, "block_size": x["block_size"]})
    return pair[0], pair[1]


def _mla_v4_oracle(x: dict, t: dict):
    kv = t["kv"] if "kv" in t else t["k"]
    out, _, lse = reference.sparse_mla_ref(t["q"], kv, x["indices"], scale=x["scale"], d_v=D_V4)
    return out, lse


def _mha_inputs(shape: dict, kind: str, gen, device) -> tuple[dict, dict]:
    """(fp32 inputs, bf16 inputs) of one paged decode case: R requests, one query each."""
    R, H, Hkv, D, ctx, bs = (shape[k] for k in ("batch", "heads", "kv_heads", "head_dim", "context", "block_size"))
    k, gain = sample(kind, (R * ctx, Hkv, D), gen, device)
    v, _ = sample(kind, (R * ctx, Hkv, D), gen, device)
    # As for MLA: q divided by the gain of the key channels it meets (query head h reads kv head
    # h // (H // Hkv)).
    q = torch.randn(R, H, D, generator=gen, device=device) / gain.view(Hkv, D).repeat_interleave(H // Hkv, 0)
    per_req = -(-ctx // bs)
    nb = R * per_req + 3  # a few blocks no request owns
    table = torch.randperm(nb, generator=gen, device=device)[:R * per_req].view(R, per_req).to(torch.int32)
    common = {"scale": D ** -0.5, "table": table, "block_size": bs, "num_blocks": nb,
              "cu_q": torch.arange(R + 1, device=device, dtype=torch.int32),
              "cu_k": torch.arange(R + 1, device=device, dtype=torch.int32) * ctx,
              "seq_lens": torch.full((R,), ctx, device=device, dtype=torch.int32)}
    return {"q": q, "k": k, "v": v, **common}, {"q": q.bfloat16(), "k": k.bfloat16(), "v": v.bfloat16(), **common}


def _mha_oracle(x: dict, t: dict):
    return reference.attention_varlen_ref(t["q"], t["k"], t["v"], x["cu_q"], x["cu_k"], scale=x["scale"],
                                          causal=True)


FAMILIES = {"mla": (_mla_inputs, _mla_oracle), "mla_v4": (_mla_v4_inputs, _mla_v4_oracle),
            "mha": (_mha_inputs, _mha_oracle)}


# --------------------------------------------------------------------------------------------
# Shape grids
def _mla(h, k, bs, tokens, slots):
    return dict(tokens=tokens, heads=h, topk=k, slots=slots, block_size=bs)


def _mha(h, hkv, ctx, bs, batch):
    return dict(batch=batch, heads=h, kv_heads=hkv, head_dim=128, context=ctx, block_size=bs)


GRIDS = {
    "default": {  # CPU-sized: float64 oracles only
        "mla": [_mla(h, k, 64, 8, 8192) for h in (16, 128) for k in (128, 2048)],
        "mla_v4": [_mla(h, k, 64, 8, 8192) for h in (16, 128) for k in (128, 640)],
        "mha": [_mha(h, hkv, ctx, 16, 2) for h, hkv in ((8, 1), (32, 8)) for ctx in (512, 4096)],
    },
    "full": {  # GPU: DESIGN.md's head counts and topk, vLLM's block sizes
        "mla": [_mla(h, k, bs, 32, 65536) for h in (16, 32, 64, 128) for k in (128, 512, 2048)
                for bs in (64, 16)],
        # FlashMLA's MODEL1 decode shapes: 64 (V4 Flash) / 128 (Pro) heads, topk 128 + 512 / 1024
        "mla_v4": [_mla(h, k, bs, 32, 65536) for h in (16, 64, 128) for k in (128, 640, 1152)
                   for bs in (64, 256)],
        "mha": [_mha(h, hkv, ctx, bs, 4) for h, hkv in ((8, 1), (32, 8), (64, 8))
                for ctx in (1024, 8192, 32768) for bs in (16, 64)],
    },
}


def shape_label(family: str, s: dict) -> str:
    if family.startswith("mla"):
        return f"T{s['tokens']}-H{s['heads']}-topk{s['topk']}-bs{s['block_size']}"
    return f"B{s['batch']}-H{s['heads']}/{s['kv_heads']}-D{s['head_dim']}-ctx{s['context']}-bs{s['block_size']}"


# --------------------------------------------------------------------------------------------
# The sweep
def case_seed(seed: int, family: str, label: str, kind: str) -> int:
    """The generator seed of one (family, shape, data kind): every format sees the same data."""
    return zlib.crc32(f"{seed}:{family}:{label}:{kind}".encode())


def run(grid: dict, kinds, formats: list[Case], *, seed: int = 0, device=None, run_kernels: bool = GPU,
        progress=sys.stderr) -> list[dict]:
    """One row per (family, shape, data kind, ready format), each with its error dicts."""
    device = torch.device(device or ("cuda" if GPU else "cpu"))
    ready = [f for f in formats if f.pending is None]
    jobs = [(fam, s, k) for fam in FAMILIES for s in grid.get(fam, []) for k in kinds
            if any(f.family == fam for f in ready)]
    rows = []
    for n, (fam, shape, kind) in enumerate(jobs, 1):
        t0 = time.time()
        make_inputs, oracle = FAMILIES[fam]
        label = shape_label(fam, shape)
        gen = torch.Generator(device=device).manual_seed(case_seed(seed, fam, label, kind))
        x32, x16 = make_inputs(shape, kind, gen, device)
        ref32 = oracle(x32, x32)
        ref16 = oracle(x16, x16)
        floor = compare(*ref16, *ref32)  # what rounding the inputs to bf16 costs, any format
        for fmt in (f for f in ready if f.family == fam):
            state = fmt.quantize(x16)
            deq = oracle(x16, fmt.dequantize(x16, state))
            row = {"family": fam, "format": fmt.name, "data": kind, "shape": label, **shape,
                   "format_err": compare(*deq, *ref16), "kernel_err": None, "bf16_vs_fp32": floor}
            if run_kernels:
                out, lse = fmt.kernel(x16, state)
                measured = (out.float(), lse.float())
                row["kernel_err"] = compare(*measured, *deq)
            else:
                measured = deq
            row["measured"] = "kernel" if run_kernels else "oracle"
            row["vs_bf16"] = compare(*measured, *ref16)
            row["vs_fp32"] = compare(*measured, *ref32)
            rows.append(row)
        print(f"  [{n}/{len(jobs)}] {fam} {label} {kind}: {time.time() - t0:.1f} s", file=progress, flush=True)
    return rows


def round_trip(tokens: int, seed: int, kinds) -> list[dict]:
    """Cache-level errors of every MLA format: unpack(pack(x)) against the bf16 input."""
    rows = []
    for kind in kinds:
        kv_c, k_pe = make_latents(kind, tokens, torch.Generator().manual_seed(seed))
        for fmt in family_formats(SPARSE_MLA):
            rows.append({"format": fmt.name, "data": kind, "tokens": tokens, **round_trip_errors(fmt, kv_c, k_pe)})
    return rows


# --------------------------------------------------------------------------------------------
# Output
METRICS = ("rel_l2", "max_abs", "cosine", "cosine_min", "lse_abs")


def _e(v: float) -> str:
    return f"{v:.2e}"


def _cos(v: float) -> str:
    return f"{v:.6f}"


def table(rows: list[dict], pending: list[dict]) -> str:
    """The markdown table: one row per measurement, then one per pending format."""
    cols = ["family", "format", "data", "shape", "measured",
            "bf16: rel L2", "max abs", "min cos", "lse err",
            "fp32: rel L2", "max abs", "min cos", "lse err", "format err", "kernel err"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        b, f = r["vs_bf16"], r["vs_fp32"]
        kern = _e(r["kernel_err"]["rel_l2"]) if r["kernel_err"] else "n/a (CPU)"
        out.append(f"| {r['family']} | {r['format']} | {r['data']} | {r['shape']} | {r['measured']} | "
                   f"{_e(b['rel_l2'])} | {_e(b['max_abs'])} | {_cos(b['cosine_min'])} | {_e(b['lse_abs'])} | "
                   f"{_e(f['rel_l2'])} | {_e(f['max_abs'])} | {_cos(f['cosine_min'])} | {_e(f['lse_abs'])} | "
                   f"{_e(r['format_err']['rel_l2'])} | {kern} |")
    for p in pending:
        out.append(f"| {p['family']} | {p['format']} | pending | – | – |" + " – |" * 10)
    return "\n".join(out)


def round_trip_table(rows: list[dict]) -> str:
    out = ["| format | data | rel L2 | latent rel L2 | max abs | cosine | rope exact |",
           "|---|---|---|---|---|---|---|"]
    out += [f"| {r['format']} | {r['data']} | {r['rel_l2']:.3e} | {r['latent_rel_l2']:.3e} | {r['max_abs']:.3e} | "
            f"{r['cosine']:.8f} | {'yes' if r['rope_exact'] else 'NO'} |" for r in rows]
    return "\n".join(out)


def report(result: dict) -> str:
    """Markdown of a sweep result (stdout, and docs/accuracy.md through tools/docs.py)."""
    kern = ("kernel outputs (sparse_mla_decode, paged_attention) on the GPU" if result["kernels"] == "run" else
            "the oracle over the dequantized cache; kernels are not run on a CPU (kernel err n/a, "
            "see tools/sweep.py)")
    lines = [
        f"{result['device']}, {result['date']}, torch {result['torch']}, triton {result['triton']}, "
        f"git {result['git']}. Command: `{result['command']}` ({result['seconds']:.0f} s).",
        "",
        f"Measured: {kern}. Against bf16 = fp32 oracle on the bf16 inputs; against fp32 = the same oracle on "
        f"the fp32 inputs before rounding. min cos: smallest cosine of one (token, head) output row; lse err: "
        f"max abs, natural log. format err: oracle on the dequantized cache vs oracle on the bf16 inputs; kernel "
        f"err: kernel vs oracle on the dequantized cache (rel L2). Softmax scale: MLA 1/sqrt(192), MLA V4 (DeepSeek-V4, d_qk 512: "
        f"448 nope of the data kind | 64 rope) 1/sqrt(512), MHA 1/sqrt(D). "
        f"MLA: decode, topk distinct random slots; MHA: paged decode, one query per request, causal. Data: "
        f"q ~ N(0, 1); cache gaussian N(0, 1), outliers (1 channel in 64 times U(50, 200); q divided by the same "
        f"factor there, so scores keep their spread), heavy_tailed (Student-t, 3 degrees of freedom).",
        "",
        table(result["rows"], result["pending"]),
        "",
    ]
    for p in result["pending"]:
        lines.append(f"- pending `{p['format']}` ({p['family']}): {p['why']}")
    if result.get("indexer"):
        from openmla.tools._sweep_indexer import indexer_table
        lines += ["", "DSA indexer: the top-k set that the fp8 path (ue8m0 q, fp8_indexer cache) selects vs "
                  "fp32 math on the unquantized bf16 q, k (tools/_sweep_indexer.py):", "",
                  indexer_table(result["indexer"])]
    if result["round_trip"]:
        lines += ["", "MLA cache round trip (`unpack(pack(x))` against the bf16 input x, "
                  f"{result['round_trip'][0]['tokens']} tokens):", "", round_trip_table(result["round_trip"])]
    return "\n".join(lines)


def csv_rows(result: dict) -> list[dict]:
    out = []
    for r in result["rows"]:
        flat = {k: v for k, v in r.items() if not isinstance(v, dict) and v is not None}
        for key in ("vs_bf16", "vs_fp32", "format_err", "kernel_err", "bf16_vs_fp32"):
            for m in METRICS:
                flat[f"{key}_{m}"] = r[key][m] if r[key] else ""
        out.append({"status": "ok", **flat})
    for p in result["pending"]:
        out.append({"status": f"pending: {p['why']}", "family": p["family"], "format": p["format"]})
    return out


def write_csv(path: str, result: dict) -> None:
    rows = csv_rows(result)
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def need_matplotlib():
    """matplotlib.pyplot, or SystemExit(2) with what to install."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print("sweep.py: --plot needs matplotlib, which is not installed. Install the extra: "
              "pip install -e '.[plot]'  (or: pip install matplotlib)", file=sys.stderr)
        raise SystemExit(2)


def plot(result: dict, path: str) -> None:
    """Bars: rel L2 of the measured output against fp32 attention (the bf16 bar is the floor any
    bf16 model pays), median over shapes with min-max whiskers, per family x data kind, one bar
    per format; log scale."""
    plt = need_matplotlib()
    fams = [f for f in FAMILIES if any(r["family"] == f for r in result["rows"])]
    if not fams:
        print("sweep.py: nothing measured, no plot written", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, len(fams), figsize=(6 * len(fams), 4), squeeze=False)
    for ax, fam in zip(axes[0], fams):
        rows = [r for r in result["rows"] if r["family"] == fam]
        kinds = list(dict.fromkeys(r["data"] for r in rows))
        fmts = list(dict.fromkeys(r["format"] for r in rows))
        width = 0.8 / len(fmts)
        for i, fm in enumerate(fmts):
            med, lo, hi = [], [], []
            for k in kinds:
                v = sorted(r["vs_fp32"]["rel_l2"] for r in rows if r["format"] == fm and r["data"] == k)
                m = v[len(v) // 2]
                med.append(m), lo.append(m - v[0]), hi.append(v[-1] - m)
            xs = [j + (i - (len(fmts) - 1) / 2) * width for j in range(len(kinds))]
            ax.bar(xs, med, width, yerr=[lo, hi], capsize=3, label=fm)
        ax.set_yscale("log")
        ax.set_xticks(range(len(kinds)), kinds)
        ax.set_title(f"{fam}: {rows[0]['measured']} output vs fp32 attention", fontsize=10)
        ax.set_ylabel("relative L2 error")
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['device']}, {result['date']}: median over shapes, whiskers min-max", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def device_name() -> str:
    return torch.cuda.get_device_name() if GPU else "cpu"


def usage_error(msg: str):
    """One line on stderr and exit status 2 (bad arguments)."""
    print(f"sweep.py: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def check_writable(opt: str, path: str) -> None:
    """usage_error unless path names a file that can be written: not a folder, in an existing
    folder that this process may write to (and, if the file exists, that may be overwritten)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        usage_error(f"{opt} {path}: is a folder, expected a file name")
    if not os.path.isdir(folder):
        usage_error(f"{opt} {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        usage_error(f"{opt} {path}: not writable")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="the GPU grid (all head counts, topk up to 2048, "
                    "contexts up to 32k, two block sizes)")
    ap.add_argument("--family", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    ap.add_argument("--formats", nargs="+", help="format names (default: all; pending ones are listed, not run)")
    ap.add_argument("--data", nargs="+", choices=DATA_KINDS, default=list(DATA_KINDS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", action="append", default=[], help="write FILE.json or FILE.csv (repeatable)")
    ap.add_argument("--plot", help="write a PNG (needs matplotlib: the 'plot' extra)")
    ap.add_argument("--indexer", action="store_true", help="also the DSA indexer rows: how often fp8 logits "
                    "change the selected top-k set vs fp32 (tools/_sweep_indexer.py)")
    args = ap.parse_args(argv)
    # Every argument is checked before the sweep runs (minutes on a GPU), so a typo costs nothing.
    for o in args.out:
        if not o.endswith((".json", ".csv")):
            usage_error(f"--out: expected a .json or .csv file name, got {o!r}")
        check_writable("--out", o)
    if args.plot:
        check_writable("--plot", args.plot)
        need_matplotlib()
    names = {f.name for f in FORMATS}
    for n in args.formats or []:
        if n not in names:
            usage_error(f"--formats: expected names from {sorted(names)}, got {n!r}")
    formats = [f for f in FORMATS if f.family in args.family and (not args.formats or f.name in args.formats)]
    if not formats:
        have = {fam: sorted(f.name for f in FORMATS if f.family == fam) for fam in args.family}
        usage_error(f"--formats {' '.join(args.formats)}: no such format in --family "
                    f"{' '.join(args.family)} (it has {have}): nothing to sweep")
    grid_name = "full" if args.full else "default"
    grid = {fam: GRIDS[grid_name][fam] for fam in args.family}
    if args.full and not GPU:
        print("sweep.py: warning: --full is sized for a GPU; on a CPU its float64 oracles take a long time",
              file=sys.stderr)

    t0 = time.time()
    ready = [f for f in formats if f.pending is None]
    print(f"accuracy sweep ({grid_name} grid) on {device_name()}: {len(ready)} formats x {len(args.data)} data kinds "
          f"x {sum(len(v) for v in grid.values())} shapes; kernels {'run' if GPU else 'not run (no GPU)'}",
          file=sys.stderr, flush=True)
    rows = run(grid, args.data, formats, seed=args.seed)
    import triton
    result = {
        "sweep": "attention_accuracy", "grid": grid_name, "device": device_name(),
        "date": datetime.date.today().isoformat(), "torch": torch.__version__, "triton": triton.__version__,
        "git": git_revision(),
        "command": " ".join(["python tools/sweep.py"] + (sys.argv[1:] if argv is None else argv)),
        "kernels": "run" if GPU else "n/a (CPU)", "seconds": 0.0, "rows": rows,
        "pending": [{"family": f.family, "format": f.name, "why": f.pending} for f in formats if f.pending],
        "round_trip": round_trip(2048, args.seed, args.data) if "mla" in args.family else [],
    }
    if args.indexer:
        from openmla.tools._sweep_indexer import GRIDS as INDEXER_GRIDS, indexer_rows
        result["indexer"] = indexer_rows(args.data, INDEXER_GRIDS[grid_name], sample=sample, seed=args.seed,
                                         run_kernels=GPU)
    result["seconds"] = time.time() - t0
    print(report(result))
    for o in args.out:
        if o.endswith(".json"):
            with open(o, "w") as f:
                json.dump(result, f, indent=1)
        else:
            write_csv(o, result)
    if args.plot:
        plot(result, args.plot)
    print(f"({result['seconds']:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
