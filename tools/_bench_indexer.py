"""The DSA indexer entries of tools/bench.py (issue 26): DeepSeek-V3.2's lightning indexer, 64
heads of 128, fp8 K cache in vLLM's layout (page 64), topk 2048.

    indexer_decode        paged_mqa_logits + decode_topk: the whole decode indexer step
    indexer_paged_logits  paged_mqa_logits alone; bytes = the indexer cache bytes it reads (the
                          issue's bar: >= 75 % of the measured copy bandwidth)
    indexer_topk          decode_topk alone over fp32 logits; bytes = the logits it reads
    indexer_prefill       mqa_logits (causal, one prompt) + topk_per_row, rows in chunks that
                          bound the logits buffer; FLOPs = the causal half of 2 * T^2 * 64 * 128

The torch references are DeepGEMM-free: gather the pages, widen fp8 to bf16, bf16 matmul, ReLU,
weighted head sum, torch.topk (what a GPU without DeepGEMM would otherwise run). Top-k results
are checked by the logits they select (sorted), relative to the oracle's top-k over the fp32
oracle logits: 0 when the sets agree up to ties.

Each decode case also records `set_diff_fp8_vs_fp32` (the sweep row of issue 26): over the
checked rows, the fraction of the top-k set that changes when the logits come from the fp8
cache and fp8 q (what runs) instead of fp32 math on the same bf16 q and k before quantization.
Random Gaussian q and k make logits far more tied than a trained model's; read it as an upper
bound of what quantization moves, not a model's figure.

Registers itself on import (tools/bench.py imports this module).
"""
from __future__ import annotations

import torch

from openmla.kernels import reference
from openmla.kernels.indexer import decode_topk, mqa_logits, paged_mqa_logits, topk_per_row
from openmla.quant.indexer_cache import INDEXER_K_FP8
from openmla.tools._bench_core import Op, register, rel_l2

H, D, PAGE = 64, 128, 64
CHECK_ROWS = 2  # the oracle runs in float64 over whole rows: check a few, time them all
_SOFTMAX, _HEAD = D ** -0.5, H ** -0.5


