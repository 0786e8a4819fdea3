"""quant/mla_formats.py: pack against an independent numpy implementation of FlashMLA's quantizer
rule (DESIGN.md "fp8_ds_mla"), the scale rules' corner values, rope bits, the round-trip error
bound, the bf16 format, and the error messages."""
import numpy as np
import pytest
import torch

from openmla.quant import BF16_MLA, FP8_DS_MLA, FP8_DS_MLA_RAW, FP8DSMLAFormat, mla_format_of
from tests.helpers import DEVICE
from tests.helpers.quant import gaussian, huge, near_pow2_amax, outlier_channels, seeded, tiny

F = FP8_DS_MLA


# ---------------------------------------------------------------------------------------------
# The oracle: FlashMLA's reference quantizer (tests/quant.py there), re-derived from the rule in
# numpy, one tile at a time, with its own e4m3fn encoder. Shares no code with quant/.
# ---------------------------------------------------------------------------------------------

def _e4m3fn_positive_values() -> np.ndarray:
    """Values of the codes 0x00..0x7E (0x7F is NaN), increasing."""
    codes = np.arange(0x7F)
    e, m = codes >> 3, codes & 7
    return np.where(e == 0, m * 2.0 ** -9, (1 + m / 8) * 2.0 ** (e - 7))


_E4M3 = _e4m3fn_positive_values()


