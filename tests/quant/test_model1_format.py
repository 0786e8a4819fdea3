"""quant/model1_format.py: the DeepSeek-V4 ("MODEL1") fp8 sparse cache descriptor, pack and unpack.

pack is checked byte for byte against `spec_quantize` below, written from the text of FlashMLA
9241ae3 tests/quant.py (`MODEL1_FP8Sparse`) with the spec's own numbers: per block, bs records
of 576 bytes (448 e4m3 nope | 64 bf16 rope), then bs x 8 scale bytes (7 ue8m0 + 1 pad), padded
to a multiple of 576; scale = 2^ceil(log2(max(amax / 448, 1e-4))) per 64-wide tile."""
import numpy as np
import pytest
import torch

from openmla.quant import (CACHE_FORMATS, FP8_DS_MLA, FP8_MODEL1, SPARSE_MLA, Model1Format, cache_format,
                           formats, kv_cache_dtype_names, mla_format_of)
from openmla.quant.mla_cache_format import check_mla_format
from tests.helpers.quant import gaussian, huge, outlier_channels, seeded, tiny


# ---------------------------------------------------------------------------------------------
# The spec, independently: explicit byte offsets, one tile at a time.
# ---------------------------------------------------------------------------------------------
def spec_quantize(k: torch.Tensor) -> torch.Tensor:
    """k [nb, bs, 512] bf16 -> [nb, padded] uint8 block bytes as FlashMLA's MODEL1 quantizer
    defines them (pad bytes 0: FlashMLA leaves them unset)."""
    nb, bs, _ = k.shape
    padded = (bs * 584 + 575) // 576 * 576
    out = torch.zeros(nb, padded, dtype=torch.uint8)
    rec = torch.arange(bs)[:, None] * 576  # [bs, 1] record starts
    for t in range(7):
        x = k[..., 64 * t: 64 * (t + 1)]
        inv = x.abs().max(dim=-1).values.float() / 448.0
        s = torch.pow(2, torch.clamp_min(inv, 1e-4).log2().ceil()).float()  # [nb, bs]
        q = (x.float() / s[..., None]).to(torch.float8_e4m3fn).view(torch.uint8)
        out[:, (rec + 64 * t + torch.arange(64)).reshape(-1)] = q.reshape(nb, -1)
        # ue8m0: the biased exponent of a power of two; NaN (and inf) -> 0xFF
        e = torch.where(torch.isfinite(s), s.log2().round() + 127, torch.full_like(s, 255.0))
        out[:, bs * 576 + torch.arange(bs) * 8 + t] = e.to(torch.uint8)
    rope = k[..., 448:].to(torch.bfloat16).contiguous().view(torch.uint8)  # [nb, bs, 128]
    out[:, (rec + 448 + torch.arange(128)).reshape(-1)] = rope.reshape(nb, -1)
    return out


def blocks_of(cache: torch.Tensor) -> torch.Tensor:
    """A cache as returned by pack -> [nb, padded] bytes (its storage rows, padding included)."""
    nb, bs = cache.shape[:2]
    padded = (bs * 584 + 575) // 576 * 576
    return cache.as_strided((nb, padded), (cache.stride(0) if nb > 1 else padded, 1))


def as_k(kv_c: torch.Tensor, k_pe: torch.Tensor, bs: int) -> torch.Tensor:
    """[N, 512] latents + [N, 64] rope -> MODEL1 tokens [N // bs, bs, 512] (nope 448 | rope)."""
    k = torch.cat([kv_c[:, :448], k_pe.to(kv_c.dtype)], dim=-1)
    return k.view(-1, bs, 512)


