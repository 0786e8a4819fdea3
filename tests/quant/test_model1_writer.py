"""quant.model1_writer.write_model1_cache: the bytes it writes equal FP8_MODEL1.pack's exactly (record
at row * 576, 7 scale bytes + a 0 pad at block_size * 576 + row * 8), nothing else in the cache
changes (other slots, other blocks, the padding between blocks, an interleaved layer), skipped and
out-of-range slots write nothing, and bad input raises ValueError naming the tensor."""
import pytest
import torch

from openmla.quant import FP8_DS_MLA, FP8_MODEL1
from openmla.quant.model1_writer import write_model1_cache
from openmla.quant.mla_writer import write_mla_cache
from tests.helpers import DEVICE, INT32_MAX, INT32_MIN

F = FP8_MODEL1


def _tokens(T, dtype=torch.bfloat16, seed=0, *, wide=False):
    """k [T, 512]: random with an outlier channel, a zero tile, a tile at the 1e-4 floor; with
    wide=True a slice of a wider tensor (token stride 700)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(T, 700 if wide else 512, generator=g) * 2
    k[:, 100] *= 80.0
    if T > 1:
        k[1, 128:192] = 0.0
    if T > 2:
        k[2, 256:320] *= 1e-6
    k = k.to(dtype).to(DEVICE)
    return k[:, 90:602] if wide else k


def _cache(nb, bs, *, extra=0, layers=1):
    """A MODEL1 cache whose every byte starts 0xAB (padding and other layers included): block
    stride padded_block_bytes + extra, `layers` caches interleaved block by block; the last."""
    stride = F.padded_block_bytes(bs) + extra
    store = torch.full((nb, layers, stride), 0xAB, dtype=torch.uint8, device=DEVICE)
    view = store[:, layers - 1, : F.block_bytes(bs)].view(nb, bs, 1, 584)
    return view, store


def _expected(store_before, k, slots, nb, bs, layers):
    """store_before with each written token's pack bytes placed where the layout says."""
    want = F.pack(k.view(-1, 1, 512).cpu())  # one token a block: its record then its 8 scale bytes
    exp = store_before.clone().cpu()
    for t, s in enumerate(slots):
        if 0 <= s < nb * bs:
            b, r = divmod(s, bs)
            tok = want[t].reshape(-1)
            exp[b, layers - 1, r * 576:(r + 1) * 576] = tok[:576]
            exp[b, layers - 1, bs * 576 + r * 8: bs * 576 + r * 8 + 8] = tok[576:584]
    return exp


WRITES = [  # id, T, nb, bs, dtype, wide, extra stride, layers, 3-d view
    ("bs64-T9", 9, 2, 64, torch.bfloat16, False, 0, 1, False),
    ("bs2-T7-strided", 7, 5, 2, torch.bfloat16, True, 36, 1, False),
    ("bs1-T4-fp32", 4, 6, 1, torch.float32, False, 0, 1, False),
    ("bs4-T6-fp16-interleaved", 6, 3, 4, torch.float16, False, 0, 2, False),
    ("bs3-T5-3d", 5, 4, 3, torch.bfloat16, False, 2, 1, True),
]


