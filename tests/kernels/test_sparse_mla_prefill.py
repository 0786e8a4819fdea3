"""kernels.sparse_mla_prefill (d_qk 576) against the fp32 oracle kernels.reference.sparse_mla_ref.

out within "sparse_prefill" (abs 8e-4 or rel 3/128 elementwise), max_logits and lse within
"lse" (abs 1e-5), inf positions exact. Inputs are adversarial by default (tests/helpers/prefill.py:
NaN in every kv row no valid index selects, invalid indices of every kind, duplicate indices, a
non-default softmax scale, empty rows; the data scale and why). d_qk 512 (V4):
test_sparse_mla_prefill_d512.py.
"""
from __future__ import annotations

import re

import pytest
import torch

from openmla.kernels.sparse_mla_prefill import sm90 as sm90
from openmla.kernels.sparse_mla_prefill import sm90_kn as sm90_kn
from openmla.kernels.device import sm90_gluon
from openmla.kernels.sparse_mla_prefill import sparse_mla_prefill
from tests.helpers import DEVICE, GPU_ONLY, SM90_ONLY, compile_gluon_sm90
from tests.helpers.prefill import Case, build, check


# ------------------------------------------------------------------------------------------------
# Regular: head counts of the contract, topk a multiple of the row block
REGULAR = [
    pytest.param(Case(T=3, H=16, topk=128), id="T3-H16-topk128"),
    pytest.param(Case(T=2, H=32, topk=128), id="T2-H32-topk128"),
    pytest.param(Case(T=2, H=64, topk=128), id="T2-H64-topk128"),
    pytest.param(Case(T=2, H=128, topk=128), id="T2-H128-topk128"),
    pytest.param(Case(T=1, H=16, topk=2048, N=3000), id="T1-H16-topk2048"),
    pytest.param(Case(T=64, H=16, topk=2048, N=32768), id="T64-H16-topk2048", marks=GPU_ONLY),
    pytest.param(Case(T=64, H=32, topk=2048, N=32768), id="T64-H32-topk2048", marks=GPU_ONLY),
    pytest.param(Case(T=64, H=64, topk=2048, N=32768), id="T64-H64-topk2048", marks=GPU_ONLY),
    pytest.param(Case(T=64, H=128, topk=2048, N=32768), id="T64-H128-topk2048", marks=GPU_ONLY),
]

# Irregular: head counts that are no tile size, topk that is no multiple of the row block
IRREGULAR = [
    pytest.param(Case(T=3, H=1, topk=1), id="T3-H1-topk1"),
    pytest.param(Case(T=3, H=5, topk=50), id="T3-H5-topk50"),
    pytest.param(Case(T=2, H=20, topk=50), id="T2-H20-topk50"),
    pytest.param(Case(T=2, H=100, topk=50), id="T2-H100-topk50"),
    pytest.param(Case(T=2, H=5, topk=1000, N=1500), id="T2-H5-topk1000"),
    pytest.param(Case(T=40, H=5, topk=1000, N=5000), id="T40-H5-topk1000", marks=GPU_ONLY),
    pytest.param(Case(T=40, H=1, topk=2048, N=5000), id="T40-H1-topk2048", marks=GPU_ONLY),
    pytest.param(Case(T=33, H=128, topk=1000, N=5000), id="T33-H128-topk1000", marks=GPU_ONLY),
    pytest.param(Case(T=33, H=40, topk=777, N=5000), id="T33-H40-topk777", marks=GPU_ONLY),
]


@pytest.mark.parametrize("case", REGULAR + IRREGULAR)
def test_matches_oracle(case, request):
    check(case, request)


# ------------------------------------------------------------------------------------------------
# Invalid indices of every kind (< 0, >= N, INT32_MIN/MAX), a row with none valid
INVALID = [
    pytest.param(Case(T=4, H=16, topk=50, invalid=0.3), id="T4-H16-topk50"),
    pytest.param(Case(T=3, H=64, topk=128, invalid=0.5), id="T3-H64-topk128"),
    pytest.param(Case(T=4, H=1, topk=1, invalid=0.5), id="T4-H1-topk1"),
    pytest.param(Case(T=32, H=128, topk=2048, N=8000, invalid=0.3), id="T32-H128-topk2048",
                 marks=GPU_ONLY),
    pytest.param(Case(T=32, H=32, topk=1000, N=8000, invalid=0.9), id="T32-H32-topk1000",
                 marks=GPU_ONLY),
]


