"""quant.mla_gather.gather_upconvert over DeepSeek-V4 (FP8_MODEL1) caches (kernel:
quant/model1_gather.py): every gathered row equals FP8_MODEL1.unpack of its token rounded to bf16
(exact) with the rope bits verbatim, every other dst row is untouched, a missing block gives a zero
row without reading the cache, rows outside dst are not written, bad arguments raise."""
import itertools

import pytest
import torch

from openmla.quant import FP8_MODEL1
from openmla.quant.mla_gather import gather_upconvert
from tests.helpers import DEVICE, INT32_MAX, INT32_MIN, shuffled_block_table

F = FP8_MODEL1


def build(seq_lens, block_size, *, spare_blocks=3, extra_cols=2, gaps=(0, 5, 1, 0, 3, 2), dst_spare=4,
          extra_stride=36, flat=False, seed=0):
    """A MODEL1 cache whose unwritten slots hold NaN (NaN bytes and 0xFF scales), blocks
    `extra_stride` bytes further apart than FlashMLA's, each request's tokens in shuffled blocks;
    block-table columns past a request's need hold invalid entries; dst NaN-filled with gaps."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    M = max(need + [1]) + extra_cols
    num_blocks = len(seq_lens) * M + spare_blocks
    block_table = shuffled_block_table(len(seq_lens), M, num_blocks, g, device="cpu")
    bad = torch.tensor([INT32_MAX, -1, INT32_MIN, num_blocks], dtype=torch.int32)
    past = torch.arange(M)[None, :] >= torch.tensor(need)[:, None]  # columns no token needs
    block_table[past] = bad[torch.arange(int(past.sum())) % 4]
    starts = list(itertools.accumulate(
        (gaps[b % len(gaps)] + (seq_lens[b - 1] if b else 0) for b in range(len(seq_lens)))))
    k = torch.full((num_blocks, block_size, 512), float("nan"))
    for b, n in enumerate(seq_lens):
        for p in range(n):
            x = torch.randn(512, generator=g) * float(torch.rand(1, generator=g)) * 10
            x[17] *= 40.0  # an outlier channel
            k[block_table[b, p // block_size], p % block_size] = x
    row = starts[-1] + seq_lens[-1] if seq_lens else 0
    cache = F.pack(k.bfloat16().unsqueeze(2), block_stride=F.padded_block_bytes(block_size) + extra_stride)
    dst = torch.full((row + dst_spare, 512), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    return dict(cache=(cache.squeeze(2) if flat else cache).to(DEVICE), dst=dst, block_table=block_table.to(DEVICE),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                starts=torch.tensor(starts, dtype=torch.int32, device=DEVICE))


def expected(args, zero_rows=()):
    """dst as the contract says, from FP8_MODEL1.unpack; (b, p) in zero_rows: a zero row."""
    cache, want = args["cache"].cpu(), args["dst"].cpu().clone()
    bt, bs = args["block_table"].cpu(), cache.shape[1]
    rows = F.unpack(cache).reshape(cache.shape[0], bs, 512).to(torch.bfloat16)
    for b, (n, s) in enumerate(zip(args["seq_lens"].tolist(), args["starts"].tolist())):
        for p in range(n):
            if 0 <= s + p < want.shape[0]:
                want[s + p] = 0 if (b, p) in zero_rows else rows[int(bt[b, p // bs]), p % bs]
    return want


def assert_bits(name, got, want):
    """bf16 bit equality; a NaN matches any NaN in the nope part (its payload is no contract)."""
    g, w = got.cpu().view(torch.int16), want.cpu().view(torch.int16)
    both_nan = torch.isnan(got.cpu()) & torch.isnan(want.cpu())
    both_nan[:, 448:] = False
    bad = ((g != w) & ~both_nan).nonzero()
    assert bad.numel() == 0, f"{name}: {len(bad)} elements differ, first at {bad[0].tolist()}"


CASES = [  # seq_lens, block_size, max_seq_len hint, flat (a [nb, bs, 584] view)
    pytest.param([64, 128, 37], 64, None, False, id="B3-bs64"),
    pytest.param([5, 1, 0, 17], 1, None, False, id="B4-bs1"),
    pytest.param([9, 4, 3], 2, None, True, id="B3-bs2-3d"),
    pytest.param([130, 3], 61, 1, False, id="bs61-hint-too-small-still-complete"),
    pytest.param([0, 0], 16, None, False, id="all-empty"),
]


@pytest.mark.parametrize("seq_lens,block_size,hint,flat", CASES)
def test_gather_equals_unpack(seq_lens, block_size, hint, flat):
    args = build(seq_lens, block_size, flat=flat, seed=block_size + len(seq_lens))
    want = expected(args)
    gather_upconvert(**args, max_seq_len=hint)
    assert_bits("dst", args["dst"], want)


def test_missing_blocks_give_zero_rows_and_rows_outside_dst_are_not_written():
    args = build([10, 7, 6], 4, seed=3)
    bt = args["block_table"]
    bt[0, 1] = -1  # request 0, positions 4..7
    bt[1, 0] = args["cache"].shape[0]  # request 1, positions 0..3: one past the last block
    bt[2, 1] = INT32_MAX  # request 2, positions 4..5
    args["starts"][2] = args["dst"].shape[0] - 3  # positions 3..5 of request 2 fall off the end
    zero = {(0, p) for p in range(4, 8)} | {(1, p) for p in range(4)} | {(2, 4), (2, 5)}
    want = expected(args, zero)
    gather_upconvert(**args)
    assert_bits("dst", args["dst"], want)


def test_nan_tile_stays_nan_and_sm80_path_is_the_same():
    from openmla.kernels.device import ARCHES, arch_of, assume
    args = build([6, 5], 4, seed=4)
    blocks = F.block_view(args["cache"])
    b0 = int(args["block_table"][0, 0])
    blocks[b0, 4 * 576 + 8 * 2 + 5] = 0xFF  # the scale of tile 5 of token 2: NaN
    blocks[b0, 3 * 576 + 10] = 0x7F  # an e4m3 NaN in token 3
    want = expected(args)
    outs = []
    for path in (assume(arch_of(DEVICE)), assume(ARCHES["sm_80"])):
        dst = args["dst"].clone()
        with path:
            gather_upconvert(**{**args, "dst": dst})
        assert_bits("dst", dst, want)
        outs.append(dst)
    s = int(args["starts"][0])
    assert bool(outs[0][s + 2, 320:384].isnan().all()) and bool(outs[0][s + 2, :320].isfinite().all())
    assert bool(outs[0][s + 3, 10].isnan()) and int(outs[0][s + 3].isnan().sum()) == 1


BAD = [
    ("dst", lambda a: a.update(dst=torch.zeros(40, 576, dtype=torch.bfloat16, device=DEVICE)),
     ValueError, r"dst.shape: expected \(\*, 512\)"),
    ("cache", lambda a: a.update(cache=torch.zeros(4, 4, 2, 584, dtype=torch.uint8, device=DEVICE)),
     ValueError, r"cache.shape: expected \[num_blocks, block_size, 1, 584\]"),
    ("cache", lambda a: a.update(cache=torch.zeros(4, 4, 600, dtype=torch.uint8, device=DEVICE)[..., :584]),
     ValueError, r"cache.stride\(1\): expected 584"),
    ("block_table", lambda a: a.update(block_table=a["block_table"].long()), ValueError, r"block_table.dtype"),
]


@pytest.mark.parametrize("name,mutate,exc,match", [pytest.param(*b, id=f"{b[0]}-{i}") for i, b in enumerate(BAD)])
def test_bad_arguments(name, mutate, exc, match):
    args = build([6, 5], 4, seed=5)
    mutate(args)
    with pytest.raises(exc, match=match):
        gather_upconvert(**args)
