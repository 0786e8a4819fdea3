"""quant.kv_cache.write_kv_cache: bytes equal a torch reference exactly, only mapped rows change,
negative slots are skipped, out-of-range slots raise (or are skipped with check_slots=False)."""
import pytest
import torch

from openmla.quant.int8 import quantize_per_channel_ref, quantize_per_token_head_ref
from openmla.quant.kv_cache import quantize_fp8_per_tensor, write_kv_cache
from tests.helpers import DEVICE, INT32_MAX, INT32_MIN, put_rows

FP8 = torch.float8_e4m3fn
CACHE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": FP8}
IN_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _bits(x):
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def quantize_ref(x, cache_dtype, scale):
    """The writer's contract in torch: x.to(cache) or e4m3fn(rne(x_fp32 / scale)) saturating."""
    if cache_dtype != FP8:
        return x.to(cache_dtype)
    return quantize_fp8_per_tensor(x, scale)


def _inputs(T, H, D, dtype, g, scale):
    """[T, H, D] keys/values as slices of wider tensors, with rounding ties, saturation, inf, NaN."""
    x = torch.randn(2, T, H, D + 16, generator=g) * 3
    if scale is not None:  # land on e4m3 values +- half an ulp (ties) and past 448 (saturation)
        s = float(scale)
        x[0, 0, 0, :6] = torch.tensor([1.0625, 1.1875, -3.375, 300.0, 1000.0, -1e6]) * s
        x[1, 0, 0, :3] = torch.tensor([float("inf"), -float("inf"), 0.0])
        x[0, :, :, 8:] *= 60 * s  # most of the e4m3 range
    x[0, -1, -1, 5] = 1.0 + 2.0**-8  # a bf16 tie (from fp32 input)
    x[1, -1, 0, 7] = float("nan")
    x = x.to(dtype).to(DEVICE)
    return x[0, :, :, 3:3 + D], x[1, :, :, 3:3 + D]


def _caches(num_blocks, bs, H, D, dtype, layout, extra_rows):
    shape = (num_blocks, bs + extra_rows, H, D) if layout == "NHD" else (num_blocks, H, bs + extra_rows, D)
    backs = []
    for _ in range(2):
        b = torch.empty(shape, dtype=dtype, device=DEVICE)
        _bits(b).copy_(torch.randint(0, 100, shape, dtype=_bits(b).dtype))  # finite garbage
        backs.append(b)
    view = (lambda b: b[:, :bs]) if layout == "NHD" else (lambda b: b[:, :, :bs])
    return backs, [view(b) for b in backs]


def check_write(T, H, D, bs, num_blocks, cache, in_dtype, layout, *, n_skip=2, extra_rows=1,
                slot_dtype=torch.int64, seed=0):
    g = torch.Generator().manual_seed(seed)
    cdt = CACHE_DTYPES[cache]
    # k: a power of two, so x / scale lands exactly on the planted ties; v: a general scale,
    # so only a correctly rounded division matches.
    scales = (torch.tensor([0.25]), torch.tensor([0.0371])) if cdt == FP8 else (None, None)
    key, value = _inputs(T, H, D, IN_DTYPES[in_dtype], g, scales[0])
    backs, (kc, vc) = _caches(num_blocks, bs, H, D, cdt, layout, extra_rows)
    slots = torch.randperm(num_blocks * bs, generator=g)[:T]
    for i in range(n_skip):
        slots[(3 * i + 1) % T] = (-1, INT32_MIN, -123456)[i % 3]
    before = [_bits(b).clone() for b in backs]
    ks, vs = (None if s is None else s.to(DEVICE) for s in scales)
    write_kv_cache(key, value, kc, vc, slots.to(slot_dtype).to(DEVICE), k_scale=ks, v_scale=vs,
                   layout=layout)
    for name, x, scale, back, old in (("k_cache", key, ks, backs[0], before[0]),
                                      ("v_cache", value, vs, backs[1], before[1])):
        want = old.clone()
        _place(want, layout, bs, slots.tolist(), _bits(quantize_ref(x, cdt, scale)))
        _assert_bits(name, _bits(back), want)


