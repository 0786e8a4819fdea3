"""mla/sparse/plan.py: split_prefill_chunks, build_sparse_mla_plan (paths, the decode/prefill split,
per-chunk workspace structures) and the plan's reuse check. Expected values come from plain
Python loops written here from DESIGN.md.

No kernels run here. Decode-only builds are made from `meta` tensors: a meta tensor has no data,
so any read of it back to the host (.item(), .tolist(), a sync on a GPU) raises; a build that
succeeds on them provably reads nothing from the device.
"""
import dataclasses
import random

import pytest
import torch

from openmla.mla.sparse.plan import (
    MIN_HEADS_FOR_SEPARATE,
    SparseMLAPlan,
    build_sparse_mla_plan,
    split_prefill_chunks,
)
from openmla.quant import BF16_MLA, FP8_DS_MLA
from tests.helpers import DEVICE, shuffled_block_table


# ----------------------------------------------------------------------------------------------
# split_prefill_chunks
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seq_lens,rows,want", [
    pytest.param([5, 5, 5], 10, [(0, 2), (2, 3)], id="two-fit-then-one"),
    pytest.param([10], 10, [(0, 1)], id="one-exact-fit"),
    pytest.param([3, 8, 2, 2, 9], 10, [(0, 1), (1, 3), (3, 4), (4, 5)], id="irregular"),
    pytest.param([1, 1, 1, 1], 100, [(0, 4)], id="all-in-one"),
    pytest.param([0, 0, 4, 0], 4, [(0, 4)], id="zero-lengths-fit"),
    pytest.param([4, 4, 4], 4, [(0, 1), (1, 2), (2, 3)], id="each-fills-it"),
    pytest.param([], 4, [], id="no-requests"),
    pytest.param(torch.tensor([6, 6, 6], dtype=torch.int32), 12, [(0, 2), (2, 3)], id="cpu-tensor"),
])
def test_split_prefill_chunks(seq_lens, rows, want):
    assert split_prefill_chunks(seq_lens, rows) == want


def test_split_prefill_chunks_is_greedy_and_covers():
    """Random cases: contiguous ranges covering every request in order, each fitting, and each
    closed only because the next request would not fit (greedy)."""
    rng = random.Random(5)
    for _ in range(200):
        rows = rng.randint(1, 50)
        lens = [rng.randint(0, rows) for _ in range(rng.randint(0, 12))]
        chunks = split_prefill_chunks(lens, rows)
        assert [r for a, b in chunks for r in range(a, b)] == list(range(len(lens)))
        for i, (a, b) in enumerate(chunks):
            assert b > a and sum(lens[a:b]) <= rows
            if i + 1 < len(chunks):
                assert sum(lens[a:b + 1]) > rows


@pytest.mark.parametrize("seq_lens,rows,match", [
    pytest.param([4, 11, 2], 10, r"seq_lens\[1\]: expected <= workspace_rows = 10", id="seq-too-long"),
    pytest.param([3, -1], 10, r"seq_lens\[1\]: expected >= 0", id="negative"),
    pytest.param([3], 0, "workspace_rows: expected a positive int", id="rows-0"),
    pytest.param([3], 2.5, "workspace_rows: expected a positive int", id="rows-float"),
    pytest.param(torch.tensor([1.0, 2.0]), 10, "seq_lens.dtype: expected an integer dtype", id="float-tensor"),
    pytest.param(torch.tensor([1, 2], device="meta"), 10, "seq_lens.device: expected cpu", id="device-tensor"),
    pytest.param([1.5], 10, "seq_lens: expected integers", id="float-list"),
])
def test_split_prefill_chunks_errors(seq_lens, rows, match):
    with pytest.raises(ValueError, match=match):
        split_prefill_chunks(seq_lens, rows)


# ----------------------------------------------------------------------------------------------
# build_sparse_mla_plan
# ----------------------------------------------------------------------------------------------
BLOCK_SIZE = 16


