"""quant.kv_cache.write_kv_cache: bytes equal a torch reference exactly, only mapped rows change,
negative slots are skipped, out-of-range slots raise (or are skipped with check_slots=False)."""
import pytest
import torch

from quant.kv_cache import quantize_fp8_per_tensor, write_kv_cache
from tests.helpers import DEVICE, INT32_MAX, INT32_MIN

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
        q = _bits(quantize_ref(x, cdt, scale))
        for t, s in enumerate(slots.tolist()):
            if s >= 0:
                if layout == "NHD":
                    want[s // bs, s % bs] = q[t]
                else:
                    want[s // bs, :, s % bs] = q[t]
        got = _bits(back)
        diff = (got != want).nonzero()
        if diff.numel():
            i = tuple(diff[0].tolist())
            raise AssertionError(f"{name}: {len(diff)} elements differ, first at {i}: "
                                 f"got bits {got[i].item()}, want {want[i].item()}")


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
                          (key, key.clone(), kc, kc.clone(), slots, None, None, "NHD"),
                          test_utils=("test_schema", "test_faketensor"))