def e4m3fn_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> e4m3fn codes: round to nearest, ties to even, saturating at +-448 (finite x)."""
    a = np.abs(x.astype(np.float64))
    hi = np.clip(np.searchsorted(_E4M3, a), 1, 0x7E)
    lo = hi - 1
    d_lo, d_hi = a - _E4M3[lo], _E4M3[hi] - a
    code = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(a >= 448.0, 0x7E, code)
    return (code | (np.signbit(x).astype(np.int64) << 7)).astype(np.uint8)


def flashmla_quantize(kv_c: np.ndarray, rope_bits: np.ndarray, rule: str) -> np.ndarray:
    """kv_c [N, 512] float32 (exact copy of the input), rope_bits [N, 64] uint16 -> [N, 656] uint8."""
    n = kv_c.shape[0]
    out = np.zeros((n, 656), dtype=np.uint8)
    scales = np.zeros((n, 4), dtype=np.float32)
    for t in range(4):
        tile = kv_c[:, 128 * t:128 * (t + 1)]
        s = np.abs(tile).max(axis=1) / np.float32(448.0)  # float32 / float32: correctly rounded
        if rule == "pow2":
            e = np.ceil(np.log2(np.maximum(s, np.float32(1e-4))))  # fp32 log2, as FlashMLA
            s = np.ldexp(np.float32(1.0), e.astype(np.int32)).astype(np.float32)
        else:
            s = np.maximum(s, np.finfo(np.float32).tiny)
        scales[:, t] = s
        out[:, 128 * t:128 * (t + 1)] = e4m3fn_encode((tile / s[:, None]).astype(np.float32))
    out[:, 512:528] = scales.astype("<f4").view(np.uint8)
    out[:, 528:] = rope_bits.astype("<u2").view(np.uint8)
    return out


def _np32(x: torch.Tensor) -> np.ndarray:
    return x.detach().float().cpu().numpy()


def _rope_bits(k_pe: torch.Tensor) -> np.ndarray:
    return k_pe.to(torch.bfloat16).cpu().view(torch.int16).numpy().view(np.uint16)


def _assert_bytes(name: str, got: torch.Tensor, want: np.ndarray) -> None:
    g = got.cpu().numpy()
    diff = np.argwhere(g != want)
    if diff.size:
        t, b = diff[0]
        raise AssertionError(f"{name}: {len(diff)} bytes differ, first token {t} byte {b}: "
                             f"got {g[t, b]:#04x}, want {want[t, b]:#04x}")


DATA = [
    pytest.param(lambda: gaussian(64), id="gaussian-bf16"),
    pytest.param(lambda: gaussian(16, torch.float32), id="gaussian-fp32"),
    pytest.param(lambda: gaussian(16, torch.float16), id="gaussian-fp16"),
    pytest.param(lambda: outlier_channels(48), id="outlier-channels"),
    pytest.param(lambda: tiny(16), id="tiny-lt1e-6"),
    pytest.param(lambda: tiny(16, torch.float32), id="tiny-lt1e-6-fp32"),
    pytest.param(lambda: huge(16), id="huge-amax1e4"),
    pytest.param(lambda: near_pow2_amax(), id="amax-at-and-just-above-448x2^k-fp32"),
]


# --- pack == FlashMLA's rule, byte for byte ---------------------------------------------------

@pytest.mark.parametrize("fmt", [pytest.param(FP8_DS_MLA, id="pow2"), pytest.param(FP8_DS_MLA_RAW, id="raw")])
@pytest.mark.parametrize("make", DATA)
def test_pack_matches_flashmla_rule(make, fmt):
    kv_c, k_pe = make()
    got = fmt.pack(kv_c.to(DEVICE), k_pe.to(DEVICE))
    want = flashmla_quantize(_np32(kv_c), _rope_bits(k_pe), fmt.scale_rule)
    _assert_bytes(f"pack[{fmt.scale_rule}]", got, want)


def test_pack_divides_amax_by_448_on_every_device():
    """The rule divides: s = amax / 448 correctly rounded (vLLM's raw CUDA writer does too). torch on
    CUDA evaluates `tensor / 448.0` (a Python float) as tensor * fl32(1/448) (ATen
    div_true_kernel_cuda), one ulp off for about half of all bf16 amax values, so FP8DSMLAFormat.scales
    must divide by a tensor (e.g. `amax.float() / torch.full_like(amax.float(), 448.0)`). Every
    positive bf16 value in [2^-10, 2^14) is one tile's amax here."""
    amax = torch.arange(0x3A80, 0x4680, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    amax = amax[: amax.numel() // 4 * 4].view(-1, 4)
    kv = torch.zeros(amax.shape[0], 4, 128, dtype=torch.bfloat16)
    kv[:, :, 0] = amax
    kv[:, :, 1] = -amax * 0.5
    kv = kv.view(-1, 512)
    pe = torch.zeros(kv.shape[0], 64, dtype=torch.bfloat16)
    out = FP8_DS_MLA_RAW.pack(kv.to(DEVICE), pe.to(DEVICE)).cpu()
    _, scale, _ = FP8_DS_MLA_RAW.unpack_parts(out)
    want = torch.from_numpy(_np32(amax) / np.float32(448.0))
    bad = (scale != want).nonzero()
    assert bad.numel() == 0, (f"{len(bad)}/{want.numel()} raw scales are not amax / 448; first: amax "
                              f"{amax[tuple(bad[0])].item()}, got {scale[tuple(bad[0])].item()!r}, "
                              f"want {want[tuple(bad[0])].item()!r}")
    _assert_bytes("pack[raw]", out, flashmla_quantize(_np32(kv), _rope_bits(pe), "raw"))


def test_near_pow2_edge_keeps_scale_and_saturates():
    """The edge the rule's fp32 log2 creates, pinned explicitly: amax = 448 * 2^-13 * (1 + 2^-23)
    has amax / 448 = 2^-13 (1 + 2^-23) whose fp32 log2 is exactly -13.0 -> scale 2^-13, and the
    element (448 * (1 + 2^-23) after scaling) saturates to 448 (code 0x7E)."""
    v = np.float32(2.0 ** -13 * (1 + 2.0 ** -23))
    assert float(np.log2(v)) == -13.0
    amax = np.float32(v * np.float32(448.0))
    assert np.float32(amax / np.float32(448.0)) == v
    kv = torch.zeros(1, 512)
    kv[0, :] = 1e-9
    kv[0, 7] = float(amax)
    out = F.pack(kv.to(DEVICE), torch.ones(1, 64, dtype=torch.bfloat16, device=DEVICE)).cpu()
    _, scale, _ = F.unpack_parts(out)
    assert scale[0, 0].item() == 2.0 ** -13
    assert out[0, 7].item() == 0x7E


# --- scale rule corner values -------------------------------------------------------------------

@pytest.mark.parametrize("fmt,amax,want", [
    pytest.param(FP8_DS_MLA, 0.0, 2.0 ** -13, id="pow2-zero-tile-floor-2^-13"),
    pytest.param(FP8_DS_MLA, 336.0, 1.0, id="pow2-amax336-scale1"),
    pytest.param(FP8_DS_MLA, 448.0, 1.0, id="pow2-amax448-scale1"),
    pytest.param(FP8_DS_MLA, 449.0, 2.0, id="pow2-amax449-scale2"),
    pytest.param(FP8_DS_MLA, 1e-7, 2.0 ** -13, id="pow2-tiny-floor"),
    pytest.param(FP8_DS_MLA, 1e4, 32.0, id="pow2-amax1e4-scale32"),
    pytest.param(FP8_DS_MLA_RAW, 0.0, float(np.finfo(np.float32).tiny), id="raw-zero-tile-FLT_MIN"),
    pytest.param(FP8_DS_MLA_RAW, 336.0, 0.75, id="raw-amax336"),
    pytest.param(FP8_DS_MLA_RAW, 448.0, 1.0, id="raw-amax448"),
])
def test_scale_rule_values(fmt, amax, want):
    kv = torch.zeros(2, 512)
    kv[:, 128:256] = torch.linspace(-1, 1, 128) * amax  # tile 1 carries amax, tiles 0, 2, 3 are zero
    out = fmt.pack(kv.to(DEVICE), torch.zeros(2, 64, dtype=torch.bfloat16, device=DEVICE)).cpu()
    _, scale, _ = fmt.unpack_parts(out)
    floor = 2.0 ** -13 if fmt.scale_rule == "pow2" else float(np.finfo(np.float32).tiny)
    assert scale[:, 1].tolist() == [np.float32(want)] * 2
    assert scale[:, [0, 2, 3]].flatten().tolist() == [np.float32(floor)] * 6
    assert torch.all(out[:, :128] == 0) and torch.all(out[:, 256:512] == 0)


def test_nan_in_a_tile_poisons_only_that_tile():
    kv, pe = gaussian(2)
    kv[1, 300] = float("nan")
    out = F.pack(kv.to(DEVICE), pe.to(DEVICE)).cpu()
    lat, scale, _ = F.unpack_parts(out)
    assert torch.isnan(scale[1, 2]) and torch.isnan(lat[1, 256:384]).all()
    want_clean = flashmla_quantize(_np32(kv[:1]), _rope_bits(pe[:1]), "pow2")
    _assert_bytes("pack[clean token]", out[:1], want_clean)
    keep = [i for i in range(656) if not (256 <= i < 384 or 520 <= i < 524)]
    want_row = flashmla_quantize(np.nan_to_num(_np32(kv[1:]), nan=0.0), _rope_bits(pe[1:]), "pow2")
    _assert_bytes("pack[other tiles of the NaN token]", out[1:, keep], want_row[:, keep])


# --- rope bytes ---------------------------------------------------------------------------------

def test_rope_bits_verbatim_including_nan_payloads_and_inf():
    """bf16 rope is copied bit for bit: NaN payloads, -0.0, +-inf and subnormals survive."""
    kv, pe = gaussian(4)
    bits = pe.view(torch.int16)
    special = [0x7F81, 0xFFC3, 0x7FC0, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x807F]  # NaNs, +-inf, -0, subnormals
    bits[1, :len(special)] = torch.tensor([b - 0x10000 if b >= 0x8000 else b for b in special], dtype=torch.int16)
    out = F.pack(kv.to(DEVICE), pe.to(DEVICE)).cpu()
    assert torch.equal(out[:, 528:].contiguous().view(torch.int16), bits)
    _, _, rope = F.unpack_parts(out)
    assert torch.equal(rope.view(torch.int16), bits)


def test_rope_from_fp32_rounds_to_nearest_even():
    kv, _ = gaussian(2)
    pe32 = torch.randn(2, 64, generator=seeded(9)) * 3
    pe32[0, 0] = 1.0 + 2.0 ** -8   # tie between two bf16 values: rounds to even (1.0)
    pe32[0, 1] = 1.0 + 3 * 2.0 ** -8  # tie: rounds to even (1 + 2^-6)
    out = F.pack(kv.to(DEVICE), pe32.to(DEVICE)).cpu()
    rope = out[:, 528:].contiguous().view(torch.bfloat16)
    assert rope[0, 0].item() == 1.0 and rope[0, 1].item() == 1.0 + 2.0 ** -6
    assert torch.equal(rope.view(torch.int16), torch.from_numpy(_bf16_rne_bits(pe32.numpy())))


# --- round trip ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", [pytest.param(FP8_DS_MLA, id="pow2"), pytest.param(FP8_DS_MLA_RAW, id="raw")])
@pytest.mark.parametrize("make", DATA[:7])
def test_round_trip_error_bound(make, fmt):
    """|unpack(pack(x)) - x| <= max(|x| 2^-4, s 2^-10) per element: half an e4m3 step (3 mantissa
    bits) in the normal range, half the subnormal step 2^-9 (times the tile scale) below it."""
    kv_c, k_pe = make()
    out = fmt.pack(kv_c.to(DEVICE), k_pe.to(DEVICE)).cpu()
    back = fmt.unpack(out)
    _, scale, _ = fmt.unpack_parts(out)
    x = kv_c.double()
    s = scale.double().repeat_interleave(128, dim=1)
    err = (back[:, :512].double() - x).abs()
    bound = torch.maximum(x.abs() * 2.0 ** -4, s * 2.0 ** -10)
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"round-trip error {worst:.3f} x the bound"
    assert torch.equal(back[:, 512:], k_pe.float())
    # and the quantization is doing work: not every element is exact
    assert err.max().item() > 0


# --- bf16 format --------------------------------------------------------------------------------

def _bf16_rne_bits(x: np.ndarray) -> np.ndarray:
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16).view(np.int16)


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32"),
                                   pytest.param(torch.float16, id="fp16")])