def near_pow2_tiles(seed=5) -> torch.Tensor:
    """[nb, 4, 512] bf16 tokens whose tiles have amax 448 * 2^k or a bf16 step above or below:
    the scale rule's ceil(log2(.)) edge, for k from the 1e-4 floor up to 2^100."""
    g = seeded(seed)
    amax = []
    for k in (-20, -14, -13, -12, -1, 0, 1, 7, 60, 100):
        base = torch.tensor(448.0 * 2.0 ** k).bfloat16()
        for d in (-1, 0, 1, 2):
            amax.append((base.view(torch.int16) + d).view(torch.bfloat16).float())
    amax = torch.stack(amax)
    n = -(-amax.numel() // 7) * 7
    amax = torch.cat([amax, amax[: n - amax.numel()]]).view(-1, 7)  # [tokens, 7]
    x = (torch.rand(amax.shape[0], 7, 64, generator=g) * 2 - 1) * amax[..., None] * 0.999
    pos = torch.randint(0, 64, (amax.shape[0], 7), generator=g)
    x.scatter_(2, pos[..., None], -amax[..., None])
    x[:, :, 7] = amax * 0.75
    tokens = torch.cat([x.reshape(-1, 448), torch.randn(x.shape[0], 64, generator=g)], dim=-1)
    pad = (-tokens.shape[0]) % 4
    tokens = torch.cat([tokens, tokens[:pad]])
    return tokens.view(-1, 4, 512).bfloat16()


INPUTS = {
    "gaussian": lambda: as_k(*gaussian(128, seed=11), bs=64),
    "flashmla": lambda: (torch.randn(3, 64, 512, generator=seeded(12)) / 10).clamp(-1, 1).bfloat16(),
    "outliers": lambda: as_k(*outlier_channels(60, seed=13), bs=4),
    "tiny": lambda: as_k(*tiny(16, seed=14), bs=2),
    "huge": lambda: as_k(*huge(16, seed=15), bs=16),
    "near_pow2": near_pow2_tiles,
    "zeros": lambda: torch.zeros(2, 64, 512, dtype=torch.bfloat16),
    "neg_zeros_and_subnormals": lambda: torch.where(
        torch.arange(512) % 3 == 0, torch.tensor(-0.0), torch.tensor(2.0 ** -130)).expand(1, 3, 512).bfloat16(),
    "bf16_extremes": lambda: torch.tensor([3.3895e38, -3.3895e38, 1e-38, 448.0]).repeat(128).view(1, 1, 512).bfloat16(),
    "block256": lambda: (torch.randn(2, 256, 512, generator=seeded(16)) * 3).bfloat16(),
    "block1": lambda: torch.randn(5, 1, 512, generator=seeded(17)).bfloat16(),
}


# ---------------------------------------------------------------------------------------------
# pack: byte identity with the spec
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(INPUTS))
def test_pack_is_byte_identical_to_the_spec(kind):
    k = INPUTS[kind]()
    nb, bs = k.shape[:2]
    cache = FP8_MODEL1.pack(k.unsqueeze(2))
    assert cache.shape == (nb, bs, 1, 584) and cache.dtype == torch.uint8
    if nb > 1:  # FlashMLA's view (a single block's stride is whatever torch's view makes it)
        assert cache.stride() == ((bs * 584 + 575) // 576 * 576, 584, 584, 1)
    assert torch.equal(blocks_of(cache), spec_quantize(k))
    flat = FP8_MODEL1.pack(k)  # [nb, bs, 512] in -> [nb, bs, 584] out, same bytes
    assert flat.shape == (nb, bs, 584) and torch.equal(blocks_of(flat), blocks_of(cache))


def test_zeros_get_the_floor_scale():
    cache = FP8_MODEL1.pack(torch.zeros(1, 2, 512, dtype=torch.bfloat16))
    b = blocks_of(cache)[0]
    assert int(b[: 2 * 576].count_nonzero()) == 0  # e4m3 +0 and bf16 +0
    # 1e-4 -> 2^ceil(-13.29) = 2^-13 -> byte 114; pad byte 0
    assert b[2 * 576: 2 * 584].tolist() == [114] * 7 + [0] + [114] * 7 + [0]


def test_pack_takes_a_block_stride_and_fp32_and_fp16():
    k = torch.randn(3, 8, 512, generator=seeded(18))
    a = FP8_MODEL1.pack(k.bfloat16())
    b = FP8_MODEL1.pack(k.bfloat16(), block_stride=8 * 584 + 100)
    assert b.stride(0) == 8 * 584 + 100
    assert torch.equal(FP8_MODEL1.unpack(a), FP8_MODEL1.unpack(b))
    # fp32 in: nope quantized from the fp32 values, rope rounded to bf16
    c = FP8_MODEL1.unpack(FP8_MODEL1.pack(k))
    assert torch.equal(c[..., 448:], k[..., 448:].bfloat16().float())
    h = FP8_MODEL1.unpack(FP8_MODEL1.pack(k.half()))
    assert torch.equal(h[..., 448:], k[..., 448:].half().bfloat16().float())


def test_nan_tiles_get_nan_scales():
    k = torch.randn(1, 2, 512, generator=seeded(19)).bfloat16()
    k[0, 1, 70] = float("nan")  # tile 1 of row 1
    back = FP8_MODEL1.unpack(FP8_MODEL1.pack(k))
    assert bool(back[0, 1, 64:128].isnan().all())
    assert bool(back[0, 0].isfinite().all()) and bool(back[0, 1, :64].isfinite().all())
    assert bool(back[0, 1, 128:].isfinite().all())
    assert int(blocks_of(FP8_MODEL1.pack(k))[0, 2 * 576 + 8 + 1]) == 255


# ---------------------------------------------------------------------------------------------
# unpack
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gaussian", "outliers", "huge", "near_pow2", "block256"])
def test_round_trip_error_bound(kind):
    k = INPUTS[kind]()
    back = FP8_MODEL1.unpack(FP8_MODEL1.pack(k))
    assert back.shape == k.shape and back.dtype == torch.float32
    assert torch.equal(back[..., 448:], k[..., 448:].float())  # rope verbatim
    x = k[..., :448].float()
    s = FP8_MODEL1.tile_scales(x.unflatten(-1, (7, 64)).abs().amax(-1)).repeat_interleave(64, -1)
    err = (back[..., :448] - x).abs()
    # e4m3: half a step of 3 mantissa bits, or of the smallest subnormal (2^-9) times the scale;
    # at the ceil(log2) edge the amax element saturates to 448 from < 448 * (1 + 2^-7)
    assert bool((err <= x.abs() * 2 ** -4 + s * 2 ** -10).all())
    assert float(err.max()) > 0


def test_unpack_is_flashmla_dequantize():
    """FlashMLA dequantizes in bf16 (fp8 -> bf16 times the scale as bf16): exact, so it equals
    the fp32 unpack rounded to bf16 with no change."""
    k = INPUTS["outliers"]()
    nope, scale, rope = FP8_MODEL1.unpack_parts(FP8_MODEL1.pack(k))
    assert nope.shape == (15, 4, 448) and scale.shape == (15, 4, 7) and rope.shape == (15, 4, 64)
    bf = (nope.bfloat16().view(15, 4, 7, 64) * scale.bfloat16()[..., None]).view(15, 4, 448)
    assert torch.equal(bf.float(), FP8_MODEL1.unpack(FP8_MODEL1.pack(k))[..., :448])
    assert bool((scale.log2() == scale.log2().round()).all())  # powers of two


def test_unpack_reads_strided_and_interleaved_caches():
    k = torch.randn(4, 16, 512, generator=seeded(20)).bfloat16()
    dense = FP8_MODEL1.pack(k.unsqueeze(2))
    store = torch.full((4, 2, dense.stride(0)), 0xFF, dtype=torch.uint8)  # two layers interleaved
    store[:, 1] = blocks_of(dense)
    view = store[:, 1, : 16 * 584].view(4, 16, 1, 584)
    assert view.stride(0) == 2 * dense.stride(0)
    assert torch.equal(FP8_MODEL1.unpack(view), FP8_MODEL1.unpack(dense))
    assert mla_format_of(view) is FP8_MODEL1


# ---------------------------------------------------------------------------------------------
# The descriptor and the registry
# ---------------------------------------------------------------------------------------------
def test_descriptor_layout():
    f = FP8_MODEL1
    assert (f.head_dim, f.latent_dim, f.nope_dim, f.rope_dim) == (512, 512, 448, 64)
    assert (f.num_tiles, f.tile_size, f.scale_stride, f.record_bytes, f.bytes_per_token) == (7, 64, 8, 576, 584)
    assert (f.nope_offset, f.rope_offset, f.row_width, f.cache_dtype) == (0, 448, 584, torch.uint8)
    assert (f.quantized, f.blocked, f.pow2, f.scale_bias) == (True, True, True, 127)
    assert f.record_offset(3) == 3 * 576 and f.scales_offset(64) == 64 * 576
    assert f.token_scale_offset(64, 5) == 64 * 576 + 40 and f.block_bytes(64) == 64 * 584
    # FlashMLA's block strides: block sizes 64, 256 and 2 (its MODEL1 configs), 1
    assert [f.padded_block_bytes(b) for b in (64, 256, 2, 1)] == [37440, 149760, 1728, 1152]
    assert [(s.of, s.kind, s.dtype) for s in f.scales] == [("nope", "per_tile", torch.float8_e8m0fnu)]
    assert f.tensors[0].dtype == torch.uint8 and "584" in f.tensors[0].shape


def test_registry():
    assert FP8_MODEL1 in CACHE_FORMATS and FP8_MODEL1 in formats(SPARSE_MLA)
    for name in ("fp8_model1", "fp8_ds_mla_v4", "model1_fp8_sparse"):
        assert cache_format(name, SPARSE_MLA) is FP8_MODEL1
        assert name in kv_cache_dtype_names(SPARSE_MLA)
    # vLLM's "fp8_ds_mla" stays the V3.2 format; vLLM has no separate name for this one
    assert cache_format("fp8_ds_mla", SPARSE_MLA, vllm=True) is FP8_DS_MLA
    assert "fp8_model1" not in kv_cache_dtype_names(SPARSE_MLA, vllm=True)
    assert isinstance(FP8_MODEL1, Model1Format)


def test_format_of_a_cache():
    c = FP8_MODEL1.empty_cache(3, 64)
    assert c.shape == (3, 64, 1, 584) and c.stride(0) == 37440
    assert mla_format_of(c) is FP8_MODEL1 and mla_format_of(c.squeeze(2)) is FP8_MODEL1
    assert check_mla_format(c, FP8_MODEL1) is FP8_MODEL1
    assert mla_format_of(torch.zeros(2, 4, 656, dtype=torch.uint8)) is FP8_DS_MLA
    with pytest.raises(ValueError, match=r"cache.shape\[-1\]: expected 656 for a fp8_ds_mla cache or 584 for "
                                         r"a fp8_model1 cache of dtype torch.uint8, got 600"):
        mla_format_of(torch.zeros(2, 4, 600, dtype=torch.uint8))
    with pytest.raises(ValueError, match="fmt: expected a format of the cache"):
        check_mla_format(torch.zeros(2, 4, 656, dtype=torch.uint8), FP8_MODEL1)


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad,match", [
    (torch.zeros(2, 4, 576, dtype=torch.bfloat16), r"k.shape: expected \[num_blocks, block_size, 512\]"),
    (torch.zeros(2, 4, 2, 512, dtype=torch.bfloat16), r"k.shape: expected"),
    (torch.zeros(8, 512, dtype=torch.bfloat16), r"k.shape: expected"),
    (torch.zeros(2, 4, 512, dtype=torch.int32), r"k.dtype: expected"),
    ("k", r"k: expected a torch.Tensor"),
])
def test_pack_refuses_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        FP8_MODEL1.pack(bad)


