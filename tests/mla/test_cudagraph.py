"""CUDA graphs of both layers as the vLLM backends run them (DESIGN.md, Serving contract); GPU only.

Each backend's decode forward (OPENMLA_SPARSE: SparseMLAImpl.forward_mqa; OPENMLA_ATTN:
PagedAttentionImpl.forward, cache write included) is captured in a torch.cuda.CUDAGraph with the
plan its vLLM metadata builder makes: mla/vllm/common.py's sparse_mla_plan / attention_plan, the
functions the builders call, given CommonAttentionMetadata's fields over vLLM-style persistent
tensors (tests/helpers/vllm.EngineBuffers; vLLM itself is not installed on the GPU machines, and
tests/vllm/test_vllm_cudagraph.py runs the builders themselves on vLLM's metadata on the CPU).
The capture batch is vLLM's dummy decode batch. Each later step writes new queries, indices,
sequence lengths, block tables and slots into the same tensors (fewer requests padded to the
capture size as vLLM pads them; speculative 1 + k and variable-length decodes), rebuilds the plan
into the same buffers, replays, and compares with an eager call on the same inputs: bit for bit.
The plans are built and the eager calls run with CUDA's sync debug mode set to "error": a host
read of a device tensor fails the test.

Also a 61-layer decode step of SparseMLAImpl (fp8 cache, H = 16 and 128, batch 1, 32, 128: one
plan, 61 layers with their own caches): every layer's output eager against captured, bit for bit,
over two steps.
"""
import contextlib
import functools
from types import SimpleNamespace

import pytest
import torch

from openmla.mla.mha.impl import PagedAttentionImpl
from openmla.mla.sparse.impl import SparseMLAImpl
from openmla.mla.vllm.common import attention_plan, sparse_mla_plan
from openmla.quant.kv_cache import quantize_fp8_per_tensor
from tests.helpers import DEVICE, INT32_MAX, INT32_MIN, capture, random_paged_cache
from tests.helpers.sparse import N_NOPE, ROPE, SCALE, L, kv_b_proj_fp8
from tests.helpers.vllm import EngineBuffers

pytestmark = pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU: CUDA graph capture")

INVALID = torch.tensor([INT32_MIN, -123456, -1, INT32_MAX], dtype=torch.int32)
SPARSE_MAX_CTX, ATTN_MAX_CTX = 3000, 2000  # contexts are drawn below these


@contextlib.contextmanager
def no_host_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


