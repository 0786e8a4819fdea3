"""kernels.merge.merge_attn_states against kernels.reference.merge_attn_states_ref, and merging as
attention over the union of two key sets."""
import itertools

import pytest
import torch

from openmla.kernels.merge import merge_attn_states
from openmla.kernels.paged_attention import varlen_attention
from openmla.kernels.reference import attention_varlen_ref, merge_attn_states_ref
from tests.helpers import DEVICE, assert_close

INF = float("inf")
LSE_KINDS = {"finite": None, "+inf": INF, "-inf": -INF}


def _parts(T, H, D, dtype, g, *, spread=4.0):
    a = (torch.randn(T, H, D, generator=g) * 2).to(dtype)
    b = (torch.randn(T, H, D, generator=g) * 2).to(dtype)
    a_lse = torch.randn(T, H, generator=g) * spread
    b_lse = torch.randn(T, H, generator=g) * spread
    return a, a_lse, b, b_lse


def _check(a, a_lse, b, b_lse, out_dtype, *, with_lse=True):
    T, H, D = a.shape
    out = torch.full((T, H, D), float("nan"), dtype=out_dtype, device=DEVICE)
    out_lse = torch.full((T, H), float("nan"), device=DEVICE) if with_lse else None
    merge_attn_states(out, a, a_lse, b, b_lse, out_lse)
    want, want_lse = merge_attn_states_ref(a, a_lse, b, b_lse)
    assert_close("out", out, want, "fp32" if out_dtype == torch.float32 else "bf16")
    if with_lse:
        assert_close("out_lse", out_lse, want_lse, "fp32")
    return out, out_lse


REGULAR = [  # (T, H, D, part dtype, out dtype, with out_lse)
    pytest.param(7, 5, 80, torch.float32, torch.bfloat16, True, id="T7-H5-D80-fp32in-bf16out"),
    pytest.param(3, 32, 128, torch.bfloat16, torch.bfloat16, True, id="T3-H32-D128-bf16"),
    pytest.param(4, 3, 512, torch.float16, torch.float16, False, id="T4-H3-D512-fp16-no-lse"),
    pytest.param(5, 2, 8, torch.float32, torch.float32, True, id="T5-H2-D8-fp32"),
]


@pytest.mark.parametrize("T,H,D,dtype,out_dtype,with_lse", REGULAR)
def test_regular(T, H, D, dtype, out_dtype, with_lse):
    g = torch.Generator().manual_seed(T * 100 + H)
    a, a_lse, b, b_lse = (x.to(DEVICE) for x in _parts(T, H, D, dtype, g))
    _check(a, a_lse, b, b_lse, out_dtype, with_lse=with_lse)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32out", "bf16out"])
def test_every_inf_combination(out_dtype):
    """All 9 (a, b) pairs of {finite, +inf, -inf} lse, one per head; empty parts hold NaN."""
    combos = list(itertools.product(LSE_KINDS, repeat=2))
    T, H, D = 2, len(combos), 24
    g = torch.Generator().manual_seed(0)
    a, a_lse, b, b_lse = _parts(T, H, D, torch.float32, g)
    for h, (ka, kb) in enumerate(combos):
        for out, lse, kind in ((a, a_lse, ka), (b, b_lse, kb)):
            if LSE_KINDS[kind] is not None:
                lse[:, h] = LSE_KINDS[kind]
                out[:, h] = float("nan")
    out, out_lse = _check(*(x.to(DEVICE) for x in (a, a_lse, b, b_lse)), out_dtype)
    assert not bool(out.isnan().any()), "an empty part leaked NaN"
    for h, (ka, kb) in enumerate(combos):
        if ka != "finite" and kb != "finite":
            assert bool((out[:, h] == 0).all()) and bool((out_lse[:, h] == -INF).all()), (ka, kb)


def test_far_apart_lse_do_not_overflow():
    """lse values 1000 apart: one part's weight underflows to 0, nothing overflows to inf/NaN."""
    g = torch.Generator().manual_seed(3)
    a, a_lse, b, b_lse = _parts(3, 4, 32, torch.float32, g)
    a_lse[:, :2], b_lse[:, :2] = 800.0, -300.0
    a_lse[:, 2:], b_lse[:, 2:] = -1000.0, 90.0
    _check(*(x.to(DEVICE) for x in (a, a_lse, b, b_lse)), torch.float32)


