"""sparse_mla_decode over MODEL1 (DeepSeek-V4) caches, with and without an extra cache, against
kernels.reference.sparse_mla_decode_ref (fed the same cache bytes, which the oracle unpacks:
format error is not mistaken for kernel error).

Every cache here starts as 0xFF in every byte (NaN nope, NaN rope, NaN ue8m0 scale, the pad byte
and the padding between blocks), blocks lie further apart than FlashMLA's padding, and only the
slots a valid index selects are written. Index lists mix in every kind of invalid index; the
per-tile magnitudes of the keys vary (so the tile scales differ within a block); the softmax
scale is FlashMLA's d_qk ** -0.55. Tolerances: out within "sparse_decode_model1" (FlashMLA's
MODEL1 bounds, its cosine bound included), lse within "lse" (stricter than FlashMLA's).
"""
import pytest
import torch

from openmla.kernels.reference import sparse_mla_decode_ref
from openmla.kernels.sparse_mla_decode import sparse_mla_decode
from openmla.kernels.sparse_mla_decode import op as _op
from openmla.kernels.sparse_mla_decode import sm90_model1
from openmla.kernels.sparse_mla_decode.op import _launch_model1
from openmla.quant import BF16_MLA, FP8_DS_MLA, FP8_MODEL1
from tests.helpers import (DEVICE, GPU_ONLY, SM90_ONLY, assert_close, compile_gluon_sm90, invalid_indices,
                           random_paged_cache)

SCALE = 512 ** -0.55
NEG_INF = float("-inf")


def _gpu(*args, id):
    return pytest.param(*args, id=id, marks=GPU_ONLY)


def model1_cache(num_blocks, block_size, slots, g):
    """A MODEL1 cache, all bytes 0xFF, whose `slots` hold packed random tokens; blocks are 64
    bytes further apart than FlashMLA's padded stride. Keys: N(0, 1) times a power of two in
    [2^-4, 2^1] per (token, tile), so tile scales differ 32-fold within a block. (Wider ranges
    with a peaked softmax make outputs that cancel ~100-fold from terms ~10: any kernel with a
    16-bit P then misses the absolute 1e-3, FlashMLA's bf16 P four times more than this one.)"""
    stride = FP8_MODEL1.padded_block_bytes(block_size) + 64
    cache = FP8_MODEL1.empty_cache(num_blocks, block_size, block_stride=stride, device=DEVICE)
    cache.as_strided((num_blocks, stride), (stride, 1)).fill_(0xFF)
    k = torch.randn(num_blocks, block_size, 512, generator=g)
    mag = 2.0 ** torch.randint(-4, 2, (num_blocks, block_size, 8), generator=g).float()
    k = (k.view(num_blocks, block_size, 8, 64) * mag[..., None]).view(num_blocks, block_size, 512)
    full = FP8_MODEL1.block_view(FP8_MODEL1.pack(k.bfloat16(), block_stride=stride).to(DEVICE))
    dst = FP8_MODEL1.block_view(cache)
    for s in torch.unique(slots).tolist():
        b, r = divmod(s, block_size)
        rec = slice(FP8_MODEL1.record_offset(r), FP8_MODEL1.record_offset(r + 1))
        sc = FP8_MODEL1.token_scale_offset(block_size, r)
        dst[b, rec] = full[b, rec]
        dst[b, sc:sc + FP8_MODEL1.num_tiles] = full[b, sc:sc + FP8_MODEL1.num_tiles]
    return cache