@pytest.mark.parametrize("T,nb,bs,dtype,wide,extra,layers,flat", [pytest.param(*w[1:], id=w[0]) for w in WRITES])
def test_writer_equals_pack(T, nb, bs, dtype, wide, extra, layers, flat):
    k = _tokens(T, dtype, seed=T + bs, wide=wide)
    cache, store = _cache(nb, bs, extra=extra, layers=layers)
    g = torch.Generator().manual_seed(bs)
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[T // 2] = -1  # a padding token
    if T > 3:
        slots[1] = INT32_MIN
    before = store.clone()
    write_model1_cache(k, cache.squeeze(2) if flat else cache, slots.to(torch.int32).to(DEVICE))
    assert torch.equal(store.cpu(), _expected(before, k, slots.tolist(), nb, bs, layers))
    assert int((store != before).sum()) > 0


def test_edges_of_the_scale_rule_and_nan():
    """amax at 448 * 2^k and a bf16 step around it, zeros, bf16 extremes, -0: byte-identical; a
    NaN tile gets scale byte 0xFF and NaN nope bytes in that tile only."""
    g = torch.Generator().manual_seed(7)
    rows = []
    for e in (-20, -13, -1, 0, 7, 100):
        base = torch.tensor(448.0 * 2.0 ** e).bfloat16().view(torch.int16)
        for d in (-1, 0, 1):
            x = torch.rand(512, generator=g) * 2 - 1
            amax = (base + d).view(torch.bfloat16).float()
            rows.append(torch.cat([(x[:448] * amax * 0.9).index_fill(0, torch.tensor([64 * (d + 1) + 3]), -amax),
                                   x[448:]]))
    rows.append(torch.zeros(512))
    rows.append(torch.tensor([3.3895e38, -3.3895e38, 1e-38, -0.0]).repeat(128))
    k = torch.stack(rows).bfloat16()
    cache, store = _cache(3, 8)
    before = store.clone()
    slots = list(range(k.shape[0]))
    write_model1_cache(k.to(DEVICE), cache, torch.tensor(slots, device=DEVICE))
    assert torch.equal(store.cpu(), _expected(before, k, slots, 3, 8, 1))

    bad = k[:2].clone()
    bad[1, 200] = float("nan")  # tile 3 of token 1
    write_model1_cache(bad.to(DEVICE), cache, torch.tensor([0, 1], device=DEVICE))
    back = F.unpack(cache.cpu())[0, :2, 0]
    assert bool(back[1, 192:256].isnan().all()) and int(F.block_view(cache)[0, 8 * 576 + 8 + 3]) == 0xFF
    assert bool(back[1, :192].isfinite().all()) and bool(back[1, 256:].isfinite().all())
    assert torch.equal(back[0], F.unpack(F.pack(bad[:1].view(1, 1, 512)))[0, 0])


def test_out_of_range_slots_raise_or_are_skipped():
    k = _tokens(4)
    cache, store = _cache(2, 4)
    before = store.clone()
    for bad in (8, 9, INT32_MAX):
        with pytest.raises(ValueError, match=r"slot_mapping: expected values < num_blocks \* block_size = 8"):
            write_model1_cache(k, cache, torch.tensor([0, bad, 1, 2], device=DEVICE))
        assert torch.equal(store, before)  # checked before anything is written
    slots = [3, 8, INT32_MAX, -123456]
    write_model1_cache(k, cache, torch.tensor(slots, dtype=torch.int64, device=DEVICE), check_slots=False)
    assert torch.equal(store.cpu(), _expected(before, k, slots, 2, 4, 1))


def test_empty_batch_and_empty_cache_are_no_ops():
    cache, store = _cache(2, 4)
    before = store.clone()
    write_model1_cache(_tokens(4)[:0], cache, torch.zeros(0, dtype=torch.int32, device=DEVICE))
    assert torch.equal(store, before)
    empty = F.empty_cache(0, 4, device=DEVICE)
    write_model1_cache(_tokens(2), empty, torch.tensor([-1, 0], device=DEVICE), check_slots=False)


BAD = [
    ("k", lambda a: a.update(k=a["k"][:, :448]), r"k.shape: expected \(T, 512\)"),
    ("k", lambda a: a.update(k=a["k"].int()), r"k.dtype"),
    ("k", lambda a: a.update(k=a["k"].t().contiguous().t()), r"k.stride\(-1\): expected 1"),
    ("slot_mapping", lambda a: a.update(slot_mapping=a["slot_mapping"][:2]), r"slot_mapping.shape: expected \(4,\)"),
    ("slot_mapping", lambda a: a.update(slot_mapping=a["slot_mapping"].float()), r"slot_mapping.dtype"),
    ("cache", lambda a: a.update(cache=torch.zeros(2, 4, 2, 584, dtype=torch.uint8, device=DEVICE)),
     r"cache.shape: expected \[num_blocks, block_size, 1, 584\]"),
    ("cache", lambda a: a.update(cache=torch.zeros(2, 4, 600, dtype=torch.uint8, device=DEVICE)[..., :584]),
     r"cache.stride\(1\): expected 584"),
    ("cache", lambda a: a.update(cache=torch.zeros(2, 4, 577, dtype=torch.uint8, device=DEVICE)),
     r"cache.shape\[-1\]: expected 656 for a fp8_ds_mla cache or 584"),
    ("fmt", lambda a: a.update(fmt=FP8_DS_MLA), r"fmt: expected a format of the cache"),
]


@pytest.mark.parametrize("name,mutate,match", [pytest.param(*b, id=f"{b[0]}-{i}") for i, b in enumerate(BAD)])
def test_bad_arguments_raise_valueerror_naming_the_tensor(name, mutate, match):
    args = dict(k=_tokens(4), cache=_cache(2, 4)[0], slot_mapping=torch.arange(4, device=DEVICE), fmt=None)
    mutate(args)
    with pytest.raises(ValueError, match=match):
        write_model1_cache(args["k"], args["cache"], args["slot_mapping"], fmt=args["fmt"])


def test_the_writers_refuse_each_others_formats():
    with pytest.raises(NotImplementedError, match="write_model1_cache: writes DeepSeek-V4"):
        write_model1_cache(_tokens(1), torch.zeros(2, 4, 656, dtype=torch.uint8, device=DEVICE),
                           torch.zeros(1, dtype=torch.int32, device=DEVICE))
    with pytest.raises(NotImplementedError, match="laid out per block; write them with"):
        write_mla_cache(torch.zeros(1, 512, device=DEVICE), torch.zeros(1, 64, device=DEVICE),
                        F.empty_cache(2, 4, device=DEVICE).squeeze(2), torch.zeros(1, dtype=torch.int32, device=DEVICE))


@pytest.mark.skipif(DEVICE == "cuda" and torch.version.hip is not None,
                    reason="the NVIDIA sm_80 path (inline PTX) does not run on an AMD GPU")
def test_sm80_integer_e4m3_path_equals_pack():
    """Before sm_89 the writer converts to e4m3 by integer arithmetic (quant/e4m3.py): same bytes."""
    from openmla.kernels.device import ARCHES, assume
    k = _tokens(6, seed=9)
    k[3, 40] = 1e30  # saturates its neighbours to subnormals / zero
    cache, store = _cache(2, 4, extra=8)
    before = store.clone()
    slots = [6, 0, -1, 3, 7, 1]
    with assume(ARCHES["sm_80"]):
        write_model1_cache(k, cache, torch.tensor(slots, dtype=torch.int32, device=DEVICE))
    assert torch.equal(store.cpu(), _expected(before, k, slots, 2, 4, 1))
