"""quant.mla_writer.write_mla_cache: the bytes it writes equal fmt.pack's (on the CPU) exactly, only the mapped
rows change, and bad input raises ValueError naming the tensor."""
import numpy as np
import pytest
import torch

from openmla.quant import BF16_MLA, FP8_DS_MLA, FP8_DS_MLA_RAW, INT8_QKV
from openmla.quant.mla_writer import write_mla_cache
from tests.helpers import DEVICE, INT32_MAX, INT32_MIN, random_paged_cache
from tests.helpers.quant import near_pow2_amax, outlier_channels


def pack_oracle(fmt, kv_c, k_pe):
    """fmt.pack on the inputs' own device (the byte-level truth the writer must equal)."""
    return fmt.pack(kv_c, k_pe)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """Raw bits of a cache tensor, for bit-exact comparisons (NaN == NaN when the bits agree)."""
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


def _inputs(T, dtype, seed, *, wide=False):
    """kv_c [T, 512], k_pe [T, 64]; with wide=True, slices of wider tensors (token stride != width)."""
    g = torch.Generator().manual_seed(seed)
    kv_c = torch.randn(T, 700 if wide else 512, generator=g) * 3
    k_pe = torch.randn(T, 80 if wide else 64, generator=g)
    kv_c[:, 200] *= 50.0  # an outlier channel
    if T > 1:
        kv_c[1, 384:] = 0.0  # an all-zero tile: scale at the rule's floor
    # slice on the device: .to(device) would make a non-dense view contiguous
    kv_c, k_pe = kv_c.to(dtype).to(DEVICE), k_pe.to(torch.bfloat16).to(DEVICE)
    if wide:
        kv_c, k_pe = kv_c[:, 101:613], k_pe[:, 9:73]
        assert kv_c.stride(0) == 700 and k_pe.stride(0) == 80
    return kv_c, k_pe