def mla_cache(fmt, num_blocks, block_size, slots, g):
    """A fp8_ds_mla or bf16 cache (strided view, unused rows NaN) whose `slots` are packed."""
    cache, _ = random_paged_cache(num_blocks, block_size, fmt.row_width, fmt.cache_dtype)
    used = torch.unique(slots).long()
    rows = fmt.pack(torch.randn(len(used), 512, generator=g), torch.randn(len(used), 64, generator=g))
    cache[used // block_size, used % block_size] = rows.to(DEVICE)
    return cache


def index_list(T, topk, slots, g, *, n_bad=None):
    """[T, topk] int32 slots uniform over the cache with invalid indices of every kind mixed in."""
    idx = torch.randint(0, slots, (T, topk), generator=g, dtype=torch.int32)
    bad = torch.tensor(invalid_indices(slots), dtype=torch.int32)
    n_bad = min(topk // 3, len(bad)) if n_bad is None else n_bad
    for t in range(T):
        pos = torch.randperm(topk, generator=g)[:n_bad]
        idx[t, pos] = bad[torch.randint(0, len(bad), (len(pos),), generator=g)]
    return idx


def make_case(T, H, topk, nb, bs, extra=None, *, seed, fmt=FP8_MODEL1, q_mul=1.0):
    """(q, cache, indices, extra kwargs) ; extra = (extra_topk, extra_num_blocks, extra_block_size)."""
    g = torch.Generator().manual_seed(seed)
    build = model1_cache if fmt is FP8_MODEL1 else lambda *a: mla_cache(fmt, *a)
    idx = index_list(T, topk, nb * bs, g)
    cache = build(nb, bs, idx[(idx >= 0) & (idx < nb * bs)], g)
    kw = {}
    if extra is not None:
        xtopk, xnb, xbs = extra
        xidx = index_list(T, xtopk, xnb * xbs, g)
        kw = dict(extra_cache=build(xnb, xbs, xidx[(xidx >= 0) & (xidx < xnb * xbs)], g),
                  extra_indices=xidx.to(DEVICE))
    q = (torch.randn(T, H, fmt.head_dim, generator=g) * q_mul).bfloat16()
    return q.to(DEVICE), cache, idx.to(DEVICE), kw


def check(q, cache, idx, *, scale=SCALE, out=None, **kw):
    got, lse = sparse_mla_decode(q, cache, idx, scale=scale, out=out, **kw)
    want, want_lse = sparse_mla_decode_ref(q, cache, idx, scale=scale, **kw)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert_close("out", got, want, "sparse_decode_model1")
    assert_close("lse", lse, want_lse, "lse")
    return got, lse


def lengths(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


# ----------------------------------------------------------------------------------------------
# Head counts, topk, block sizes (FlashMLA's 256 / 64 / 2 and odd ones), with and without extra.
# ----------------------------------------------------------------------------------------------
SHAPES = [  # T, H, topk, num_blocks, block_size, extra (extra_topk, blocks, block_size) or None
    pytest.param(3, 1, 50, 5, 16, None, id="T3-H1-topk50-bs16"),
    pytest.param(2, 8, 1, 40, 2, None, id="T2-H8-topk1-bs2"),
    pytest.param(2, 16, 50, 3, 64, (20, 20, 2), id="T2-H16-topk50-bs64+20-bs2"),
    pytest.param(2, 8, 128, 2, 256, (64, 3, 64), id="T2-H8-topk128-bs256+64-bs64"),
    pytest.param(2, 48, 37, 4, 61, (50, 30, 2), id="T2-H48-topk37-bs61+50-bs2"),
    pytest.param(1, 64, 50, 2, 64, (128, 100, 2), id="T1-H64-topk50-bs64+128-bs2"),
    pytest.param(1, 128, 16, 3, 8, (16, 5, 3), id="T1-H128-topk16-bs8+16-bs3"),
    _gpu(4, 64, 128, 40, 256, (512, 200, 64), id="T4-H64-topk128-bs256+512-bs64"),
    _gpu(4, 128, 128, 40, 256, (1024, 2000, 2), id="T4-H128-topk128-bs256+1024-bs2"),
    _gpu(6, 16, 2048, 40, 64, (576, 30, 61), id="T6-H16-topk2048-bs64+576-bs61"),
    _gpu(5, 32, 576, 50, 53, None, id="T5-H32-topk576-bs53"),
]


@pytest.mark.parametrize("T,H,topk,nb,bs,extra", SHAPES)
def test_shapes(T, H, topk, nb, bs, extra):
    q, cache, idx, kw = make_case(T, H, topk, nb, bs, extra, seed=T * 100 + H + topk)
    check(q, cache, idx, **kw)


# ----------------------------------------------------------------------------------------------
# topk_length / extra_topk_length (0, negative, partial, > topk), sinks (finite, +inf, -inf).
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("main_len,extra_len", [
    pytest.param([0, 7, 50, 1000], None, id="len-0-7-50-1000"),
    pytest.param(None, [0, 3, 40, -2], id="xlen-0-3-40-neg"),
    pytest.param([0, -1, 13, 50], [0, 0, 1, 99], id="len+xlen-both-empty-row0-row1"),
])
@pytest.mark.parametrize("sink", [None, "finite", "inf"])
@pytest.mark.parametrize("H", [16, pytest.param(64, marks=GPU_ONLY)])  # 64: a full Gluon block on Hopper, two Triton head blocks elsewhere
def test_lengths_and_sinks(main_len, extra_len, sink, H):
    T = 4
    q, cache, idx, kw = make_case(T, H, 50, 3, 64, (40, 20, 2), seed=3, q_mul=2.0)
    g = torch.Generator().manual_seed(4)
    if main_len is not None:
        kw["topk_length"] = lengths(main_len)
    if extra_len is not None:
        kw["extra_topk_length"] = lengths(extra_len)
    if sink is not None:
        s = torch.randn(H, generator=g) * 2
        if sink == "inf":  # FlashMLA's generator: some heads +inf (out 0), some -inf (no sink)
            s[::3], s[1::3] = float("inf"), NEG_INF
        kw["attn_sink"] = s.to(DEVICE)
    got, lse = check(q, cache, idx, **kw)
    empty = torch.zeros(T, dtype=torch.bool, device=DEVICE)
    if main_len is not None and extra_len is not None:
        empty = (kw["topk_length"] <= 0) & (kw["extra_topk_length"] <= 0)
        assert bool(empty.any())
    assert bool((got[empty] == 0).all()) and bool((lse[empty] == NEG_INF).all())
    assert bool(torch.isfinite(lse[~empty]).all())


def test_zero_length_extra_equals_no_extra():
    """extra_topk_length 0 everywhere gives what the main list alone gives (the oracle of both)."""
    q, cache, idx, kw = make_case(3, 8, 37, 4, 16, (30, 10, 2), seed=8)
    sink = torch.randn(8).to(DEVICE)
    got, lse = check(q, cache, idx, attn_sink=sink, extra_topk_length=lengths([0, 0, 0]), **kw)
    alone, alone_lse = check(q, cache, idx, attn_sink=sink)
    assert_close("out", got, alone.float(), "sparse_decode_model1")
    assert_close("lse", lse, alone_lse, "lse")


def test_rows_with_no_valid_index():
    """A token whose lists hold only invalid indices (FlashMLA's zero-length cache: all -1, and
    every other invalid kind): out 0, lse -inf, with or without a sink; the others are normal."""
    T, H = 3, 8
    q, cache, idx, kw = make_case(T, H, 37, 4, 16, (30, 10, 2), seed=9)
    bad = lengths(invalid_indices(64))
    idx[0] = bad[torch.arange(37, device=DEVICE) % len(bad)]
    kw["extra_indices"][0] = -1
    kw["extra_indices"][1] = -1  # token 1: main list only
    for sink in (None, torch.full((H,), 3.0, device=DEVICE)):
        got, lse = check(q, cache, idx, attn_sink=sink, **kw)
        assert bool((got[0] == 0).all()) and bool((lse[0] == NEG_INF).all())
        assert bool(torch.isfinite(lse[1:]).all())


# ----------------------------------------------------------------------------------------------
# Splits: any split count, including splits that straddle the main and the extra list, and
# splits that the lengths leave empty, merges to the oracle; s_q > 1 (one index row a token).
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_splits", [1, 2, 3, 5])
def test_forced_splits(num_splits):
    T, H = 2, 16
    q, cache, idx, kw = make_case(T, H, 40, 3, 64, (56, 30, 2), seed=num_splits, q_mul=2.0)
    kw.update(topk_length=lengths([40, 9]), extra_topk_length=lengths([17, 56]))
    sink = torch.randn(H).to(DEVICE)
    out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=DEVICE)
    lse = _launch_model1(q, cache, idx, kw["topk_length"], sink, out, SCALE, FP8_MODEL1,
                         kw["extra_cache"], kw["extra_indices"], kw["extra_topk_length"],
                         config=dict(BLOCK_N=16), num_splits=num_splits)
    want, want_lse = sparse_mla_decode_ref(q, cache, idx, scale=SCALE, attn_sink=sink, **kw)
    assert_close("out", out, want, "sparse_decode_model1")
    assert_close("lse", lse, want_lse, "lse")


@GPU_ONLY
@pytest.mark.parametrize("num_splits", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("H", [64, 128])
def test_forced_splits_64_head_blocks(num_splits, H):
    """The 64-head, 64-key blocks of the Gluon kernel (Hopper; the Triton kernel's 32-head blocks
    elsewhere): splits that straddle the two lists (XSTART = 192), splits the lengths leave empty,
    lengths cutting a block, a sink, in the merge and in the one-split epilogue."""
    T = 3
    q, cache, idx, kw = make_case(T, H, 150, 40, 64, (200, 300, 2), seed=num_splits + H, q_mul=2.0)
    kw.update(topk_length=lengths([150, 9, 0]), extra_topk_length=lengths([131, 200, 70]))
    sink = torch.randn(H).to(DEVICE)
    out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=DEVICE)
    lse = _launch_model1(q, cache, idx, kw["topk_length"], sink, out, SCALE, FP8_MODEL1,
                         kw["extra_cache"], kw["extra_indices"], kw["extra_topk_length"],
                         num_splits=num_splits)
    want, want_lse = sparse_mla_decode_ref(q, cache, idx, scale=SCALE, attn_sink=sink, **kw)
    assert_close("out", out, want, "sparse_decode_model1")
    assert_close("lse", lse, want_lse, "lse")


@SM90_ONLY
@pytest.mark.parametrize("H", [1, 16, 48, 64, 128])
def test_hopper_dispatch(H):
    """On Hopper, MODEL1 runs the Gluon kernel at every head count (so the GPU tests test it there),
    in 64-head blocks; a pinned config, or a cache whose block stride is not a multiple of 16 bytes,
    the Triton kernel."""
    q, cache, idx, kw = make_case(2, H, 64, 4, 64, (32, 20, 2), seed=H)
    plan = _op._plan_model1(q, cache, idx, kw["extra_cache"], kw["extra_indices"], FP8_MODEL1, None, None)
    assert plan[0] is _op._M1_SM90 and plan[1][0] == 2 * -(-H // 64) and plan[3]["BLOCK_H"] == 64
    pinned = _op._plan_model1(q, cache, idx, None, None, FP8_MODEL1, dict(BLOCK_N=32), None)
    assert pinned[0] is _op._M1
    odd = FP8_MODEL1.empty_cache(4, 64, block_stride=FP8_MODEL1.padded_block_bytes(64) + 2, device=DEVICE)
    assert not sm90_model1.usable(q, odd) and sm90_model1.usable(q, cache)


@pytest.mark.skipif(not sm90_model1._GLUON, reason="this Triton has no Gluon: the sm_90 kernel is not built")
@pytest.mark.parametrize("extra,split,roll", [(False, True, False), (True, True, False), (False, False, False),
                                              (True, True, True), (True, False, True)],
                         ids=["split", "extra-split", "staged-out", "roll-extra-split", "roll-extra-staged"])
def test_sm90_model1_kernel_compiles(extra, split, roll):
    """The Gluon kernel cannot run in the interpreter: compile it for sm_90a so that a change
    that breaks it, outgrows shared memory (227 KB; it uses 209 KB) or spills fails on the CPU
    too. Register split score 224 / value 160 / producer 120: no stack without the extra cache, 8
    bytes with it (the producer's second set of cache arguments); the producer at 112 spills 32-64
    bytes, the score warpgroup at 216 (producer 128) 16. Unsplit rows at > 32 heads store their
    bf16 output through shared memory (STAGE_OUT): 16-byte stores, none without it. At <= 64 heads
    the producer is `sm90_model1_gather.producer_roll` (ROLL): the rows as int32 words, converted by
    inline PTX, no more stack than the other producer. At 128 heads (not ROLL) two producers of half
    a block at 64 registers each (score 224 / value 160 / 64 / 64) keep a few loop-invariant words
    of their list position on the stack (SASS, 2026-11-29): 16 bytes, 32 with the extra cache."""
    got = compile_gluon_sm90(
        "openmla.kernels.sparse_mla_decode.sm90_model1", "sparse_mla_decode_sm90_model1_kernel",
        dict(E4M3=True, HAS_LEN=True, HAS_EXTRA=extra, HAS_XLEN=extra, HAS_SINK=True, SPLIT=split,
             BLOCK_H=sm90_model1.BLOCK_H, BLOCK_N=sm90_model1.BLOCK_N, TILE=64, NT=7, ROPE=64, REC=576,
             ROPE_OFF=448, SCALE_BYTES=8, STAGE_OUT=not split, ROLL=roll),
        ["*bf16", "*u8", "*i32", "*i32", "*u8", "*i32", "*i32", "*fp32", "*bf16", "*fp32", "*fp32", "*fp32"],
        sm90_model1.NUM_WARPS,
        # the output's strides as a launch specializes them (multiples of 16: 16-byte stores)
        named_ptrs=dict(stride_ot="i32", stride_oh="i32"))
    # unsplit rows: 0 or 16 bytes of stack by the flags, with the direct stores as with the staged
    # ones (HAS_LEN False / True: 16 / 0 direct, 0 / 16 staged; ptxas at the register split's edge)
    stack = (8 * extra if split else 16) if roll else 16 + 16 * extra
    assert got["shared"] <= 227 * 1024 and got["regs"] <= 255 and got["stack"] <= stack, got
    # wgmma; 16-byte gathers into registers (the bytes are converted before they reach shared memory)
    assert got["hgmma"] > 0 and got["ldg128"] > 0 and got["ldgsts"] == 0, got
    assert (got["stg128"] > 0) == (not split), got


def flashmla_case(b, s_q, H, lists, *, seed, zero_seqlen=False):
    """FlashMLA's decode generator (tests/lib.py generate_testcase_for_decode) in openmla's layout:
    T = b * s_q token rows. lists: ((s_k, topk, block_size, with_length), ...), the main list then
    optionally the extra one. Per list: request lengths ~ N(s_k, s_k / 2) clipped to >= s_q (with
    zero_seqlen 0 in both lists for request 0 and about half the others), each request's blocks from a shuffled table, each token
    `topk` distinct positions of its request (-1 past its length), keys N(0, 1) / 10 clamped to
    [-1, 1], every slot no counted index selects NaN (0xFF bytes, scales included), lengths drawn
    per request in [0, topk] and given to each of its tokens. q in [-1, 1]; sinks with +-inf heads.
    Returns (q, cache, indices, kw) for `check`."""
    g = torch.Generator().manual_seed(seed)
    T = b * s_q
    q = torch.randn(T, H, 512, generator=g).clamp(-1, 1).bfloat16()
    sink = torch.randn(H, generator=g)
    sink[::4], sink[1::4] = float("inf"), NEG_INF
    kw = {"attn_sink": sink.to(DEVICE)}
    zero = (torch.rand(b, generator=g) < 0.5) | (torch.arange(b) == 0)  # request 0 always
    for prefix, (s_k, K, bs, with_len) in zip(("", "extra_"), lists):
        seq = torch.normal(float(s_k), s_k / 2, (b,), generator=g).clamp_min(s_q).long()
        if zero_seqlen:
            seq[zero] = 0
        per_req = -(-max(int(seq.max()), 1) // (4 * bs)) * 4  # blocks a request, as FlashMLA pads
        nb = b * per_req
        table = torch.randperm(nb, generator=g).view(b, per_req)
        idx = torch.full((T, K), -1, dtype=torch.int32)
        for t in range(T):
            pos = torch.randperm(int(seq[t // s_q]), generator=g)[:K]
            idx[t, :len(pos)] = (table[t // s_q, pos // bs] * bs + pos % bs).int()
        n = torch.randint(0, K + 1, (b,), generator=g, dtype=torch.int32).repeat_interleave(s_q) if with_len else None
        cache = FP8_MODEL1.pack((torch.randn(nb, bs, 512, generator=g) / 10).clamp(-1, 1).bfloat16())
        counted = idx.clone()
        if n is not None:
            counted[torch.arange(K)[None, :] >= n[:, None]] = -1
        unused = torch.ones(nb * bs, dtype=torch.bool)
        unused[counted[counted >= 0].long()] = False
        view = FP8_MODEL1.block_view(cache)
        view[:, :FP8_MODEL1.scales_offset(bs)].unflatten(1, (bs, FP8_MODEL1.record_bytes))[unused.view(nb, bs)] = 0xFF
        view[:, FP8_MODEL1.scales_offset(bs):].unflatten(1, (bs, FP8_MODEL1.scale_stride))[unused.view(nb, bs)] = 0xFF
        kw.update({prefix + "cache": cache.to(DEVICE), prefix + "indices": idx.to(DEVICE)})
        if n is not None:
            kw[prefix + "topk_length"] = n.to(DEVICE)
    return q.to(DEVICE), kw.pop("cache"), kw.pop("indices"), kw


FLASHMLA_CASES = [  # b, s_q, H, ((s_k, topk, block_size, with_length), extra or nothing), zero_seqlen
    pytest.param(2, 2, 64, ((200, 64, 64, True), (60, 40, 2, True)), False, id="b2-sq2-H64-64bs64L+40bs2L"),
    pytest.param(3, 1, 8, ((100, 37, 61, False), (50, 24, 2, True)), True, id="b3-sq1-H8-zero-seqlen"),
    _gpu(4, 3, 64, ((512, 64, 2, True), (2046, 2048, 64, False)), False, id="b4-sq3-H64-64bs2L+2048bs64"),
    _gpu(37, 3, 128, ((1024, 576, 61, False), (512, 64, 69, True)), False, id="b37-sq3-H128-576bs61+64bs69L"),
    _gpu(4, 1, 128, ((2046, 2048, 576, True),), False, id="b4-sq1-H128-2048bs576L"),
    _gpu(37, 3, 64, ((650, 576, 53, True), (512, 64, 61, True)), True, id="b37-sq3-H64-zero-seqlen"),
    *[_gpu(4, 2, h, ((1024, 576, 61, True), (2046, 2048, 2, True)), False, id=f"b4-sq2-H{h}-576bs61L+2048bs2L")
      for h in (1, 8, 16, 32, 48)],
]


@pytest.mark.parametrize("b,s_q,H,lists,zero_seqlen", FLASHMLA_CASES)
def test_flashmla_generator(b, s_q, H, lists, zero_seqlen):
    """FlashMLA's correctness and corner cases (its generator, s_q > 1: one index row a token),
    and head counts FlashMLA cannot run."""
    q, cache, idx, kw = flashmla_case(b, s_q, H, lists, seed=b * 10 + H, zero_seqlen=zero_seqlen)
    got, lse = check(q, cache, idx, **kw)
    if zero_seqlen:  # a request with no cache tokens in either list: out 0, lse -inf
        empty = (idx < 0).all(1)
        if "extra_indices" in kw:
            empty &= (kw["extra_indices"] < 0).all(1)
        assert bool(empty.any()) and bool((got[empty] == 0).all()) and bool((lse[empty] == NEG_INF).all())


# ----------------------------------------------------------------------------------------------
# Faults stay visible: a NaN in a selected token's nope byte, rope or scale byte makes the rows
# that attend it NaN (out and lse); past topk_length, or unselected, it never shows.
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["nope", "rope", "scale"])
@pytest.mark.parametrize("which", ["main", "extra"])
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("H", [8, pytest.param(64, marks=GPU_ONLY)])  # 64: a full Gluon block on Hopper, two Triton head blocks elsewhere
def test_faults(where, which, num_splits, H):
    T = 3
    q, cache, idx, kw = make_case(T, H, 32, 3, 16, (24, 12, 2), seed=21)
    c, i, bs = (cache, idx, 16) if which == "main" else (kw["extra_cache"], kw["extra_indices"], 2)
    slots = c.shape[0] * bs
    pos = int(((i[1] >= 0) & (i[1] < slots)).nonzero()[0])  # token 1's first valid (written) slot
    slot = int(i[1, pos])
    i[i == slot] = -1
    i[1, pos] = slot  # now attended by token 1 at `pos` only
    blk, row = divmod(slot, bs)
    at = {"nope": FP8_MODEL1.record_offset(row) + 100,  # tile 1
          "rope": FP8_MODEL1.record_offset(row) + FP8_MODEL1.rope_offset + 2 * 17,  # bf16 0xFFFF
          "scale": FP8_MODEL1.token_scale_offset(bs, row) + 6}[where]
    FP8_MODEL1.block_view(c)[blk, at:at + (2 if where == "rope" else 1)] = 0x7F if where == "nope" else 0xFF
    out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=DEVICE)
    lse = _launch_model1(q, cache, idx, None, None, out, SCALE, FP8_MODEL1, kw["extra_cache"],
                         kw["extra_indices"], None, num_splits=num_splits)
    want, want_lse = sparse_mla_decode_ref(q, cache, idx, scale=SCALE, **kw)
    assert bool(torch.isnan(want[1]).all()) and not bool(torch.isnan(want[[0, 2]]).any())
    assert_close("out", out, want, "sparse_decode_model1")
    assert_close("lse", lse, want_lse, "lse")
    # the same fault past the row's length is not attended
    name = "topk_length" if which == "main" else "extra_topk_length"
    kw[name] = lengths([i.shape[1], pos, i.shape[1]])
    got, lse = check(q, cache, idx, **kw)
    assert bool(torch.isfinite(lse).all())


# ----------------------------------------------------------------------------------------------
# The extra cache beside the other formats (FlashMLA's reference defines it for any layout).
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", [FP8_DS_MLA, BF16_MLA], ids=["fp8_ds_mla", "bf16"])
def test_extra_cache_other_formats(fmt):
    T, H = 3, 8
    q, cache, idx, kw = make_case(T, H, 37, 4, 16, (30, 20, 2), seed=31, fmt=fmt, q_mul=2.0)
    kw.update(topk_length=lengths([37, 0, 5]), extra_topk_length=lengths([3, 30, 0]),
              attn_sink=torch.randn(H).to(DEVICE))
    check(q, cache, idx, **kw)


def test_out_argument_and_custom_op():
    """out= is written in place; the registered op passes opcheck with the extra tensors."""
    q, cache, idx, kw = make_case(2, 3, 20, 2, 16, (10, 8, 2), seed=41)
    buf = torch.full((2, 4, 1024), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got, _ = check(q, cache, idx, out=buf[:, 1:, 256:768], **kw)
    assert got.data_ptr() == buf[:, 1:, 256:768].data_ptr() and bool(torch.isnan(buf[:, 0]).all())
    out = torch.empty(2, 3, 512, dtype=torch.bfloat16, device=DEVICE)
    torch.library.opcheck(torch.ops.openmla.sparse_mla_decode.default,
                          (q, cache, idx, None, None, out, SCALE, FP8_MODEL1.name, kw["extra_cache"],
                           kw["extra_indices"], None), test_utils=("test_schema", "test_faketensor"))


@GPU_ONLY
@pytest.mark.parametrize("H", [16, 64])
def test_cuda_graph_replay_with_new_inputs(H):
    """Captured once (main + extra cache, both lengths, sink), replayed with new q, indices,
    lengths and cache bytes: each replay matches the oracle for the inputs it saw (the op reads no
    device tensor on the host)."""
    T, topk, xtopk = 32, 128, 512
    q, cache, idx, kw = make_case(T, H, topk, 40, 256, (xtopk, 600, 2), seed=H)
    kw.update(topk_length=lengths([topk] * T), extra_topk_length=lengths([xtopk] * T),
              attn_sink=torch.randn(H).to(DEVICE))
    out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=DEVICE)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (compile) outside the capture
        sparse_mla_decode(q, cache, idx, scale=SCALE, out=out, **kw)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse = sparse_mla_decode(q, cache, idx, scale=SCALE, out=out, **kw)
    for seed in (1, 2):
        q2, cache2, idx2, kw2 = make_case(T, H, topk, 40, 256, (xtopk, 600, 2), seed=100 + seed, q_mul=2.0)
        for dst, src in ((q, q2), (cache, cache2), (idx, idx2), (kw["extra_cache"], kw2["extra_cache"]),
                         (kw["extra_indices"], kw2["extra_indices"])):
            dst.copy_(src)
        kw["topk_length"].copy_(torch.randint(0, topk + 5, (T,), dtype=torch.int32))
        kw["extra_topk_length"].copy_(torch.randint(-1, xtopk + 5, (T,), dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want, want_lse = sparse_mla_decode_ref(q, cache, idx, scale=SCALE, **kw)
        assert_close("out", out, want, "sparse_decode_model1")
        assert_close("lse", lse, want_lse, "lse")


# ----------------------------------------------------------------------------------------------
# Bad arguments: ValueError naming the tensor, before any launch.
# ----------------------------------------------------------------------------------------------
def test_bad_arguments():
    q, cache, idx, kw = make_case(2, 4, 8, 2, 4, (6, 3, 2), seed=51)
    xc, xi = kw["extra_cache"], kw["extra_indices"]

    def raises(match, q=q, cache=cache, idx=idx, **kw):
        with pytest.raises(ValueError, match=match):
            sparse_mla_decode(q, cache, idx, scale=SCALE, **kw)

    raises("extra_indices / extra_topk_length: expected None without extra_cache", extra_indices=xi)
    raises("extra_indices / extra_topk_length", extra_topk_length=lengths([1, 1]))
    raises("extra_indices: expected \\[T, extra_topk\\] int32 with extra_cache", extra_cache=xc)
    raises("extra_indices", extra_cache=xc, extra_indices=xi.long())
    raises("extra_indices.shape\\[0\\]: expected 2", extra_cache=xc, extra_indices=xi[:1])
    raises("extra_indices.shape\\[1\\] \\(topk\\): expected >= 1", extra_cache=xc, extra_indices=xi[:, :0])
    raises("extra_topk_length", extra_cache=xc, extra_indices=xi, extra_topk_length=lengths([1, 1, 1]))
    fp8_cache, _ = random_paged_cache(2, 4, FP8_DS_MLA.row_width, torch.uint8)
    raises("fmt: expected a format of the extra_cache", extra_cache=fp8_cache, extra_indices=xi)
    raises("q.shape\\[-1\\]: expected 512", q=torch.zeros(2, 4, 576, dtype=torch.bfloat16, device=DEVICE))
    raises("cache.stride\\(1\\): expected 584", cache=torch.zeros(2, 4, 600, dtype=torch.uint8,
                                                                  device=DEVICE)[..., :584])
    raises("extra_cache.shape: expected num_blocks >= 1", extra_cache=xc[:0], extra_indices=xi)
