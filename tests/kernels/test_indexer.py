"""kernels/indexer: paged decode logits, ragged prefill logits and the per-row top-k against the
fp32 oracles of kernels/reference/indexer.py, on adversarial inputs (NaN-filled unused cache
rows, invalid block-table entries of every kind, shuffled pages, zero lengths, rows shorter than
k, ties, NaN and inf logits)."""
import sys

import pytest
import torch

from openmla.kernels.device import num_sms
from openmla.kernels.indexer import decode_topk, mqa_logits, paged_mqa_logits, topk_per_row
from openmla.kernels.indexer.mqa_logits import MQA_LOGITS_CONFIGS, mqa_logits_kernel
from openmla.kernels.reference import (indexer_q_quant_ref, indexer_topk_ref, mqa_logits_ref,
                                       paged_mqa_logits_ref, topk_per_row_ref)
from openmla.quant.indexer_cache import INDEXER_K_FP8, write_indexer_k_cache
from tests.helpers import DEVICE, GPU_ONLY, INT32_MAX, INT32_MIN
from tests.helpers.indexer import FP8_MMA_REL, abs_index_cache

D = 128


def assert_logits(name, got, want, bound, rel=FP8_MMA_REL):
    """Same NaN / +-inf positions as the oracle, and |got - want| <= rel * bound, bound = the
    oracle's logits of |q|, |w|, |k| (what the accumulation error scales with)."""
    for what, fn in (("NaN", torch.isnan), ("+inf", lambda x: x == float("inf")),
                     ("-inf", lambda x: x == float("-inf"))):
        bad = fn(got.cpu()) != fn(want.cpu())
        assert not bad.any(), f"{name}: {what} positions differ at {bad.nonzero()[:4].tolist()}"
    fin = torch.isfinite(want)
    err = (got[fin].double() - want[fin].double()).abs()
    lim = rel * bound[fin].double() + 1e-30
    worst = int((err / lim).argmax()) if err.numel() else 0
    assert bool((err <= lim).all()), (f"{name}: {int((err > lim).sum())} logits off by more than "
                                      f"{rel:.3g} of their bound; worst err {err[worst]:.3g} vs {lim[worst]:.3g}")


def _paged_bound(q, w, cache, cl, table, max_len):
    return paged_mqa_logits_ref(q.float().abs(), w.abs(), abs_index_cache(cache, INDEXER_K_FP8), cl, table,
                                max_model_len=max_len)


