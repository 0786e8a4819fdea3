"""The sparse-attention step entry of tools/bench.py (issue 26): one DeepSeek-V3.2 layer's
decode attention as mla.sparse.indexer_step.SparseAttentionStep runs it, the indexer's top-k
(64 heads of 128 over the fp8 index cache, page 64) feeding sparse MLA over the fp8_ds_mla
cache.

    sparse_attention_step   B requests of `context` tokens, one query token each: the step's
                            plans built once (as an engine does per step, outside the timing),
                            then SparseAttentionStep.forward (paged indexer logits, top-k,
                            index conversion, sparse MLA decode, absorption and projection)

The torch reference is DeepGEMM-free: the indexer as tools/_bench_indexer.py's (pages gathered,
fp8 widened to bf16, bf16 matmul, ReLU, weighted head sum, torch.topk), then the selected rows
gathered and attended with bf16 matmuls (tools/_bench_mla.py's torch_sparse_attention).

The check: the top-k of the first rows against the oracle's (by the logits they select, 0 when
the sets agree up to ties; reported as `topk_error`) and the layer output of the first tokens
against the float64 oracle over the step's own selection; the larger of the two is the error.

Registers itself on import (tools/bench.py imports this module).
"""
from __future__ import annotations

import torch

from openmla.kernels import reference
from openmla.quant import FP8_DS_MLA
from openmla.quant.indexer_cache import INDEXER_K_FP8
from openmla.tools._bench_core import Op, register, rel_l2
from openmla.tools._bench_indexer import _topk_error, _torch_decode_logits
from openmla.tools._bench_mla import CHECK_TOKENS, torch_sparse_attention

H_INDEX, D_INDEX, PAGE = 64, 128, 64
_NOPE, _V = 128, 128