def test_bf16_format_pack_unpack(dtype):
    kv, pe = outlier_channels(8, dtype)
    pe = pe.float().to(dtype) * 1.37
    out = BF16_MLA.pack(kv.to(DEVICE), pe.to(DEVICE)).cpu()
    assert out.dtype == torch.bfloat16 and out.shape == (8, 576)
    want = np.concatenate([_bf16_rne_bits(_np32(kv)), _bf16_rne_bits(_np32(pe))], axis=1)
    assert np.array_equal(out.view(torch.int16).numpy(), want)
    assert torch.equal(BF16_MLA.unpack(out), out.float())


def test_format_layout_constants():
    assert (F.bytes_per_token, F.scale_offset, F.rope_offset, F.num_tiles) == (656, 512, 528, 4)
    assert (F.row_width, F.cache_dtype, F.head_dim) == (656, torch.uint8, 576)
    assert (BF16_MLA.row_width, BF16_MLA.bytes_per_token, BF16_MLA.cache_dtype) == (576, 1152, torch.bfloat16)


# --- errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("cache,match", [
    pytest.param(torch.zeros(2, 4, 656, dtype=torch.uint8), None, id="uint8-656-ok"),
    pytest.param(torch.zeros(2, 4, 576, dtype=torch.bfloat16), None, id="bf16-576-ok"),
    pytest.param(torch.zeros(2, 4, 576, dtype=torch.uint8), r"my_cache\.shape\[-1\]: expected 656", id="uint8-576"),
    pytest.param(torch.zeros(2, 4, 656, dtype=torch.bfloat16), r"my_cache\.shape\[-1\]: expected 576", id="bf16-656"),
    pytest.param(torch.zeros(2, 4, 576, dtype=torch.float16), r"my_cache\.dtype: expected", id="fp16"),
    pytest.param(torch.zeros(2, 4, 656, dtype=torch.float8_e4m3fn), r"my_cache\.dtype", id="fp8-dtype"),
    pytest.param([1, 2], r"my_cache: expected a torch.Tensor", id="list"),
])
def test_mla_format_of(cache, match):
    if match is None:
        fmt = mla_format_of(cache, "my_cache")
        assert fmt is (FP8_DS_MLA if cache.dtype == torch.uint8 else BF16_MLA)
    else:
        with pytest.raises(ValueError, match=match):
            mla_format_of(cache, "my_cache")


