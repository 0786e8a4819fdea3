"""mla/sparse/indexer_step.py: the sparse-attention step (indexer -> top-k -> sparse MLA) against
the oracles composed the other way round.

The step scores every token through the paged index cache, one row per token, with per-token
context lengths (build_indexer_plan). The reference takes each request as vLLM does: a decode
request's n tokens as one paged row group with next_n = n and the request's seq_len
(paged_mqa_logits_ref's native speculative form), a prefill request through its keys gathered
into a contiguous K (mqa_logits_ref, row i sees [0, context + i + 1)); then topk_per_row_ref, then
the float64 unabsorbed MLA over the selected positions (tests.helpers.sparse.Step.reference).

Inputs are adversarial: NaN bytes in every index-cache slot nobody wrote (0xFF: NaN as e4m3 and
as the fp32 scale), the MLA cache NaN-filled too, a shuffled block table with -1 past each
request's blocks, strided caches, decodes, speculative decodes and prefills with and without
context in one batch, padding tokens, rows shorter and longer than topk.
"""
import pytest
import torch

from openmla.kernels.reference.indexer import mqa_logits_ref, paged_mqa_logits_ref, topk_per_row_ref
from openmla.mla.sparse.impl import SparseMLAImpl
from openmla.mla.sparse.indexer_step import (
    SparseAttentionStep, build_indexer_plan, indexer_plan_from_tokens, indexer_topk,
)
from openmla.quant.indexer_cache import INDEXER_K_FP8, INDEXER_K_FP8_RAW, write_indexer_k_cache
from tests.helpers import DEVICE, assert_close, random_paged_cache, shuffled_block_table
from tests.helpers.indexer import (D_INDEX, IndexInputs, abs_index_cache, assert_same_selection,
                                  oracle_selection)
from tests.helpers.sparse import MIXED_BATCH, SCALE, V_DIM, Step, kv_b_proj_fp8, reference_weight


def index_inputs(step, heads, fmt, seed):
    return IndexInputs(step.reqs, step.block_table, step.cache.shape[0], step.cache.shape[1], step.T,
                       heads, fmt, seed)