class Requests:
    """A step's decode requests over a pool of num_blocks cache blocks: query lengths, contexts
    drawn up to max_ctx, each request's blocks a random set of the pool (block-table rows of M
    entries, unused entries -1), and the slots of its new tokens."""

    def __init__(self, qlens, max_ctx, M, bs, num_blocks, g):
        self.qlens, self.bs = qlens, bs
        n = len(qlens)
        self.ctx = [int(c) for c in torch.randint(1, max_ctx, (n,), generator=g)]
        self.seq = [c + q for c, q in zip(self.ctx, qlens)]
        perm = torch.randperm(num_blocks, generator=g)[:n * M].view(n, M).to(torch.int32)
        for r, s in enumerate(self.seq):
            perm[r, -(-s // bs):] = -1
        self.block_table = perm
        self.positions = [(r, self.ctx[r] + i) for r, q in enumerate(qlens) for i in range(q)]
        self.slots = torch.tensor([self.slot(r, p) for r, p in self.positions], dtype=torch.int64)

    def slot(self, r, p):
        return int(self.block_table[r, p // self.bs]) * self.bs + p % self.bs

    def all_slots(self):
        """(request, position, slot) of every token of every request, context and new."""
        rp = [(r, p) for r, s in enumerate(self.seq) for p in range(s)]
        return rp, torch.tensor([self.slot(r, p) for r, p in rp], dtype=torch.int64)

    def fill(self, bufs, q_len):
        n, real = len(self.qlens), sum(self.qlens)
        even = [real // n + (i < real % n) for i in range(n)]  # vLLM's host split (varlen)
        bufs.fill(self.qlens, self.seq, self.block_table, self.slots, max_query_len=q_len,
                  qlens_cpu=even)


def topk_positions(reqs, T, topk, g):
    """[T, topk] int32: for each real token, distinct causal positions of its request in random
    order with invalid values mixed in; padding rows hold stale positions."""
    out = torch.randint(-5, 4000, (T, topk), generator=g, dtype=torch.int32)
    for t, (_, p) in enumerate(reqs.positions):
        n_ok = min(p + 1, topk - 4)
        pos = torch.randperm(p + 1, generator=g)[:n_ok].to(torch.int32)
        bad = INVALID[torch.randint(0, len(INVALID), (topk - n_ok,), generator=g)]
        out[t] = torch.cat([pos, bad])[torch.randperm(topk, generator=g)]
    return out


# ----------------------------------------------------------------------------------------------
# OPENMLA_SPARSE: forward_mqa in a graph, with the builder's plan.
# ----------------------------------------------------------------------------------------------
SPARSE_CASES = [  # kv_cache_dtype, H, q_len (1 + spec tokens), capture T, topk, each step's query lens
    pytest.param("fp8_ds_mla", 16, 1, 32, 2048, [[1] * 32, [1] * 19, [1] * 3], id="fp8-H16-decode-T32"),
    pytest.param("fp8_ds_mla", 128, 1, 32, 2048, [[1] * 32, [1] * 7, [1]], id="fp8-H128-separate-T32"),
    pytest.param("bf16", 64, 1, 16, 512, [[1] * 16, [1] * 9], id="bf16-H64-T16"),
    pytest.param("fp8_ds_mla", 32, 3, 48, 2048, [[3] * 16, [3] * 5, [3, 1, 2, 3, 1]],
                 id="fp8-H32-spec2-T48-varlen"),
]


@pytest.mark.parametrize("kv,H,q_len,T,topk,steps", SPARSE_CASES)
def test_sparse_forward_mqa_graph_replays(kv, H, q_len, T, topk, steps):
    g = torch.Generator().manual_seed(H + T)
    bs, max_ctx = 64, SPARSE_MAX_CTX
    R = T // q_len
    M = -(-(max_ctx + q_len) // bs)
    impl = SparseMLAImpl(H, SCALE, kv, max_model_len=M * bs)
    fmt = impl.cache_format
    num_blocks = R * M + 8
    cache, _ = random_paged_cache(num_blocks, bs, fmt.row_width, fmt.cache_dtype)
    bufs = EngineBuffers(T, R, M + 3, DEVICE)
    req_ids = torch.empty(2 * T, dtype=torch.int32, device=DEVICE)  # the builder's buffer
    q = torch.empty(T, H, 576, dtype=torch.bfloat16, device=DEVICE)
    topk_buf = torch.empty(T, topk, dtype=torch.int32, device=DEVICE)

    def plan():
        return sparse_mla_plan(SimpleNamespace(**bufs.metadata()), block_size=bs, num_heads=H,
                               cache_format=fmt, max_model_len=M * bs, decode_threshold=q_len,
                               req_id_out=req_ids)

    bufs.capture_batch(q_len)
    q.copy_(torch.randn(T, H, 576, generator=g))
    topk_buf.random_(-5, 200)
    captured = plan()
    graph, static_out = capture(lambda: impl.forward_mqa(q, cache, topk_buf, captured))

    for qlens in steps:
        reqs = Requests(qlens, max_ctx, M, bs, num_blocks, g)
        _, slots = reqs.all_slots()
        impl.write_cache(torch.randn(len(slots), L, generator=g).to(torch.bfloat16).to(DEVICE),
                         torch.randn(len(slots), ROPE, generator=g).to(torch.bfloat16).to(DEVICE),
                         cache, slots.to(DEVICE))
        reqs.fill(bufs, q_len)
        q.copy_(torch.randn(T, H, 576, generator=g))
        topk_buf.copy_(topk_positions(reqs, T, topk, g))
        with no_host_sync():
            p = plan()
            want = impl.forward_mqa(q, cache, topk_buf, p)
        assert p.req_id_per_token.data_ptr() == captured.req_id_per_token.data_ptr()
        graph.replay()
        torch.cuda.synchronize()
        real = sum(qlens)
        assert torch.equal(static_out, want), f"step {qlens}: replay differs from eager"
        assert torch.count_nonzero(want[real:]) == 0
        assert bool(torch.isfinite(want).all()) and torch.count_nonzero(want[:real]) > 0


# ----------------------------------------------------------------------------------------------
# OPENMLA_ATTN: forward (cache write, then attention) in a graph, with the builder's plan.
# ----------------------------------------------------------------------------------------------
ATTN_CASES = [  # kv_cache_dtype, H, H_kv, D, block_size, q_len, capture T, layer options, each step's query lens
    pytest.param("auto", 32, 8, 128, 16, 1, 64, {}, [[1] * 64, [1] * 41, [1] * 2], id="bf16-GQA4-D128-T64"),
    pytest.param("fp8", 32, 8, 128, 16, 3, 48, {}, [[3] * 16, [3] * 5, [3, 1, 2, 2]],
                 id="fp8-spec2-T48-varlen"),
    pytest.param("auto", 16, 2, 64, 32, 1, 32, dict(sliding_window=300, softcap=30.0, sinks=True),
                 [[1] * 32, [1] * 11], id="bf16-window-softcap-sinks-T32"),
]


@pytest.mark.parametrize("kv,H,H_kv,D,bs,q_len,T,opts,steps", ATTN_CASES)
def test_attention_forward_graph_replays(kv, H, H_kv, D, bs, q_len, T, opts, steps):
    g = torch.Generator().manual_seed(H + D + T)
    max_ctx = ATTN_MAX_CTX
    R = T // q_len
    M = -(-(max_ctx + q_len) // bs)
    fp8 = kv == "fp8"
    sinks = (torch.randn(H, generator=g) * 2).to(DEVICE) if opts.get("sinks") else None
    impl = PagedAttentionImpl(H, D, 0.9 / D ** 0.5, H_kv, sliding_window=opts.get("sliding_window"),
                              softcap=opts.get("softcap"), sinks=sinks, kv_cache_dtype=kv)
    scales = (0.027, 0.019)
    if fp8:
        impl.set_kv_scales(*scales)
    num_blocks = R * M + 8
    cdt = torch.float8_e4m3fn if fp8 else torch.bfloat16
    kv_cache = torch.full((2, num_blocks, bs, H_kv, D), float("nan"), device=DEVICE).to(cdt)
    bufs = EngineBuffers(T, R, M + 3, DEVICE)
    query = torch.empty(T, H, D, dtype=torch.bfloat16, device=DEVICE)
    key = torch.empty(T, H_kv, D, dtype=torch.bfloat16, device=DEVICE)
    value = torch.empty_like(key)
    out = torch.empty(T, H, D, dtype=torch.bfloat16, device=DEVICE)

    def plan():
        return attention_plan(SimpleNamespace(**bufs.metadata()), block_size=bs, num_heads=H,
                              num_kv_heads=H_kv, decode_threshold=q_len)

    bufs.capture_batch(q_len)
    for t in (query, key, value):
        t.copy_(torch.randn(t.shape, generator=g))
    captured = plan()
    graph, static_out = capture(lambda: impl.forward(query, key, value, kv_cache, captured, out))

    for qlens in steps:
        reqs = Requests(qlens, max_ctx, M, bs, num_blocks, g)
        rp, slots = reqs.all_slots()
        ctx = torch.tensor([p < reqs.ctx[r] for r, p in rp])
        kv_new = torch.randn(2, len(rp), H_kv, D, generator=g)
        for i in range(2):  # the contexts, as an earlier step left them (fp8 rows as bytes)
            rows = quantize_fp8_per_tensor(kv_new[i][ctx], scales[i]) if fp8 else kv_new[i][ctx].to(cdt)
            flat = kv_cache[i].view(-1, H_kv, D)
            if fp8:
                flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
            flat[slots[ctx].to(DEVICE)] = rows.to(DEVICE)
        reqs.fill(bufs, q_len)
        real = sum(qlens)
        query.copy_(torch.randn(T, H, D, generator=g))
        key.copy_(torch.randn(T, H_kv, D, generator=g))
        value.copy_(torch.randn(T, H_kv, D, generator=g))
        key[:real], value[:real] = kv_new[0][~ctx].to(DEVICE), kv_new[1][~ctx].to(DEVICE)
        with no_host_sync():
            p = plan()
            want = impl.forward(query, key, value, kv_cache, p, torch.empty_like(out))
        graph.replay()  # writes the same new keys and values again, then attends
        torch.cuda.synchronize()
        assert torch.equal(static_out, want), f"step {qlens}: replay differs from eager"
        assert torch.count_nonzero(want[real:]) == 0
        assert bool(torch.isfinite(want).all()) and torch.count_nonzero(want[:real]) > 0


# ----------------------------------------------------------------------------------------------
# A 61-layer decode step of SparseMLAImpl: eager against captured.
# ----------------------------------------------------------------------------------------------
NUM_LAYERS = 61
STEP_TOPK, STEP_SEQ, STEP_BS = 2048, 2304, 64


@functools.lru_cache(maxsize=1)
def layer_caches(B):
    """61 fp8_ds_mla caches of B requests x STEP_SEQ tokens (blocks permuted per layer)."""
    g = torch.Generator(device=DEVICE).manual_seed(B)
    per_req = STEP_SEQ // STEP_BS
    nb = B * per_req + 4
    fmt = SparseMLAImpl(1, SCALE, "fp8_ds_mla", max_model_len=STEP_SEQ).cache_format
    base = fmt.pack(torch.randn(nb, STEP_BS, L, device=DEVICE, generator=g).to(torch.bfloat16),
                    torch.randn(nb, STEP_BS, ROPE, device=DEVICE, generator=g).to(torch.bfloat16))
    return [base.roll(layer * 7, dims=0).contiguous() for layer in range(NUM_LAYERS)]


@pytest.mark.parametrize("B,H", [pytest.param(b, h, id=f"B{b}-H{h}") for b in (1, 32, 128) for h in (16, 128)])
def test_61_layer_sparse_step_eager_vs_captured(B, H):
    g = torch.Generator().manual_seed(B * 1000 + H)
    w8, s = kv_b_proj_fp8(H, g)
    first = SparseMLAImpl(H, SCALE, "fp8_ds_mla", max_model_len=STEP_SEQ + 2)
    first.load_kv_b_proj(w8.to(DEVICE), s.to(DEVICE))
    layers = [first]
    for _ in range(NUM_LAYERS - 1):  # own layers, one weight (the step's work is the same)
        impl = SparseMLAImpl(H, SCALE, "fp8_ds_mla", max_model_len=STEP_SEQ + 2)
        impl.W_UK, impl.W_UV = first.W_UK, first.W_UV
        layers.append(impl)
    caches = layer_caches(B)
    per_req = STEP_SEQ // STEP_BS
    qsl = torch.arange(B + 1, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.empty(B, dtype=torch.int32, device=DEVICE)
    block_table = torch.empty(B, per_req, dtype=torch.int32, device=DEVICE)
    slots = torch.empty(B, dtype=torch.int64, device=DEVICE)
    req_ids = torch.empty(B, dtype=torch.int32, device=DEVICE)
    q_nope = torch.empty(B, H, N_NOPE, dtype=torch.bfloat16, device=DEVICE)
    q_pe = torch.empty(B, H, ROPE, dtype=torch.bfloat16, device=DEVICE)
    topk = torch.empty(B, STEP_TOPK, dtype=torch.int32, device=DEVICE)

    def new_step(seq):
        seq_lens.fill_(seq)
        block_table.copy_(torch.randperm(B * per_req, generator=g).view(B, per_req))
        slots.copy_(block_table[:, (seq - 1) // STEP_BS].long() * STEP_BS + (seq - 1) % STEP_BS)
        q_nope.copy_(torch.randn(B, H, N_NOPE, generator=g))
        q_pe.copy_(torch.randn(B, H, ROPE, generator=g))
        topk.copy_(torch.rand(B, seq, generator=g).topk(STEP_TOPK, dim=-1).indices)
        return seq

    def step(seq):
        plan = first.build_plan(qsl, seq_lens, block_table, slots, block_size=STEP_BS,
                                query_lens_cpu=[1] * B, seq_lens_cpu=[seq] * B, max_query_len=1,
                                req_id_out=req_ids)
        return [impl.forward(q_nope, q_pe, cache, topk, plan) for impl, cache in zip(layers, caches)]

    seq = new_step(STEP_SEQ - 1)
    graph, static_outs = capture(lambda: step(seq))  # the plan is rebuilt inside: capturable
    for seq in (STEP_SEQ - 1, STEP_SEQ):
        new_step(seq)
        with no_host_sync():
            want = step(seq)
        graph.replay()
        torch.cuda.synchronize()
        for layer, (got, w) in enumerate(zip(static_outs, want)):
            assert torch.equal(got, w), f"layer {layer}, seq {seq}: replay differs from eager"
        assert bool(torch.isfinite(want[-1]).all()) and torch.count_nonzero(want[-1]) > 0