BF = torch.bfloat16


@pytest.mark.parametrize("fmt", [pytest.param(FP8_DS_MLA, id="fp8"), pytest.param(BF16_MLA, id="bf16")])
@pytest.mark.parametrize("kv_c,k_pe,match", [
    pytest.param(torch.zeros(3, 511, dtype=BF), torch.zeros(3, 64, dtype=BF), r"kv_c\.shape\[-1\]: expected 512, got 511",
                 id="kv_c-width"),
    pytest.param(torch.zeros(3, 512, dtype=BF), torch.zeros(3, 65, dtype=BF), r"k_pe\.shape\[-1\]: expected 64, got 65",
                 id="k_pe-width"),
    pytest.param(torch.zeros(3, 512, dtype=BF), torch.zeros(2, 64, dtype=BF), r"k_pe\.shape\[:-1\]: expected \(3,\)",
                 id="token-count"),
    pytest.param(torch.zeros(3, 512, dtype=torch.int32), torch.zeros(3, 64, dtype=BF), r"kv_c\.dtype", id="kv_c-int"),
    pytest.param(torch.zeros(3, 512, dtype=BF), torch.zeros(3, 64, dtype=torch.float64), r"k_pe\.dtype", id="k_pe-fp64"),
    pytest.param(torch.tensor(1.0), torch.zeros(64), r"kv_c\.dim\(\): expected >= 1", id="kv_c-0d"),
    pytest.param(torch.zeros(512), torch.tensor(1.0), r"k_pe\.dim\(\): expected >= 1", id="k_pe-0d"),
])
def test_pack_errors_name_the_tensor(fmt, kv_c, k_pe, match):
    with pytest.raises(ValueError, match=match):
        fmt.pack(kv_c, k_pe)


