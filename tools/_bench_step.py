"""The decode-step entry of tools/bench.py: sparse_mla_step, a whole decode step of SparseMLAImpl
over DeepSeek-V3.2's 61 layers (fp8_ds_mla caches), as an engine runs its attention: the step's
plan built once, then every layer's forward (absorb q, convert the per-request indices, decode,
project out).

Each layer has its own weights and its own cache (the same random contents, blocks rotated per
layer), T requests of slots // T tokens each, one query token each, topk random positions of its
request per token. bench.py times the step as every op: `ms`, the step captured in one CUDA graph
and replayed (the step's kernels back to back), `eager ms`, the wall time of eager steps, and
`captured ms` (Op.captured): the wall time of a step as vLLM runs a FULL graph, the plan built
eagerly into the persistent request-id buffer, then the replay of a graph captured once.

Registers itself on import (tools/bench.py imports this module).
"""
from __future__ import annotations

import torch

from openmla.kernels import reference
from openmla.quant import FP8_DS_MLA
from openmla.tools._bench_core import Op, register, rel_l2
from openmla.tools._bench_mla import CHECK_TOKENS, random_topk_indices, torch_sparse_attention

_NOPE, _V = 128, 128  # DeepSeek's qk_nope_head_dim and v_head_dim
LAYERS = 61  # DeepSeek-V3.2


def _build(p, device):
    from openmla.mla.sparse.impl import SparseMLAImpl
    T, H, slots, bs, n_layers = p["tokens"], p["heads"], p["slots"], p["block_size"], p["layers"]
    seq = slots // T
    per_req = -(-seq // bs)
    nb = slots // bs
    if T * per_req > nb:
        raise ValueError(f"sparse_mla_step: {T} requests of {seq} tokens do not fit {slots} slots")
    g = torch.Generator(device=device).manual_seed(0)
    base = torch.empty(nb, bs, FP8_DS_MLA.row_width, dtype=torch.uint8, device=device)
    for b0 in range(0, nb, 1024):  # pack in pieces to bound temporary memory
        b1 = min(nb, b0 + 1024)
        base[b0:b1] = FP8_DS_MLA.pack(torch.randn(b1 - b0, bs, 512, device=device, generator=g).bfloat16(),
                                      torch.randn(b1 - b0, bs, 64, device=device, generator=g).bfloat16())
    caches = [base] + [base.roll(7 * i, dims=0) for i in range(1, n_layers)]
    scale = 576 ** -0.5
    layers = []
    for _ in range(n_layers):
        impl = SparseMLAImpl(H, scale, FP8_DS_MLA, max_model_len=seq, qk_nope_head_dim=_NOPE, v_head_dim=_V)
        impl.load_kv_b_proj((torch.randn(H * (_NOPE + _V), 512, device=device, generator=g) * 512 ** -0.5).bfloat16())
        layers.append(impl)
    table = torch.randperm(nb, device=device, generator=g)[:T * per_req].view(T, per_req).to(torch.int32)
    last = seq - 1  # this step's token of each request is its last
    return {"layers": layers, "caches": caches, "scale": scale, "table": table, "seq": seq,
            "qsl": torch.arange(T + 1, device=device, dtype=torch.int32),
            "seq_lens": torch.full((T,), seq, device=device, dtype=torch.int32),
            "slots": table[:, last // bs] * bs + last % bs,
            "req_id": torch.arange(T, device=device, dtype=torch.int32),
            "req_id_buffer": torch.empty(T, device=device, dtype=torch.int32),
            "positions": random_topk_indices(T, seq, p["topk"], device),  # within each request
            "q_nope": torch.randn(T, H, _NOPE, device=device, generator=g).bfloat16(),
            "q_pe": torch.randn(T, H, 64, device=device, generator=g).bfloat16()}


def _plan(x, req_id_out=None):
    T = x["qsl"].shape[0] - 1
    return x["layers"][0].build_plan(x["qsl"], x["seq_lens"], x["table"], x["slots"],
                                     block_size=x["caches"][0].shape[1], query_lens_cpu=[1] * T,
                                     seq_lens_cpu=[x["seq"]] * T, max_query_len=1,
                                     req_id_out=req_id_out)


def _layers(x, plan):
    out = None
    for impl, cache in zip(x["layers"], x["caches"]):
        out = impl.forward(x["q_nope"], x["q_pe"], cache, x["positions"], plan)
    return out  # the last layer's: the one checked


def _run(x):
    return _layers(x, _plan(x))


def _captured(x):
    """A step as vLLM runs a FULL graph: the plan rebuilt eagerly into the persistent buffer the
    graph reads (the step's host work), then the replay."""
    plan = _plan(x, x["req_id_buffer"])
    _layers(x, plan)  # compile and allocate outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _layers(x, plan)

    def step():
        _plan(x, x["req_id_buffer"])
        graph.replay()
    return step


def _torch(x):
    """Every layer in torch: bf16 absorption, gather + matmul attention, bf16 projection."""
    bs = x["caches"][0].shape[1]
    pos = x["positions"].long()
    slots = x["table"].long().gather(1, pos // bs) * bs + pos % bs  # token t is request t's query
    out = None
    for impl, cache in zip(x["layers"], x["caches"]):
        q = torch.cat([torch.bmm(x["q_nope"].transpose(0, 1), impl.W_UK).transpose(0, 1), x["q_pe"]], -1)
        flat = cache.reshape(-1, cache.shape[-1])
        o = torch_sparse_attention(q, lambda idx: FP8_DS_MLA.unpack(flat[idx]).to(torch.bfloat16),
                                   flat.shape[0], slots, x["scale"])
        out = torch.bmm(o.transpose(0, 1), impl.W_UV).transpose(0, 1)
    return out


def _error(x, out):
    """The last layer on CHECK_TOKENS tokens against the float64 oracle."""
    sl = slice(0, CHECK_TOKENS)
    impl, cache = x["layers"][-1], x["caches"][-1]
    q = torch.cat([torch.einsum("thn,hnl->thl", x["q_nope"][sl].double(), impl.W_UK.double()),
                   x["q_pe"][sl].double()], -1)
    slots = reference.convert_req_index_ref(x["req_id"][sl], x["table"], x["positions"][sl], cache.shape[1])
    o_lat, _ = reference.sparse_mla_decode_ref(q, cache, slots, scale=x["scale"])
    return rel_l2(out[sl], torch.einsum("thl,hlv->thv", o_lat.double(), impl.W_UV.double()))


def _count(p):
    t, h, k, n = p["tokens"], p["heads"], p["topk"], p["layers"]
    flops = 2.0 * t * h * k * (576 + 512) + 2.0 * t * h * 512 * (_NOPE + _V)
    nbytes = t * k * 656 + h * (_NOPE + _V) * 512 * 2  # gathered rows, W_UK and W_UV
    return n * flops, float(n * nbytes)


_STEP = [dict(tokens=t, heads=h, topk=2048, slots=262144, block_size=64, layers=LAYERS)
         for t in (1, 32, 128) for h in (16, 128)]
register(Op(
    name="sparse_mla_step",
    shape_sets={"standard": _STEP, "host": _STEP,
                "small": [dict(tokens=2, heads=16, topk=64, slots=512, block_size=64, layers=2)]},
    build=_build, run=_run, torch_ref=_torch, error=_error, count=_count,
    label=lambda p: f"fp8-T{p['tokens']}-H{p['heads']}-topk{p['topk']}-L{p['layers']}",
    captured=_captured,
))