@pytest.mark.parametrize("case", INVALID)
def test_invalid_indices_are_skipped(case, request):
    out, max_logits, lse = check(case, request)
    # the last row has no valid index: out 0, max_logits -inf, lse -inf (checked against the
    # oracle above; said here once more as the contract)
    assert bool((out[-1] == 0).all())
    assert bool((max_logits[-1] == float("-inf")).all()) and bool((lse[-1] == float("-inf")).all())


# ------------------------------------------------------------------------------------------------
# topk_length (0, negative, > topk, random) and attention sinks
LENGTHS_AND_SINKS = [
    pytest.param(Case(T=5, H=16, topk=50, lengths=True), id="T5-H16-topk50-len"),
    pytest.param(Case(T=4, H=64, topk=128, lengths=True, invalid=0.2), id="T4-H64-topk128-len-invalid"),
    pytest.param(Case(T=3, H=5, topk=50, sink=True), id="T3-H5-topk50-sink"),
    pytest.param(Case(T=4, H=32, topk=50, sink=True, lengths=True, invalid=0.3),
                 id="T4-H32-topk50-sink-len-invalid"),
    pytest.param(Case(T=48, H=128, topk=2048, N=8000, lengths=True, sink=True),
                 id="T48-H128-topk2048-sink-len", marks=GPU_ONLY),
    pytest.param(Case(T=48, H=16, topk=1000, N=8000, lengths=True, sink=True, invalid=0.2),
                 id="T48-H16-topk1000-sink-len-invalid", marks=GPU_ONLY),
]


@pytest.mark.parametrize("case", LENGTHS_AND_SINKS)
def test_lengths_and_sinks(case, request):
    out, max_logits, lse = check(case, request)
    if case.lengths:  # row 0 has topk_length 0: empty, with or without a sink
        assert bool((out[0] == 0).all()) and bool((lse[0] == float("-inf")).all())


# ------------------------------------------------------------------------------------------------
# Softmax scale, strided kv rows (a flat view of a padded cache) and strided q
LAYOUT_AND_SCALE = [
    pytest.param(Case(T=3, H=16, topk=128, scale=0.3), id="T3-H16-topk128-scale0.3"),
    pytest.param(Case(T=2, H=64, topk=50, scale=1.0), id="T2-H64-topk50-scale1"),
    # a negative scale: the kernels keep the raw q.k max, so the op runs them on -q
    pytest.param(Case(T=3, H=16, topk=50, scale=-0.05, sink=True, invalid=0.2),
                 id="T3-H16-topk50-negative-scale-sink-invalid"),
    pytest.param(Case(T=2, H=64, topk=128, scale=-0.3, lengths=True), id="T2-H64-topk128-negative-scale-len"),
    pytest.param(Case(T=3, H=16, topk=50, row_stride=640, q_heads_stride=3),
                 id="T3-H16-topk50-kvstride640-qstrided"),
    pytest.param(Case(T=2, H=64, topk=128, row_stride=600, invalid=0.2), id="T2-H64-topk128-kvstride600"),
    # rows not on 16 bytes: the Triton kernel serves them on Hopper too
    pytest.param(Case(T=5, H=64, topk=200, N=900, row_stride=580), id="T5-H64-topk200-kvstride580"),
    pytest.param(Case(T=64, H=128, topk=2048, N=8000, row_stride=656, scale=0.3, invalid=0.1),
                 id="T64-H128-topk2048-kvstride656-scale0.3", marks=GPU_ONLY),
]


@pytest.mark.parametrize("case", LAYOUT_AND_SCALE)
def test_scale_and_strides(case, request):
    check(case, request)