@pytest.mark.parametrize("fmt,cache,match", [
    pytest.param(FP8_DS_MLA, torch.zeros(2, 576, dtype=torch.uint8), r"cache\.shape\[-1\]: expected 656", id="fp8-width"),
    pytest.param(FP8_DS_MLA, torch.zeros(2, 656, dtype=BF), r"cache\.dtype: expected torch\.uint8", id="fp8-dtype"),
    pytest.param(BF16_MLA, torch.zeros(2, 656, dtype=BF), r"cache\.shape\[-1\]: expected 576", id="bf16-width"),
    pytest.param(BF16_MLA, torch.zeros(2, 576, dtype=torch.uint8), r"cache\.dtype: expected torch\.bfloat16",
                 id="bf16-dtype"),
    pytest.param(FP8_DS_MLA, torch.tensor(7, dtype=torch.uint8), r"cache\.dim\(\): expected >= 1", id="fp8-0d"),
    pytest.param(BF16_MLA, torch.tensor(7.0, dtype=BF), r"cache\.dim\(\): expected >= 1", id="bf16-0d"),
])
def test_unpack_errors_name_the_tensor(fmt, cache, match):
    with pytest.raises(ValueError, match=match):
        fmt.unpack(cache)


def test_unknown_scale_rule():
    with pytest.raises(ValueError, match=r"scale_rule: expected one of \('pow2', 'raw'\), got 'ue8m0'"):
        FP8DSMLAFormat(scale_rule="ue8m0")