def test_strided_views_and_in_place():
    """lse as transposed views of vLLM's [H, T] tensors, parts as slices, out aliasing a_out."""
    g = torch.Generator().manual_seed(4)
    T, H, D = 6, 4, 64
    a_lse = (torch.randn(H, T, generator=g) * 3).to(DEVICE).t()
    b_lse = (torch.randn(H, T, generator=g) * 3).to(DEVICE).t()
    a_lse[0, 1] = -INF
    wide = torch.randn(T, H, 2 * D, generator=g).to(DEVICE)
    a, b = wide[:, :, :D], wide[:, :, D:]
    want, want_lse = merge_attn_states_ref(a, a_lse, b, b_lse)
    out_lse = torch.empty(H, T, device=DEVICE).t()
    merge_attn_states(a, a, a_lse, b, b_lse, out_lse)
    assert_close("out", a, want, "fp32")
    assert_close("out_lse", out_lse, want_lse, "fp32")


@pytest.mark.parametrize("split", [0, 13, 40], ids=lambda s: f"split-at-{s}")
def test_merge_of_two_key_ranges_equals_attention_over_both(split):
    """Attention over keys [0, split) and [split, L) separately, merged, equals attention over all L
    (the cascade identity); split 0 leaves one part empty (lse -inf)."""
    g = torch.Generator().manual_seed(5)
    H, H_kv, D, Lq, L = 8, 2, 64, 5, 40
    q = torch.randn(Lq, H, D, generator=g).bfloat16().to(DEVICE)
    k = torch.randn(L, H_kv, D, generator=g).bfloat16().to(DEVICE)
    v = torch.randn(L, H_kv, D, generator=g).bfloat16().to(DEVICE)
    cu_q = torch.tensor([0, Lq], dtype=torch.int32, device=DEVICE)
    parts = []
    for lo, hi in ((0, split), (split, L)):
        cu_k = torch.tensor([0, hi - lo], dtype=torch.int32, device=DEVICE)
        parts += list(varlen_attention(q, k[lo:hi], v[lo:hi], cu_q, cu_k, scale=0.2, return_lse=True))
    out = torch.empty_like(q)
    out_lse = torch.empty(Lq, H, device=DEVICE)
    merge_attn_states(out, parts[0], parts[1], parts[2], parts[3], out_lse)
    cu_k = torch.tensor([0, L], dtype=torch.int32, device=DEVICE)
    want, want_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, scale=0.2)
    assert_close("out", out, want, "bf16")
    assert_close("out_lse", out_lse, want_lse, "fp32")


def test_bad_inputs_raise():
    a = torch.zeros(2, 3, 8, device=DEVICE)
    lse = torch.zeros(2, 3, device=DEVICE)
    with pytest.raises(ValueError, match="b_out.shape"):
        merge_attn_states(a.clone(), a, lse, a[:1], lse)
    with pytest.raises(ValueError, match="a_lse.dtype"):
        merge_attn_states(a.clone(), a, lse.double(), a, lse)
    with pytest.raises(ValueError, match="b_lse.shape"):
        merge_attn_states(a.clone(), a, lse, a, lse[:, :2])
    with pytest.raises(ValueError, match="out.stride"):
        merge_attn_states(a.clone().transpose(1, 2).contiguous().transpose(1, 2), a, lse, a, lse)
    with pytest.raises(ValueError, match="out_lse.shape"):
        merge_attn_states(a.clone(), a, lse, a, lse, lse[:1])


def test_registered_as_custom_op():
    a = torch.randn(2, 3, 8, device=DEVICE)
    lse = torch.randn(2, 3, device=DEVICE)
    torch.library.opcheck(torch.ops.openmla.merge_attn_states.default,
                          (torch.empty_like(a), a, lse, a.clone(), lse.clone(), torch.empty_like(lse)),
                          test_utils=("test_schema", "test_faketensor"))


def _fold_ref(po, plse):
    """merge_attn_states_ref folded over the parts: po [S, T, H, D], plse [S, T, H]."""
    out, lse = po[0].float(), plse[0].float()
    for s in range(1, po.shape[0]):
        out, lse = merge_attn_states_ref(out, lse, po[s], plse[s])
    return out, lse