# ------------------------------------------------------------------------------------------------
# Two kernels serve 64-head blocks: the Gluon one on Hopper (every test above runs it there for
# H > 32) and the Triton one everywhere else. On Hopper, run the Triton one here too.
TRITON_PATH = [
    pytest.param(Case(T=33, H=128, topk=1000, N=5000), id="T33-H128-topk1000"),
    pytest.param(Case(T=32, H=64, topk=2048, N=8000, invalid=0.3), id="T32-H64-topk2048-invalid"),
    pytest.param(Case(T=9, H=100, topk=300, N=3000, invalid=0.2, lengths=True, sink=True),
                 id="T9-H100-topk300-lengths-sink"),
    pytest.param(Case(T=40, H=16, topk=2048, N=5000), id="T40-H16-topk2048"),
    pytest.param(Case(T=9, H=27, topk=300, N=3000, invalid=0.2, lengths=True, sink=True),
                 id="T9-H27-topk300-lengths-sink"),
]


@SM90_ONLY
@pytest.mark.parametrize("case", TRITON_PATH)
def test_triton_kernel_on_hopper(case, request, monkeypatch):
    monkeypatch.setenv("OPENMLA_SM90_GLUON", "0")
    assert not sm90_gluon(DEVICE)
    check(case, request)


@pytest.mark.skipif(not sm90._GLUON, reason="this Triton has no Gluon: the sm_90 kernel is not built")
@pytest.mark.parametrize("tma", [True, False], ids=["tma-io", "register-io"])
@pytest.mark.parametrize("d_rope", [64, 0], ids=["d_qk576", "d_qk512"])
def test_sm90_kernel_compiles_without_spills(d_rope, tma):
    """The Gluon kernel cannot run in the interpreter: compile it for sm_90a so that a change
    that breaks it, spills or outgrows shared memory fails on the CPU too; for V3.2 rows and for
    DeepSeek-V4's 512-wide rows (no rope buffers), q in and the output out by TMA (tiles of 64
    columns: 9 or 8 loads, 8 stores) or by cp.async and stores from registers. What it is for: the
    score warpgroup's wgmmas (rope 4 + latent 32 k16 steps, then 4 value steps over its 128
    columns), the value warpgroup's (4 steps x 3 chunks of 128 columns), and 16-byte cp.async
    copies: the producer's gathers (per thread per block of 64 rows: 32 latent + 4 rope) and, without
    TMA, q's (the same count)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type
    const = dict(HAS_LEN=True, HAS_SINK=True, OFF32=False, D_LAT=512, D_ROPE=d_rope, BLOCK_H=sm90.BLOCK_H,
                 BLOCK_N=sm90.BLOCK_N, DS=sm90.SCORE_COLS, TAU=sm90.TAU, V_REGS=sm90.V_REGS,
                 P_REGS=sm90.P_REGS, TMA_OUT=tma, Q_TMA=tma)
    named = dict(ws_o="*fp32", ws_lse="*fp32", ws_ml="*fp32")  # the split pieces' workspace (tail.py)
    if tma:
        out = torch.empty(2 * sm90.BLOCK_H, 512, dtype=torch.bfloat16)
        q = torch.empty(2 * sm90.BLOCK_H, 512 + d_rope, dtype=torch.bfloat16)
        named["o_desc"] = mangle_type(TensorDescriptor.from_tensor(out, [sm90.BLOCK_H, 64], sm90._OUT_TILE))
        named["q_desc"] = mangle_type(TensorDescriptor.from_tensor(q, [sm90.BLOCK_H, 64], sm90._OUT_TILE))
    else:
        const.update(o_desc=None, q_desc=None)
    got = compile_gluon_sm90(
        "openmla.kernels.sparse_mla_prefill.sm90", "sparse_mla_prefill_sm90_kernel", const,
        ["*bf16", "*bf16", "*i32", "*i32", "*fp32", "*bf16", "*fp32", "*fp32"], sm90.NUM_WARPS, named_ptrs=named)
    assert got["shared"] <= 227 * 1024 and got["stack"] == 0 and got["regs"] <= 255, got
    assert got["hgmma"] == (4 if d_rope else 0) + 32 + 4 + 3 * 4, got
    assert got["ldgsts128"] == (1 if tma else 2) * (32 + (4 if d_rope else 0)), got
    assert got["tma_store"] == (512 // 64 if tma else 0), got
    assert got["tma_load"] == ((512 + d_rope) // 64 if tma else 0), got


@pytest.mark.skipif(not sm90._GLUON, reason="this Triton has no Gluon: the sm_90 kernel is not built")
@pytest.mark.parametrize("H,strided,want", [(64, "", True), (128, "", True), (96, "", False),
                                            (64, "out", False), (64, "q", False)])
def test_sm90_io_path_choice(H, strided, want, monkeypatch):
    """The 64-head kernel's output leaves by TMA (a descriptor over out as [T * H, 512], [64, 64]
    tiles) only when every head block is 64 whole rows of a contiguous out, else from registers;
    q arrives by TMA (over q as [T * H, 576]) under the same rule for q, else by cp.async. The
    launch is recorded (Gluon does not run in the interpreter)."""
    seen = {}

    class _Record:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.update(grid=grid, **kw)

    monkeypatch.setattr(sm90, "sparse_mla_prefill_sm90_kernel", _Record())
    T = 3
    q = torch.randn(T, H, 1152).bfloat16()[..., 576:] if strided == "q" else torch.randn(T, H, 576).bfloat16()
    kv = torch.randn(100, 576).bfloat16()
    idx = torch.zeros(T, 64, dtype=torch.int32)
    out = torch.empty(T, H, 1024, dtype=torch.bfloat16)[..., :512] if strided == "out" else torch.empty(
        T, H, 512, dtype=torch.bfloat16)
    ml, lse = torch.empty(T, H), torch.empty(T, H)
    sm90.launch(q, kv, idx, None, None, out, ml, lse, 0.1, 1.4426950408889634, 512, 64)
    assert seen["grid"] == (T * -(-H // sm90.BLOCK_H),)
    for name, t, d_qk, use in (("o", out, 512, want or strided == "q"), ("q", q, 576, want or strided == "out")):
        assert seen[name.upper() + "_TMA" if name == "q" else "TMA_OUT"] is use
        d = seen[name + "_desc"]
        if use:
            assert list(d.shape) == [T * H, d_qk] and list(d.block_shape) == [sm90.BLOCK_H, 64]
            assert d.base.data_ptr() == t.data_ptr()
        else:
            assert d is None


@pytest.mark.skipif(not sm90_kn._GLUON, reason="this Triton has no Gluon: the sm_90 kernel is not built")
@pytest.mark.parametrize("block_h", [16, 32])
@pytest.mark.parametrize("flags", [False, True], ids=["per-score", "row-flags"])
def test_sm90_kn_kernel_compiles(block_h, flags):
    """The keys-on-M Gluon kernel (H <= 32), compiled for sm_90a on the CPU, with faults per score
    and from row flags: shared memory fits, both consumers issue their wgmmas (rope 4 + latent 32
    score steps, 8 x 4 value steps) and the producer its 16-byte gathers (32 latent + 4 rope per
    thread per block of 64 rows). It spills a few values at 32 heads (reloaded from L1): accepted,
    see the module docstring."""
    got = compile_gluon_sm90(
        "openmla.kernels.sparse_mla_prefill.sm90_kn", "sparse_mla_prefill_sm90_kn_kernel",
        dict(HAS_LEN=True, HAS_SINK=True, OFF32=True, D_LAT=512, D_ROPE=64, BLOCK_H=block_h,
             BLOCK_N=sm90_kn.BLOCK_N, C_REGS=sm90_kn.C_REGS, TAU=sm90_kn.TAU, FLAGS=flags),
        ["*bf16", "*bf16", "*i32", "*i32", "*fp32", "*bf16", "*fp32", "*fp32"], sm90_kn.NUM_WARPS,
        named_ptrs=dict(flag_ptr="*u8", ws_o="*fp32", ws_lse="*fp32", ws_ml="*fp32"))
    assert got["shared"] <= 227 * 1024 and got["regs"] <= 255 and got["stack"] <= 128, got
    assert got["hgmma"] == 2 * (4 + 32 + 32), got
    assert got["ldgsts128"] == 32 + 4, got


# ------------------------------------------------------------------------------------------------
# The torch custom op and its fake implementation
@pytest.mark.parametrize("d_qk", [576, 512])
def test_custom_op_and_fake(d_qk):
    c = Case(T=2, H=5, topk=50, d_qk=d_qk)
    a = build(c, 1)
    out = torch.full((2, 5, 512), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got = torch.ops.openmla.sparse_mla_prefill(a["q"], a["kv"], a["indices"], None, None, out, 0.1)
    want = sparse_mla_prefill(a["q"], a["kv"], a["indices"], scale=0.1)
    for g, w in zip((out, *got), want):
        assert torch.equal(g, w)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fq, fkv, fidx = (mode.from_tensor(t) for t in (a["q"], a["kv"], a["indices"]))
        out, lse, ml = sparse_mla_prefill(fq, fkv, fidx, scale=0.1)
    assert out.shape == (2, 5, 512) and out.dtype == torch.bfloat16
    assert ml.shape == lse.shape == (2, 5) and ml.dtype == lse.dtype == torch.float32


# ------------------------------------------------------------------------------------------------
# Bad arguments raise ValueError naming the tensor (nothing is launched)
def _good():
    return dict(q=torch.zeros(2, 4, 576, dtype=torch.bfloat16), kv=torch.zeros(10, 576, dtype=torch.bfloat16),
                indices=torch.zeros(2, 8, dtype=torch.int32), scale=0.1,
                topk_length=torch.zeros(2, dtype=torch.int32), attn_sink=torch.zeros(4))


BAD = [
    pytest.param("q", dict(q=torch.zeros(2, 4, 576, dtype=torch.float16)), "q.dtype", id="q-fp16"),
    pytest.param("q", dict(q=torch.zeros(2, 4, 512, dtype=torch.bfloat16)), "q.shape", id="q-512"),
    pytest.param("q", dict(q=torch.zeros(2, 576, 4, dtype=torch.bfloat16).transpose(1, 2)),
                 "q.stride(-1)", id="q-last-dim-strided"),
    pytest.param("kv", dict(kv=torch.zeros(10, 640, dtype=torch.bfloat16)), "kv.shape", id="kv-640"),
    pytest.param("kv", dict(kv=torch.zeros(2, 5, 576, dtype=torch.bfloat16)), "kv.dim()", id="kv-3d"),
    pytest.param("kv", dict(kv=torch.zeros(576, 10, dtype=torch.bfloat16).t()), "kv.stride(-1)",
                 id="kv-column-major"),
    pytest.param("indices", dict(indices=torch.zeros(2, 8, dtype=torch.int64)), "indices.dtype",
                 id="indices-int64"),
    pytest.param("indices", dict(indices=torch.zeros(3, 8, dtype=torch.int32)), "indices.shape",
                 id="indices-wrong-T"),
    pytest.param("topk_length", dict(topk_length=torch.zeros(3, dtype=torch.int32)), "topk_length.shape",
                 id="topk_length-wrong-T"),
    pytest.param("topk_length", dict(topk_length=torch.zeros(2)), "topk_length.dtype",
                 id="topk_length-fp32"),
    pytest.param("attn_sink", dict(attn_sink=torch.zeros(5)), "attn_sink.shape", id="attn_sink-wrong-H"),
    pytest.param("attn_sink", dict(attn_sink=torch.zeros(4, dtype=torch.bfloat16)), "attn_sink.dtype",
                 id="attn_sink-bf16"),
    pytest.param("kv", dict(kv=torch.zeros(10, 576, dtype=torch.bfloat16, device="meta")), "kv.device",
                 id="kv-other-device"),
    pytest.param("scale", dict(scale=0.0), "scale", id="scale-zero"),
    pytest.param("scale", dict(scale=float("nan")), "scale", id="scale-nan"),
    # refused as sparse_mla_decode refuses them (the same checks, with the same names)
    pytest.param("indices", dict(indices=torch.zeros(2, 0, dtype=torch.int32)), "indices.shape[1] (topk)",
                 id="topk-0"),
    pytest.param("scale", dict(scale="0.1"), "scale", id="scale-str"),
    pytest.param("scale", dict(scale=torch.tensor(0.1)), "scale", id="scale-tensor"),
    pytest.param("scale", dict(scale=True), "scale", id="scale-bool"),
    pytest.param("scale", dict(scale=None), "scale", id="scale-None"),
]


@pytest.mark.parametrize("name,override,names", BAD)
def test_bad_arguments_raise(name, override, names):
    a = {**_good(), **override}
    q, kv, idx, scale = a.pop("q"), a.pop("kv"), a.pop("indices"), a.pop("scale")
    with pytest.raises(ValueError, match="^" + re.escape(names)):
        sparse_mla_prefill(q, kv, idx, scale=scale, **a)