def batch(qlens, seq_lens, *, padding=0, device=DEVICE, seed=0):
    """The engine's per-step tensors for requests with these query/sequence lengths."""
    g = torch.Generator().manual_seed(seed)
    R = len(qlens)
    qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0).tolist()) if R else [0], dtype=torch.int32)
    M = max([(s + BLOCK_SIZE - 1) // BLOCK_SIZE for s in seq_lens] + [1])
    bt = shuffled_block_table(R, M, R * M + 3, generator=g, device="cpu")
    T = int(qsl[-1]) + padding
    slots = torch.randint(0, 1000, (T,), generator=g, dtype=torch.int32)
    return dict(query_start_loc=qsl.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
                block_table=bt.to(device), slot_mapping=slots.to(device))


def req_ids_loop(qlens, T):
    out = [r for r, n in enumerate(qlens) for _ in range(n)]
    return out + [len(qlens)] * (T - len(out))


@pytest.mark.parametrize("kv,H,fp8_path,want", [
    pytest.param("bf16", 8, None, "bf16", id="bf16"),
    pytest.param("auto", 64, None, "bf16", id="auto-is-bf16"),
    pytest.param("fp8_ds_mla", MIN_HEADS_FOR_SEPARATE - 1, None, "mixed", id="fp8-auto-H31-mixed"),
    pytest.param("fp8_ds_mla", MIN_HEADS_FOR_SEPARATE, None, "separate", id="fp8-auto-H32-separate"),
    pytest.param("fp8_ds_mla", 128, "mixed", "mixed", id="fp8-H128-forced-mixed"),
    pytest.param("fp8_ds_mla", 4, "separate", "separate", id="fp8-H4-forced-separate"),
])
def test_path_choice(kv, H, fp8_path, want):
    qlens, seq = [1, 1, 5], [9, 20, 7]
    plan = build_sparse_mla_plan(**batch(qlens, seq), block_size=BLOCK_SIZE, num_heads=H,
                                 kv_cache_dtype=kv, max_model_len=64, fp8_path=fp8_path,
                                 query_lens_cpu=qlens, seq_lens_cpu=seq)
    assert plan.path == want
    assert plan.cache_format is (BF16_MLA if kv in ("bf16", "auto") else FP8_DS_MLA)
    assert (plan.num_tokens, plan.num_reqs, plan.block_size, plan.num_heads) == (7, 3, BLOCK_SIZE, H)
    assert plan.req_id_per_token.dtype == torch.int32
    assert plan.req_id_per_token.tolist() == req_ids_loop(qlens, 7)
    if want == "separate":
        assert (plan.num_decodes, plan.num_decode_tokens, plan.num_prefills, plan.num_prefill_tokens) == (2, 2, 1, 5)
        assert len(plan.prefill_chunks) == 1
    else:  # every token takes the decode kernel
        assert (plan.num_decodes, plan.num_decode_tokens, plan.num_prefills) == (3, 7, 0)
        assert plan.prefill_chunks == ()


@pytest.mark.parametrize("kv,H,qlens,threshold,padding,host_lens", [
    pytest.param("fp8_ds_mla", 32, [1] * 5, 1, 0, True, id="separate-decode-R5"),
    pytest.param("fp8_ds_mla", 64, [3, 1, 3, 2], 3, 2, True, id="separate-specdecode-padded"),
    pytest.param("fp8_ds_mla", 16, [1, 1, 1], 1, 0, False, id="mixed-no-host-lens"),
    pytest.param("bf16", 8, [2, 2], 2, 1, False, id="bf16-no-host-lens"),
])
def test_decode_only_reads_nothing_and_builds_no_prefill(kv, H, qlens, threshold, padding, host_lens):
    """Device inputs on `meta` (unreadable): the build must not read them. Then the same build
    on real tensors gives the token -> request map of a loop."""
    seq = [40 + 7 * i for i in range(len(qlens))]
    kw = dict(block_size=BLOCK_SIZE, num_heads=H, kv_cache_dtype=kv, max_model_len=64,
              decode_threshold=threshold)
    if host_lens:
        kw.update(query_lens_cpu=torch.tensor(qlens), seq_lens_cpu=seq)
    plan = build_sparse_mla_plan(**batch(qlens, seq, padding=padding, device="meta"), **kw)
    T = sum(qlens) + padding
    assert plan.prefill_chunks == () and plan.num_prefills == 0 and plan.is_decode_only
    assert plan.device == torch.device("meta") and plan.req_id_per_token.shape == (T,)
    real = build_sparse_mla_plan(**batch(qlens, seq, padding=padding), **kw)
    assert real.req_id_per_token.tolist() == req_ids_loop(qlens, T)
    assert real.prefill_chunks == ()
    # every row, padding included, takes the decode kernel on every path: a decode step's
    # launches depend on T alone (what a CUDA graph captured for T replays)
    assert (real.num_decode_tokens, real.num_padding_tokens) == (T, 0)


@pytest.mark.parametrize("qlens,max_query_len,decode_only", [
    pytest.param([1, 3, 2], 3, True, id="bound-within-threshold"),
    pytest.param([1, 1], 1, True, id="decode"),
    pytest.param([1, 3, 2], 4, False, id="bound-past-threshold"),
])
def test_max_query_len_bound_decides_decode_only(qlens, max_query_len, decode_only):
    """The separate path with no host lengths: a max_query_len within decode_threshold makes
    the step decode-only without them (meta tensors: nothing read); past it, the lengths are
    needed (read from query_start_loc: impossible on meta)."""
    seq = [40, 41, 42][:len(qlens)]
    kw = dict(block_size=BLOCK_SIZE, num_heads=64, kv_cache_dtype="fp8_ds_mla", max_model_len=64,
              decode_threshold=3, max_query_len=max_query_len)
    if decode_only:
        plan = build_sparse_mla_plan(**batch(qlens, seq, padding=2, device="meta"), **kw)
        assert plan.path == "separate" and plan.is_decode_only
        assert (plan.num_decode_tokens, plan.num_padding_tokens) == (sum(qlens) + 2, 0)
    else:
        with pytest.raises(NotImplementedError):  # meta: .tolist() of query_start_loc
            build_sparse_mla_plan(**batch(qlens, seq, padding=2, device="meta"), **kw)
        plan = build_sparse_mla_plan(**batch(qlens, seq, padding=2), **kw)
        assert (plan.num_decodes, plan.num_prefills) == (3, 0)  # all <= 3 after all


def test_req_id_out_is_written_in_place():
    """The request ids go into the first T entries of the caller's buffer (the builder's
    persistent one: a CUDA graph reads them at one address); the rest is left alone."""
    qlens, seq = [2, 1, 3], [9, 20, 7]
    buf = torch.full((12,), -99, dtype=i32, device=DEVICE)
    for padding in (0, 3):
        plan = _build(qlens=qlens, seq=seq, padding=padding, req_id_out=buf, decode_threshold=3)
        T = sum(qlens) + padding
        assert plan.req_id_per_token.data_ptr() == buf.data_ptr()
        assert plan.req_id_per_token.shape == (T,)
        assert buf.tolist() == req_ids_loop(qlens, T) + [-99] * (12 - T)


def test_plan_buffer_is_step_scratch():
    plan = _build()
    a = plan.buffer("q", (7, 64, 576), torch.bfloat16)
    assert a.shape == (7, 64, 576) and a.dtype == torch.bfloat16 and a.device == plan.device
    assert plan.buffer("q", (7, 64, 576), torch.bfloat16) is a  # the next layer gets it again
    assert plan.buffer("o", (7, 64, 512), torch.bfloat16) is not a
    assert plan.buffer("q", (7, 64, 576), torch.float32).dtype == torch.float32


def test_separate_prefill_chunks_match_loop():
    """Decodes (1 and 3 tokens), then prefills split over a 30-row workspace; a 2-token request
    after the first prefill runs with the prefills. Every chunk field against a loop."""
    qlens = [1, 3, 1, 6, 2, 9, 8, 7]
    seq = [30, 23, 48, 16, 4, 9, 30, 12]
    b = batch(qlens, seq, padding=3)
    plan = build_sparse_mla_plan(**b, block_size=BLOCK_SIZE, num_heads=64, kv_cache_dtype="fp8_ds_mla",
                                 max_model_len=64, decode_threshold=3, workspace_rows=30,
                                 query_lens_cpu=qlens, seq_lens_cpu=torch.tensor(seq))
    assert plan.path == "separate" and plan.workspace_rows == 30
    assert (plan.num_decodes, plan.num_decode_tokens) == (3, 5)
    assert (plan.num_prefills, plan.num_prefill_tokens, plan.num_padding_tokens) == (5, 32, 3)
    assert plan.req_id_per_token.tolist() == req_ids_loop(qlens, 40)
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    # prefill seq_lens [16, 4, 9, 30, 12] in 30 rows: [16, 4, 9] | [30] | [12]
    assert [(c.req_start, c.req_end) for c in plan.prefill_chunks] == [(3, 6), (6, 7), (7, 8)]
    for c in plan.prefill_chunks:
        rs, re = c.req_start, c.req_end
        lens = seq[rs:re]
        assert (c.token_start, c.token_end) == (starts[rs], starts[re])
        assert (c.num_rows, c.max_seq_len) == (sum(lens), max(lens))
        assert c.workspace_starts.dtype == torch.int32
        assert c.workspace_starts.tolist() == [sum(lens[:k]) for k in range(len(lens))]
        assert c.workspace_request_ids.tolist() == [k for k in range(re - rs) for _ in range(qlens[rs + k])]
        assert c.seq_lens.tolist() == lens
        assert torch.equal(c.block_table, b["block_table"][rs:re])
        assert c.num_rows <= plan.workspace_rows


def test_separate_without_host_lengths_reads_them():
    """Without query_lens_cpu / seq_lens_cpu the separate path reads them back (a sync on a GPU,
    documented); the plan is the same."""
    qlens, seq = [1, 4, 5], [10, 12, 5]
    kw = dict(block_size=BLOCK_SIZE, num_heads=32, kv_cache_dtype="fp8_ds_mla", max_model_len=64,
              workspace_rows=12)
    b = batch(qlens, seq)
    a = build_sparse_mla_plan(**b, **kw)
    c = build_sparse_mla_plan(**b, **kw, query_lens_cpu=qlens, seq_lens_cpu=seq)
    for p in (a, c):
        assert [(x.req_start, x.req_end, x.token_start, x.token_end) for x in p.prefill_chunks] == \
            [(1, 2, 1, 5), (2, 3, 5, 10)]
    assert a.workspace_rows == 12


def test_default_workspace_is_5_max_model_len():
    plan = build_sparse_mla_plan(**batch([1], [3]), block_size=BLOCK_SIZE, num_heads=64,
                                 kv_cache_dtype="fp8_ds_mla", max_model_len=100, query_lens_cpu=[1])
    assert plan.workspace_rows == 500


def _build(**over):
    qlens, seq = over.pop("qlens", [1, 6]), over.pop("seq", [9, 8])
    b = batch(qlens, seq, padding=over.pop("padding", 0))
    kw = dict(block_size=BLOCK_SIZE, num_heads=64, kv_cache_dtype="fp8_ds_mla", max_model_len=64,
              query_lens_cpu=qlens, seq_lens_cpu=seq)
    for k, v in over.items():
        (b if k in b else kw)[k] = v
    return build_sparse_mla_plan(**b, **kw)


i32 = torch.int32


@pytest.mark.parametrize("over,exc,match", [
    pytest.param(dict(kv_cache_dtype="fp8_e4m3"), NotImplementedError, "kv_cache_dtype 'fp8_e4m3'", id="kv-dtype"),
    pytest.param(dict(num_heads=129), NotImplementedError, "num_heads 129", id="H129"),
    pytest.param(dict(num_heads=0), ValueError, "num_heads: expected a positive int", id="H0"),
    pytest.param(dict(block_size=0), ValueError, "block_size: expected a positive int", id="bs0"),
    pytest.param(dict(decode_threshold=0), ValueError, "decode_threshold", id="threshold0"),
    pytest.param(dict(fp8_path="fast"), ValueError, "fp8_path: expected one of", id="fp8-path-name"),
    pytest.param(dict(kv_cache_dtype="bf16", fp8_path="mixed"), ValueError, "fp8_path: expected None for a bf16",
                 id="fp8-path-on-bf16"),
    pytest.param(dict(query_start_loc=torch.tensor([0, 1, 7], device=DEVICE)), ValueError, "query_start_loc.dtype", id="qsl-int64"),
    pytest.param(dict(seq_lens=torch.tensor([9, 8, 1], dtype=i32, device=DEVICE)), ValueError, r"seq_lens.shape: expected \(2,\)",
                 id="seq-lens-R"),
    pytest.param(dict(block_table=torch.zeros(3, 2, dtype=i32, device=DEVICE)), ValueError, r"block_table.shape: expected \(2, \*\)",
                 id="bt-rows"),
    pytest.param(dict(slot_mapping=torch.zeros(7, 1, dtype=i32, device=DEVICE)), ValueError, r"slot_mapping.dim\(\)", id="slots-2d"),
    pytest.param(dict(slot_mapping=torch.zeros(7, dtype=i32, device="meta")), ValueError, "slot_mapping.device",
                 id="mixed-devices"),
    pytest.param(dict(slot_mapping=torch.zeros(5, dtype=i32, device=DEVICE)), ValueError, r"sum\(query_lens_cpu\): expected <= num tokens 5",
                 id="tokens-short"),
    pytest.param(dict(query_lens_cpu=[1, 6, 1]), ValueError, r"len\(query_lens_cpu\): expected 2", id="qlens-R"),
    pytest.param(dict(query_lens_cpu=torch.tensor([1, 6], device="meta")), ValueError, "query_lens_cpu.device",
                 id="qlens-device"),
    pytest.param(dict(seq=[9, 5]), ValueError, r"seq_lens\[1\]: expected >= its query length 6", id="seq-lt-query"),
    pytest.param(dict(seq=[9, 40], workspace_rows=32), ValueError, r"seq_lens\[0\]: expected <= workspace_rows = 32",
                 id="prefill-over-workspace"),
    pytest.param(dict(max_query_len=-1), ValueError, "max_query_len: expected None or an int >= 0", id="max-q-negative"),
    pytest.param(dict(max_query_len=True), ValueError, "max_query_len: expected None or an int >= 0", id="max-q-bool"),
    pytest.param(dict(req_id_out=torch.zeros(7, dtype=torch.int64, device=DEVICE)), ValueError, "req_id_out.dtype",
                 id="req-id-out-int64"),
    pytest.param(dict(req_id_out=torch.zeros(6, dtype=i32, device=DEVICE)), ValueError,
                 r"req_id_out.shape\[0\]: expected >= 7", id="req-id-out-short"),
    pytest.param(dict(req_id_out=torch.zeros(8, 1, dtype=i32, device=DEVICE)), ValueError, r"req_id_out.dim\(\)",
                 id="req-id-out-2d"),
    pytest.param(dict(req_id_out=torch.zeros(16, dtype=i32, device=DEVICE)[::2]), ValueError,
                 "req_id_out: expected a contiguous tensor", id="req-id-out-strided"),
    pytest.param(dict(req_id_out=torch.zeros(8, dtype=i32, device="meta")), ValueError, "req_id_out.device",
                 id="req-id-out-device"),
])
def test_build_errors(over, exc, match):
    with pytest.raises(exc, match=match):
        _build(**over)


# ----------------------------------------------------------------------------------------------
# A reused plan checks that it still matches.
# ----------------------------------------------------------------------------------------------
def _inputs(T, H, fmt=FP8_DS_MLA, bs=BLOCK_SIZE, topk=5):
    q = torch.empty(T, H, 576, dtype=torch.bfloat16, device=DEVICE)
    cache = torch.empty(4, bs, fmt.row_width, dtype=fmt.cache_dtype, device=DEVICE)
    return q, cache, torch.zeros(T, topk, dtype=i32, device=DEVICE)


def test_plan_reuse_matches():
    plan = _build()
    assert isinstance(plan, SparseMLAPlan)
    plan.check_matches(*_inputs(7, 64))  # what it was built for: no error
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.num_tokens = 8


@pytest.mark.parametrize("args,match", [
    pytest.param(_inputs(8, 64), r"q.shape\[0\]: expected 7 \(the plan's num_tokens\), got 8", id="tokens"),
    pytest.param(_inputs(7, 32), r"q.shape\[1\]: expected 64 \(the plan's num_heads\), got 32", id="heads"),
    pytest.param(_inputs(7, 64, fmt=BF16_MLA), r"cache: expected \[num_blocks, block_size, 656\] torch.uint8 "
                 r"\(a fp8_ds_mla cache\)", id="cache-format"),
    pytest.param(_inputs(7, 64, bs=64), r"cache.shape\[1\] \(block_size\): expected 16", id="block-size"),
    pytest.param(_inputs(7, 64)[:2] + (torch.zeros(6, 5, dtype=i32, device=DEVICE),),
                 r"topk_indices.shape\[0\]: expected 7", id="indices-rows"),
    pytest.param(_inputs(7, 64)[:2] + (torch.zeros(7, 5, dtype=torch.int64, device=DEVICE),),
                 "topk_indices.dtype", id="indices-int64"),
])
def test_plan_reuse_mismatch_raises(args, match):
    with pytest.raises(ValueError, match=match):
        _build().check_matches(*args)