CASES = [  # (T, H, D, bs, num_blocks, cache, input dtype, layout)
    pytest.param(24, 8, 128, 16, 3, "bf16", "bf16", "NHD", id="T24-H8-D128-bs16-bf16"),
    pytest.param(24, 8, 128, 16, 3, "fp8", "bf16", "NHD", id="T24-H8-D128-bs16-fp8"),
    pytest.param(20, 2, 80, 64, 2, "fp8", "fp32", "HND", id="T20-H2-D80-bs64-fp8-HND-fp32in"),
    pytest.param(13, 1, 256, 1, 20, "bf16", "fp32", "NHD", id="T13-H1-D256-bs1-fp32in"),
    pytest.param(9, 4, 64, 7, 3, "fp16", "fp16", "HND", id="T9-H4-D64-bs7-fp16-HND"),
    pytest.param(9, 32, 8, 16, 2, "fp8", "fp16", "NHD", id="T9-H32-D8-fp8-fp16in"),
    pytest.param(16, 3, 96, 16, 2, "fp16", "bf16", "NHD", id="T16-H3-D96-bf16in-fp16cache"),
]


@pytest.mark.parametrize("T,H,D,bs,num_blocks,cache,in_dtype,layout", CASES)
def test_write_matches_reference_bits(T, H, D, bs, num_blocks, cache, in_dtype, layout):
    check_write(T, H, D, bs, num_blocks, cache, in_dtype, layout)


def test_int32_slots_extra_rows_all_skipped():
    check_write(12, 2, 64, 16, 2, "fp8", "bf16", "NHD", slot_dtype=torch.int32, extra_rows=3)
    check_write(6, 2, 64, 16, 1, "bf16", "bf16", "HND", n_skip=6)