def test_pack_refuses_bad_block_stride():
    k = torch.zeros(2, 4, 512, dtype=torch.bfloat16)
    for bad in (4 * 584 - 2, 4 * 584 + 1):
        with pytest.raises(ValueError, match=r"block_stride: expected an even number >= 2336"):
            FP8_MODEL1.pack(k, block_stride=bad)


def _bad_caches():
    good = FP8_MODEL1.empty_cache(3, 4)
    store = torch.zeros(3 * 4 * 584 + 1, dtype=torch.uint8)
    return [
        (good.float(), r"cache.dtype: expected torch.uint8"),
        (torch.zeros(3, 4, 656, dtype=torch.uint8), r"cache.shape: expected \[num_blocks, block_size, 1, 584\]"),
        (torch.zeros(3, 4, 2, 584, dtype=torch.uint8), r"cache.shape: expected"),
        (torch.zeros(3, 4, 584, 2, dtype=torch.uint8)[..., 0], r"cache.stride\(-1\): expected 1"),
        (torch.zeros(3, 4, 600, dtype=torch.uint8)[..., :584], r"cache.stride\(1\): expected 584"),
        (torch.zeros(3 * 584 * 5, dtype=torch.uint8).as_strided((3, 4, 584), (584 * 3, 584, 1)),
         r"cache.stride\(0\): expected >= block_size \* 584 = 2336"),
        (store[1:].view(3, 4, 584), r"cache: expected a 2-byte aligned start"),
    ]


@pytest.mark.parametrize("i", range(7))
def test_unpack_refuses_bad_caches(i):
    bad, match = _bad_caches()[i]
    with pytest.raises(ValueError, match=match):
        FP8_MODEL1.unpack(bad)