def _q_w(rows, H, seed):
    """q [rows, H, 128] e4m3fn and folded weights [rows, H], as the model's Indexer makes them."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, H, D, generator=g)
    q[:, :, 3] *= 20.0
    w = torch.randn(rows, H, generator=g)
    qf, wf = indexer_q_quant_ref(q.to(torch.bfloat16), w, softmax_scale=D ** -0.5, head_scale=H ** -0.5)
    return qf.to(DEVICE), wf.to(DEVICE)


def _paged_cache(num_blocks, block_size, seed, *, pad_bytes=8):
    """A cache whose every byte is 0xFF (NaN fp8 values, NaN scales) until written, as a strided
    view (block stride above the block's bytes); returns (cache, write(keys [n, 128], slots))."""
    w = INDEXER_K_FP8.bytes_per_token
    back = torch.full((num_blocks, block_size * w + pad_bytes), 0xFF, dtype=torch.uint8, device=DEVICE)
    cache = back.as_strided((num_blocks, block_size, w), (block_size * w + pad_bytes, w, 1))
    return cache


def _paged_batch(ctx, next_n, H, block_size, seed, *, table_extra=2, bad_pages=(), pad_bytes=8):
    """Requests with context lengths `ctx` over shuffled pages of a NaN-filled cache holding only
    their keys. bad_pages: (request, page index, value) block-table entries to corrupt."""
    g = torch.Generator().manual_seed(seed)
    B = len(ctx)
    pages = [-(-c // block_size) for c in ctx]
    M = max(pages + [1]) + table_extra
    num_blocks = sum(pages) + 3
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((B, M), -1, dtype=torch.int32)
    cache = _paged_cache(num_blocks, block_size, seed, pad_bytes=pad_bytes)
    used = 0
    for b, (c, p) in enumerate(zip(ctx, pages)):
        table[b, :p] = perm[used:used + p].to(torch.int32)
        used += p
        if c:
            k = torch.randn(c, D, generator=g).to(torch.bfloat16).to(DEVICE)
            pos = torch.arange(c)
            slots = table[b, pos // block_size].long() * block_size + pos % block_size
            write_indexer_k_cache(k, cache, slots.to(DEVICE))
    for b, i, v in bad_pages:
        table[b, i] = v
    q, w = _q_w(B * next_n, H, seed + 1)
    return q.view(B, next_n, H, D), w, cache, table.to(DEVICE)


PAGED = [
    pytest.param([37, 1, 64], 1, 64, 16, None, id="B3-n1-H64-bs16"),
    pytest.param([5, 130], 2, 64, 64, None, id="B2-n2-H64-bs64"),
    pytest.param([9, 3, 0, 20], 3, 16, 4, None, id="B4-n3-H16-bs4-len0"),
    pytest.param([40, 7], 2, 64, 8, [[40, 38], [7, 7]], id="B2-n2-per-row-lens"),
    pytest.param([50], 4, 32, 1, None, id="B1-n4-H32-bs1"),
    pytest.param([20, 1, 33, 16, 0, 5, 64, 17], 1, 64, 16, None, id="B8-n1-H64-bs16"),  # q by TMA on sm_90
]


@pytest.mark.parametrize("clean", [True, False], ids=["clean", "unclean"])
@pytest.mark.parametrize("ctx,next_n,H,bs,per_row", PAGED)
def test_paged_logits(ctx, next_n, H, bs, per_row, clean):
    q, w, cache, table = _paged_batch(ctx, next_n, H, bs, seed=len(ctx) * 7 + bs)
    cl = torch.tensor(per_row if per_row else ctx, dtype=torch.int32, device=DEVICE)
    max_len = max(ctx) + 5
    want = paged_mqa_logits_ref(q, w, cache, cl, table, max_model_len=max_len)
    got = paged_mqa_logits(q, w, cache, cl, table, max_model_len=max_len, clean_logits=clean, block_n=16)
    bound = _paged_bound(q, w, cache, cl, table, max_len)
    if clean:
        assert_logits("logits", got, want, bound)
    else:  # only what a row can see is promised
        vis = torch.isfinite(want)
        assert_logits("visible logits", got[vis], want[vis], bound[vis])


def test_paged_logits_invalid_pages_and_table_width():
    """Block-table entries < 0, >= num_blocks, INT32_MIN/MAX: positions -inf, never read; a
    context longer than the table's pages reads nothing past the table."""
    ctx = [40, 33]
    bad = [(0, 0, -1), (0, 2, INT32_MAX), (1, 1, INT32_MIN), (1, 3, 10 ** 6)]
    q, w, cache, table = _paged_batch(ctx, 1, 64, 8, seed=3, table_extra=0, bad_pages=bad)
    cl = torch.tensor([40, 45], dtype=torch.int32, device=DEVICE)  # request 1 past its table
    want = paged_mqa_logits_ref(q, w, cache, cl, table, max_model_len=64)
    got = paged_mqa_logits(q, w, cache, cl, table, max_model_len=64, block_n=16)
    assert_logits("logits", got, want, _paged_bound(q, w, cache, cl, table, 64))
    assert torch.isinf(got[0, :8]).all() and torch.isinf(got[1, 8:16]).all() and torch.isinf(got[1, 40:]).all()
    assert torch.isfinite(got[0, 8:16]).all()


def test_paged_logits_faults_stay_visible():
    """NaN in one visible key makes exactly that position NaN; a NaN q head makes the row NaN."""
    q, w, cache, table = _paged_batch([30, 30], 1, 64, 16, seed=5)
    vals, scales = INDEXER_K_FP8.read_ref(cache)
    p = int(table[0, 1])
    vals[p, 3, 17] = 0x7F  # key 19 of request 0: a NaN element
    q = q.clone()
    q.view(torch.uint8)[1, 0, 5, 0] = 0x7F  # request 1's q: NaN in one head
    cl = torch.tensor([30, 30], dtype=torch.int32, device=DEVICE)
    want = paged_mqa_logits_ref(q, w, cache, cl, table, max_model_len=32)
    got = paged_mqa_logits(q, w, cache, cl, table, max_model_len=32, block_n=16)
    assert_logits("logits", got, want, _paged_bound(q, w, cache, cl, table, 32))
    assert torch.isnan(got[0]).nonzero().flatten().tolist() == [19]
    assert torch.isnan(got[1, :30]).all() and torch.isinf(got[1, 30:]).all()


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_logits_gpu_paths(arch):
    """The paths other GPUs take, run in the interpreter: sm_90's fp8 dot on float8 pointers,
    sm_80's integer e4m3 widening to an fp16 dot (kernels.device.assume)."""
    from openmla.kernels.device import ARCHES, assume
    q, w, cache, table = _paged_batch([37, 9], 2, 64, 16, seed=21)
    cl = torch.tensor([37, 9], dtype=torch.int32, device=DEVICE)
    want = paged_mqa_logits_ref(q, w, cache, cl, table, max_model_len=40)
    ks = torch.tensor([0, 0, 3], dtype=torch.int32, device=DEVICE)
    ke = torch.tensor([5, 40, 9], dtype=torch.int32, device=DEVICE)
    vals, sc = INDEXER_K_FP8.read_ref(cache)
    k8, ksc = vals[table[0, :3].long()].reshape(-1, D).view(torch.float8_e4m3fn), sc[table[0, :3].long()].reshape(-1)
    qr, wr = q[0], w[:2]
    qr = torch.cat([qr, q[1, :1]])
    wr = torch.cat([wr, w[2:3]])
    want_r = mqa_logits_ref(qr, wr, k8, ksc, ks, ke)
    with assume(ARCHES[arch]):
        got = paged_mqa_logits(q, w, cache, cl, table, max_model_len=40, block_n=16)
        got_r = mqa_logits(qr, wr, k8, ksc.contiguous(), ks, ke)
    assert_logits("paged logits", got, want, _paged_bound(q, w, cache, cl, table, 40))
    bound_r = mqa_logits_ref(qr.float().abs(), wr.abs(), k8.float().abs(), ksc, ks, ke)
    assert_logits("ragged logits", got_r, want_r, bound_r)


@pytest.mark.parametrize("ctx,next_n,H,bs,per_row", [p for p in PAGED if p.values[3] >= 16])
def test_paged_logits_tma_pages(ctx, next_n, H, bs, per_row):
    """sm_90's TMA path (a tile is a page: its keys by a tensor descriptor, its scales by pointer
    for one-row requests and by a second descriptor for several) in the interpreter, on the PAGED
    cases whose page can be a TMA box, incl. invalid pages, a key fault and a block stride that is
    not a multiple of 16 (the pointer path then). Batches of 8 query rows take the query block by
    TMA too."""
    from openmla.kernels.device import ARCHES, assume
    from openmla.kernels.indexer.paged_mqa_logits import _query_descriptor, _tma_ok
    bad = [(0, 1, -1), (len(ctx) - 1, 0, INT32_MAX)]
    q, w, cache, table = _paged_batch(ctx, next_n, H, bs, seed=31 + bs, bad_pages=bad, pad_bytes=16)
    vals, _ = INDEXER_K_FP8.read_ref(cache)
    vals[int(table[0, 0]), 2, 9] = 0x7F  # key 2 of request 0: NaN
    cl = torch.tensor(per_row if per_row else ctx, dtype=torch.int32, device=DEVICE)
    max_len = max(ctx) + 5
    want = paged_mqa_logits_ref(q, w, cache, cl, table, max_model_len=max_len)
    bound = _paged_bound(q, w, cache, cl, table, max_len)
    assert _tma_ok(ARCHES["sm_90"], True, cache)
    assert (_query_descriptor(q, True) is not None) == (len(ctx) * next_n >= 8)
    with assume(ARCHES["sm_90"]):
        got = paged_mqa_logits(q, w, cache, cl, table, max_model_len=max_len)
    assert_logits("logits", got, want, bound)
    assert torch.isnan(got[:next_n, 2]).all()
    padded = _paged_cache(cache.shape[0], bs, seed=1, pad_bytes=4)
    padded.copy_(cache)
    assert not _tma_ok(ARCHES["sm_90"], True, padded)
    with assume(ARCHES["sm_90"]):
        got = paged_mqa_logits(q, w, padded, cl, table, max_model_len=max_len)
    assert_logits("logits (pointer path)", got, want, bound)


RAGGED = [  # (ks, ke, S)
    pytest.param([0, 0, 0, 5, 5, 5, 5], [1, 2, 3, 6, 7, 8, 9], 9, id="causal-2req"),
    pytest.param([0, 3, 10, 140, 7, 20, -5], [40, 3, 100, 150, 2, 400, 6], 150, id="irregular-empty-clip"),
    pytest.param([0] * 5, [70] * 5, 70, id="full-rows"),
]


def _only_config(monkeypatch, i):
    """Run mqa_logits with candidate i of its config space only (every tile shape is tested)."""
    cfg = MQA_LOGITS_CONFIGS.candidates[i]
    monkeypatch.setattr(mqa_logits_kernel, "configs", [cfg])
    monkeypatch.setattr(mqa_logits_kernel, "cache", {})
    return cfg


@pytest.mark.parametrize("config", range(len(MQA_LOGITS_CONFIGS.candidates)))
def test_ragged_logits_every_config(config, monkeypatch):
    _only_config(monkeypatch, config)
    test_ragged_logits([0, 3, 10, 140, 7, 20, -5], [40, 3, 100, 150, 2, 400, 6], 150, 16)


@pytest.mark.parametrize("H", [64, 8])
@pytest.mark.parametrize("ks,ke,S", RAGGED)
def test_ragged_logits(ks, ke, S, H):
    T = len(ks)
    q, w = _q_w(T, H, seed=S + H)
    g = torch.Generator().manual_seed(S)
    k_vals, k_sc = INDEXER_K_FP8.pack(torch.randn(S, D, generator=g).to(DEVICE))
    ks_t = torch.tensor(ks, dtype=torch.int32, device=DEVICE)
    ke_t = torch.tensor(ke, dtype=torch.int32, device=DEVICE)
    # keys no row sees hold NaN: they must never reach a logit
    seen = torch.zeros(S, dtype=torch.bool)
    for a, e in zip(ks, ke):
        seen[max(a, 0):max(min(e, S), 0)] = True
    k_vals[~seen.to(DEVICE)] = 0x7F
    k_sc[~seen.to(DEVICE)] = float("nan")
    k8 = k_vals.view(torch.float8_e4m3fn)
    want = mqa_logits_ref(q, w, k8, k_sc[:, 0], ks_t, ke_t)
    got = mqa_logits(q, w, k8, k_sc[:, 0].contiguous(), ks_t, ke_t)
    bound = mqa_logits_ref(q.float().abs(), w.abs(), k8.float().abs(), k_sc[:, 0], ks_t, ke_t)
    assert_logits("logits", got, want, bound)
    got_u = mqa_logits(q, w, k8, k_sc[:, 0].contiguous(), ks_t, ke_t, clean_logits=False)
    vis = torch.isfinite(want)
    assert_logits("visible logits", got_u[vis], want[vis], bound[vis])


def _check_topk(got, logits, ends, k, starts=None):
    """got equals the oracle up to ties: same length, -1 padding, distinct in-range columns,
    and the same multiset of logits (NaN counted as NaN)."""
    want = topk_per_row_ref(logits, ends, k, starts=starts)
    R, L = logits.shape
    assert got.shape == (R, k) and got.dtype == torch.int32
    st = [0] * R if starts is None else starts.tolist()
    for r in range(R):
        g, w_ = got[r].tolist(), want[r].tolist()
        n_valid = sum(i >= 0 for i in w_)
        assert all(i >= 0 for i in g[:n_valid]) and all(i == -1 for i in g[n_valid:]), (r, g)
        gs = g[:n_valid]
        assert len(set(gs)) == n_valid, (r, "duplicates")
        a = max(0, min(st[r], L))
        e = max(a, min(int(ends[r]), L))
        assert all(0 <= i < e - a for i in gs), (r, gs)
        if e - a <= k:
            assert gs == list(range(e - a)), r
            continue
        # values compared as numbers (-0.0 == 0.0 is a tie), NaN as NaN
        vg = sorted((v != v, 0.0 if v != v else v) for v in logits[r, [a + i for i in gs]].tolist())
        vw = sorted((v != v, 0.0 if v != v else v) for v in logits[r, [a + i for i in w_[:n_valid]]].tolist())
        assert vg == vw, (r, "selected values differ")


def _topk_logits(R, L, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(max(R, 5), L, generator=g)
    x[1] = torch.randint(0, 5, (L,), generator=g).float()  # heavy ties
    x[2, 3], x[2, 11], x[2, 12], x[2, 40] = float("nan"), float("inf"), float("-inf"), -float("nan")
    x[3] = float("-inf")  # a visible row of -inf: still real keys
    x[4, ::2] = -0.0
    x[4, 1::2] = 0.0
    return x[:R].contiguous().to(DEVICE)


@pytest.mark.parametrize("k", [1, 7, 64, 300, 2048])
@pytest.mark.parametrize("row_programs", [1, 3])
def test_topk_per_row(k, row_programs):
    x = _topk_logits(8, 2500, seed=k)
    starts = torch.tensor([0, 5, 0, 100, 7, 2400, 0, 3], dtype=torch.int32, device=DEVICE)
    ends = torch.tensor([2500, 2400, 1000, 120, 2500, 2500, 0, 2], dtype=torch.int32, device=DEVICE)
    got = topk_per_row(x, ends, k, starts=starts, block=512, row_programs=row_programs)
    _check_topk(got, x, ends, k, starts)


@pytest.mark.parametrize("R, L, k, want", [
    (1, 4096, 2048, (16, 256)),  # one wave: the smallest block whose parts number <= 32 a row
    (8, 4096, 2048, (16, 256)),
    (33, 4096, 2048, (4, 1024)),  # 256 and 512 would need a second wave
    (1, 16384, 2048, (32, 512)),
    (2, 16384, 2048, (32, 512)),
    (8, 16384, 2048, (16, 1024)),
    (1, 65536, 2048, (128, 512)),  # no block gives <= 32 parts in one wave: the smallest in one wave
    (16, 16384, 2048, (16, 512)),  # past one wave: parts of 1024 columns, 512-column steps
    (64, 65536, 2048, (17, 512)),  # ... filling the GPU 8 times
    (10 ** 6, 65536, 2048, (1, 512)),
    (64, 4096, 2048, (1, None)),  # short rows past one wave: one program
    (1, 4096, 4096, (1, None)),  # no selection: every column is taken
    (1, 1024, 2, (1, None)),  # rows of at most 1024 columns: one program
])
def test_topk_split_rule(monkeypatch, R, L, k, want):
    """The default split (host rule), on a GPU of 132 SMs (the H200's, where it was measured)."""
    from openmla.kernels.indexer import topk as topk_module
    monkeypatch.setattr(topk_module, "num_sms", lambda device: 132)
    assert topk_module._split(DEVICE, R, L, k) == want


@pytest.mark.parametrize("k", [5, 300])
def test_topk_split_rows_equal_one_program(k):
    """A row split over P programs gives exactly the one-program result (same columns in the
    same slots, ties taken in column order), whatever P, parts that get no column included."""
    x = _topk_logits(6, 3000, seed=20 + k)
    x[0, 2000:2100] = 50.0  # ties straddling part boundaries, more of them than k
    x[5] = x[1]
    x[5, 1500] = float("nan")
    starts = torch.tensor([0, 3, 0, 10, 0, 999], dtype=torch.int32, device=DEVICE)
    ends = torch.tensor([3000, 2990, 2999, 2000, 3000, 1200], dtype=torch.int32, device=DEVICE)
    one = topk_per_row(x, ends, k, starts=starts, block=256, row_programs=1)
    _check_topk(one, x, ends, k, starts)
    for P in (3, 16):  # parts of 1024 columns; of 256, four of them empty
        got = topk_per_row(x, ends, k, starts=starts, block=256, row_programs=P)
        assert torch.equal(got, one), P


@pytest.mark.parametrize("rows,parts", [(1, 4), (2, 4), (6, 4), (6, 32)])
@pytest.mark.parametrize("limits", [{}, {"_PAIRWISE": 2}, {"_CANDIDATES": 3}])
def test_topk_split_finish_in_the_write_launch(rows, parts, limits, monkeypatch):
    """The last stage runs in the write launch when rows x parts fit one wave (the interpreter's 8
    SMs: 1 and 2 rows of 4 parts; on a GPU all but 6 x 32, which also runs without programmatic
    dependent launch) and in a launch of its own otherwise: the same slots as one program, with
    the bucket ranked pairwise, by radix over the list, and read back from the row (parts past
    the row's 4000 columns get none)."""
    topk = sys.modules["openmla.kernels.indexer.topk"]
    x = _topk_logits(6, 4000, seed=33)
    x[0, 900:3000] = 2.0  # the k-th key's bucket: ties across every part
    ends = torch.tensor([4000, 3999, 3500, 4000, 2500, 4000], dtype=torch.int32, device=DEVICE)[:rows]
    x = x[:rows].contiguous()
    for name, value in limits.items():
        monkeypatch.setattr(topk, name, value)
    one = topk_per_row(x, ends, 300, block=256, row_programs=1)
    _check_topk(one, x, ends, 300)
    launches = []
    finish = topk.topk_split_finish_kernel

    class _Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return finish[grid]
    monkeypatch.setattr(topk, "topk_split_finish_kernel", _Spy())
    got = topk_per_row(x, ends, 300, block=1024, row_programs=parts)
    assert torch.equal(got, one)
    assert len(launches) == (0 if rows * parts <= num_sms(DEVICE) else 1), launches


@pytest.mark.parametrize("row_programs", [1, 4])
def test_topk_bucket_past_the_candidate_list(row_programs, monkeypatch):
    """The k-th key's bucket ranked pairwise (short list), by radix over the list, and read back
    from the row (more keys than the list holds) selects the same columns; so do rows whose bucket
    is taken whole, or holds only ties of the k-th key."""
    x = _topk_logits(6, 2048, seed=9)
    x[0, 100:1900] = 3.0  # the k-th key's bucket: 1800 ties
    x[5, :] = torch.arange(2048, device=DEVICE).float()  # a bucket of a few distinct keys
    ends = torch.full((6,), 2048, dtype=torch.int32, device=DEVICE)
    topk = sys.modules["openmla.kernels.indexer.topk"]
    want = topk_per_row(x, ends, 200, block=256, row_programs=row_programs)
    _check_topk(want, x, ends, 200)
    for name, value in (("_PAIRWISE", 2), ("_CANDIDATES", 3)):
        with monkeypatch.context() as mp:
            mp.setattr(topk, name, value)
            got = topk_per_row(x, ends, 200, block=256, row_programs=row_programs)
        _check_topk(got, x, ends, 200)
        assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values), name


def test_topk_rows_shorter_longer_equal_to_k():
    x = _topk_logits(6, 64, seed=1)
    ends = torch.tensor([16, 15, 17, 0, 64, 1], dtype=torch.int32, device=DEVICE)
    got = topk_per_row(x, ends, 16, block=16)
    _check_topk(got, x, ends, 16)
    assert got[3].eq(-1).all() and got[5].tolist() == [0] + [-1] * 15


def test_topk_out_buffer_and_ends_clipped():
    x = _topk_logits(4, 100, seed=2)
    buf = torch.full((4, 40), 99, dtype=torch.int32, device=DEVICE)
    ends = torch.tensor([INT32_MAX, 100, -5, 50], dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([INT32_MIN, 10, 0, 60], dtype=torch.int32, device=DEVICE)
    out = topk_per_row(x, ends, 30, starts=starts, out=buf[:, 5:35], block=32)
    assert out.data_ptr() == buf[:, 5:35].data_ptr()
    assert buf[:, :5].eq(99).all() and buf[:, 35:].eq(99).all()
    _check_topk(out, x, ends, 30, starts)


@pytest.mark.parametrize("next_n,per_row", [(1, False), (2, False), (3, True)])
def test_decode_topk(next_n, per_row):
    B = 3
    x = _topk_logits(B * next_n, 300, seed=next_n)
    if per_row:
        cl = torch.tensor([[290, 291, 292], [2, 3, 4], [0, 1, 300]], dtype=torch.int32, device=DEVICE)
        ends = cl.reshape(-1)
    else:
        cl = torch.tensor([300, 3, 40], dtype=torch.int32, device=DEVICE)
        j = torch.arange(next_n, device=DEVICE)
        ends = (cl[:, None] - next_n + 1 + j[None, :]).reshape(-1).clamp_min(0).to(torch.int32)
    got = decode_topk(x, cl, next_n, 20, block=64)
    _check_topk(got, x, ends, 20)
    assert torch.equal(indexer_topk_ref(x, cl, next_n, 20) >= 0, got >= 0)
    assert torch.equal(decode_topk(x, cl, next_n, 20, block=64, row_programs=4), got)


def test_decode_step_chain():
    """Writer -> paged logits -> decode top-k equals the oracle chain (sets up to ties)."""
    q, w, cache, table = _paged_batch([70, 20, 130], 2, 64, 16, seed=11)
    cl = torch.tensor([70, 20, 130], dtype=torch.int32, device=DEVICE)
    logits = paged_mqa_logits(q, w, cache, cl, table, max_model_len=160, clean_logits=False)
    got = decode_topk(logits, cl, 2, 32)
    want_logits = paged_mqa_logits_ref(q, w, cache, cl, table, max_model_len=160)
    ends = (cl[:, None] - 1 + torch.arange(2, device=DEVICE)[None, :]).reshape(-1).to(torch.int32)
    _check_topk(got, want_logits, ends, 32)


@pytest.mark.parametrize("bad", ["q_dtype", "q_dim", "weights_shape", "ctx_shape", "table_dtype",
                                 "max_len", "cache_width"])
def test_paged_bad_input(bad):
    q, w, cache, table = _paged_batch([10, 5], 1, 64, 4, seed=1)
    cl = torch.tensor([10, 5], dtype=torch.int32, device=DEVICE)
    kw = dict(max_model_len=16)
    name = {"q_dtype": "q", "q_dim": "q", "weights_shape": "weights", "ctx_shape": "context_lens",
            "table_dtype": "block_table", "max_len": "max_model_len", "cache_width": "cache"}[bad]
    if bad == "q_dtype":
        q = q.float()
    elif bad == "q_dim":
        q = torch.zeros(2, 1, 64, 64, dtype=torch.uint8, device=DEVICE)
    elif bad == "weights_shape":
        w = w[:1]
    elif bad == "ctx_shape":
        cl = torch.zeros(2, 3, dtype=torch.int32, device=DEVICE)
    elif bad == "table_dtype":
        table = table.long()
    elif bad == "max_len":
        kw["max_model_len"] = -1
    elif bad == "cache_width":
        cache = torch.zeros(4, 4, 128, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match=name):
        paged_mqa_logits(q, w, cache, cl, table, **kw)


def test_ragged_and_topk_bad_input():
    q, w = _q_w(3, 64, seed=0)
    k = torch.zeros(10, D, dtype=torch.uint8, device=DEVICE)
    sc = torch.ones(10, device=DEVICE)
    ks = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="ke"):
        mqa_logits(q, w, k, sc, ks, ks[:2])
    with pytest.raises(ValueError, match="k_scale"):
        mqa_logits(q, w, k, sc[:9], ks, ks)
    x = torch.zeros(3, 10, device=DEVICE)
    with pytest.raises(ValueError, match="k"):
        topk_per_row(x, ks, 0)
    with pytest.raises(ValueError, match="ends"):
        topk_per_row(x, ks.long(), 4)
    with pytest.raises(ValueError, match="next_n"):
        decode_topk(x, ks, 2, 4)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="row_programs"):
            topk_per_row(x, ks, 4, row_programs=bad)


# ---------------------------------------------------------------------------------------------
# GPU sizes: DeepSeek-V3.2's shapes (H 64, topk 2048, page 64), long contexts
# ---------------------------------------------------------------------------------------------
@GPU_ONLY
@pytest.mark.parametrize("B,ctx,next_n", [(1, 4096, 1), (8, 16384, 1), (4, 65536, 2), (64, 8192, 1)])
def test_paged_logits_topk_gpu(B, ctx, next_n):
    g = torch.Generator().manual_seed(B)
    lens = torch.randint(ctx // 2, ctx + 1, (B,), generator=g).tolist()
    q, w, cache, table = _paged_batch(lens, next_n, 64, 64, seed=B)
    cl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    want = paged_mqa_logits_ref(q, w, cache, cl, table, max_model_len=ctx)
    got = paged_mqa_logits(q, w, cache, cl, table, max_model_len=ctx)
    assert_logits("logits", got, want, _paged_bound(q, w, cache, cl, table, ctx))
    idx = decode_topk(got, cl, next_n, 2048)
    ends = (cl[:, None] - next_n + 1 + torch.arange(next_n, device=DEVICE)[None, :]).reshape(-1).int()
    _check_topk(idx.cpu(), got.cpu(), ends.cpu(), 2048)


@GPU_ONLY
def test_ragged_logits_topk_gpu():
    lens = [3000, 5000]
    T = sum(lens)
    ks = torch.cat([torch.full((n,), s, dtype=torch.int32) for n, s in zip(lens, [0, lens[0]])])
    ke = torch.cat([torch.arange(1, n + 1, dtype=torch.int32) + s for n, s in zip(lens, [0, lens[0]])])
    q, w = _q_w(T, 64, seed=2)
    k_vals, k_sc = INDEXER_K_FP8.pack(torch.randn(T, D, device=DEVICE))
    k8 = k_vals.view(torch.float8_e4m3fn)
    ks, ke = ks.to(DEVICE), ke.to(DEVICE)
    want = mqa_logits_ref(q, w, k8, k_sc[:, 0], ks, ke)
    got = mqa_logits(q, w, k8, k_sc[:, 0].contiguous(), ks, ke)
    assert_logits("logits", got, want, mqa_logits_ref(q.float().abs(), w.abs(), k8.float().abs(), k_sc[:, 0], ks, ke))
    idx = topk_per_row(got, ke, 2048, starts=ks)
    sub = torch.arange(0, T, 97)
    _check_topk(idx[sub].cpu(), got[sub].cpu(), ke[sub].cpu(), 2048, ks[sub].cpu())