def _slots(T, num_slots, seed, n_skip):
    """Distinct, shuffled slots over the whole cache; n_skip of them replaced by negative values."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randperm(num_slots, generator=g)[:T].to(torch.int64)
    neg = [-1, INT32_MIN, -123456]
    for i in range(n_skip):
        s[(3 * i + 1) % T] = neg[i % 3]
    return s


def check_write(kv_c, k_pe, fmt, block_size, num_blocks, slots, *, extra_rows=1, slot_dtype=torch.int32,
                pass_fmt=True):
    cache, backing = random_paged_cache(num_blocks, block_size, fmt.row_width, fmt.cache_dtype,
                                        extra_rows=extra_rows)
    before = _bits(backing).clone()
    write_mla_cache(kv_c, k_pe, cache, slots.to(slot_dtype).to(DEVICE), fmt=fmt if pass_fmt else None)
    want = pack_oracle(fmt, kv_c, k_pe)
    got_all = _bits(backing)
    expect = before.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expect[s // block_size, s % block_size] = _bits(want[t])
    diff = (got_all != expect).nonzero()
    if diff.numel():
        b, r, c = diff[0].tolist()
        raise AssertionError(f"{len(diff)} cache elements differ, first at block {b} row {r} col {c}: "
                             f"got {got_all[b, r, c].item()}, want {expect[b, r, c].item()}")


FMT = {"pow2": FP8_DS_MLA, "raw": FP8_DS_MLA_RAW, "bf16": BF16_MLA}

# id -> (T, block_size, num_blocks, fmt, kv dtype, wide inputs, n_skip, extra_rows)
REGULAR = [
    pytest.param(24, 64, 3, "pow2", torch.bfloat16, False, 3, 1, id="T24-bs64-pow2"),
    pytest.param(24, 64, 3, "raw", torch.bfloat16, False, 3, 1, id="T24-bs64-raw"),
    pytest.param(24, 64, 3, "bf16", torch.bfloat16, False, 3, 1, id="T24-bs64-bf16cache"),
]
IRREGULAR = [
    pytest.param(20, 1, 37, "pow2", torch.bfloat16, False, 4, 1, id="T20-bs1-pow2"),
    pytest.param(20, 61, 2, "pow2", torch.bfloat16, False, 2, 3, id="T20-bs61-pow2-extra3rows"),
    pytest.param(20, 61, 2, "raw", torch.float32, False, 2, 1, id="T20-bs61-raw-fp32in"),
    pytest.param(13, 1, 20, "bf16", torch.float32, False, 1, 2, id="T13-bs1-bf16cache-fp32in"),
    pytest.param(16, 61, 1, "bf16", torch.bfloat16, True, 2, 1, id="T16-bs61-bf16cache-sliced-inputs"),
    pytest.param(16, 64, 2, "pow2", torch.bfloat16, True, 2, 1, id="T16-bs64-pow2-sliced-inputs"),
    pytest.param(16, 64, 2, "pow2", torch.float16, False, 0, 1, id="T16-bs64-pow2-fp16in"),
    pytest.param(16, 64, 2, "raw", torch.float16, True, 5, 1, id="T16-bs64-raw-fp16in-sliced"),
    pytest.param(6, 7, 5, "pow2", torch.bfloat16, False, 6, 1, id="T6-all-skipped"),
]


@pytest.mark.parametrize("T,block_size,num_blocks,fmt,dtype,wide,n_skip,extra_rows", REGULAR + IRREGULAR)
def test_writer_equals_pack(T, block_size, num_blocks, fmt, dtype, wide, n_skip, extra_rows):
    kv_c, k_pe = _inputs(T, dtype, seed=T * 1000 + block_size, wide=wide)
    slots = _slots(T, num_blocks * block_size, seed=block_size, n_skip=n_skip)
    check_write(kv_c, k_pe, FMT[fmt], block_size, num_blocks, slots, extra_rows=extra_rows,
                slot_dtype=torch.int64 if T % 2 == 0 else torch.int32)


# --- the rule's edges -----------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", [pytest.param("pow2", id="pow2"), pytest.param("raw", id="raw")])
def test_writer_amax_at_and_just_above_448x2k(fmt):
    """amax = 448 * 2^k and a few ulps above: the kernel's log2 must round like pack's (fp32)."""
    kv_c, k_pe = near_pow2_amax(torch.float32)
    T = kv_c.shape[0]
    slots = _slots(T, 64 * 2, seed=5, n_skip=0)
    check_write(kv_c.to(DEVICE), k_pe.to(DEVICE), FMT[fmt], 64, 2, slots)


def test_writer_tiny_and_huge_tiles():
    kv_c, k_pe = outlier_channels(12)
    kv_c = kv_c.float()
    kv_c[0:4] *= 1e-9  # scale floor (pow2) / tiny raw scales
    kv_c[4:8] *= 1e30  # amax near 1e35: exponent 2^110-ish, far from the floor
    kv_c[8, 0:128] = 3.3895314e38  # bf16 max in fp32 input
    for fmt in (FP8_DS_MLA, FP8_DS_MLA_RAW):
        check_write(kv_c.to(DEVICE), k_pe.to(DEVICE), fmt, 8, 3, _slots(12, 24, seed=6, n_skip=1))


def test_writer_nan_tile_poisons_that_tile_like_pack():
    """A NaN in kv_c gives that tile a NaN scale and fp8 NaN latent bytes, like pack (the NaN's
    sign bit may differ: compared modulo sign); other tiles and tokens are byte-exact."""
    kv_c, k_pe = _inputs(4, torch.bfloat16, seed=7)
    kv_c[2, 130] = float("nan")
    k_pe = k_pe.clone()
    k_pe.view(torch.int16)[3, :3] = torch.tensor([0x7F81, 0x7F80, -0x3D], dtype=torch.int16)  # payloads, inf
    cache, backing = random_paged_cache(3, 4, 656, torch.uint8)
    slots = torch.tensor([5, 0, 11, 2], device=DEVICE)
    write_mla_cache(kv_c, k_pe, cache, slots)
    want = pack_oracle(FP8_DS_MLA, kv_c, k_pe)
    got = torch.stack([cache[s // 4, s % 4] for s in slots.tolist()])
    poisoned = torch.zeros_like(want, dtype=torch.bool)
    poisoned[2, 128:256] = True  # tile 1 of token 2
    poisoned[2, 516:520] = True  # its scale
    assert torch.equal(got[2, 128:256] & 0x7F, torch.full_like(got[2, 128:256], 0x7F))
    assert torch.equal(want[2, 128:256] & 0x7F, torch.full_like(want[2, 128:256], 0x7F))
    assert torch.isnan(got[2, 516:520].contiguous().view(torch.float32)).all()
    assert torch.equal(got[~poisoned], want[~poisoned])


# --- never a wild write -------------------------------------------------------------------------

def test_out_of_range_slot_raises_and_unchecked_never_writes_outside():
    kv_c, k_pe = _inputs(5, torch.bfloat16, seed=8)
    backing = torch.full((4, 8, 656), 0xFF, dtype=torch.uint8, device=DEVICE)
    cache = backing[:3]  # slots 24.. would land in backing block 3 if the kernel wrote them
    slots = torch.tensor([3, 24, INT32_MAX, 23, 3 * 8 + 7], dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"slot_mapping: expected values < num_blocks \* block_size = 24.*got max"):
        write_mla_cache(kv_c, k_pe, cache, slots)
    assert torch.all(backing == 0xFF)  # the check runs before the launch
    write_mla_cache(kv_c, k_pe, cache, slots, check_slots=False)
    want = pack_oracle(FP8_DS_MLA, kv_c, k_pe)
    assert torch.equal(cache[0, 3], want[0]) and torch.equal(cache[2, 7], want[3])
    expect = torch.full_like(backing, 0xFF)
    expect[0, 3], expect[2, 7] = want[0], want[3]
    assert torch.equal(backing, expect)


def test_empty_batch_is_a_no_op():
    cache, backing = random_paged_cache(2, 4, 656, torch.uint8)
    empty = torch.empty(0, 512, dtype=torch.bfloat16, device=DEVICE)
    write_mla_cache(empty, empty[:, :64], cache, torch.empty(0, dtype=torch.int32, device=DEVICE))
    assert torch.all(backing == 0xFF)


# --- errors ---------------------------------------------------------------------------------------

def _ok():
    kv_c, k_pe = _inputs(3, torch.bfloat16, seed=9)
    cache, _ = random_paged_cache(2, 4, 656, torch.uint8)
    return dict(kv_c=kv_c, k_pe=k_pe, cache=cache, slot_mapping=torch.tensor([0, 5, -1], device=DEVICE))


BAD = [
    pytest.param("kv_c", lambda a: a["kv_c"].to(torch.int32), r"kv_c\.dtype", id="kv_c-int32"),
    pytest.param("kv_c", lambda a: a["kv_c"][:, :500], r"kv_c\.shape: expected \(T, 512\)", id="kv_c-width"),
    pytest.param("kv_c", lambda a: a["kv_c"][None], r"kv_c\.dim\(\)", id="kv_c-3d"),
    pytest.param("kv_c", lambda a: a["kv_c"].t().contiguous().t(), r"kv_c\.stride\(-1\)", id="kv_c-col-major"),
    pytest.param("k_pe", lambda a: a["k_pe"][:2], r"k_pe\.shape: expected \(3, \*\), got \(2, 64\)", id="k_pe-tokens"),
    pytest.param("k_pe", lambda a: a["k_pe"][:, :32], r"k_pe\.shape: expected \(T, 64\)", id="k_pe-width"),
    pytest.param("slot_mapping", lambda a: a["slot_mapping"].float(), r"slot_mapping\.dtype", id="slots-float"),
    pytest.param("slot_mapping", lambda a: a["slot_mapping"][:2], r"slot_mapping\.shape", id="slots-short"),
    pytest.param("cache", lambda a: a["cache"].float(), r"cache\.dtype", id="cache-fp32"),
    pytest.param("cache", lambda a: torch.zeros(2, 4, 600, dtype=torch.uint8, device=DEVICE),
                 r"cache\.shape\[-1\]: expected 656", id="cache-width"),
    pytest.param("cache", lambda a: torch.zeros(2, 4, 656, 2, dtype=torch.uint8, device=DEVICE)[..., 0],
                 r"cache\.stride\(-1\)", id="cache-strided-rows"),
    pytest.param("cache", lambda a: a["cache"][0], r"cache\.dim\(\): expected 3", id="cache-2d"),
    pytest.param("cache", lambda a: torch.zeros(2 * 4 * 656 + 2, dtype=torch.uint8, device=DEVICE)[2:].view(2, 4, 656),
                 r"cache: expected rows starting at 4-byte aligned addresses", id="cache-misaligned"),
]


@pytest.mark.parametrize("name,mutate,match", BAD)
def test_bad_arguments_raise_valueerror_naming_the_tensor(name, mutate, match):
    args = _ok()
    args[name] = mutate(args)
    with pytest.raises(ValueError, match=match):
        write_mla_cache(**args)


@pytest.mark.parametrize("cache_fmt,fmt,match", [
    pytest.param(FP8_DS_MLA, BF16_MLA, r"fmt: expected a format of the cache \(torch.uint8 rows of 656\), got "
                 r"bf16 \(rows of 576 torch.bfloat16\)", id="bf16-fmt-on-fp8-cache"),
    pytest.param(BF16_MLA, FP8_DS_MLA_RAW, r"fmt: expected a format of the cache \(torch.bfloat16 rows of 576\), "
                 r"got fp8_ds_mla_raw", id="fp8-fmt-on-bf16-cache"),
    pytest.param(FP8_DS_MLA, "pow2", r"fmt: expected a sparse MLA cache format", id="fmt-string"),
    pytest.param(FP8_DS_MLA, INT8_QKV, r"fmt: expected a sparse MLA cache format", id="fmt-mha"),
])
def test_fmt_must_match_the_cache(cache_fmt, fmt, match):
    args = _ok()
    args["cache"], _ = random_paged_cache(2, 4, cache_fmt.row_width, cache_fmt.cache_dtype)
    with pytest.raises(ValueError, match=match):
        write_mla_cache(**args, fmt=fmt)


def test_default_fmt_is_pow2_for_uint8():
    kv_c, k_pe = _inputs(4, torch.bfloat16, seed=10)
    check_write(kv_c, k_pe, FP8_DS_MLA, 4, 2, torch.tensor([7, 0, -1, 3]), pass_fmt=False)
