"""quant.indexer_cache: the indexer K cache format (vLLM 0.32's page-blocked layout) and its Triton
writer, byte for byte against the torch reference writer; only the mapped tokens' bytes change."""
import numpy as np
import pytest
import torch

from openmla.quant.indexer_cache import (INDEXER_K_FP8, INDEXER_K_FP8_RAW, indexer_k_format_of,
                                         write_indexer_k_cache)
from tests.helpers import DEVICE, INT32_MAX, INT32_MIN

FORMATS = [pytest.param(INDEXER_K_FP8, id="ue8m0"), pytest.param(INDEXER_K_FP8_RAW, id="raw")]


def _keys(T, seed, dtype=torch.bfloat16, *, wide=False):
    """[T, 128] keys with an outlier channel, an all-zero token, a tiny token, NaN and inf tokens."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(T, 160 if wide else 128, generator=g) * 2
    k[:, 7] *= 40.0
    if T > 3:
        k[1] = 0.0  # amax floor
        k[2] *= 1e-7  # below the floor too
        k[3, 5] = float("nan")  # NaN is dropped from amax (CUDA fmaxf), stays NaN in its byte
    if T > 4:
        k[4, 9] = float("inf")  # inf amax: inf scale, the others 0, inf / inf NaN
    k = k.to(dtype).to(DEVICE)
    return k[:, 13:141] if wide else k


def _near_pow2_keys():
    """Tokens whose amax / 448 sits on or a few ulps above 2^k: the ue8m0 rounding edge."""
    rows = []
    for e in (-20, -13, -9, -1, 0, 3, 20):
        base = np.float32(448.0 * 2.0 ** e)
        for i in range(4):
            a = np.float32(base + np.float32(i) * np.spacing(base))
            r = torch.linspace(-0.9, 0.9, 128) * float(a)
            r[17] = float(a)
            r[40] = float(a) * 0.75
            rows.append(r)
    return torch.stack(rows).to(DEVICE)


def _cache(num_blocks, block_size, fmt, *, pad_bytes=0):
    """A NaN-byte (0xFF) filled cache as a strided view (block stride = block bytes + pad_bytes)."""
    w = fmt.bytes_per_token
    backing = torch.full((num_blocks, block_size * w + pad_bytes), 0xFF, dtype=torch.uint8, device=DEVICE)
    cache = backing.as_strided((num_blocks, block_size, w), (block_size * w + pad_bytes, w, 1))
    return cache, backing


def _slots(T, num_slots, seed, n_skip):
    g = torch.Generator().manual_seed(seed)
    s = torch.randperm(num_slots, generator=g)[:T].to(torch.int64)
    neg = [-1, INT32_MIN, -123456]
    for i in range(n_skip):
        s[(3 * i + 1) % T] = neg[i % 3]
    return s


def check_write(k, fmt, num_blocks, block_size, slots, *, pad_bytes=0, slot_dtype=torch.int64):
    cache, backing = _cache(num_blocks, block_size, fmt, pad_bytes=pad_bytes)
    want_cache, want_backing = _cache(num_blocks, block_size, fmt, pad_bytes=pad_bytes)
    write_indexer_k_cache(k, cache, slots.to(slot_dtype).to(DEVICE), fmt=fmt)
    fmt.write_ref(k, want_cache, slots.to(DEVICE))
    assert torch.equal(backing, want_backing)  # padding bytes and unmapped tokens untouched too
    # the written tokens read back as pack gives them
    values, scales = fmt.read_ref(cache)
    q, s = fmt.pack(k)
    for t, sl in enumerate(slots.tolist()):
        if 0 <= sl < num_blocks * block_size:
            assert torch.equal(values[sl // block_size, sl % block_size], q[t])
            assert torch.equal(scales[sl // block_size, sl % block_size].view(torch.int32), s[t].view(torch.int32))
    return cache


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("T,num_blocks,block_size,n_skip,pad", [
    pytest.param(6, 4, 64, 0, 0, id="T6-bs64"),
    pytest.param(9, 5, 3, 2, 0, id="T9-bs3-skip2"),
    pytest.param(5, 6, 1, 1, 0, id="T5-bs1"),
    pytest.param(7, 4, 16, 3, 36, id="T7-bs16-strided-blocks"),
])
def test_write_matches_reference(fmt, T, num_blocks, block_size, n_skip, pad):
    k = _keys(T, seed=T + block_size)
    check_write(k, fmt, num_blocks, block_size, _slots(T, num_blocks * block_size, T, n_skip), pad_bytes=pad)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_write_other_input_dtypes_and_wide_rows(dtype):
    k = _keys(6, seed=3, dtype=dtype, wide=True)
    assert k.stride(0) == 160
    check_write(k, INDEXER_K_FP8, 3, 4, _slots(6, 12, 1, 1), slot_dtype=torch.int32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_ue8m0_edge(fmt):
    k = _near_pow2_keys()
    check_write(k, fmt, 8, 4, torch.arange(k.shape[0], dtype=torch.int64))


def test_layout_is_page_blocked():
    """Token o of block b: values at byte b * stride(0) + o * 128, scale at + block_size * 128 + 4 o
    (vLLM's indexer_k_quant_and_cache / DeepGEMM layout), checked on raw bytes."""
    bs, nb = 4, 3
    k = _keys(5, seed=9)
    slots = torch.tensor([5, 0, 11, 2, 7])
    cache, backing = _cache(nb, bs, INDEXER_K_FP8, pad_bytes=8)
    write_indexer_k_cache(k, cache, slots.to(DEVICE))
    q, s = INDEXER_K_FP8.pack(k)
    stride = bs * 132 + 8
    flat = backing.reshape(-1)
    for t, sl in enumerate(slots.tolist()):
        b, o = divmod(sl, bs)
        base = b * stride
        assert torch.equal(flat[base + o * 128: base + o * 128 + 128], q[t])
        assert torch.equal(flat[base + bs * 128 + 4 * o: base + bs * 128 + 4 * o + 4], s[t].view(torch.uint8))
    assert INDEXER_K_FP8.unpack(q, s)[0].isfinite().all()
    m, _ = np.frexp(s[:4].cpu().numpy())  # ue8m0 scales are powers of two (token 4 has inf)
    assert np.all(m == 0.5) and torch.isinf(s[4]).all()


def test_quantization_rule_values():
    """Scale = 2^ceil(log2(max(amax, 1e-4) / 448)); raw keeps amax/448; NaN ignored in amax."""
    k = torch.zeros(3, 128)
    k[0, 0] = 448.0 * 3  # amax / 448 = 3 -> ue8m0 4, raw 3
    k[1] = 0.0  # floor: 1e-4 / 448
    k[2, 0], k[2, 1] = float("nan"), 448.0  # NaN dropped: scale 1
    q, s = INDEXER_K_FP8.pack(k)
    _, s_raw = INDEXER_K_FP8_RAW.pack(k)
    assert s[0, 0] == 4.0 and s_raw[0, 0] == 3.0
    floor = torch.tensor(1e-4, dtype=torch.float32) / torch.tensor(448.0)
    assert s_raw[1, 0] == floor and s[1, 0] == 2.0 ** np.ceil(np.log2(float(floor)))
    assert s[2, 0] == 1.0 and q[2, 1] == 0x7E and (q[2, 0] & 0x7F) == 0x7F


def test_skip_and_out_of_range_slots_write_nothing():
    k = _keys(5, seed=2)
    slots = torch.tensor([-1, INT32_MIN, 12, INT32_MAX, 3])
    cache, backing = _cache(3, 4, INDEXER_K_FP8)
    before = backing.clone()
    write_indexer_k_cache(k, cache, slots.to(DEVICE), check_slots=False)
    changed = (backing != before).reshape(3, -1)
    assert changed.any()
    want, wb = _cache(3, 4, INDEXER_K_FP8)
    INDEXER_K_FP8.write_ref(k, want, slots.to(DEVICE))
    assert torch.equal(backing, wb)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_indexer_k_cache(k, cache, slots.to(DEVICE))


def test_empty_and_scale_fmt_names():
    cache, backing = _cache(2, 4, INDEXER_K_FP8)
    before = backing.clone()
    write_indexer_k_cache(torch.empty(0, 128, dtype=torch.bfloat16, device=DEVICE), cache,
                          torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(backing, before)
    assert indexer_k_format_of("ue8m0") is INDEXER_K_FP8
    assert indexer_k_format_of(None) is INDEXER_K_FP8_RAW and indexer_k_format_of("") is INDEXER_K_FP8_RAW


@pytest.mark.parametrize("bad", ["k_dim", "k_dtype", "cache_width", "cache_dtype", "rows_strided",
                                 "slots_shape", "slots_dtype", "scale_fmt"])
def test_bad_input_raises(bad):
    k = _keys(4, seed=1)
    cache, _ = _cache(2, 4, INDEXER_K_FP8)
    slots = torch.arange(4, device=DEVICE)
    fmt = INDEXER_K_FP8
    name = {"k_dim": "k", "k_dtype": "k", "cache_width": "cache", "cache_dtype": "cache",
            "rows_strided": "cache", "slots_shape": "slot_mapping", "slots_dtype": "slot_mapping",
            "scale_fmt": "scale_fmt"}[bad]
    with pytest.raises(ValueError, match=name):
        if bad == "k_dim":
            k = torch.zeros(4, 64, dtype=torch.bfloat16, device=DEVICE)
        elif bad == "k_dtype":
            k = k.to(torch.int32)
        elif bad == "cache_width":
            cache = torch.zeros(2, 4, 136, dtype=torch.uint8, device=DEVICE)
        elif bad == "cache_dtype":
            cache = torch.zeros(2, 4, 132, dtype=torch.int8, device=DEVICE)
        elif bad == "rows_strided":
            cache = torch.zeros(2, 4, 264, dtype=torch.uint8, device=DEVICE)[:, :, :132]
        elif bad == "slots_shape":
            slots = slots[:3]
        elif bad == "slots_dtype":
            slots = slots.float()
        elif bad == "scale_fmt":
            fmt = type(INDEXER_K_FP8)(scale_fmt="e8m0")
        write_indexer_k_cache(k, cache, slots, fmt=fmt)