def _decode_inputs(p, device):
    B, ctx, n = p["batch"], p["context"], p["next_n"]
    g = torch.Generator(device=device).manual_seed(0)
    pages = -(-ctx // PAGE)
    nb = B * pages + 1
    table = torch.randperm(nb, device=device, generator=g)[:B * pages].view(B, pages).to(torch.int32)
    cache = torch.empty(nb, PAGE, INDEXER_K_FP8.bytes_per_token, dtype=torch.uint8, device=device)
    k_bf16 = torch.empty(nb * PAGE, D, dtype=torch.bfloat16, device=device)
    for s0 in range(0, nb * PAGE, 1 << 20):  # bounded temporaries
        s1 = min(nb * PAGE, s0 + (1 << 20))
        k_bf16[s0:s1] = torch.randn(s1 - s0, D, device=device, generator=g).bfloat16()
        # the torch writer (byte-identical to the Triton one, which the interpreter cannot run
        # outside the tests: libdevice)
        INDEXER_K_FP8.write_ref(k_bf16[s0:s1], cache, torch.arange(s0, s1, device=device))
    q_bf16 = torch.randn(B * n, H, D, device=device, generator=g).bfloat16()
    w_raw = torch.randn(B * n, H, device=device, generator=g)
    q, w = reference.indexer_q_quant_ref(q_bf16, w_raw, softmax_scale=_SOFTMAX, head_scale=_HEAD)
    lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
    return {"q": q.view(B, n, H, D), "w": w, "cache": cache, "table": table, "lens": lens,
            "next_n": n, "topk": p["topk"], "max_len": ctx, "k_bf16": k_bf16, "q_bf16": q_bf16,
            "w_raw": w_raw}


def _logits(x, clean=False):
    return paged_mqa_logits(x["q"], x["w"], x["cache"], x["lens"], x["table"],
                            max_model_len=x["max_len"], clean_logits=clean)


def _oracle_logits(x, rows):
    """Oracle logits of the first `rows` requests (all their next_n rows)."""
    n = x["next_n"]
    return reference.paged_mqa_logits_ref(x["q"][:rows], x["w"][:rows * n], x["cache"], x["lens"][:rows],
                                          x["table"][:rows], max_model_len=x["max_len"])


def _row_ends(x, rows):
    n = x["next_n"]
    return reference.decode_row_ends_ref(x["lens"][:rows], n)


def _selected_values(logits, idx, ends):
    """Sorted logits a top-k result selects in each row (-1 entries dropped), concatenated."""
    vals = []
    for r in range(idx.shape[0]):
        sel = idx[r][idx[r] >= 0].long()
        if sel.numel() and int(sel.max()) >= int(ends[r]):
            return torch.full((1,), float("nan"))  # a column the row cannot see: a wrong result
        vals.append(logits[r, sel].double().sort().values)
    return torch.cat(vals) if vals else torch.zeros(0, dtype=torch.float64)


def _topk_error(x, idx):
    rows = min(CHECK_ROWS, x["q"].shape[0])
    want_logits = _oracle_logits(x, rows)
    ends = _row_ends(x, rows)
    want = reference.topk_per_row_ref(want_logits, ends.to(torch.int32), x["topk"])
    got = idx[:want.shape[0]]
    return rel_l2(_selected_values(want_logits, got, ends), _selected_values(want_logits, want, ends))


def _set_diff_fp32(x, idx):
    """Fraction of the checked rows' top-k that differs from the top-k of fp32 logits computed
    from the unquantized bf16 q and k (weights without q's scale folded in)."""
    rows = min(CHECK_ROWS, x["q"].shape[0])
    n, bs = x["next_n"], x["cache"].shape[1]
    ends = _row_ends(x, rows)
    diffs = []
    for r in range(rows * n):
        b, e = r // n, int(ends[r])
        pos = torch.arange(e, device=idx.device)
        k = x["k_bf16"][(x["table"][b, pos // bs].long() * bs + pos % bs)].float()
        s = (x["q_bf16"][r].float() @ k.T).relu() * (x["w_raw"][r] * _SOFTMAX * _HEAD)[:, None]
        ref = set(torch.topk(s.sum(0), min(x["topk"], e)).indices.tolist())
        got = set(idx[r][idx[r] >= 0].tolist())
        diffs.append(len(ref ^ got) / (2 * max(1, len(ref))))
    return sum(diffs) / len(diffs)


def _decode_run(x):
    return decode_topk(_logits(x), x["lens"], x["next_n"], x["topk"])


def _decode_error(x, idx):
    x.setdefault("report", {})["set_diff_fp8_vs_fp32"] = _set_diff_fp32(x, idx)
    return _topk_error(x, idx)


def _torch_decode_logits(x):
    """DeepGEMM-free torch: gather pages, fp8 -> bf16, bf16 matmul, ReLU, weighted head sum."""
    values, scales = INDEXER_K_FP8.read_ref(x["cache"])
    B, n = x["q"].shape[:2]
    k = values[x["table"].long()].flatten(1, 2).view(torch.float8_e4m3fn).bfloat16()  # [B, P, D]
    sc = scales[x["table"].long()].flatten(1, 3)[:, :x["max_len"]]
    s = torch.bmm(x["q"].reshape(B, n * H, D).bfloat16(), k[:, :x["max_len"]].transpose(1, 2))
    s = (s.float().relu_().view(B, n, H, -1) * x["w"].view(B, n, H, 1)).sum(2) * sc[:, None, :]
    ends = _row_ends(x, B).view(B, n)
    cols = torch.arange(s.shape[-1], device=s.device)
    return s.masked_fill(cols >= ends[..., None], float("-inf")).view(B * n, -1)


def _torch_decode(x):
    return torch.topk(_torch_decode_logits(x), min(x["topk"], x["max_len"]), dim=-1).indices


def _decode_count(p):
    B, ctx, n = p["batch"], p["context"], p["next_n"]
    return 2.0 * B * n * H * D * ctx, float(B * ctx * INDEXER_K_FP8.bytes_per_token)


def _logits_error(x, out):
    rows = min(CHECK_ROWS, x["q"].shape[0])
    want = _oracle_logits(x, rows)
    got = out[:want.shape[0]]
    vis = torch.isfinite(want)
    return rel_l2(got[vis], want[vis])


def _topk_build(p, device):
    x = _decode_inputs(p, device)
    x["logits"] = _logits(x, clean=False)
    return x


def _topk_error_given(x, idx):
    rows = min(CHECK_ROWS, x["q"].shape[0])
    ends = _row_ends(x, rows).to(torch.int32)
    lg = x["logits"][:rows * x["next_n"]]
    want = reference.topk_per_row_ref(lg, ends, x["topk"])
    return rel_l2(_selected_values(lg, idx[:want.shape[0]], ends), _selected_values(lg, want, ends))


def _topk_count(p):
    return 0.0, float(p["batch"] * p["next_n"] * p["context"] * 4)


def _prefill_inputs(p, device):
    T = p["tokens"]
    g = torch.Generator(device=device).manual_seed(0)
    q, w = reference.indexer_q_quant_ref(torch.randn(T, H, D, device=device, generator=g).bfloat16(),
                                         torch.randn(T, H, device=device, generator=g),
                                         softmax_scale=_SOFTMAX, head_scale=_HEAD)
    kv, ks = INDEXER_K_FP8.pack(torch.randn(T, D, device=device, generator=g).bfloat16())
    starts = torch.zeros(T, dtype=torch.int32, device=device)
    ends = torch.arange(1, T + 1, dtype=torch.int32, device=device)  # causal: one prompt
    chunk = p["chunk"]
    return {"q": q, "w": w, "k": kv.view(torch.float8_e4m3fn), "k_scale": ks[:, 0].contiguous(),
            "ks": starts, "ke": ends, "topk": p["topk"], "chunk": chunk,
            "logits": torch.empty(chunk, T, dtype=torch.float32, device=device),
            "out": torch.empty(T, p["topk"], dtype=torch.int32, device=device)}


def _prefill_run(x):
    T = x["q"].shape[0]
    for r0 in range(0, T, x["chunk"]):
        r1 = min(T, r0 + x["chunk"])
        lg = mqa_logits(x["q"][r0:r1], x["w"][r0:r1], x["k"], x["k_scale"], x["ks"][r0:r1], x["ke"][r0:r1],
                        clean_logits=False, out=x["logits"][:r1 - r0])
        topk_per_row(lg, x["ke"][r0:r1], x["topk"], starts=x["ks"][r0:r1], out=x["out"][r0:r1])
    return x["out"]


def _prefill_error(x, idx):
    """The last CHECK_ROWS rows (the longest windows) against the oracle."""
    T = x["q"].shape[0]
    rows = slice(T - CHECK_ROWS, T)
    want_logits = reference.mqa_logits_ref(x["q"][rows], x["w"][rows], x["k"], x["k_scale"], x["ks"][rows],
                                           x["ke"][rows])
    want = reference.topk_per_row_ref(want_logits, x["ke"][rows], x["topk"])
    ends = x["ke"][rows]
    return rel_l2(_selected_values(want_logits, idx[rows], ends), _selected_values(want_logits, want, ends))


def _torch_prefill(x):
    T = x["q"].shape[0]
    k = x["k"].bfloat16()
    cols = torch.arange(T, device=k.device)
    step = max(1, (1 << 28) // (H * T))  # rows a step: the [rows, H, T] scores stay near 1.5 GB
    for r0 in range(0, T, step):
        r1 = min(T, r0 + step)
        s = torch.einsum("thd,sd->ths", x["q"][r0:r1].bfloat16(), k).float().relu_()
        lg = (s * x["w"][r0:r1, :, None]).sum(1) * x["k_scale"][None, :]
        lg.masked_fill_(cols[None, :] >= x["ke"][r0:r1, None], float("-inf"))
        x["out"][r0:r1] = torch.topk(lg, min(x["topk"], T), dim=-1).indices.to(torch.int32)[:, :x["topk"]]
    return x["out"]


def _prefill_count(p):
    T = p["tokens"]
    return 2.0 * H * D * T * (T + 1) / 2, float(T * INDEXER_K_FP8.bytes_per_token)


_DECODE = [dict(batch=b, context=c, next_n=1, topk=2048) for b in (1, 8, 64) for c in (4096, 16384, 65536)]
_DECODE += [dict(batch=32, context=16384, next_n=2, topk=2048)]
_DECODE_SMALL = [dict(batch=2, context=300, next_n=2, topk=64)]
_label = lambda p: f"B{p['batch']}-ctx{p['context']}-n{p['next_n']}-topk{p['topk']}"  # noqa: E731

register(Op(name="indexer_decode", shape_sets={"standard": _DECODE, "small": _DECODE_SMALL},
            build=_decode_inputs, run=_decode_run, torch_ref=_torch_decode, error=_decode_error,
            count=_decode_count, label=_label))
register(Op(name="indexer_paged_logits", shape_sets={"standard": _DECODE, "small": _DECODE_SMALL},
            build=_decode_inputs, run=_logits, torch_ref=_torch_decode_logits, error=_logits_error,
            count=_decode_count, label=_label))
register(Op(name="indexer_topk", shape_sets={"standard": _DECODE, "small": _DECODE_SMALL},
            build=_topk_build, run=lambda x: decode_topk(x["logits"], x["lens"], x["next_n"], x["topk"]),
            torch_ref=lambda x: torch.topk(x["logits"], min(x["topk"], x["max_len"]), dim=-1).indices,
            error=_topk_error_given, count=_topk_count, label=_label,
            interpreter_exact=lambda p: True))
register(Op(name="indexer_prefill",
            shape_sets={"standard": [dict(tokens=t, chunk=4096, topk=2048) for t in (4096, 16384, 65536)],
                        "small": [dict(tokens=48, chunk=20, topk=16)]},
            build=_prefill_inputs, run=_prefill_run, torch_ref=_torch_prefill, error=_prefill_error,
            count=_prefill_count, label=lambda p: f"T{p['tokens']}-chunk{p['chunk']}-topk{p['topk']}"))