def reference_selection(step, idx, topk, threshold):
    """Per token: (positions selected by the oracles, (logits of its visible positions, their
    logits of |q|, |w|, |k|)) the request-wise way (module docstring); padding tokens select
    nothing."""
    bs = step.cache.shape[1]
    values, scales = idx.fmt.read_ref(idx.cache)
    abs_cache = abs_index_cache(idx.cache, idx.fmt)
    bt = step.block_table
    sel = torch.full((step.T, topk), -1, dtype=torch.int32)
    logits_of = [None] * step.T
    t = 0
    for r, ((c, n), s) in enumerate(zip(step.reqs, step.seq)):
        q, w = idx.q_fp8[t:t + n], idx.weights[t:t + n]
        if n <= threshold:  # a decode: n rows of the paged form, seq_len as the context length
            lg = paged_mqa_logits_ref(q.unsqueeze(0), w, idx.cache, step.seq_lens[r:r + 1],
                                      bt[r:r + 1], max_model_len=s, fmt=idx.fmt)
            bound = paged_mqa_logits_ref(q.float().abs().unsqueeze(0), w.abs(), abs_cache,
                                         step.seq_lens[r:r + 1], bt[r:r + 1], max_model_len=s, fmt=idx.fmt)
            ends = torch.arange(c + 1, s + 1)
            got = topk_per_row_ref(lg, ends.to(lg.device), topk)
        else:  # a prefill: its keys gathered, row i sees [0, c + i + 1)
            pos = torch.arange(s)
            blk, off = bt[r, pos // bs].long().cpu(), pos % bs
            k = values[blk, off].view(torch.float8_e4m3fn)
            ksc = scales[blk, off, 0]
            ks = torch.zeros(n, dtype=torch.int32)
            ke = torch.arange(c + 1, s + 1, dtype=torch.int32)
            lg = mqa_logits_ref(q, w, k, ksc, ks.to(q.device), ke.to(q.device))
            bound = mqa_logits_ref(q.float().abs(), w.abs(), k.float().abs(), ksc, ks.to(q.device),
                                   ke.to(q.device))
            got = topk_per_row_ref(lg, ke.to(lg.device), topk, starts=ks.to(lg.device))
        sel[t:t + n] = got.cpu()
        for i in range(n):
            logits_of[t + i] = (lg[i, :c + i + 1].cpu(), bound[i, :c + i + 1].cpu())
        t += n
    return sel, logits_of


def token_context_lens(step):
    """Visible tokens of each token of the step: position + 1 in its request; 0 for padding."""
    out = []
    for c, n in step.reqs:
        out += [c + i + 1 for i in range(n)]
    return out + [0] * (step.T - len(out))


# ----------------------------------------------------------------------------------------------
# The whole step on a mixed batch
# ----------------------------------------------------------------------------------------------
STEP_CASES = [  # kv_cache_dtype, fp8_path, H (MLA heads), index heads, block_size, topk, index fmt,
    # prefills on the ragged path (host lengths given) or as paged rows
    pytest.param("fp8_ds_mla", "mixed", 4, 8, 16, 12, INDEXER_K_FP8, True, id="fp8-mixed-H4-I8-bs16-topk12-ragged"),
    pytest.param("fp8_ds_mla", "separate", 8, 4, 7, 20, INDEXER_K_FP8_RAW, True,
                 id="fp8-separate-H8-I4-bs7-topk20-raw-ragged"),
    pytest.param("fp8_ds_mla", "mixed", 4, 8, 16, 12, INDEXER_K_FP8, False, id="fp8-mixed-H4-I8-bs16-topk12-paged"),
    pytest.param("bf16", None, 3, 64, 16, 64, INDEXER_K_FP8, False, id="bf16-H3-I64-bs16-topk64-all-short-paged"),
]


@pytest.mark.parametrize("kv,fp8_path,H,heads,bs,topk,fmt,ragged", STEP_CASES)
def test_step_mixed_batch(kv, fp8_path, H, heads, bs, topk, fmt, ragged):
    g = torch.Generator().manual_seed(H * 100 + bs)
    w8, s = kv_b_proj_fp8(H, g)
    impl = SparseMLAImpl(H, SCALE, kv, max_model_len=64, fp8_path=fp8_path,
                         workspace_rows=30 if fp8_path == "separate" else None)
    impl.load_kv_b_proj(w8.to(DEVICE), s.to(DEVICE))
    step = Step(impl, MIXED_BATCH, block_size=bs, topk=topk, padding=2, seed=H + bs)
    plan = step.plan(impl, threshold=3)
    idx = index_inputs(step, heads, fmt, seed=bs)
    host = dict(query_lens_cpu=step.qlens, seq_lens_cpu=step.seq, decode_threshold=3) if ragged else {}
    iplan = build_indexer_plan(step.query_start_loc, step.seq_lens, step.block_table,
                               req_id_per_token=plan.req_id_per_token, max_context=64, **host)
    assert iplan.context_lens.tolist() == token_context_lens(step)
    # decodes (query_len <= 3) first: 8 paged rows, then the 30 prefill tokens in one chunk
    assert (iplan.num_paged_tokens, len(iplan.ragged_chunks)) == ((8, 1) if ragged else (step.T, 0))

    layer = SparseAttentionStep(impl, topk=topk, index_format=fmt)
    layer.write_index_cache(idx.new_k, idx.cache, idx.slots)  # this step's keys; padding skipped
    sel = torch.empty(step.T, topk, dtype=torch.int32, device=DEVICE)
    out = layer.forward(step.q_nope, step.q_pe, step.cache, idx.q_fp8, idx.weights, idx.cache, plan,
                        iplan, topk_out=sel)

    want_sel, logits_of = reference_selection(step, idx, topk, threshold=3)
    assert_same_selection(sel[:-2], want_sel[:-2], logits_of)
    assert torch.all(sel[-2:] == -1)  # padding tokens select nothing
    # the attention over what was selected (the step's own selection: ties may differ)
    base = torch.tensor([0] + step.seq).cumsum(0)
    req_of = [r for r, (_, n) in enumerate(step.reqs) for _ in range(n)]
    ref_idx = torch.full((step.T, topk), -1, dtype=torch.int64)
    for t, r in enumerate(req_of):
        row = sel[t].cpu().long()
        ref_idx[t] = torch.where(row >= 0, row + base[r], -1)
    step.ref_idx = ref_idx
    assert_close("out", out, step.reference(reference_weight(w8, s), H), "bf16")
    assert torch.count_nonzero(out[-2:]) == 0


@pytest.mark.parametrize("ragged", [False, True], ids=["paged", "ragged"])
def test_long_rows_are_scored_in_blocks(ragged):
    """A logits budget of one row at a time gives the same selection as one block: paged rows
    one by one; ragged prefill requests one chunk each, the longest split by query rows."""
    g = torch.Generator().manual_seed(5)
    impl = SparseMLAImpl(2, SCALE, "fp8_ds_mla", max_model_len=64)
    impl.load_kv_b_proj(*(t.to(DEVICE) for t in kv_b_proj_fp8(2, g)))
    step = Step(impl, MIXED_BATCH, block_size=16, topk=8, padding=1, seed=9)
    idx = index_inputs(step, 4, INDEXER_K_FP8, seed=3)
    idx.write_new()
    iplan = build_indexer_plan(step.query_start_loc, step.seq_lens, step.block_table,
                               num_tokens=step.T, max_context=64)
    whole = indexer_topk(idx.q_fp8, idx.weights, idx.cache, iplan, topk=8)
    if ragged:  # 4 * 64 * 4 bytes: at most 64 logits per chunk row block
        small = build_indexer_plan(step.query_start_loc, step.seq_lens, step.block_table,
                                   num_tokens=step.T, max_context=64, query_lens_cpu=step.qlens,
                                   seq_lens_cpu=step.seq, decode_threshold=3, max_logits_bytes=4 * 64)
        # prefills (10, 6) (0, 9) (22, 8) (5, 7): 6x16 rows split 4 + 2; 9x9 split 7 + 2;
        # 8x30 split 2 + 2 + 2 + 2; 7x12 split 5 + 2
        assert [c.token_end - c.token_start for c in small.ragged_chunks] == [4, 2, 7, 2, 2, 2, 2, 2, 5, 2]
        rowwise = indexer_topk(idx.q_fp8, idx.weights, idx.cache, small, topk=8)
    else:
        rowwise = indexer_topk(idx.q_fp8, idx.weights, idx.cache, iplan, topk=8, max_logits_bytes=4 * 64)
        assert torch.equal(whole, rowwise)
    want, logits_of = reference_selection(step, idx, 8, threshold=3)
    for got in (whole, rowwise):  # two kernels may break a tie of rounded sums differently
        assert_same_selection(got[:-1], want[:-1], logits_of)
        assert torch.all(got[-1] == -1)


@pytest.mark.parametrize("reqs,pad", [
    pytest.param([(30, 3), (47, 3), (20, 3), (10, 6), (0, 9)], 2, id="spec3-then-prefills"),
    pytest.param([(30, 2), (5, 2), (47, 2)], 3, id="spec2-decode-only-padded"),
])
def test_uniform_speculative_decodes_score_each_request_once(reqs, pad):
    """Decodes of one length n > 1 (host lengths given) are paged in groups of n rows per request,
    the same selection as one row per token and as the oracles."""
    g = torch.Generator().manual_seed(len(reqs))
    bs, topk, R = 16, 10, len(reqs)
    T = sum(n for _, n in reqs) + pad
    nblk = [-(-(c + n) // bs) for c, n in reqs]
    bt = shuffled_block_table(R, max(nblk), R * max(nblk) + 3, generator=g, device="cpu")
    for r in range(R):
        bt[r, nblk[r]:] = -1
    bt = bt.to(DEVICE)
    idx = IndexInputs(reqs, bt, R * max(nblk) + 3, bs, T, 8, INDEXER_K_FP8, seed=4)
    idx.write_new()
    qlens, seqs = [n for _, n in reqs], [c + n for c, n in reqs]
    qsl = torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    seq_lens = torch.tensor(seqs, dtype=torch.int32, device=DEVICE)
    grouped = build_indexer_plan(qsl, seq_lens, bt, num_tokens=T, max_context=64, query_lens_cpu=qlens,
                                 seq_lens_cpu=seqs, decode_threshold=3)
    n, nd = qlens[0], sum(1 for q in qlens if q <= 3)
    assert (grouped.paged_next_n, grouped.num_paged_tokens) == (n, nd * n)
    per_token = build_indexer_plan(qsl, seq_lens, bt, num_tokens=T, max_context=64)
    assert per_token.paged_next_n == 1
    want, logits_of = oracle_selection(idx, bt, topk)
    for plan in (grouped, per_token):
        got = indexer_topk(idx.q_fp8, idx.weights, idx.cache, plan, topk=topk)
        assert_same_selection(got[:T - pad], want[:T - pad], logits_of)
        assert torch.all(got[T - pad:] == -1)


# ----------------------------------------------------------------------------------------------
# Plans
# ----------------------------------------------------------------------------------------------
def test_plan_decode_only_with_padding_requests():
    """A CUDA-graph-padded decode batch: padding requests own no token, padding tokens belong to
    no request; with max_context above every seq_len. Spec-decode rows see one more token each."""
    qsl = torch.tensor([0, 1, 3, 5, 5, 5], dtype=torch.int32, device=DEVICE)
    seq = torch.tensor([9, 4, 2, 0, 0], dtype=torch.int32, device=DEVICE)
    bt = torch.zeros(5, 3, dtype=torch.int32, device=DEVICE)
    p = build_indexer_plan(qsl, seq, bt, num_tokens=7, max_context=128)
    assert p.req_id_per_token.tolist() == [0, 1, 1, 2, 2, 5, 5]
    assert p.context_lens.tolist() == [9, 3, 4, 1, 2, 0, 0]
    # no request at all
    p0 = build_indexer_plan(qsl[:1], seq[:0], bt[:0], num_tokens=3, max_context=4)
    assert p0.context_lens.tolist() == [0, 0, 0]


def test_plan_from_tokens_and_padding_rows_select_nothing():
    """Tokens of no request (ids -1, R and huge) and a context length of 0 select nothing and
    read nothing, whatever the cache holds (it is all NaN here)."""
    cache, _ = random_paged_cache(4, 8, INDEXER_K_FP8.bytes_per_token, torch.uint8)
    req = torch.tensor([-1, 2, 2**31 - 1, 0], dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor([5, 5, 5, 0], dtype=torch.int32, device=DEVICE)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)
    p = indexer_plan_from_tokens(req, ctx, bt, max_context=16)
    q = torch.randn(4, 2, D_INDEX).to(torch.float8_e4m3fn).to(DEVICE)
    got = indexer_topk(q, torch.rand(4, 2, device=DEVICE), cache, p, topk=3)
    assert torch.all(got == -1)


def test_nan_key_in_a_visible_slot_is_selected():
    """Faults stay visible: a NaN key the token sees ranks first and is selected."""
    cache, _ = random_paged_cache(2, 4, INDEXER_K_FP8.bytes_per_token, torch.uint8)
    k = torch.randn(8, D_INDEX, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    k[5, 3] = float("nan")
    bt = torch.tensor([[1, 0]], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([4, 5, 6, 7, 0, 1, 2, 3], dtype=torch.int32, device=DEVICE)
    write_indexer_k_cache(k.to(DEVICE), cache, slots)
    p = indexer_plan_from_tokens(torch.zeros(1, dtype=torch.int32, device=DEVICE),
                                 torch.tensor([8], dtype=torch.int32, device=DEVICE), bt, max_context=8)
    q = torch.randn(1, 2, D_INDEX).to(torch.float8_e4m3fn).to(DEVICE)
    got = indexer_topk(q, torch.rand(1, 2, device=DEVICE) + 0.1, cache, p, topk=2)
    assert 5 in got[0].tolist()


# ----------------------------------------------------------------------------------------------
# Misuse
# ----------------------------------------------------------------------------------------------
def _small():
    cache, _ = random_paged_cache(2, 4, INDEXER_K_FP8.bytes_per_token, torch.uint8)
    p = indexer_plan_from_tokens(torch.zeros(3, dtype=torch.int32, device=DEVICE),
                                 torch.ones(3, dtype=torch.int32, device=DEVICE),
                                 torch.zeros(1, 2, dtype=torch.int32, device=DEVICE), max_context=8)
    q = torch.zeros(3, 2, D_INDEX, dtype=torch.float8_e4m3fn, device=DEVICE)
    return q, torch.ones(3, 2, device=DEVICE), cache, p


@pytest.mark.parametrize("change,match", [
    pytest.param(dict(q=torch.zeros(3, 2, D_INDEX, dtype=torch.bfloat16)), "q_fp8.dtype", id="q-bf16"),
    pytest.param(dict(q=torch.zeros(2, 2, D_INDEX, dtype=torch.float8_e4m3fn)), r"q_fp8.shape", id="q-rows"),
    pytest.param(dict(q=torch.zeros(3, 2, 64, dtype=torch.float8_e4m3fn)), r"q_fp8.shape", id="q-dim64"),
    pytest.param(dict(w=torch.ones(3, 3)), r"weights.shape", id="weights-heads"),
    pytest.param(dict(w=torch.ones(3, 2, dtype=torch.bfloat16)), r"weights.dtype", id="weights-bf16"),
    pytest.param(dict(cache=torch.zeros(2, 4, 128, dtype=torch.uint8)), r"index_cache.shape", id="cache-width"),
    pytest.param(dict(topk=0), "topk: expected an int >= 1", id="topk0"),
    pytest.param(dict(out=torch.zeros(3, 4, dtype=torch.int64)), "out.dtype", id="out-int64"),
])
def test_indexer_topk_errors(change, match):
    q, w, cache, p = _small()
    q, w, cache = (change.get(k, v) for k, v in (("q", q), ("w", w), ("cache", cache)))
    with pytest.raises(ValueError, match=match):
        indexer_topk(q.to(DEVICE), w.to(DEVICE), cache.to(DEVICE), p, topk=change.get("topk", 4),
                     out=change.get("out"))


@pytest.mark.parametrize("kwargs,match", [
    pytest.param(dict(max_context=0), "max_context: expected a positive int", id="max-context-0"),
    pytest.param(dict(max_context=8), "num_tokens: expected an int when", id="no-token-count"),
    pytest.param(dict(max_context=8, num_tokens=4, req_id_per_token=torch.zeros(3, dtype=torch.int32)),
                 r"num_tokens: expected 3", id="count-mismatch"),
    pytest.param(dict(max_context=8, req_id_per_token=torch.zeros(3, dtype=torch.int64)),
                 r"req_id_per_token.dtype", id="req-int64"),
])
def test_build_indexer_plan_errors(kwargs, match):
    qsl = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)
    if "req_id_per_token" in kwargs:
        kwargs["req_id_per_token"] = kwargs["req_id_per_token"].to(DEVICE)
    with pytest.raises(ValueError, match=match):
        build_indexer_plan(qsl, torch.tensor([3], dtype=torch.int32, device=DEVICE),
                           torch.zeros(1, 1, dtype=torch.int32, device=DEVICE), **kwargs)


def test_step_refuses_a_plan_of_another_batch():
    g = torch.Generator().manual_seed(2)
    impl = SparseMLAImpl(2, SCALE, "bf16", max_model_len=64)
    impl.load_kv_b_proj(*(t.to(DEVICE) for t in kv_b_proj_fp8(2, g)))
    step = Step(impl, MIXED_BATCH[:2], block_size=16, topk=4, padding=0, seed=1)
    plan = step.plan(impl, threshold=1)
    q, w, cache, iplan = _small()  # 3 tokens, the MLA plan has 2
    layer = SparseAttentionStep(impl, topk=4)
    with pytest.raises(ValueError, match="index_plan.num_tokens: expected 2"):
        layer.forward(step.q_nope, step.q_pe, step.cache, q, w, cache, plan, iplan)
    with pytest.raises(ValueError, match="mla: expected a SparseMLAImpl"):
        SparseAttentionStep(object(), topk=4)
    assert V_DIM == impl.v_head_dim
