"""mla/sparse/impl.py: SparseMLAImpl end to end against a float64 *unabsorbed* MLA layer.

The layer test builds one engine step the way vLLM would: requests ordered decodes first
(1-token decodes, 3-token speculative decodes, decode_threshold 3), then prefills with context,
then padding tokens; the context was written by an earlier `write_cache`, the step's new tokens
by this step's. The cache is a NaN-filled strided view with a shuffled block table (-1 past each
request's blocks); the indices mix causal positions with every invalid kind and include empty
rows; q_nope/q_pe are non-contiguous slices; kv_b_proj is DeepSeek's fp8 with 128x128 block
scales; the softmax scale is not (n + r)^-0.5.

The reference expands every cached latent per head through the dequantized kv_b_proj
(k_nope = W_UK c, v = W_UV^T c), softmaxes over the selected tokens only and runs in float64
(mla.absorb.attention_unabsorbed). It is fed the formats' round trips, so format error is not
mistaken for layer error: the cache's (fmt.unpack(fmt.pack(...))) and the weights' (the layer
keeps W_UK/W_UV in bf16). What is left is the bf16 chain of the absorbed form (q_lat, the latent
output and the output are bf16), inside the "bf16" tolerance.
"""
import pytest
import torch

from openmla.kernels.merge_project import fuses
from openmla.mla.absorb import attention_unabsorbed
from openmla.mla.sparse.impl import SparseMLAImpl
from tests.helpers import DEVICE, assert_close, random_paged_cache, shuffled_block_table
from tests.helpers.sparse import (
    EMPTY_ROWS, INVALID, MIXED_BATCH, N_NOPE, ROPE, SCALE, V_DIM, L, Step, kv_b_proj_fp8,
    reference_weight,
)


# ----------------------------------------------------------------------------------------------
# The layer on a mixed batch: every cache format and path.
# ----------------------------------------------------------------------------------------------
LAYER_CASES = [  # kv_cache_dtype, fp8_path, H, block_size, workspace_rows, topk
    pytest.param("bf16", None, 4, 16, None, 40, id="bf16-H4-bs16-topk40"),
    pytest.param("auto", None, 3, 7, None, 64, id="bf16auto-H3-bs7-topk64"),
    pytest.param("fp8_ds_mla", "mixed", 8, 7, None, 40, id="fp8-mixed-H8-bs7-topk40"),
    pytest.param("fp8_ds_mla", "separate", 8, 16, 30, 40, id="fp8-separate-H8-bs16-ws30-topk40"),
    pytest.param("fp8_ds_mla", "separate", 16, 7, 30, 33, id="fp8-separate-H16-bs7-ws30-topk33"),
]


@pytest.mark.parametrize("kv,fp8_path,H,bs,ws,topk", LAYER_CASES)
def test_layer_mixed_batch(kv, fp8_path, H, bs, ws, topk):
    g = torch.Generator().manual_seed(H * 1000 + bs)
    w8, s = kv_b_proj_fp8(H, g)
    impl = SparseMLAImpl(H, SCALE, kv, max_model_len=64, fp8_path=fp8_path, workspace_rows=ws)
    impl.load_kv_b_proj(w8.to(DEVICE), s.to(DEVICE))
    step = Step(impl, MIXED_BATCH, block_size=bs, topk=topk, padding=2, seed=H + bs, empty_rows=EMPTY_ROWS)
    plan = step.plan(impl, threshold=3)
    assert plan.path == (fp8_path or "bf16")
    if fp8_path == "separate":
        # prefill seq_lens 16, 9, 30, 12 over 30 rows: [16, 9] | [30] | [12]
        assert [(c.req_start, c.req_end) for c in plan.prefill_chunks] == [(4, 6), (6, 7), (7, 8)]
        assert (plan.num_decode_tokens, plan.num_prefill_tokens, plan.num_padding_tokens) == (8, 30, 2)
    out = impl.forward(step.q_nope, step.q_pe, step.cache, step.topk_indices, plan)
    assert out.shape == (step.T, H, V_DIM) and out.dtype == torch.bfloat16
    want = step.reference(reference_weight(w8, s), H)
    assert_close("out", out, want, "bf16")
    assert torch.count_nonzero(out[-2:]) == 0  # padding
    if fp8_path == "separate":  # the workspace is allocated once and reused by the next step
        ws_ptr = impl._workspace.data_ptr()
        again = torch.empty_like(out)
        impl.forward(step.q_nope, step.q_pe, step.cache, step.topk_indices, plan, out=again)
        assert impl._workspace.data_ptr() == ws_ptr
        assert torch.equal(again, out)