def test_out_of_range_slot_raises_or_is_skipped():
    key = torch.randn(3, 2, 16).bfloat16().to(DEVICE)
    kc = torch.zeros(2, 4, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([1, 8, INT32_MAX], device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache(key, key, kc, vc, slots)
    assert not bool(kc.any()), "nothing may be written when the check fails"
    write_kv_cache(key, key, kc, vc, slots, check_slots=False)
    assert torch.equal(kc[0, 1], key[0]) and int((kc != 0).sum()) == int((key[0] != 0).sum())


def test_bad_inputs_raise():
    key = torch.randn(3, 2, 16).bfloat16().to(DEVICE)
    kc = torch.zeros(2, 4, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    k8 = kc.to(FP8)
    slots = torch.tensor([0, 1, 2], device=DEVICE)
    one = torch.ones(1, device=DEVICE)
    with pytest.raises(ValueError, match="k_scale"):
        write_kv_cache(key, key, k8, k8.clone(), slots, v_scale=one)
    with pytest.raises(ValueError, match="v_scale"):
        write_kv_cache(key, key, kc, kc.clone(), slots, v_scale=one)
    with pytest.raises(ValueError, match="k_cache.shape"):
        write_kv_cache(key, key, kc, kc.clone(), slots, layout="HND")
    with pytest.raises(ValueError, match="v_cache.dtype"):
        write_kv_cache(key, key, kc, k8, slots, k_scale=one, v_scale=one)
    with pytest.raises(ValueError, match="slot_mapping.shape"):
        write_kv_cache(key, key, kc, kc.clone(), slots[:2])
    with pytest.raises(ValueError, match="value.shape"):
        write_kv_cache(key, key[:, :1], kc, kc.clone(), slots)
    with pytest.raises(ValueError, match="layout"):
        write_kv_cache(key, key, kc, kc.clone(), slots, layout="nhd")


def test_registered_as_custom_op():
    key = torch.randn(3, 2, 16).bfloat16().to(DEVICE)
    kc = torch.zeros(2, 4, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    slots = torch.tensor([0, -1, 5], device=DEVICE)
    torch.library.opcheck(torch.ops.openmla.write_kv_cache.default,
                          (key, key.clone(), kc, kc.clone(), slots, None, None, "NHD", None, None, "bf16"),
                          test_utils=("test_schema", "test_faketensor"))


# ----------------------------------------------------------------------------------------------
# int8 caches (DESIGN.md "int8 caches"): int8_qkv (int8 K + K-scale cache, int8 V with a static
# per-channel scale) and int8_qk (int8 K + K-scale cache, V in the model dtype). The oracle is
# quant/int8.py's torch references, compared byte for byte.
# ----------------------------------------------------------------------------------------------
NAN, INF = float("nan"), float("inf")
V_CACHES = {"int8": torch.int8, "bf16": torch.bfloat16, "fp16": torch.float16}  # int8_qkv / int8_qk


def _canonical_nan(x):
    """x with every NaN replaced by one NaN (torch's), other values unchanged."""
    return torch.where(torch.isnan(x), torch.full_like(x, NAN), x)


def _canonical_nan_bits(x):
    """fp32 as int32 bits, every NaN mapped to one pattern (a computed NaN's sign/payload is
    unspecified: torch gives 0x7fc00000, PTX max.NaN 0x7fffffff); other values bit for bit."""
    return torch.where(torch.isnan(x), torch.full_like(x, NAN), x).view(torch.int32)


def _int8_inputs(T, H, D, dtype, g):
    """key, value [T, H, D] (slices of wider tensors) and v_scale [H, D] fp32 with planted cases:
    K: token 0 head 0 has scale 0.25 exactly and ties 2.5 -> 2, 3.5 -> 4, -0.5 -> 0; token 2 a
    NaN (NaN scale, q 0); token 3 an inf (inf scale, q 0); token 5 head 0 all zero (scale 1e-8).
    V: channels 0..3 of head 0 have scale 0.25 with ties, a value past 127 * scale, NaN -> 0,
    -inf -> -127; elsewhere scales in [0.01, 0.05] and values reaching past the clamp."""
    x = torch.randn(2, T, H, D + 16, generator=g)
    x[0] *= torch.rand(T, H, 1, generator=g) * 20  # per-(token, head) magnitudes from 0 to 20
    k, v = x[0, :, :, 5:5 + D], x[1, :, :, 5:5 + D]
    k[0, 0, :] = 0.1
    k[0, 0, :4] = torch.tensor([31.75, 0.625, 0.875, -0.125])  # amax 31.75: s = 0.25 exactly
    k[2, -1, D - 1] = NAN
    k[3, 0, 1] = INF
    k[5, 0, :] = 0.0
    v_scale = (0.01 + 0.04 * torch.rand(D, H, generator=g)).t()  # [H, D], strides (1, H)
    v_scale[0, :4] = 0.25
    v_scale[0, 6] = 0.0371
    v *= 3.0  # |v| up to ~12: past 127 * 0.05 = 6.35 for a few values, so some clamp
    v[0, 0, :4] = torch.tensor([0.625, -0.875, 0.125, 100.0])  # -> 2, -4, 0, 127
    v[2, 0, 4] = NAN
    v[3, 0, 5] = -INF
    v[:, 0, 6] = _division_ties(0.0371, T)
    x = x.to(dtype).to(DEVICE)
    return x[0, :, :, 5:5 + D], x[1, :, :, 5:5 + D], v_scale.to(DEVICE)


def _division_ties(s, n):
    """n fp32 values x with x / s == k + 0.5 exactly (correctly rounded) but x * (1 / s) != k + 0.5:
    only a correctly rounded division quantizes them as the reference (exact for fp32 input)."""
    k = torch.arange(-120, 120, dtype=torch.float32) + 0.5
    s = torch.tensor(s, dtype=torch.float32)
    x0 = k * s
    x = torch.cat([x0, torch.nextafter(x0, x0 + 1), torch.nextafter(x0, x0 - 1)])
    k3 = k.repeat(3)
    x = x[(x / s == k3) & (x * (1 / s) != k3)]
    assert x.numel() >= n
    return x[:n]


def _garbage(shape, dtype, g):
    """Finite random bytes for int8, NaN for floats: untouched entries must keep them."""
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8).to(DEVICE)
    return torch.full(shape, NAN, dtype=dtype, device=DEVICE)


def _scale_cache(nb, H, bs, extra_rows, g, permuted):
    """[nb, H, bs] fp32 NaN-filled strided view: a hidden slot per (block, head), or (permuted)
    storage [nb, bs + extra, H] seen through a permute, so no stride is the natural one."""
    back = _garbage((nb, bs + extra_rows, H) if permuted else (nb, H, bs + extra_rows),
                    torch.float32, g)
    return back, _scale_cache_view(back, bs, permuted)


def _place(want, layout, bs, slots, rows):
    """want[block, offset] (NHD) or want[block, :, offset] (HND) = rows[t] for every slot >= 0
    that is in range."""
    n = want.shape[0] * bs
    for t, s in enumerate(slots):
        if 0 <= s < n:
            put_rows(want, layout, s // bs, s % bs, rows[t])


def _assert_bits(name, got, want):
    diff = (got != want).nonzero()
    if diff.numel():
        i = tuple(diff[0].tolist())
        raise AssertionError(f"{name}: {len(diff)} elements differ, first at {i}: "
                             f"got bits {got[i].item()}, want {want[i].item()}")


def check_int8_write(T, H, D, bs, nb, v_cache, in_dtype, layout, *, slot_dtype=torch.int64,
                     extra_rows=1, permuted_scales=False, oob_slots=(), seed=0, k_smooth=None):
    g = torch.Generator().manual_seed(seed)
    vdt = V_CACHES[v_cache]
    key, value, v_scale = _int8_inputs(T, H, D, IN_DTYPES[in_dtype], g)
    shape = (nb, bs + extra_rows, H, D) if layout == "NHD" else (nb, H, bs + extra_rows, D)
    view = (lambda b: b[:, :bs]) if layout == "NHD" else (lambda b: b[:, :, :bs])  # noqa: E731
    kb, vb = _garbage(shape, torch.int8, g), _garbage(shape, vdt, g)
    sb, ksc = _scale_cache(nb, H, bs, extra_rows, g, permuted_scales)
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[1], slots[4] = -1, INT32_MIN  # padding; the planted rows 0, 2, 3, 5 are written
    if T > 6:
        slots[6] = -123456
    for i, s in oob_slots:
        slots[i] = s
    before = [_bits(b).cpu().clone() for b in (kb, vb, sb)]
    if vdt != torch.int8:
        v_scale = None
    write_kv_cache(key, value, view(kb), view(vb), slots.to(slot_dtype).to(DEVICE), v_scale=v_scale,
                   layout=layout, check_slots=not oob_slots, k_scale_cache=ksc, k_smooth=k_smooth)

    if k_smooth is None:
        q_k, s_k = quantize_per_token_head_ref(key.cpu())
    else:  # the cache holds K / f: a correctly rounded fp32 division, then the same rule
        q_k, s_k = quantize_per_token_head_ref(key.cpu().float() / k_smooth.cpu())
    q_v = (quantize_per_channel_ref(value.cpu(), v_scale.cpu()) if v_scale is not None
           else value.cpu().to(vdt))
    sl = slots.tolist()
    for name, back, old, rows in (("k_cache", kb, before[0], _bits(q_k)),
                                  ("v_cache", vb, before[1], _bits(q_v))):
        want = old.clone()
        _place(view(want), layout, bs, sl, rows)
        got = _bits(back).cpu()
        if back.dtype != torch.int8:  # a float V cache: a NaN's sign and payload are unspecified
            got, want = (_bits(_canonical_nan(x.view(back.dtype))) for x in (got, want))
        _assert_bits(name, got, want)
    # The scale cache: written entries compared with NaN canonicalized, untouched ones raw.
    got = sb.cpu()
    written = torch.zeros(got.shape, dtype=torch.bool)
    want = got.new_empty(got.shape).copy_(before[2].view(torch.float32))
    w_mask, w_val = (_scale_cache_view(x, bs, permuted_scales) for x in (written, want))
    for t, s in enumerate(sl):
        if 0 <= s < nb * bs:
            w_mask[s // bs, :, s % bs] = True
            w_val[s // bs, :, s % bs] = s_k[t]
    got_bits = torch.where(written, _canonical_nan_bits(got), got.view(torch.int32))
    want_bits = torch.where(written, _canonical_nan_bits(want), before[2].view(torch.int32))
    _assert_bits("k_scale_cache", got_bits, want_bits)
    assert int(written.sum()) == H * sum(0 <= s < nb * bs for s in sl)


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
@pytest.mark.parametrize("v_cache,layout,in_dtype", [pytest.param("int8", "NHD", "bf16", id="qkv-NHD-bf16"),
                                                     pytest.param("bf16", "HND", "fp32", id="qk-HND-fp32")])
def test_int8_write_with_k_smooth(v_cache, layout, in_dtype):
    """k_smooth: K / f per channel (a strided [H, D] view of factors that are not powers of two,
    so the division rounds) before the per-token rule: bytes and scales equal the torch reference
    with its correctly rounded division, planted NaN / inf / zero keys included."""
    g = torch.Generator().manual_seed(9)
    H, D = 3, 64
    f = (torch.rand(D, H, generator=g) * 30 + 0.01).t()  # [H, D], strides (1, H)
    check_int8_write(14, H, D, 16, 2, v_cache, in_dtype, layout, k_smooth=f.to(DEVICE))


def _scale_cache_view(back, bs, permuted):
    """The [nb, H, bs] view of a K-scale cache backing (see _scale_cache)."""
    return back[:, :bs].permute(0, 2, 1) if permuted else back[:, :, :bs]


INT8_CASES = [  # (T, H, D, bs, num_blocks, v cache, input dtype, layout)
    # regular
    pytest.param(24, 4, 64, 16, 3, "int8", "bf16", "NHD", id="qkv-T24-H4-D64-bs16-NHD-bf16"),
    pytest.param(24, 8, 32, 16, 3, "bf16", "bf16", "NHD", id="qk-T24-H8-D32-bs16-NHD-bf16"),
    pytest.param(16, 2, 128, 16, 2, "int8", "fp16", "HND", id="qkv-T16-H2-D128-bs16-HND-fp16"),
    pytest.param(16, 2, 128, 16, 2, "fp16", "fp16", "HND", id="qk-T16-H2-D128-bs16-HND-fp16"),
    # irregular: odd block sizes, D not a power of two, H not a power of two, fp32 input
    pytest.param(20, 2, 80, 61, 2, "int8", "fp32", "HND", id="qkv-T20-H2-D80-bs61-HND-fp32"),
    pytest.param(9, 3, 96, 61, 2, "fp16", "fp32", "NHD", id="qk-T9-H3-D96-bs61-NHD-fp32"),
    pytest.param(13, 1, 128, 1, 20, "int8", "fp16", "NHD", id="qkv-T13-H1-D128-bs1-NHD-fp16"),
    pytest.param(7, 3, 16, 1, 12, "bf16", "fp32", "HND", id="qk-T7-H3-D16-bs1-HND-fp32"),
    # several programs per token (BLOCK_H < H)
    pytest.param(6, 16, 256, 7, 2, "int8", "bf16", "NHD", id="qkv-T6-H16-D256-bs7-NHD"),
]


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
@pytest.mark.parametrize("T,H,D,bs,num_blocks,v_cache,in_dtype,layout", INT8_CASES)
def test_int8_write_matches_reference_bits(T, H, D, bs, num_blocks, v_cache, in_dtype, layout):
    check_int8_write(T, H, D, bs, num_blocks, v_cache, in_dtype, layout)


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
@pytest.mark.parametrize("v_cache,layout", [pytest.param("int8", "NHD", id="qkv-NHD"),
                                            pytest.param("bf16", "HND", id="qk-HND")])
def test_int8_permuted_scale_cache_int32_slots_out_of_range_skipped(v_cache, layout):
    """A K-scale cache whose storage is [nb, bs + 1, H] (permuted view), int32 slots, and
    check_slots=False with out-of-range slots: those are never written."""
    n = 3 * 16
    check_int8_write(12, 2, 64, 16, 3, v_cache, "bf16", layout, slot_dtype=torch.int32,
                     permuted_scales=True, oob_slots=((7, n), (8, n + 5), (9, INT32_MAX)))


def _int8_setup(v_dtype=torch.int8, H=2, D=16, nb=2, bs=4):
    key = torch.randn(3, H, D).bfloat16().to(DEVICE)
    kc = torch.zeros(nb, bs, H, D, dtype=torch.int8, device=DEVICE)
    vc = torch.zeros(nb, bs, H, D, dtype=v_dtype, device=DEVICE)
    ksc = torch.zeros(nb, H, bs, device=DEVICE)
    vs = torch.full((H, D), 0.05, device=DEVICE)
    slots = torch.tensor([0, 1, 2], device=DEVICE)
    return key, kc, vc, ksc, vs, slots


BAD_INT8 = [  # (what to change, error type, message regex)
    pytest.param(dict(ksc=None), ValueError, "k_scale_cache", id="no-k_scale_cache"),
    pytest.param(dict(ksc=torch.zeros(2, 4, 2)), ValueError, r"k_scale_cache\.shape",
                 id="k_scale_cache-NHD-shaped"),
    pytest.param(dict(ksc=torch.zeros(2, 2, 4, dtype=torch.float16)), ValueError,
                 r"k_scale_cache\.dtype", id="k_scale_cache-fp16"),
    pytest.param(dict(vs=None), ValueError, "v_scale", id="qkv-no-v_scale"),
    pytest.param(dict(vs=torch.full((1,), 0.05)), ValueError, r"v_scale\.",
                 id="qkv-per-tensor-v_scale"),
    pytest.param(dict(vs=torch.full((2, 16), 0.05, dtype=torch.bfloat16)), ValueError,
                 r"v_scale\.dtype", id="qkv-bf16-v_scale"),
    pytest.param(dict(vs=torch.full((16, 2), 0.05)), ValueError, r"v_scale\.shape",
                 id="qkv-transposed-v_scale"),
    pytest.param(dict(ks=torch.ones(1)), ValueError, "k_scale", id="int8-with-k_scale"),
    pytest.param(dict(vc=torch.zeros(2, 4, 2, 16, dtype=torch.bfloat16)), ValueError, "v_scale",
                 id="qk-with-v_scale"),
    pytest.param(dict(vc=torch.zeros(2, 4, 2, 16)), ValueError, r"v_cache\.dtype", id="qk-fp32-v"),
    pytest.param(dict(vc=torch.zeros(2, 4, 2, 8, dtype=torch.int8)), ValueError,
                 r"v_cache\.shape", id="qkv-v_cache-shape"),
    pytest.param(dict(vc=torch.zeros(2, 4, 2, 16, dtype=FP8)), NotImplementedError,
                 "int8 k_cache.*float8_e4m3fn v_cache", id="int8-k-fp8-v"),
    pytest.param(dict(kc=torch.zeros(2, 4, 2, 16, dtype=torch.bfloat16)), NotImplementedError,
                 "int8 v_cache.*bfloat16 k_cache", id="bf16-k-int8-v"),
    pytest.param(dict(kc=torch.zeros(2, 4, 2, 16, dtype=FP8), ks=torch.ones(1)),
                 NotImplementedError,
                 "int8 v_cache.*float8_e4m3fn k_cache", id="fp8-k-int8-v"),
]


@pytest.mark.parametrize("change,exc,match", BAD_INT8)
def test_int8_bad_inputs_raise(change, exc, match):
    key, kc, vc, ksc, vs, slots = _int8_setup()
    args = dict(kc=kc, vc=vc, ksc=ksc, vs=vs, ks=None)
    args.update({k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v
                 for k, v in change.items()})
    before = [t.clone() for t in (kc, vc, ksc)]
    with pytest.raises(exc, match=match):
        write_kv_cache(key, key, args["kc"], args["vc"], slots, k_scale=args["ks"],
                       v_scale=args["vs"], k_scale_cache=args["ksc"])
    assert all(torch.equal(a, b) for a, b in zip((kc, vc, ksc), before)), "nothing may be written"


def test_k_scale_cache_rejected_without_int8_k():
    key = torch.randn(3, 2, 16).bfloat16().to(DEVICE)
    kc = torch.zeros(2, 4, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="k_scale_cache"):
        write_kv_cache(key, key, kc, kc.clone(), torch.tensor([0, 1, 2], device=DEVICE),
                       k_scale_cache=torch.zeros(2, 2, 4, device=DEVICE))


def test_int8_registered_as_custom_op():
    key, kc, vc, ksc, vs, _ = _int8_setup()
    slots = torch.tensor([0, -1, 5], device=DEVICE)
    torch.library.opcheck(torch.ops.openmla.write_kv_cache.default,
                          (key, key.clone(), kc, vc, slots, None, vs, "NHD", ksc, None, "int8_qkv"),
                          test_utils=("test_schema", "test_faketensor"))
