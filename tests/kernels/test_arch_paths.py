"""The paths other GPUs take, run where the tests run. `kernels.device.assume(arch)` makes the
dispatch pick what it picks on that GPU; these cases run the picks whose code differs from the
default path and can run on the CPU and on any NVIDIA GPU: the integer e4m3 conversions of GPUs
before sm_89 (Triton has no float8e4nv type there, so fp8 caches travel as bytes), on
adversarial inputs (NaN in unused cache rows, invalid indices, a NaN tile). Attention results
match the oracle (and, in the interpreter, the default path bit for bit); cache bytes and
gathered rows equal the default path's everywhere (the conversions are exact). Which arch gets
which path is checked too (the dispatch's one table). Whether each target's kernels compile:
test_aot_compile.py."""
import math

import pytest
import torch

from openmla.kernels import device
from openmla.kernels.device import ARCHES, E4M3_BITS, E4M3_CAST, E4M3_PTX
from openmla.kernels.paged_attention import paged_attention
from openmla.kernels.reference import paged_attention_ref, sparse_mla_decode_ref
from openmla.kernels.sparse_mla_decode import sparse_mla_decode
from openmla.quant import FP8_DS_MLA
from openmla.quant.kv_cache import write_kv_cache
from openmla.quant.mla_gather import gather_upconvert
from openmla.quant.mla_writer import write_mla_cache
from tests.helpers import DEVICE, INTERPRET, assert_close, invalid_indices, random_paged_cache
from tests.helpers.kernels import build

# sm_80's choices run on the CPU and on every later NVIDIA GPU (not on an AMD one: the
# dispatch would also pick NVIDIA-only options there)
BITS_HERE = pytest.mark.skipif(DEVICE == "cuda" and torch.version.hip is not None,
                               reason="the NVIDIA sm_80 path (inline PTX, maxnreg) does not run "
                                      "on an AMD GPU; the CPU and NVIDIA runs cover it")


def _default_path():
    return device.assume(device.arch_of(DEVICE))


def _bits_path():
    """The dispatch of an sm_80 GPU: e4m3 bytes converted by integer arithmetic."""
    return device.assume(ARCHES["sm_80"])


def _same_bits(name, got, want):
    """Bit equality, where a NaN matches any NaN (its payload is not part of any contract)."""
    g, w = got.cpu(), want.cpu()
    both_nan = torch.zeros(g.shape, dtype=torch.bool)
    if g.is_floating_point():
        both_nan = torch.isnan(g) & torch.isnan(w)
        g, w = g.view(torch.int16 if g.element_size() == 2 else torch.int32), \
            w.view(torch.int16 if w.element_size() == 2 else torch.int32)
    bad = ((g != w) & ~both_nan).nonzero()
    assert bad.numel() == 0, f"{name}: {len(bad)} elements differ, first at {bad[0].tolist()}"


def test_arch_table(monkeypatch):
    """Gluon on sm_90 only (and off with OPENMLA_SM90_GLUON=0); the e4m3 path by generation;
    inline PTX on NVIDIA only; AMD wavefronts of 64."""
    monkeypatch.delenv("OPENMLA_SM90_GLUON", raising=False)
    e4m3 = {name: a.e4m3 for name, a in ARCHES.items()}
    assert e4m3 == {"sm_80": E4M3_BITS, "sm_86": E4M3_BITS, "sm_89": E4M3_PTX, "sm_90": E4M3_PTX,
                    "sm_100": E4M3_PTX, "sm_120": E4M3_PTX, "gfx942": E4M3_CAST,
                    "gfx950": E4M3_CAST}
    assert [n for n, a in ARCHES.items() if a.gluon_sm90] == ["sm_90"]
    assert [n for n, a in ARCHES.items() if a.ptx] == ["sm_80", "sm_86", "sm_89", "sm_90",
                                                        "sm_100", "sm_120"]
    assert {a.warp_size for n, a in ARCHES.items() if n.startswith("gfx")} == {64}
    monkeypatch.setenv("OPENMLA_SM90_GLUON", "0")
    assert not ARCHES["sm_90"].gluon_sm90
    with device.assume(ARCHES["gfx942"]):
        assert device.arch_of(DEVICE) is ARCHES["gfx942"]
    assert device.arch_of("cpu") is device.INTERPRETER


@BITS_HERE
@pytest.mark.parametrize("H,T,topk", [pytest.param(16, 2, 96, id="H16-T2-topk96"),
                                      pytest.param(40, 2, 200, id="H40-T2-topk200-split")])
