"""kernels.sparse_mla_decode against kernels.reference.sparse_mla_decode_ref (fed the same cache,
which the oracle unpacks: fp8 cases compare against the dequantized cache, so format error is not
mistaken for kernel error).

Every cache here is a strided view whose unused rows (and each block's hidden extra row) hold NaN
(bytes 0xFF for fp8_ds_mla); only the rows that valid indices select are written. Index sets mix
in every kind of invalid index; the softmax scale is not 1/sqrt(576).
"""
import re

import pytest
import torch

from openmla.kernels.reference import sparse_mla_decode_ref
from openmla.kernels.sparse_mla_decode import sm90 as sm90
from openmla.kernels.sparse_mla_decode import sm90_kn as sm90_kn
from openmla.kernels.sparse_mla_decode import sm90_bf16 as sm90_bf16
from openmla.kernels.sparse_mla_decode import sm90_bf16_kn
from openmla.kernels import device
from openmla.kernels.sparse_mla_decode import op as decode_op
from openmla.kernels.sparse_mla_decode.op import _launch, sparse_mla_decode
from openmla.quant import BF16_MLA, FP8_DS_MLA, FP8_DS_MLA_RAW
from tests.helpers import (DEVICE, GPU_ONLY, SM90_ONLY, assert_close, compile_gluon_sm90, invalid_indices,
                           random_paged_cache)

SCALE = 0.083
FORMATS = {"fp8": FP8_DS_MLA, "fp8raw": FP8_DS_MLA_RAW, "bf16": BF16_MLA}


def _gpu(*args, id):
    return pytest.param(*args, id=id, marks=GPU_ONLY)