def _build(p, device):
    from openmla.mla.sparse.impl import SparseMLAImpl
    from openmla.mla.sparse.indexer_step import SparseAttentionStep, build_indexer_plan
    B, C, H = p["batch"], p["context"], p["heads"]
    pages = -(-C // PAGE)
    nb = B * pages + 1
    g = torch.Generator(device=device).manual_seed(0)
    cache = torch.empty(nb, PAGE, FP8_DS_MLA.row_width, dtype=torch.uint8, device=device)
    index_cache = torch.empty(nb, PAGE, INDEXER_K_FP8.bytes_per_token, dtype=torch.uint8, device=device)
    for b0 in range(0, nb, 1024):  # in pieces: bounded temporaries
        b1 = min(nb, b0 + 1024)
        cache[b0:b1] = FP8_DS_MLA.pack(torch.randn(b1 - b0, PAGE, 512, device=device, generator=g).bfloat16(),
                                       torch.randn(b1 - b0, PAGE, 64, device=device, generator=g).bfloat16())
        k = torch.randn((b1 - b0) * PAGE, D_INDEX, device=device, generator=g).bfloat16()
        INDEXER_K_FP8.write_ref(k, index_cache, torch.arange(b0 * PAGE, b1 * PAGE, device=device))
    table = torch.randperm(nb, device=device, generator=g)[:B * pages].view(B, pages).to(torch.int32)
    scale = 576 ** -0.5
    impl = SparseMLAImpl(H, scale, FP8_DS_MLA, max_model_len=C, qk_nope_head_dim=_NOPE, v_head_dim=_V)
    impl.load_kv_b_proj((torch.randn(H * (_NOPE + _V), 512, device=device, generator=g) * 512 ** -0.5).bfloat16())
    qsl = torch.arange(B + 1, device=device, dtype=torch.int32)
    seq_lens = torch.full((B,), C, device=device, dtype=torch.int32)
    slots = table[:, (C - 1) // PAGE] * PAGE + (C - 1) % PAGE  # each request's last token
    plan = impl.build_plan(qsl, seq_lens, table, slots, block_size=PAGE, query_lens_cpu=[1] * B,
                           seq_lens_cpu=[C] * B, max_query_len=1)
    iplan = build_indexer_plan(qsl, seq_lens, table, req_id_per_token=plan.req_id_per_token, max_context=C)
    q, w = reference.indexer_q_quant_ref(torch.randn(B, H_INDEX, D_INDEX, device=device, generator=g).bfloat16(),
                                         torch.randn(B, H_INDEX, device=device, generator=g),
                                         softmax_scale=D_INDEX ** -0.5, head_scale=H_INDEX ** -0.5)
    # keys as tools/_bench_indexer.py names them, so its torch logits and top-k check read them
    return {"step": SparseAttentionStep(impl, topk=p["topk"]), "impl": impl, "plan": plan,
            "iplan": iplan, "mla_cache": cache, "cache": index_cache, "table": table, "scale": scale,
            "q": q.view(B, 1, H_INDEX, D_INDEX), "w": w, "lens": seq_lens, "next_n": 1,
            "max_len": C, "topk": p["topk"],
            "selected": torch.empty(B, p["topk"], dtype=torch.int32, device=device),
            "q_nope": torch.randn(B, H, _NOPE, device=device, generator=g).bfloat16(),
            "q_pe": torch.randn(B, H, 64, device=device, generator=g).bfloat16()}


def _run(x):
    return x["step"].forward(x["q_nope"], x["q_pe"], x["mla_cache"], x["q"][:, 0], x["w"], x["cache"],
                             x["plan"], x["iplan"], topk_out=x["selected"])


def _torch(x):
    topk = torch.topk(_torch_decode_logits(x), min(x["topk"], x["max_len"]), dim=-1).indices
    bs = x["mla_cache"].shape[1]
    slots = x["table"].long().gather(1, topk // bs) * bs + topk % bs
    impl = x["impl"]
    q = torch.cat([torch.bmm(x["q_nope"].transpose(0, 1), impl.W_UK).transpose(0, 1), x["q_pe"]], -1)
    flat = x["mla_cache"].reshape(-1, x["mla_cache"].shape[-1])
    o = torch_sparse_attention(q, lambda idx: FP8_DS_MLA.unpack(flat[idx]).to(torch.bfloat16),
                               flat.shape[0], slots, x["scale"])
    return torch.bmm(o.transpose(0, 1), impl.W_UV).transpose(0, 1)


def _error(x, out):
    sel_err = _topk_error(x, x["selected"])
    x.setdefault("report", {})["topk_error"] = sel_err
    sl, impl = slice(0, CHECK_TOKENS), x["impl"]
    q = torch.cat([torch.einsum("thn,hnl->thl", x["q_nope"][sl].double(), impl.W_UK.double()),
                   x["q_pe"][sl].double()], -1)
    T = x["q_nope"][sl].shape[0]
    slots = reference.convert_req_index_ref(torch.arange(T, dtype=torch.int32, device=q.device), x["table"],
                                            x["selected"][sl], x["mla_cache"].shape[1])
    o_lat, _ = reference.sparse_mla_decode_ref(q, x["mla_cache"], slots, scale=x["scale"])
    attn_err = rel_l2(out[sl], torch.einsum("thl,hlv->thv", o_lat.double(), impl.W_UV.double()))
    return max(sel_err, attn_err)


def _count(p):
    B, C, H, k = p["batch"], p["context"], p["heads"], p["topk"]
    flops = 2.0 * B * H_INDEX * D_INDEX * C + 2.0 * B * H * k * (576 + 512) + 2.0 * B * H * 512 * (_NOPE + _V)
    nbytes = B * C * INDEX_BYTES + B * k * 656 + H * (_NOPE + _V) * 512 * 2
    return flops, float(nbytes)


INDEX_BYTES = INDEXER_K_FP8.bytes_per_token
_STEP = [dict(batch=b, context=c, heads=h, topk=2048) for b in (1, 8, 64) for c in (4096, 65536) for h in (16, 128)]
register(Op(
    name="sparse_attention_step",
    shape_sets={"standard": _STEP,
                "small": [dict(batch=2, context=96, heads=4, topk=32)]},
    build=_build, run=_run, torch_ref=_torch, error=_error, count=_count,
    label=lambda p: f"B{p['batch']}-ctx{p['context']}-H{p['heads']}-topk{p['topk']}",
))