def test_sparse_decode_fp8(H, T, topk):
    """fp8_ds_mla decode, its e4m3 bytes converted by integer arithmetic: the same out and lse."""
    g = torch.Generator().manual_seed(3)
    num_blocks, bs = 6, 16
    slots = num_blocks * bs
    cache, _ = random_paged_cache(num_blocks, bs, FP8_DS_MLA.row_width, torch.uint8)
    idx = torch.randint(0, slots, (T, topk), generator=g, dtype=torch.int32)
    bad = invalid_indices(slots)
    idx[:, :len(bad)] = torch.tensor(bad, dtype=torch.int32)
    poisoned = int(idx[0, -1])  # a slot only token 0 selects
    idx[1:][idx[1:] == poisoned] = (poisoned + 1) % slots
    used = torch.unique(idx[(idx >= 0) & (idx < slots)]).long()
    rows = FP8_DS_MLA.pack(torch.randn(len(used), 512, generator=g) * 3,
                           torch.randn(len(used), 64, generator=g))
    cache[used // bs, used % bs] = rows.to(DEVICE)
    # e4m3's NaN (0x7F) in that row's latent, beside a finite scale: token 0 turns NaN (DESIGN.md:
    # faults stay visible), token 1 stays finite
    cache[poisoned // bs, poisoned % bs, 300] = 0x7F
    q = torch.randn(T, H, 576, generator=g).to(torch.bfloat16).to(DEVICE)
    sink = torch.randn(H, generator=g).to(DEVICE)
    with _bits_path():
        got = sparse_mla_decode(q, cache, idx.to(DEVICE), scale=0.07, attn_sink=sink)
    want = sparse_mla_decode_ref(q, cache, idx.to(DEVICE), scale=0.07, attn_sink=sink)
    assert torch.isnan(got[1][0]).all() and torch.isfinite(got[1][1:]).all()
    assert_close("out", got[0], want[0], "sparse_decode")
    assert_close("lse", got[1], want[1], "lse")
    if INTERPRET:  # same emulated arithmetic on both paths: only the conversion differs
        default = sparse_mla_decode(q, cache, idx.to(DEVICE), scale=0.07, attn_sink=sink)
        _same_bits("out", got[0], default[0])
        _same_bits("lse", got[1], default[1])


@BITS_HERE
@pytest.mark.parametrize("seqs,H,H_kv", [pytest.param([(1, 300), (3, 40)], 8, 2, id="decode-split"),
                                         pytest.param([(37, 80)], 4, 4, id="prefill")])
def test_paged_attention_fp8(seqs, H, H_kv):
    """An fp8 KV cache read as bytes and converted by integer arithmetic: the same out and lse."""
    b = build(seqs, H, H_kv, 64, 16, cache="fp8")
    scale = 0.9 / math.sqrt(64)
    with _bits_path():
        got = paged_attention(**b, scale=scale, return_lse=True)
    want = paged_attention_ref(**b, scale=scale)
    assert_close("out", got[0], want[0], "bf16")
    assert_close("lse", got[1], want[1], "fp32")
    if INTERPRET:
        default = paged_attention(**b, scale=scale, return_lse=True)
        _same_bits("out", got[0], default[0])
        _same_bits("lse", got[1], default[1])


@BITS_HERE
def test_cache_writers_and_gather():
    """fp32 -> e4m3 (MLA and MHA writers) and e4m3 -> bf16 (the prefill gather) by integer
    arithmetic: the same bytes, a NaN tile and saturating values included."""
    g = torch.Generator().manual_seed(5)
    T, bs = 6, 16
    kv_c = torch.randn(T, 512, generator=g) * 4
    kv_c[1, 128:256] = float("nan")
    kv_c[2, 7] = 1e30  # one huge value: the rest of its tile falls to subnormals or zero
    kv_c, k_pe = kv_c.to(torch.bfloat16).to(DEVICE), torch.randn(T, 64, generator=g).to(DEVICE)
    slots = torch.tensor([5, 40, -1, 17, 63, 22], dtype=torch.int32, device=DEVICE)
    caches = []
    for path in (_default_path(), _bits_path()):
        cache, _ = random_paged_cache(4, bs, FP8_DS_MLA.row_width, torch.uint8)
        with path:
            write_mla_cache(kv_c, k_pe.to(torch.bfloat16), cache, slots)
        caches.append(cache)
    _same_bits("fp8_ds_mla cache", caches[1], caches[0])
    caches[0][0, 5, 9], caches[0][1, 3, 400] = 0xFF, 0x7F  # e4m3 NaN beside finite scales

    table = torch.tensor([[2, 0, 3, 1]], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([64], dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([3], dtype=torch.int32, device=DEVICE)
    dsts = []
    for path in (_default_path(), _bits_path()):
        dst = torch.full((70, 576), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        with path:
            gather_upconvert(caches[0], dst, table, seq_lens, starts)
        dsts.append(dst)
    _same_bits("gathered rows", dsts[1], dsts[0])

    key = (torch.randn(T, 2, 64, generator=g) * 30).to(DEVICE)
    key[0, 1, 3], key[4, 0, 9] = float("nan"), 1e5  # NaN stays NaN, 1e5 / scale saturates
    outs = []
    for path in (_default_path(), _bits_path()):
        kc = torch.zeros(4, bs, 2, 64, dtype=torch.float8_e4m3fn, device=DEVICE)
        vc = torch.zeros_like(kc)
        with path:
            write_kv_cache(key, key * 0.5, kc, vc, slots, k_scale=torch.tensor([0.3], device=DEVICE),
                           v_scale=torch.tensor([0.7], device=DEVICE))
        outs.append((kc.view(torch.uint8), vc.view(torch.uint8)))
    _same_bits("fp8 k cache", outs[1][0], outs[0][0])
    _same_bits("fp8 v cache", outs[1][1], outs[0][1])