def make_inputs(fmt_name, T, H, topk, num_blocks, block_size, *, seed, q_mul=1.0, n_invalid=None):
    """(q, cache view, indices): indices uniform over the slots with invalid ones mixed in; only
    the rows valid indices select are packed, every other row stays NaN."""
    fmt = FORMATS[fmt_name]
    g = torch.Generator().manual_seed(seed)
    slots = num_blocks * block_size
    cache, _ = random_paged_cache(num_blocks, block_size, fmt.row_width, fmt.cache_dtype)
    idx = torch.randint(0, slots, (T, topk), generator=g, dtype=torch.int32)
    bad = torch.tensor(invalid_indices(slots), dtype=torch.int32)
    n_bad = min(topk // 3, len(bad)) if n_invalid is None else n_invalid
    for t in range(T):  # a few invalid indices at random positions of each row
        pos = torch.randperm(topk, generator=g)[:n_bad]
        idx[t, pos] = bad[torch.randint(0, len(bad), (len(pos),), generator=g)]
    used = torch.unique(idx[(idx >= 0) & (idx < slots)]).long()
    kv_c = torch.randn(len(used), 512, generator=g) * 1.5
    k_pe = torch.randn(len(used), 64, generator=g)
    rows = fmt.pack(kv_c, k_pe)
    cache[used // block_size, used % block_size] = rows.to(DEVICE)
    q = (torch.randn(T, H, 576, generator=g) * q_mul).to(torch.bfloat16)
    return q.to(DEVICE), cache, idx.to(DEVICE)


def check(q, cache, idx, *, topk_length=None, attn_sink=None, scale=SCALE, out=None):
    got, lse = sparse_mla_decode(q, cache, idx, scale=scale, topk_length=topk_length,
                                 attn_sink=attn_sink, out=out)
    want, want_lse = sparse_mla_decode_ref(q, cache, idx, scale=scale, topk_length=topk_length,
                                           attn_sink=attn_sink)
    assert got.dtype == q.dtype and got.shape == want.shape
    assert_close("out", got, want, "sparse_decode")
    assert_close("lse", lse, want_lse, "lse")
    return got, lse


# ----------------------------------------------------------------------------------------------
# Regular and irregular shapes: every head count, topk and block size of the issue.
# ----------------------------------------------------------------------------------------------
SHAPES = [  # fmt, T, H, topk, num_blocks, block_size, q_mul (>1 gives peaked softmax rows)
    pytest.param("fp8", 2, 16, 64, 4, 64, 1.0, id="fp8-T2-H16-topk64-bs64"),
    pytest.param("fp8", 3, 1, 37, 5, 61, 3.0, id="fp8-T3-H1-topk37-bs61"),
    pytest.param("fp8", 2, 3, 300, 400, 1, 3.0, id="fp8-T2-H3-topk300-bs1"),
    pytest.param("fp8", 1, 128, 1, 3, 64, 1.0, id="fp8-T1-H128-topk1-bs64"),
    pytest.param("fp8", 2, 24, 37, 3, 61, 3.0, id="fp8-T2-H24-topk37-bs61"),
    pytest.param("fp8raw", 2, 16, 64, 4, 64, 3.0, id="fp8raw-T2-H16-topk64-bs64"),
    pytest.param("bf16", 2, 16, 64, 4, 64, 3.0, id="bf16-T2-H16-topk64-bs64"),
    pytest.param("bf16", 2, 24, 300, 6, 61, 1.0, id="bf16-T2-H24-topk300-bs61"),
    pytest.param("bf16", 3, 3, 1, 50, 1, 1.0, id="bf16-T3-H3-topk1-bs1"),
    _gpu("fp8", 4, 64, 2048, 64, 64, 3.0, id="fp8-T4-H64-topk2048-bs64"),
    _gpu("fp8", 5, 128, 2048, 40, 61, 3.0, id="fp8-T5-H128-topk2048-bs61"),
    _gpu("fp8", 8, 24, 2048, 3000, 1, 1.0, id="fp8-T8-H24-topk2048-bs1"),
    _gpu("fp8", 6, 3, 2048, 64, 64, 3.0, id="fp8-T6-H3-topk2048-bs64"),
    _gpu("fp8", 33, 16, 2048, 128, 64, 3.0, id="fp8-T33-H16-topk2048-bs64"),
    _gpu("fp8", 7, 1, 300, 20, 61, 1.0, id="fp8-T7-H1-topk300-bs61"),
    _gpu("fp8", 3, 128, 64, 8, 64, 1.0, id="fp8-T3-H128-topk64-bs64"),
    _gpu("bf16", 3, 128, 2048, 40, 61, 3.0, id="bf16-T3-H128-topk2048-bs61"),
    _gpu("bf16", 5, 64, 300, 1000, 1, 1.0, id="bf16-T5-H64-topk300-bs1"),
    _gpu("bf16", 9, 16, 2048, 64, 64, 1.0, id="bf16-T9-H16-topk2048-bs64"),
    # the bf16 Gluon kernel (Hopper, H > 32): splits at one token, a paged (power-of-two) layout,
    # a head count that is not a multiple of 64, and a list shorter than one key block
    _gpu("bf16", 1, 128, 2048, 64, 64, 3.0, id="bf16-T1-H128-topk2048-bs64"),
    _gpu("bf16", 2, 33, 1000, 40, 64, 3.0, id="bf16-T2-H33-topk1000-bs64"),
    _gpu("bf16", 40, 100, 2048, 3000, 1, 1.0, id="bf16-T40-H100-topk2048-bs1"),
    _gpu("bf16", 3, 64, 37, 5, 61, 3.0, id="bf16-T3-H64-topk37-bs61"),
    # more than 32 tokens of at most 16 heads: the Triton kernel on Hopper too
    _gpu("bf16", 40, 16, 300, 400, 1, 3.0, id="bf16-T40-H16-topk300-bs1"),
]


@pytest.mark.parametrize("fmt,T,H,topk,num_blocks,block_size,q_mul", SHAPES)
def test_shapes(fmt, T, H, topk, num_blocks, block_size, q_mul):
    q, cache, idx = make_inputs(fmt, T, H, topk, num_blocks, block_size, seed=T * 1000 + H, q_mul=q_mul)
    check(q, cache, idx)


# ----------------------------------------------------------------------------------------------
# topk_length (0, in range, > topk, < 0) and attention sinks.
# ----------------------------------------------------------------------------------------------
OPTIONS = [  # fmt, H, topk, block_size, topk_length per token (None: no topk_length), sink
    pytest.param("fp8", 16, 64, 64, [0, 5, 64, 1000], True, id="fp8-H16-topk64-len0-5-64-1000-sink"),
    pytest.param("fp8", 3, 37, 61, [37, -4, 20], False, id="fp8-H3-topk37-len37-neg-20"),
    pytest.param("bf16", 24, 64, 1, None, True, id="bf16-H24-topk64-sink"),
    pytest.param("bf16", 1, 37, 61, [0, 1, 36], True, id="bf16-H1-topk37-len0-1-36-sink"),
    _gpu("fp8", 128, 2048, 64, [2048, 0, 1, 1500, 5000], True, id="fp8-H128-topk2048-len-sink"),
    _gpu("fp8", 64, 300, 61, [299, 0, 300], True, id="fp8-H64-topk300-len-sink"),
    _gpu("bf16", 16, 2048, 64, [7, 2048, 0], True, id="bf16-H16-topk2048-len-sink"),
    _gpu("bf16", 128, 2048, 64, [2048, 0, 1, 1500, 5000], True, id="bf16-H128-topk2048-len-sink"),
    _gpu("bf16", 64, 300, 61, [299, 0, 300], True, id="bf16-H64-topk300-len-sink"),
]


@pytest.mark.parametrize("fmt,H,topk,block_size,lengths,sink", OPTIONS)
def test_topk_length_and_sink(fmt, H, topk, block_size, lengths, sink):
    T = len(lengths) if lengths is not None else 3
    nb = max(2, 3 * topk // block_size)
    q, cache, idx = make_inputs(fmt, T, H, topk, nb, block_size, seed=H + topk, q_mul=2.0)
    topk_length = None if lengths is None else torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    g = torch.Generator().manual_seed(H)
    attn_sink = (torch.randn(H, generator=g) * 2).to(DEVICE) if sink else None
    got, lse = check(q, cache, idx, topk_length=topk_length, attn_sink=attn_sink)
    if lengths is not None:
        empty = torch.tensor([n <= 0 for n in lengths], device=DEVICE)
        assert bool((got[empty] == 0).all()) and bool((lse[empty] == float("-inf")).all())


@GPU_ONLY
@pytest.mark.parametrize("H,topk,block_size,seed", [(17, 37, 61, 26), (17, 300, 1, 47), (17, 2048, 64, 48),
                                                    (24, 37, 61, 51), (32, 300, 1, 57)])
def test_raw_scales(H, topk, block_size, seed):
    """Raw (non-power-of-two) scales: k8 * s / R is not an fp16 number. These inputs, found by a
    wider sweep on the H200, each had one element past abs 1e-3 / rel 2/128 (up to 1.7e-3) when
    the keys-on-M kernel rounded V^T once; it now takes V^T as an fp16 pair on such blocks."""
    q, cache, idx = make_inputs("fp8raw", 3, H, topk, 40, block_size, seed=seed)
    check(q, cache, idx)


@GPU_ONLY
@pytest.mark.parametrize("H", [40, 64, 128])
def test_mixed_scale_blocks(H):
    """Raw (non-power-of-two) scales past 32 heads (the 64-head kernel on Hopper; test_raw_scales
    covers the keys-on-M kernel): blocks of power-of-two rows next to blocks holding raw rows, in
    one program and across splits, the four tiles of a row up to 2^8 apart (2^4 in raw rows) and
    some rows whose latent is all zero (the scale floor)."""
    g = torch.Generator().manual_seed(H)
    T, topk, num_blocks, bs = 3, 2048, 96, 64
    slots = num_blocks * bs
    cache, _ = random_paged_cache(num_blocks, bs, FP8_DS_MLA.row_width, FP8_DS_MLA.cache_dtype)
    idx = torch.randint(0, slots, (T, topk), generator=g, dtype=torch.int32)
    used = torch.unique(idx).long()
    # raw rows only where token 0's indices 600..663 and token 2's 1500..1530 point
    raw_slots = torch.unique(torch.cat([idx[0, 600:664], idx[2, 1500:1531]])).long()
    is_raw = torch.isin(used, raw_slots)
    tile_exp = torch.randint(-8, 1, (len(used), 4, 1), generator=g)
    tile_exp[is_raw] = torch.randint(-4, 1, (int(is_raw.sum()), 4, 1), generator=g)
    kv_c = (torch.randn(len(used), 4, 128, generator=g) * 1.5 * 2.0 ** tile_exp).reshape(len(used), 512)
    kv_c[::97] = 0.0
    k_pe = torch.randn(len(used), 64, generator=g)
    rows = FP8_DS_MLA.pack(kv_c, k_pe)
    rows[is_raw] = FP8_DS_MLA_RAW.pack(kv_c[is_raw], k_pe[is_raw])
    cache[used // bs, used % bs] = rows.to(DEVICE)
    q = torch.randn(T, H, 576, generator=g).to(torch.bfloat16).to(DEVICE)
    check(q, cache, idx.to(DEVICE))


# ----------------------------------------------------------------------------------------------
# Corner cases.
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
@pytest.mark.parametrize("sink", [False, True], ids=["nosink", "sink"])
def test_rows_with_no_valid_index(fmt, sink):
    """Rows made only of invalid indices: out = 0 and lse = -inf, whatever the sink; others normal."""
    q, cache, idx = make_inputs(fmt, 3, 5, 37, 4, 16, seed=7)
    slots = 4 * 16
    bad = torch.tensor(invalid_indices(slots), dtype=torch.int32, device=DEVICE)
    idx[0] = bad[torch.arange(37, device=DEVICE) % len(bad)]
    idx[2, :1] = -1
    attn_sink = torch.full((5,), 3.0, device=DEVICE) if sink else None
    got, lse = check(q, cache, idx, attn_sink=attn_sink)
    assert bool((got[0] == 0).all()) and bool((lse[0] == float("-inf")).all())
    assert bool(torch.isfinite(lse[1:]).all())


@pytest.mark.parametrize("num_splits", [1, 3, 7])
def test_split_counts_agree(num_splits):
    """Any split of topk merges to the oracle, including splits that topk_length leaves empty."""
    q, cache, idx = make_inputs("fp8", 2, 16, 200, 8, 64, seed=num_splits, q_mul=2.0)
    topk_length = torch.tensor([200, 40], dtype=torch.int32, device=DEVICE)
    sink = torch.randn(16).to(DEVICE)
    out = torch.empty(2, 16, 512, dtype=torch.bfloat16, device=DEVICE)
    lse = _launch(q, cache, idx, topk_length, sink, out, SCALE, FP8_DS_MLA, config=dict(BLOCK_N=16),
                  num_splits=num_splits)
    want, want_lse = sparse_mla_decode_ref(q, cache, idx, scale=SCALE, topk_length=topk_length,
                                           attn_sink=sink)
    assert_close("out", out, want, "sparse_decode")
    assert_close("lse", lse, want_lse, "lse")


def test_out_argument_strided_view():
    """`out` may be a view with any token/head strides: it is written in place and returned."""
    q, cache, idx = make_inputs("fp8", 3, 3, 37, 4, 61, seed=3)
    buf = torch.full((3, 4, 1024), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    out = buf[:, 1:, 256:768]
    got, _ = check(q, cache, idx, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert bool(torch.isnan(buf[:, 0]).all()) and bool(torch.isnan(buf[:, :, :256]).all())


def test_scale_changes_result():
    """The softmax scale is an explicit argument that reaches the kernel (two scales, two oracles)."""
    q, cache, idx = make_inputs("bf16", 2, 3, 37, 4, 16, seed=11, q_mul=2.0)
    a, _ = check(q, cache, idx, scale=0.02)
    b, _ = check(q, cache, idx, scale=0.2)
    assert not torch.equal(a, b)


@pytest.mark.parametrize("fmt_name", ["fp8", "fp8raw", "bf16"])
def test_format_descriptor_argument(fmt_name):
    """fmt= (a layer's descriptor) gives what the cache's dtype alone gives; a descriptor of
    another format, or something else, is refused before any launch."""
    fmt = FORMATS[fmt_name]
    q, cache, idx = make_inputs(fmt_name, 2, 3, 20, 3, 8, seed=11)
    want, want_lse = sparse_mla_decode(q, cache, idx, scale=SCALE)
    got, got_lse = sparse_mla_decode(q, cache, idx, scale=SCALE, fmt=fmt)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    other = BF16_MLA if fmt.quantized else FP8_DS_MLA
    with pytest.raises(ValueError, match=f"fmt: expected a format of the cache \\({cache.dtype}"):
        sparse_mla_decode(q, cache, idx, scale=SCALE, fmt=other)
    with pytest.raises(ValueError, match="fmt: expected a sparse MLA cache format"):
        sparse_mla_decode(q, cache, idx, scale=SCALE, fmt=fmt.name)


def test_registered_custom_op():
    """openmla::sparse_mla_decode is a torch custom op whose fake implementation passes opcheck."""
    q, cache, idx = make_inputs("fp8", 2, 3, 16, 2, 16, seed=5)
    out = torch.empty(2, 3, 512, dtype=torch.bfloat16, device=DEVICE)
    op = torch.ops.openmla.sparse_mla_decode.default
    torch.library.opcheck(op, (q, cache, idx, None, None, out, SCALE, "fp8_ds_mla"),
                          test_utils=("test_schema", "test_faketensor"))


def test_compiled_call_goes_through_the_custom_op(monkeypatch):
    """Under torch.compile the public op calls the registered custom op (eager calls launch
    directly); both give the same result."""
    from openmla.kernels.sparse_mla_decode import op as decode_op
    q, cache, idx = make_inputs("fp8", 2, 3, 16, 2, 16, seed=6)
    want, want_lse = sparse_mla_decode(q, cache, idx, scale=SCALE)
    calls = []
    real = decode_op._sparse_mla_decode_op
    monkeypatch.setattr(decode_op, "_sparse_mla_decode_op", lambda *a: calls.append(1) or real(*a))
    torch._dynamo.reset()
    got, got_lse = torch.compile(lambda *a: sparse_mla_decode(*a, scale=SCALE), backend="eager")(q, cache, idx)
    torch._dynamo.reset()
    assert calls, "torch.compile did not reach the registered op"
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


@GPU_ONLY
def test_cache_offsets_past_2gb():
    """Block * block stride beyond 2^31 bytes: rows at the end of a 2.2 GB fp8 cache are found."""
    nb, bs = 3300, 1024  # 3300 * 1025 * 656 B = 2.2 GB, strided view (one hidden row per block)
    cache, backing = random_paged_cache(nb, bs, FP8_DS_MLA.row_width, torch.uint8)
    g = torch.Generator().manual_seed(0)
    T, H, topk = 2, 16, 64
    slots = nb * bs
    idx = torch.randint(slots - 3 * bs, slots, (T, topk), generator=g, dtype=torch.int32)
    idx[:, :4] = torch.randint(0, bs, (T, 4), generator=g, dtype=torch.int32)  # and a few low ones
    used = torch.unique(idx).long()
    cache[used // bs, used % bs] = FP8_DS_MLA.pack(torch.randn(len(used), 512, generator=g),
                                                 torch.randn(len(used), 64, generator=g)).to(DEVICE)
    q = torch.randn(T, H, 576, generator=g).to(torch.bfloat16).to(DEVICE)
    assert (nb - 1) * backing.stride(0) > 2**31
    check(q, cache, idx.to(DEVICE))
    del cache, backing


@GPU_ONLY
@pytest.mark.parametrize("H", [16, 128])  # on Hopper, 128 heads run the Gluon kernel
def test_cuda_graph_replay_with_new_inputs(H):
    """Captured once, replayed with new q, indices, topk_length and cache contents: each replay
    matches the oracle for the inputs it saw (no host read of device tensors in the op)."""
    T, topk, nb, bs = 32, 2048, 64, 64
    q, cache, idx = make_inputs("fp8", T, H, topk, nb, bs, seed=1)
    topk_length = torch.full((T,), topk, dtype=torch.int32, device=DEVICE)
    sink = torch.randn(H).to(DEVICE)
    out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=DEVICE)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (compile) outside the capture
        sparse_mla_decode(q, cache, idx, scale=SCALE, topk_length=topk_length, attn_sink=sink, out=out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse = sparse_mla_decode(q, cache, idx, scale=SCALE, topk_length=topk_length,
                                   attn_sink=sink, out=out)
    for seed in (2, 3):
        q2, cache2, idx2 = make_inputs("fp8", T, H, topk, nb, bs, seed=seed, q_mul=2.0)
        q.copy_(q2)
        idx.copy_(idx2)
        cache.copy_(cache2)
        topk_length.copy_(torch.randint(0, topk + 10, (T,), device=DEVICE, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want, want_lse = sparse_mla_decode_ref(q, cache, idx, scale=SCALE, topk_length=topk_length,
                                               attn_sink=sink)
        assert_close("out", out, want, "sparse_decode")
        assert_close("lse", lse, want_lse, "lse")


# ----------------------------------------------------------------------------------------------
# On Hopper, fp8 caches run Gluon kernels (H > 32: 64-head tiles; H <= 32: keys on the wgmma M);
# the tests above run them there, and the Triton kernel everywhere else. On Hopper, run the Triton
# one here too.
# ----------------------------------------------------------------------------------------------


@SM90_ONLY
@pytest.mark.parametrize("T,H,topk,num_blocks,block_size,ext", [
    pytest.param(5, 128, 2048, 40, 61, True, id="T5-H128-topk2048-bs61-lengths-sink"),
    pytest.param(9, 64, 300, 1000, 1, False, id="T9-H64-topk300-bs1"),
    pytest.param(4, 16, 2048, 64, 64, True, id="T4-H16-topk2048-bs64-lengths-sink"),
    pytest.param(6, 3, 300, 1000, 1, False, id="T6-H3-topk300-bs1"),
])
def test_triton_kernel_on_hopper(T, H, topk, num_blocks, block_size, ext, monkeypatch):
    monkeypatch.setenv("OPENMLA_SM90_GLUON", "0")
    q, cache, idx = make_inputs("fp8", T, H, topk, num_blocks, block_size, seed=T + H, q_mul=3.0)
    assert not sm90.usable(q, cache) and not sm90_kn.usable(q, cache)
    tlen = sink = None
    if ext:
        tlen = torch.randint(-1, topk + 2, (T,), dtype=torch.int32).to(DEVICE)
        tlen[0] = 0
        sink = torch.randn(H).to(DEVICE)
    check(q, cache, idx, topk_length=tlen, attn_sink=sink)


@pytest.mark.skipif(not sm90._GLUON, reason="this Triton has no Gluon: the sm_90 kernel is not built")
def test_sm90_kernel_compiles():
    """The Gluon kernel cannot run in the interpreter: compile it for sm_90a so that a change
    that breaks it or outgrows shared memory (227 KB: 48 bytes to spare) fails on the CPU too.
    Spills are bounded: the three warpgroups spill ~80 bytes of loop-invariant values at their
    register split (score 248 / value 160 / producer 96); the partition's first version, which
    loaded the indices in the score warpgroup, spilled 136 and measured 7 % slower at T128 H64."""
    got = compile_gluon_sm90(
        "openmla.kernels.sparse_mla_decode.sm90", "sparse_mla_decode_sm90_kernel",
        dict(DENSE=False, HAS_LEN=True, HAS_SINK=True, SPLIT=True, BLOCK_H=sm90.BLOCK_H,
             BLOCK_N=sm90.BLOCK_N, TILE=128, ROPE=64, SCALE_OFF=512, ROPE_OFF=528, BS_SHIFT=6,
             INF_EMPTY=False),
        ["*bf16", "*u8", "*i32", "*i32", "*fp32", "*bf16", "*fp32", "*fp32", "*fp32"], sm90.NUM_WARPS)
    assert got["shared"] <= 227 * 1024 and got["regs"] <= 255 and got["stack"] <= 128, got
    # wgmma; the producer gathers with 16-byte loads into registers (no cp.async: it converts
    # the bytes before they reach shared memory)
    assert got["hgmma"] > 0 and got["ldg128"] > 0 and got["ldgsts"] == 0, got


@pytest.mark.parametrize("fmt,T,H,kernel", [
    ("fp8", 1, 128, "_TRITON"), ("fp8", 2, 64, "_TRITON"), ("fp8", 2, 65, "_SM90"),
    ("fp8", 3, 33, "_SM90"), ("fp8", 1, 32, "_KN"), ("fp8", 9, 1, "_KN"),
    ("bf16", 1, 1, "_BK"), ("bf16", 32, 16, "_BK"), ("bf16", 200, 16, "_BK"), ("bf16", 2, 32, "_BK"),
    ("bf16", 2, 33, "_BF"), ("bf16", 40, 128, "_BF"),
])
def test_hopper_kernel_choice(fmt, T, H, kernel, monkeypatch):
    """Which kernel a Hopper plan launches (the plan only; nothing runs): fp8 with more than 32
    heads on the 64-head Gluon kernel from three (token, 64-head block) pairs (sm90.FEW_BLOCKS),
    else on the Triton kernel; at most 32 heads on the keys-on-M kernel; bf16 up to 32 heads on its
    keys-on-M kernel (sm90_bf16_kn), more on its 64-head kernel. A Triton without Gluon has no
    Hopper kernels: there every plan is the Triton kernel's."""
    monkeypatch.delenv("OPENMLA_SM90_GLUON", raising=False)
    if not sm90_bf16._GLUON:
        kernel = "_TRITON"
    q, cache, idx = make_inputs(fmt, T, H, 64, 4, 64, seed=T + H)
    with device.assume(device.ARCHES["sm_90"]):
        plan = decode_op._get_plan(q, cache, idx, None, None, FORMATS[fmt])
    assert plan[0] is getattr(decode_op, kernel)


@pytest.mark.skipif(not sm90_bf16._GLUON, reason="this Triton has no Gluon (before 3.5): there is no "
                                                   "sm_90 kernel to compile, the Triton kernel serves Hopper")
@pytest.mark.parametrize("split", [False, True], ids=["one-split", "split"])
def test_sm90_bf16_kernel_compiles(split):
    """The bf16-cache Gluon kernel, compiled for sm_90a on the CPU: shared memory fits, no spills,
    wgmma, and its rows move by 16-byte cp.async only (per thread per block of 64 rows: 18 copies
    of a 576-wide bf16 row block; issued before the loop and in it). With splits it keeps 8 bytes
    on the stack (the partials' extra pointer arithmetic at the 255-register ceiling)."""
    got = compile_gluon_sm90(
        "openmla.kernels.sparse_mla_decode.sm90_bf16", "sparse_mla_decode_sm90_bf16_kernel",
        dict(DENSE=False, HAS_LEN=True, HAS_SINK=True, SPLIT=split, BLOCK_H=sm90_bf16.BLOCK_H,
             BLOCK_N=sm90_bf16.BLOCK_N, TILE=128, ROPE=64, SCALE_OFF=0, ROPE_OFF=512, BS_SHIFT=6,
             INF_EMPTY=True),
        ["*bf16", "*bf16", "*i32", "*i32", "*fp32", "*bf16", "*fp32", "*fp32", "*fp32"], sm90_bf16.NUM_WARPS)
    assert got["shared"] <= 227 * 1024 and got["regs"] <= 255 and got["stack"] <= (8 if split else 0), got
    assert got["hgmma"] > 0 and got["ldgsts128"] == got["ldgsts"] == 2 * 18, got


@pytest.mark.skipif(not sm90_bf16_kn._GLUON, reason="this Triton has no Gluon (before 3.5): there is no "
                                                      "sm_90 kernel to compile, the Triton kernel serves Hopper")
@pytest.mark.parametrize("block_h,split", [(16, False), (16, True), (32, False), (32, True)],
                         ids=["H16-one-split", "H16-split", "H32-one-split", "H32-split"])
def test_sm90_bf16_kn_kernel_compiles(block_h, split):
    """The bf16-cache keys-on-M kernel, compiled for sm_90a on the CPU: shared memory fits, its
    rows move by 16-byte cp.async only (per thread per block of 64 rows: 36 copies, issued before
    the loop and in it), and every dot is a wgmma from shared memory: 36 score wgmmas (rope and
    four latent tiles in k16 steps) and 64 value wgmmas (8 m64 tiles of the 512 dims x 4 k16 steps
    x P hi and lo) a block. No spills at 16 heads; at 32 (O^T is 128 registers a thread) ptxas
    keeps up to 32 bytes of loop-invariant values on the stack."""
    got = compile_gluon_sm90(
        "openmla.kernels.sparse_mla_decode.sm90_bf16_kn", "sparse_mla_decode_sm90_bf16_kn_kernel",
        dict(DENSE=False, HAS_LEN=True, HAS_SINK=True, SPLIT=split, BLOCK_H=block_h,
             BLOCK_N=sm90_bf16_kn.BLOCK_N, TILE=128, ROPE=64, SCALE_OFF=0, ROPE_OFF=512, BS_SHIFT=6,
             INF_EMPTY=True),
        ["*bf16", "*bf16", "*i32", "*i32", "*fp32", "*bf16", "*fp32", "*fp32", "*fp32"], sm90_bf16_kn.NUM_WARPS)
    assert got["shared"] <= 227 * 1024 and got["regs"] <= 255, got
    assert got["stack"] <= (0 if block_h == 16 else 32), got
    assert got["hgmma"] == 36 + 64 and got["ldgsts128"] == got["ldgsts"] == 2 * 36, got


@pytest.mark.skipif(not sm90_kn._GLUON, reason="this Triton has no Gluon: the sm_90 kernel is not built")
@pytest.mark.parametrize("block_h", [16, 32])
def test_sm90_kn_kernel_compiles(block_h):
    """The keys-on-M Gluon kernel (H <= 32), compiled for sm_90a on the CPU: shared memory fits,
    wgmma with register A operands, 16-byte gathers of latent and rope; register operands built from
    the bytes with no shared-memory round trip (reshape/permute must compile to nothing: the only
    shared stores in the loop are P and the softmax reductions). It spills a little (loop-invariant
    addresses, reloaded from L1: 24 / 160 bytes at 16 / 32 heads); twice the reductions a step
    spilled 192 / 304 bytes and measured 0.103 / 0.119 ms against 0.073 / 0.104 (T128, H200)."""
    got = compile_gluon_sm90(
        "openmla.kernels.sparse_mla_decode.sm90_kn", "sparse_mla_decode_sm90_kn_kernel",
        dict(DENSE=False, HAS_LEN=True, HAS_SINK=True, SPLIT=True, BLOCK_H=block_h,
             BLOCK_N=sm90_kn.BLOCK_N, TILE=128, ROPE=64, SCALE_OFF=512, ROPE_OFF=528, BS_SHIFT=6, INF_EMPTY=False),
        ["*bf16", "*u8", "*i32", "*i32", "*fp32", "*bf16", "*fp32", "*fp32", "*fp32"], sm90_kn.NUM_WARPS)
    assert got["shared"] <= 227 * 1024 and got["regs"] <= 255 and got["stack"] <= 192, got
    # rope + 4 x 8 score steps + 8 value steps of 4 M-repetitions (twice that where V^T is an fp16
    # pair: raw scales), each in the prologue-free loop
    assert got["hgmma"] == 4 + 32 + 32 + 64, got
    assert got["ldgsts128"] > 0, got


# ----------------------------------------------------------------------------------------------
# Boundary validation: ValueError naming the argument.
# ----------------------------------------------------------------------------------------------
def _bad_cases():
    q, cache, idx = make_inputs("fp8", 2, 3, 8, 2, 16, seed=9)
    bf = make_inputs("bf16", 2, 3, 8, 2, 16, seed=9)[1]
    out = torch.empty(2, 3, 512, dtype=torch.bfloat16, device=DEVICE)
    d = dict(q=q, cache=cache, indices=idx, scale=SCALE)
    return [
        ("q.dtype", dict(d, q=q.float())),
        ("q.shape[-1]", dict(d, q=q[..., :512])),
        ("q.shape[1] (heads)", dict(d, q=torch.zeros(2, 129, 576, dtype=torch.bfloat16, device=DEVICE))),
        ("q.stride(-1)", dict(d, q=torch.zeros(2, 576, 3, dtype=torch.bfloat16, device=DEVICE).transpose(1, 2))),
        ("cache.shape[-1]", dict(d, cache=torch.zeros(2, 16, 600, dtype=torch.uint8, device=DEVICE))),
        ("cache.dtype", dict(d, cache=cache.view(torch.int8))),
        ("cache.dim()", dict(d, cache=cache.reshape(-1, 656)[None, None])),
        ("cache.stride(0)", dict(d, cache=bf.as_strided((2, 16, 576), (576, 576, 1)))),
        ("indices.dtype", dict(d, indices=idx.long())),
        ("indices.shape[0]", dict(d, indices=idx[:1])),
        ("indices.shape[1] (topk)", dict(d, indices=idx[:, :0])),
        ("topk_length.dtype", dict(d, topk_length=torch.zeros(2, dtype=torch.int64, device=DEVICE))),
        ("topk_length.shape", dict(d, topk_length=torch.zeros(3, dtype=torch.int32, device=DEVICE))),
        ("attn_sink.dtype", dict(d, attn_sink=torch.zeros(3, dtype=torch.bfloat16, device=DEVICE))),
        ("attn_sink.shape", dict(d, attn_sink=torch.zeros(4, device=DEVICE))),
        ("out.shape", dict(d, out=out[:, :2])),
        ("out.dtype", dict(d, out=out.float())),
        ("scale", dict(d, scale=float("nan"))),
        ("scale", dict(d, scale=None)),
    ]


BAD_NAMES = ["q.dtype", "q.shape[-1]", "q.shape[1] (heads)", "q.stride(-1)", "cache.shape[-1]",
             "cache.dtype", "cache.dim()", "cache.stride(0)", "indices.dtype", "indices.shape[0]",
             "indices.shape[1] (topk)", "topk_length.dtype", "topk_length.shape", "attn_sink.dtype",
             "attn_sink.shape", "out.shape", "out.dtype", "scale-nan", "scale-None"]


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "after-a-good-call"])
@pytest.mark.parametrize("case", range(len(BAD_NAMES)), ids=BAD_NAMES)
def test_value_errors(case, warm):
    """Also after a good call of the same inputs but the bad one (warm): a call signature that
    passed the checks is remembered, and a changed argument must still be checked."""
    name, kwargs = _bad_cases()[case]
    if warm:
        q, cache, idx = make_inputs("fp8", 2, 3, 8, 2, 16, seed=9)
        sparse_mla_decode(q, cache, idx, scale=SCALE)
    with pytest.raises(ValueError, match="^" + re.escape(name) + ":"):
        sparse_mla_decode(**kwargs)


def test_repeated_call_signature():
    """A repeated call signature skips the checks it passed (op._VALIDATED) and gives the same
    result; the same values under other strides (a new signature) are checked and planned anew."""
    from openmla.kernels.sparse_mla_decode import op
    q, cache, idx = make_inputs("fp8", 3, 5, 40, 3, 16, seed=12)
    length = torch.tensor([40, 7, 0], dtype=torch.int32, device=DEVICE)
    op._VALIDATED.clear()
    first, lse = check(q, cache, idx, topk_length=length)
    assert len(op._VALIDATED) == 1
    again, lse2 = sparse_mla_decode(q, cache, idx, scale=SCALE, topk_length=length)
    assert len(op._VALIDATED) == 1
    assert torch.equal(first, again) and torch.equal(lse, lse2)
    wide = torch.full((3, 7, 600), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    q2 = wide[:, 1:6, 8:584]
    q2.copy_(q)  # same values, other strides
    out = torch.full((3, 5, 512), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got, lse3 = check(q2, cache, idx, topk_length=length, out=out)
    assert len(op._VALIDATED) == 2 and got is out
    assert torch.equal(got, first) and torch.equal(lse3, lse)


@GPU_ONLY
def test_device_mismatch_raises():
    q, cache, idx = make_inputs("fp8", 2, 3, 8, 2, 16, seed=9)
    with pytest.raises(ValueError, match="^indices.device"):
        sparse_mla_decode(q, cache, idx.cpu(), scale=SCALE)