def _many_parts(S, T, H, D, g):
    """S partials with empty parts (+-inf lse over NaN out) here and there, a row whose only
    non-empty parts sit in the last step, a NaN lse late in one row and a NaN out in another."""
    po = torch.randn(S, T, H, D, generator=g) * 2
    plse = torch.randn(S, T, H, generator=g) * 4
    empty = torch.rand(S, T, H, generator=g) < 0.3
    plse[empty] = torch.where(torch.rand(int(empty.sum()), generator=g) < 0.5, INF, -INF)
    po[empty] = float("nan")
    plse[:, 0, 0] = -INF
    po[:, 0, 0] = float("nan")
    plse[S - 2:, 0, 0] = torch.tensor([1.5, 0.25])[: min(S, 2)]
    po[S - 2:, 0, 0] = torch.randn(min(S, 2), D, generator=g)
    plse[S - 1, 1, 1] = float("nan")  # a non-empty part with a NaN lse, in the last step
    plse[S - 3, 0, 2], po[S - 3, 0, 2, 5] = 0.5, INF  # a non-empty part with an inf in its out
    plse[:, 1, 2] = -INF  # every part empty
    return po, plse


@pytest.mark.parametrize("S,block_s", [(37, 8), (5, 16), (64, 64)], ids=["S37-steps-of-8", "S5-one-step",
                                                                       "S64-one-full-step"])
def test_paged_split_reduction_folds_parts_in_steps(S, block_s):
    """paged_attention_reduce_kernel, BLOCK_S parts a step (a last partial step included), equals
    the two-part merge folded over every part: empty parts skipped, faults NaN, all-empty 0 / -inf."""
    from openmla.kernels.paged_attention.kernel import paged_attention_reduce_kernel
    g = torch.Generator().manual_seed(S)
    T, H, D = 2, 3, 40
    po, plse = _many_parts(S, T, H, D, g)
    want, want_lse = _fold_ref(po, plse)
    po, plse = po.to(DEVICE).contiguous(), plse.to(DEVICE).contiguous()
    out = torch.full((T, H, D), 7.0, device=DEVICE)
    lse = torch.full((T, H), 7.0, device=DEVICE)
    paged_attention_reduce_kernel[(T, 2)](
        po, plse, out, lse, H, T * H * D, H * D, D, T * H, H, out.stride(0), out.stride(1),
        lse.stride(0), lse.stride(1), HEAD_DIM=D, NUM_SPLITS=S, WRITE_LSE=True, BLOCK_S=block_s,
        BLOCK_H=2, BLOCK_D=64)
    assert_close("out", out, want, "fp32")
    assert_close("lse", lse, want_lse, "fp32")
    assert bool(out[1, 1].isnan().all()) and bool(lse[1, 1].isnan()), "a NaN lse was dropped"
    assert bool(out[0, 2].isnan().all()) and bool(lse[0, 2].isnan()), "an inf out was dropped"
    assert bool((out[1, 2] == 0).all()) and float(lse[1, 2]) == -INF


def test_sparse_decode_merge_folds_parts_in_steps(monkeypatch):
    """The sparse decode's split merge with a small PARTS_TILE (several steps of BLOCK_S parts)
    equals the two-part merge folded over every part."""
    from openmla.kernels import merge as merge_mod
    from openmla.kernels.sparse_mla_decode.op import _merge
    from openmla.quant.formats import BF16_MLA
    monkeypatch.setattr(merge_mod, "PARTS_TILE", 2048)  # 4 parts a step at D 512
    g = torch.Generator().manual_seed(11)
    S, T, H, D = 11, 2, 3, BF16_MLA.latent_dim
    po, plse = _many_parts(S, T, H, D, g)
    want, want_lse = _fold_ref(po, plse)
    assert merge_mod.parts_tile(T, H, D, S, 8)[0] < S
    po = po.permute(1, 0, 2, 3).contiguous().to(DEVICE)  # [T, S, H, D] as the decode leaves them
    plse = plse.permute(1, 0, 2).contiguous().to(DEVICE)
    out = torch.full((T, H, D), 7.0, dtype=torch.bfloat16, device=DEVICE)
    lse = torch.full((T, H), 7.0, device=DEVICE)
    _merge(po, plse, None, out, lse, BF16_MLA, None)
    assert_close("out", out, want, "bf16")
    assert_close("lse", lse, want_lse, "fp32")
    assert bool(out[1, 1].isnan().all()) and bool(out[0, 2].isnan().all())
    assert bool((out[1, 2] == 0).all()) and float(lse[1, 2]) == -INF