# ----------------------------------------------------------------------------------------------
# load_kv_b_proj
# ----------------------------------------------------------------------------------------------
def test_load_kv_b_proj_fp8_block_scales():
    """Ragged 128x128 blocks (n=96, v=64: 320 rows), a different scale per block: W_UK/W_UV are
    bf16 of the exact per-block dequantization, sliced per head by a loop."""
    H, n, v = 2, 96, 64
    g = torch.Generator().manual_seed(3)
    w8 = (torch.randn(H * (n + v), L, generator=g) * 100).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 4, generator=g) * 2.0 ** torch.randint(-12, 0, (3, 4), generator=g)
    impl = SparseMLAImpl(H, SCALE, "fp8_ds_mla", qk_nope_head_dim=n, v_head_dim=v, max_model_len=64)
    impl.load_kv_b_proj(w8.to(DEVICE), scale.to(DEVICE))
    deq = torch.empty(H * (n + v), L, dtype=torch.float64)
    for i in range(3):
        for j in range(4):
            deq[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = \
                w8[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].double() * scale[i, j].double()
    for h in range(H):
        rows = deq[h * (n + v):(h + 1) * (n + v)]
        assert_close(f"W_UK[{h}]", impl.W_UK[h], rows[:n].float().to(torch.bfloat16), "exact")
        assert_close(f"W_UV[{h}]", impl.W_UV[h], rows[n:].T.float().to(torch.bfloat16), "exact")
    assert impl.W_UK.dtype == impl.W_UV.dtype == torch.bfloat16
    assert impl.W_UK.shape == (H, n, L) and impl.W_UV.shape == (H, L, v)


def test_load_kv_b_proj_bf16():
    H = 3
    w = torch.randn(H * (N_NOPE + V_DIM), L, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    impl = SparseMLAImpl(H, SCALE, "bf16", max_model_len=64)
    impl.load_kv_b_proj(w.to(DEVICE))
    per_head = w.view(H, N_NOPE + V_DIM, L)
    assert torch.equal(impl.W_UK.cpu(), per_head[:, :N_NOPE])
    assert torch.equal(impl.W_UV.cpu(), per_head[:, N_NOPE:].transpose(1, 2))


_W8 = torch.zeros(2 * 256, L, dtype=torch.float8_e4m3fn)
_S = torch.ones(4, 4)


@pytest.mark.parametrize("weight,scale,match", [
    pytest.param(torch.zeros(3 * 256, L), None, r"kv_b_proj.weight.shape: expected \(512, 512\)", id="rows-for-H3"),
    pytest.param(torch.zeros(512, 256), None, r"kv_b_proj.weight.shape: expected \(512, 512\)", id="cols-256"),
    pytest.param(torch.zeros(512 * L), None, r"kv_b_proj.weight.dim\(\): expected 2", id="1d"),
    pytest.param(_W8, None, "weight_scale_inv: expected a block scale tensor", id="fp8-no-scale"),
    pytest.param(_W8, torch.ones(4, 3), r"weight_scale_inv.shape: expected \(4, 4\)", id="fp8-scale-shape"),
    pytest.param(torch.zeros(512, L, dtype=torch.bfloat16), _S, "weight_scale_inv: expected None", id="bf16-with-scale"),
    pytest.param(torch.zeros(512, L, dtype=torch.int8), None, "weight.dtype", id="int8"),
])
def test_load_kv_b_proj_errors(weight, scale, match):
    impl = SparseMLAImpl(2, SCALE, "fp8_ds_mla", max_model_len=64)
    with pytest.raises(ValueError, match=match):
        impl.load_kv_b_proj(weight.to(DEVICE), None if scale is None else scale.to(DEVICE))


# ----------------------------------------------------------------------------------------------
# Unsupported combinations and misuse
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,kwargs,exc,match", [
    pytest.param((8, SCALE, "fp8_e4m3"), {}, NotImplementedError, "kv_cache_dtype 'fp8_e4m3'", id="kv-fp8-e4m3"),
    pytest.param((8, SCALE, "int8"), {}, NotImplementedError, "kv_cache_dtype 'int8'", id="kv-int8"),
    pytest.param((8, SCALE, "bf16"), dict(kv_lora_rank=256), NotImplementedError, "kv_lora_rank=256", id="lora256"),
    pytest.param((8, SCALE, "bf16"), dict(qk_rope_head_dim=32), NotImplementedError, "qk_rope_head_dim=32", id="rope32"),
    pytest.param((129, SCALE, "bf16"), {}, NotImplementedError, "num_heads=129", id="H129"),
    pytest.param((0, SCALE, "bf16"), {}, ValueError, "num_heads: expected a positive int", id="H0"),
    pytest.param((8, float("nan"), "bf16"), {}, ValueError, "scale: expected a finite positive", id="scale-nan"),
    pytest.param((8, 0.0, "bf16"), {}, ValueError, "scale: expected a finite positive", id="scale-0"),
    pytest.param((8, SCALE, "bf16"), dict(fp8_path="mixed"), ValueError, "fp8_path: expected None", id="fp8path-bf16"),
    pytest.param((8, SCALE, "bf16"), dict(v_head_dim=0), ValueError, "v_head_dim: expected a positive int", id="v0"),
])
def test_constructor_errors(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        SparseMLAImpl(*args, max_model_len=64, **kwargs)


def _small_step(kv, H=4, fp8_path=None):
    impl = SparseMLAImpl(H, SCALE, kv, max_model_len=64, fp8_path=fp8_path)
    w8, s = kv_b_proj_fp8(H, torch.Generator().manual_seed(1))
    impl.load_kv_b_proj(w8.to(DEVICE), s.to(DEVICE))
    step = Step(impl, [(5, 1), (3, 1)], block_size=16, topk=4, padding=0, seed=2)
    return impl, step


def test_misuse_raises():
    impl, step = _small_step("fp8_ds_mla")
    plan = step.plan(impl, threshold=1)
    args = (step.q_nope, step.q_pe, step.cache, step.topk_indices)
    # a plan built for a bf16 cache, or for another batch, is refused before any kernel runs
    bf16_impl, bf16_step = _small_step("bf16")
    with pytest.raises(ValueError, match="plan.cache_format: expected 'fp8_ds_mla'"):
        impl.forward(*args, bf16_step.plan(bf16_impl, threshold=1))
    other, _ = _small_step("fp8_ds_mla")
    other_step = Step(other, [(5, 1), (3, 1), (2, 1)], block_size=16, topk=4, padding=0, seed=3)
    with pytest.raises(ValueError, match=r"q_nope.shape: expected \(3, 4, 128\), got \(2, 4, 128\)"):
        impl.forward(*args, other_step.plan(other, threshold=1))
    with pytest.raises(ValueError, match=r"cache: expected \[num_blocks, block_size, 656\] torch.uint8"):
        impl.forward(step.q_nope, step.q_pe, bf16_step.cache, step.topk_indices, plan)
    with pytest.raises(ValueError, match=r"cache: expected \[num_blocks, block_size, 656\]"):
        impl.write_cache(torch.zeros(1, L, dtype=torch.bfloat16, device=DEVICE),
                         torch.zeros(1, ROPE, dtype=torch.bfloat16, device=DEVICE), bf16_step.cache,
                         torch.zeros(1, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="q_pe.dtype"):
        impl.forward(step.q_nope, step.q_pe.half(), step.cache, step.topk_indices, plan)
    with pytest.raises(ValueError, match=r"q_nope.shape: expected \(2, 4, 128\)"):
        impl.forward(step.q_nope[:, :3], step.q_pe, step.cache, step.topk_indices, plan)
    fresh = SparseMLAImpl(4, SCALE, "fp8_ds_mla", max_model_len=64)
    with pytest.raises(RuntimeError, match="load_kv_b_proj"):
        fresh.forward(*args, plan)


# ----------------------------------------------------------------------------------------------
# Decode-only steps: one plan, reused over later steps while the engine updates its tensors in
# place (seq_lens grow, blocks move); on a GPU the step is captured in a CUDA graph and replayed.
# ----------------------------------------------------------------------------------------------
def run_decode_steps(kv, fp8_path, H, qlen, *, capture, R, M, bs, topk, ctx_range, seed):
    """Plan and run one decode-only step, then three later steps with new q, new tokens (written
    by the step's own write_cache), new indices, seq_lens grown in place and, before the second,
    the blocks moved (cache permuted, block table rewritten in place). With capture, plan and
    first step run in sync debug mode "error" (a host sync raises), the step is captured in a
    CUDA graph and the later steps are replays; without, the same plan is passed again. Every
    step is compared with the float64 unabsorbed reference."""
    device = DEVICE
    g = torch.Generator().manual_seed(seed)
    w8, s = kv_b_proj_fp8(H, g)
    w_ref = reference_weight(w8, s).double()
    impl = SparseMLAImpl(H, SCALE, kv, max_model_len=bs * M, fp8_path=fp8_path)
    impl.load_kv_b_proj(w8.to(device), s.to(device))
    fmt = impl.cache_format
    num_blocks = R * M + 4
    cache, backing = random_paged_cache(num_blocks, bs, fmt.row_width, fmt.cache_dtype, device=device)
    bt_cpu = shuffled_block_table(R, M, num_blocks, generator=g, device="cpu")
    block_table = bt_cpu.to(device)
    seq = [int(x) for x in torch.randint(ctx_range[0], ctx_range[1], (R,), generator=g)]
    assert max(seq) + 4 * qlen <= bs * M
    lat = torch.randn(R, bs * M, L, generator=g).to(torch.bfloat16)
    pe = torch.randn(R, bs * M, ROPE, generator=g).to(torch.bfloat16)
    ref_rows = fmt.unpack(fmt.pack(lat, pe)).view(R * bs * M, L + ROPE).double()  # row r*bs*M + p

    def slots(bt, positions):
        return torch.tensor([int(bt[r, p // bs]) * bs + p % bs for r, p in positions], dtype=torch.int32)

    def rows(positions):
        return [r for r, _ in positions], [p for _, p in positions]

    ctx = [(r, p) for r in range(R) for p in range(seq[r])]
    impl.write_cache(lat[rows(ctx)].to(device), pe[rows(ctx)].to(device), cache, slots(bt_cpu, ctx).to(device))

    T = R * qlen
    st = dict(q=torch.empty(T, H, N_NOPE + ROPE, dtype=torch.bfloat16, device=device),
              kv_c=torch.empty(T, L, dtype=torch.bfloat16, device=device),
              k_pe=torch.empty(T, ROPE, dtype=torch.bfloat16, device=device),
              slot_mapping=torch.empty(T, dtype=torch.int32, device=device),
              idx=torch.empty(T, topk, dtype=torch.int32, device=device),
              seq_lens=torch.tensor([x + qlen for x in seq], dtype=torch.int32, device=device))
    qsl = torch.arange(0, T + 1, qlen, dtype=torch.int32, device=device)

    def fill_step():
        """This step's new tokens and queries into the static buffers; the reference indices."""
        toks = [(r, seq[r] + i) for r in range(R) for i in range(qlen)]
        st["kv_c"].copy_(lat[rows(toks)])
        st["k_pe"].copy_(pe[rows(toks)])
        st["slot_mapping"].copy_(slots(bt_cpu, toks))
        st["q"].copy_(torch.randn(T, H, N_NOPE + ROPE, generator=g).to(torch.bfloat16))
        idx = torch.empty(T, topk, dtype=torch.int64)
        ref = torch.full((T, topk), -1, dtype=torch.int64)
        for t, (r, p) in enumerate(toks):
            n_ok = min(p + 1, topk - 3)
            pos = torch.randperm(p + 1, generator=g)[:n_ok]
            bad = torch.tensor(INVALID)[torch.randint(0, len(INVALID), (topk - n_ok,), generator=g)]
            order = torch.randperm(topk, generator=g)
            idx[t] = torch.cat([pos, bad])[order]
            ref[t] = torch.cat([pos + r * bs * M, torch.full((topk - n_ok,), -1)])[order]
        st["idx"].copy_(idx.to(torch.int32))
        return ref

    def step_fn(plan):
        impl.write_cache(st["kv_c"], st["k_pe"], cache, st["slot_mapping"])
        return impl.forward(st["q"][..., :N_NOPE], st["q"][..., N_NOPE:], cache, st["idx"], plan)

    def reference(ref_idx):
        used, inv = torch.unique(ref_idx.clamp_min(-1), return_inverse=True)  # -1 first if present
        sub = ref_rows[used.clamp_min(0)]
        kvh = (sub[:, :L] @ w_ref.T).view(-1, H, N_NOPE + V_DIM)
        sub_idx = torch.where(ref_idx >= 0, inv, -1)
        return attention_unabsorbed(st["q"].cpu().double(), kvh[..., :N_NOPE], sub[:, L:], kvh[..., N_NOPE:],
                                    sub_idx, scale=SCALE)

    ref_idx = fill_step()
    if capture:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        plan = impl.build_plan(qsl, st["seq_lens"], block_table, st["slot_mapping"], block_size=bs,
                               decode_threshold=qlen, query_lens_cpu=[qlen] * R,
                               seq_lens_cpu=[x + qlen for x in seq])
        first = step_fn(plan)
    finally:
        if capture:
            torch.cuda.set_sync_debug_mode(0)
    assert plan.is_decode_only and plan.prefill_chunks == () and plan.num_decode_tokens == T
    assert_close("first step", first, reference(ref_idx), "bf16")

    if capture:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step_fn(plan)  # warm up on a side stream, as graph capture wants
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = step_fn(plan)

    for step in range(3):
        seq = [x + qlen for x in seq]
        st["seq_lens"].add_(qlen)
        if step == 1:  # the engine moves blocks: permute the cache, rewrite the table in place
            perm = torch.randperm(num_blocks, generator=g)
            backing[perm.to(device)] = backing.clone()
            bt_cpu = perm[bt_cpu.long()].to(torch.int32)
            block_table.copy_(bt_cpu)
        ref_idx = fill_step()
        if capture:
            graph.replay()
            torch.cuda.synchronize()
            got = static_out
        else:
            got = step_fn(plan)
        assert_close(f"step {step + 1}", got, reference(ref_idx), "bf16")


REUSE_CASES = [  # kv_cache_dtype, fp8_path, H, query length per request (decode_threshold)
    pytest.param("bf16", None, 5, 1, id="bf16-H5-decode"),
    pytest.param("fp8_ds_mla", "separate", 4, 3, id="fp8-separate-H4-specdecode3"),
]


@pytest.mark.parametrize("kv,fp8_path,H,qlen", REUSE_CASES)
def test_decode_steps_reuse_plan(kv, fp8_path, H, qlen):
    run_decode_steps(kv, fp8_path, H, qlen, capture=False, R=3, M=5, bs=16, topk=24, ctx_range=(5, 50),
                     seed=H + qlen)


GRAPH_CASES = [
    pytest.param("bf16", None, 16, 1, id="bf16-H16-decode"),
    pytest.param("bf16", None, 128, 2, id="bf16-H128-specdecode2"),  # Hopper: the bf16 Gluon kernel
    pytest.param("fp8_ds_mla", "mixed", 16, 1, id="fp8-mixed-H16-decode"),
    pytest.param("fp8_ds_mla", "separate", 64, 3, id="fp8-separate-H64-specdecode3"),
    pytest.param("fp8_ds_mla", "separate", 128, 1, id="fp8-separate-H128-decode"),
]


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device (graph capture)")
@pytest.mark.parametrize("kv,fp8_path,H,qlen", GRAPH_CASES)
def test_decode_step_cuda_graph(kv, fp8_path, H, qlen):
    run_decode_steps(kv, fp8_path, H, qlen, capture=True, R=6, M=8, bs=64, topk=100, ctx_range=(50, 300),
                     seed=H + qlen)


# ----------------------------------------------------------------------------------------------
# Request isolation: an index at or past its request's seq_len is skipped on every path.
# ----------------------------------------------------------------------------------------------
ISOLATION_CASES = [  # kv_cache_dtype, fp8_path, H, block_size, workspace_rows
    pytest.param("bf16", None, 4, 16, None, id="bf16-H4-bs16"),
    pytest.param("fp8_ds_mla", "mixed", 8, 16, None, id="fp8-mixed-H8-bs16"),
    pytest.param("fp8_ds_mla", "separate", 8, 16, 30, id="fp8-separate-H8-bs16-ws30"),
]


@pytest.mark.parametrize("kv,fp8_path,H,bs,ws", ISOLATION_CASES)
def test_indices_past_seq_len_are_skipped(kv, fp8_path, H, bs, ws):
    """The mixed batch of test_layer_mixed_batch, with every invalid index of every row replaced
    by positions past the row's own request: seq_len, seq_len + 1 and the next request's whole
    range. On the separate path those are the next request's workspace rows (requests 4 and 5
    share a chunk); on the decode paths, slots of the request's own last block past its tokens,
    which hold stale finite latents here (a freed block's old tokens). The output must equal the
    reference that skips them, and rows made only of them stay 0."""
    g = torch.Generator().manual_seed(H * 1000 + bs + 1)
    w8, s = kv_b_proj_fp8(H, g)
    impl = SparseMLAImpl(H, SCALE, kv, max_model_len=64, fp8_path=fp8_path, workspace_rows=ws)
    impl.load_kv_b_proj(w8.to(DEVICE), s.to(DEVICE))
    step = Step(impl, MIXED_BATCH, block_size=bs, topk=40, padding=2, seed=H + bs + 1, empty_rows=EMPTY_ROWS)
    R, bt = len(MIXED_BATCH), step.block_table.cpu()
    stale = [int(bt[r, p // bs]) * bs + p % bs for r in range(R)
             for p in range(step.seq[r], -(-step.seq[r] // bs) * bs)]
    impl.write_cache(torch.randn(len(stale), L, generator=g).to(torch.bfloat16).to(DEVICE),
                     torch.randn(len(stale), ROPE, generator=g).to(torch.bfloat16).to(DEVICE), step.cache,
                     torch.tensor(stale, dtype=torch.int32, device=DEVICE))
    toks = [r for r, (_, n) in enumerate(MIXED_BATCH) for _ in range(n)]
    idx = step.topk_indices.cpu().clone()
    for t, r in enumerate(toks):
        n, nxt = step.seq[r], step.seq[(r + 1) % R]
        past = torch.tensor([n, n + 1] + [n + j for j in range(nxt)], dtype=torch.int32)
        skipped = (step.ref_idx[t] < 0).nonzero().flatten()
        idx[t, skipped] = past[torch.arange(len(skipped)) % len(past)]
    step.topk_indices = idx.to(DEVICE)
    plan = step.plan(impl, threshold=3)
    if fp8_path == "separate":
        assert [(c.req_start, c.req_end) for c in plan.prefill_chunks] == [(4, 6), (6, 7), (7, 8)]
    out = impl.forward(step.q_nope, step.q_pe, step.cache, step.topk_indices, plan)
    assert_close("out", out, step.reference(reference_weight(w8, s), H), "bf16")
    empty = [t for t, r in enumerate(toks) if (r, t - toks.index(r)) in EMPTY_ROWS]
    assert len(empty) == 2 and torch.count_nonzero(out[empty]) == 0


# ----------------------------------------------------------------------------------------------
# The layers of one decode step: the first runs the checked ops and keeps their launch plan and
# buffers in the step's plan, the later ones launch directly; every layer as if it were alone.
# ----------------------------------------------------------------------------------------------
# a top-k the decode splits on every path (the CPU's 8 SMs and 64-key blocks; Hopper's 128-key blocks)
SPLIT_TOPK = 520 if DEVICE == "cpu" else 1100
LAYERS_CASES = [  # kv_cache_dtype, fp8_path, H, topk, requests (one token each)
    pytest.param("bf16", None, 4, 40, 4, id="bf16-H4"),
    pytest.param("fp8_ds_mla", "mixed", 16, 40, 4, id="fp8-mixed-H16"),
    pytest.param("fp8_ds_mla", "separate", 8, 40, 4, id="fp8-separate-H8"),
    pytest.param("fp8_ds_mla", "mixed", 4, SPLIT_TOPK, 4, id="fp8-mixed-H4-split"),
    pytest.param("bf16", None, 2, SPLIT_TOPK, 4, id="bf16-H2-split"),
    # two tokens: the split's merge and the projection in one launch (merge_project)
    pytest.param("fp8_ds_mla", "mixed", 4, SPLIT_TOPK, 2, id="fp8-mixed-H4-split-T2"),
    pytest.param("bf16", None, 2, SPLIT_TOPK, 2, id="bf16-H2-split-T2"),
]


@pytest.mark.parametrize("kv,fp8_path,H,topk,requests", LAYERS_CASES)
def test_layers_of_a_decode_step(kv, fp8_path, H, topk, requests):
    g = torch.Generator().manual_seed(H)
    layers, weights = [], []
    for _ in range(3):
        impl = SparseMLAImpl(H, SCALE, kv, max_model_len=64, fp8_path=fp8_path)
        w8, s = kv_b_proj_fp8(H, g)
        impl.load_kv_b_proj(w8.to(DEVICE), s.to(DEVICE))
        layers.append(impl)
        weights.append(reference_weight(w8, s))
    step = Step(layers[0], [(20, 1), (7, 1), (33, 1), (2, 1)][:requests], block_size=16, topk=topk,
                padding=0, seed=H, empty_rows=[(requests - 1, 0)])
    plan = step.plan(layers[0], threshold=1)
    assert plan.is_decode_only and plan.num_decode_tokens == step.T
    # stale finite latents past each request's tokens in its last block (a freed block's old
    # tokens): an index at or past seq_len must not read them on the later layers' path either
    R, bt, bs = step.T, step.block_table.cpu(), 16
    stale = [int(bt[r, p // bs]) * bs + p % bs for r in range(R)
             for p in range(step.seq[r], -(-step.seq[r] // bs) * bs)]
    layers[0].write_cache(torch.randn(len(stale), L, generator=g).to(torch.bfloat16).to(DEVICE),
                          torch.randn(len(stale), ROPE, generator=g).to(torch.bfloat16).to(DEVICE),
                          step.cache, torch.tensor(stale, dtype=torch.int32, device=DEVICE))
    # layer 1: the step's cache in another layout (row stride 16 bytes / elements longer, a
    # separate record); layer 2: the step's cache again (the record layer 0 left); every layer
    # its own subset of the step's indices (a third of them replaced by positions past the
    # request: seq_len, seq_len + 1 and the next request's range) in its own order
    wide = step.cache.new_empty(step.cache.shape[:2] + (step.cache.shape[2] + 16,))[..., :step.cache.shape[2]]
    wide.copy_(step.cache)
    caches = [step.cache, wide, step.cache]
    all_idx, all_ref = step.topk_indices.cpu(), step.ref_idx
    # the latent output buffer, which a split decode that merge_project fuses never writes (its
    # partials are merged and projected in one launch)
    o_lat = plan.buffer("o_lat", (R, H, L), torch.bfloat16).fill_(float("nan"))
    for i, (impl, cache) in enumerate(zip(layers, caches)):
        perm = torch.randperm(all_idx.shape[1], generator=g)
        drop = torch.rand(all_idx.shape, generator=g) < (0.34 if i else 0.0)
        idx = all_idx[:, perm].clone()
        for t in range(R):  # token t is request t's query
            n, nxt = step.seq[t], step.seq[(t + 1) % R]
            past = torch.tensor([n, n + 1] + [n + j for j in range(nxt)], dtype=torch.int32)
            cols = drop[t].nonzero().flatten()
            idx[t, cols] = past[torch.arange(len(cols)) % len(past)]
        idx = idx.contiguous().to(DEVICE)
        step.ref_idx = all_ref[:, perm].masked_fill(drop, -1)
        out = impl.forward(step.q_nope, step.q_pe, cache, idx, plan)
        assert_close(f"layer {i}", out, step.reference(weights[i], H), "bf16")
        alone = impl.forward(step.q_nope, step.q_pe, cache, idx, step.plan(impl, threshold=1))
        assert torch.equal(out, alone), f"layer {i}: differs from the same layer on a fresh plan"
        again = torch.empty_like(out)
        assert impl.forward(step.q_nope, step.q_pe, cache, idx, plan, out=again) is again
        assert torch.equal(again, out)
    # (a decode-only step runs every token through the decode kernel, on every path)
    records = [r for k, r in plan.scratch.items() if isinstance(k, tuple) and k[0] == "decode layer"]
    assert len(records) == 2
    # the split cases run the decode in splits and its merge (the record keeps the partials)
    assert all((rec[2][1] is not None) == (topk == SPLIT_TOPK) for rec in records)
    fused = topk == SPLIT_TOPK and fuses(R, H, records[0][2][1].shape[1], L)
    assert fused == (topk == SPLIT_TOPK and requests == 2)
    assert bool(o_lat.isnan().all()) == fused
    # a later layer's bad inputs still raise the named errors
    step.ref_idx = all_ref
    impl = layers[2]
    with pytest.raises(ValueError, match="topk_indices"):
        impl.forward(step.q_nope, step.q_pe, step.cache, step.topk_indices.long(), plan)
    with pytest.raises(ValueError, match="cache"):
        impl.forward(step.q_nope, step.q_pe, step.cache[:, :8], step.topk_indices, plan)
    # a cache layout of no record (the first layer's checks, sparse_mla_decode's): rows overlap
    overlapping = step.cache.as_strided(step.cache.shape, (step.cache.stride(0), 8, 1))
    with pytest.raises(ValueError, match=r"cache.stride\(1\)"):
        impl.forward(step.q_nope, step.q_pe, overlapping, step.topk_indices, plan)
    with pytest.raises(ValueError, match="q_pe.dtype"):
        impl.forward(step.q_nope, step.q_pe.half(), step.cache, step.topk_indices, plan)
    with pytest.raises(ValueError, match="out"):
        impl.forward(step.q_nope, step.q_pe, step.cache, step.topk_indices, plan,
                     out=torch.empty(step.T, H, V_DIM + 1, dtype=torch.bfloat16, device=DEVICE))
    # weights replaced by a view the projections cannot read: the checked path names them
    impl.W_UK = impl.W_UK.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match="w.stride"):
        impl.forward(step.q_nope, step.q_pe, step.cache, step.topk_indices, plan)


@pytest.mark.parametrize("kv", ["bf16", "fp8_ds_mla"])
def test_empty_decode_step_in_every_layer(kv):
    """A step of no tokens returns empty outputs in its first and later layers (no launch plan is
    kept for it, so later layers take the checked path too)."""
    H = 4
    g = torch.Generator().manual_seed(2)
    layers = []
    for _ in range(2):
        impl = SparseMLAImpl(H, SCALE, kv, max_model_len=64)
        w8, s = kv_b_proj_fp8(H, g)
        impl.load_kv_b_proj(w8.to(DEVICE), s.to(DEVICE))
        layers.append(impl)
    fmt = layers[0].cache_format
    cache, _ = random_paged_cache(4, 16, fmt.row_width, fmt.cache_dtype)
    none = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    plan = layers[0].build_plan(torch.zeros(1, dtype=torch.int32, device=DEVICE), none,
                                torch.zeros(0, 4, dtype=torch.int32, device=DEVICE),
                                torch.zeros(0, dtype=torch.int64, device=DEVICE), block_size=16,
                                query_lens_cpu=[], seq_lens_cpu=[])
    for impl in layers:
        out = impl.forward(torch.zeros(0, H, N_NOPE, dtype=torch.bfloat16, device=DEVICE),
                           torch.zeros(0, H, ROPE, dtype=torch.bfloat16, device=DEVICE), cache,
                           torch.zeros(0, 8, dtype=torch.int32, device=DEVICE), plan)
        assert out.shape == (0, H, V_DIM)
