"""quant.mla_gather.gather_upconvert: every gathered row equals FP8_DS_MLA.unpack of its cache row
(latent rounded to bf16, rope bits verbatim), every other dst row is untouched, bad block-table
entries give zero rows without reading the cache, and bad arguments raise."""
import pytest
import torch

from openmla.quant import FP8_DS_MLA, FP8_DS_MLA_RAW
from openmla.quant.mla_gather import gather_upconvert
from tests.helpers import DEVICE, INT32_MAX, INT32_MIN, random_paged_cache


def build(seq_lens, block_size, *, fmt=FP8_DS_MLA, spare_blocks=3, extra_cols=2, gaps=(0, 5, 1, 0, 3, 2),
          extra_rows=1, dst_spare=4, seed=0):
    """A strided paged fp8 cache (unwritten rows are 0xFF: fp8 NaN, NaN scales) holding each request's
    tokens in shuffled blocks; block-table columns past a request's need hold invalid entries; dst is
    NaN-filled with gaps between the requests' ranges and spare rows at the end."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + spare_blocks
    M = max(need + [1]) + extra_cols
    cache, backing = random_paged_cache(num_blocks, block_size, fmt.row_width, torch.uint8, extra_rows=extra_rows)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    block_table = torch.tensor([INT32_MAX, -1, INT32_MIN, num_blocks])[torch.arange(len(seq_lens) * M) % 4]
    block_table = block_table.view(len(seq_lens), M).to(torch.int32)
    starts, row = [], 0
    for b, n in enumerate(seq_lens):
        row += gaps[b % len(gaps)]
        starts.append(row)
        row += n
        blocks = [perm.pop() for _ in range(need[b])]
        block_table[b, :need[b]] = torch.tensor(blocks, dtype=torch.int32)
        if n:
            kv = torch.randn(n, 512, generator=g) * torch.rand(n, 1, generator=g) * 10
            kv[:, 17] *= 40.0  # outlier channel
            pe = torch.randn(n, 64, generator=g).to(torch.bfloat16)
            packed = fmt.pack(kv.to(torch.bfloat16), pe).to(DEVICE)
            for p in range(n):
                cache[blocks[p // block_size], p % block_size] = packed[p]
    num_rows = row + dst_spare
    dst = torch.full((num_rows, 576), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    return dict(cache=cache, dst=dst, block_table=block_table.to(DEVICE),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                starts=torch.tensor(starts, dtype=torch.int32, device=DEVICE))


def expected(args, zero_rows=()):
    """dst as the contract says, from FP8_DS_MLA.unpack; rows in zero_rows ((b, p) pairs) are zeros."""
    cache, want = args["cache"].cpu(), args["dst"].cpu().clone()
    bt, bs = args["block_table"].cpu(), cache.shape[1]
    unpacked = FP8_DS_MLA.unpack(cache)  # [num_blocks, bs, 576] fp32
    _, _, rope = FP8_DS_MLA.unpack_parts(cache)
    for b, (n, s) in enumerate(zip(args["seq_lens"].tolist(), args["starts"].tolist())):
        for p in range(n):
            if (b, p) in zero_rows:
                want[s + p] = 0
                continue
            blk = int(bt[b, p // bs])
            want[s + p, :512] = unpacked[blk, p % bs, :512].to(torch.bfloat16)
            want[s + p, 512:] = rope[blk, p % bs]
    return want


def assert_bits(name, got, want):
    """bf16 bit equality; NaN == NaN whatever the payload in the latent (fp32 NaN * s -> bf16 NaN's
    bits are not part of the contract), bit-exact everywhere in the rope and for non-NaN values."""
    g, w = got.cpu().view(torch.int16), want.cpu().view(torch.int16)
    same = g == w
    both_nan = torch.isnan(got.cpu()) & torch.isnan(want.cpu())
    both_nan[:, 512:] = False
    bad = (~(same | both_nan)).nonzero()
    if bad.numel():
        r, c = bad[0].tolist()
        raise AssertionError(f"{name}: {len(bad)} elements differ, first at row {r} col {c}: got "
                             f"{got[r, c].item()} ({g[r, c].item() & 0xFFFF:#06x}), want {want[r, c].item()} "
                             f"({w[r, c].item() & 0xFFFF:#06x})")


# id -> (seq_lens, block_size, max_seq_len hint)
REGULAR = [
    pytest.param([64, 128, 37], 64, None, id="B3-bs64-full-and-partial-blocks"),
    pytest.param([5, 1, 0, 17], 1, None, id="B4-bs1"),
    pytest.param([61, 122, 60, 62], 61, None, id="B4-bs61"),
]
CORNER = [
    pytest.param([0, 1, 0, 2], 64, None, id="seq-lens-0-1-0-2"),
    pytest.param([0, 0], 16, None, id="all-empty"),
    pytest.param([130, 3], 61, 130, id="hint-exact-max"),
    pytest.param([130, 3], 61, 1, id="hint-too-small-still-complete"),
    pytest.param([47, 20], 64, 10**6, id="hint-huge"),
    pytest.param([33] * 9, 8, None, id="B9-bs8-same-len"),
]


@pytest.mark.parametrize("seq_lens,block_size,hint", REGULAR + CORNER)
def test_gather_equals_unpack(seq_lens, block_size, hint):
    args = build(seq_lens, block_size, seed=block_size + len(seq_lens))
    want = expected(args)
    gather_upconvert(**args, max_seq_len=hint)
    assert_bits("dst", args["dst"], want)


def test_gather_raw_rule_scales_and_dense_cache():
    """Scales that are not powers of two (the raw rule) and a cache with no hidden rows."""
    args = build([70, 9], 32, fmt=FP8_DS_MLA_RAW, extra_rows=0)
    want = expected(args)
    gather_upconvert(**args)
    assert_bits("dst", args["dst"], want)


def test_nan_tile_in_cache_stays_nan():
    """A token whose tile was poisoned at write time (NaN scale, fp8 NaN bytes) reads back NaN in
    that tile only."""
    args = build([10], 4)
    bt = args["block_table"].cpu()
    row = args["cache"][int(bt[0, 1]), 2]  # token p = 6
    row[128:256] = 0x7F
    row[516:520] = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.uint8).to(DEVICE)
    want = expected(args)
    gather_upconvert(**args)
    assert torch.isnan(args["dst"][6, 128:256].float()).all()
    assert_bits("dst", args["dst"], want)


def test_invalid_block_entries_give_zero_rows_and_no_read():
    """Needed block-table entries -1, INT32_MIN, num_blocks, INT32_MAX, and positions past the table's
    last column: those rows are zeros, and no out-of-bounds read happens."""
    args = build([20, 20, 20, 9], 4, extra_cols=0, spare_blocks=0, dst_spare=14)
    bt = args["block_table"].cpu()
    num_blocks = args["cache"].shape[0]
    assert bt.shape == (4, 5)
    bt[0, 1] = -1
    bt[1, 0] = INT32_MIN
    bt[1, 4] = num_blocks
    bt[2, 2] = INT32_MAX
    bt[3, 3:] = torch.tensor([-7, num_blocks + 1], dtype=torch.int32)
    args["block_table"] = bt.to(DEVICE)
    # request 3 had 9 tokens written (blocks 0..2); read 23: p 9..11 are unwritten rows of a valid
    # block (read as the cache holds them), 12..19 hit invalid entries, 20..22 are past column 4.
    args["seq_lens"][3] = 23
    zero = {(0, p) for p in range(4, 8)} | {(1, p) for p in range(0, 4)} | {(1, p) for p in range(16, 20)}
    zero |= {(2, p) for p in range(8, 12)} | {(3, p) for p in range(12, 23)}
    want = expected(args, zero_rows=zero)
    gather_upconvert(**args)
    assert_bits("dst", args["dst"], want)
    assert torch.all(args["dst"][int(args["starts"][3]) + 12:][:11] == 0)


def test_rows_outside_dst_are_not_written():
    """starts[b] + p outside [0, N) is skipped; dst is a view of a larger NaN buffer whose rows past
    the view must stay NaN (no wild write)."""
    args = build([12, 12], 4, gaps=(0, 0))
    full = expected(args)  # with starts [0, 12]: every token has a row
    backing = torch.full((40, 576), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    args["dst"] = backing[:20]
    args["starts"] = torch.tensor([-5, 14], dtype=torch.int32, device=DEVICE)
    gather_upconvert(**args)
    want = torch.full((40, 576), float("nan"), dtype=torch.bfloat16)
    want[0:7] = full[5:12]  # request 0, p = 5..11 -> rows 0..6
    want[14:20] = full[12:18]  # request 1, p = 0..5 -> rows 14..19; p >= 6 would be rows >= 20
    assert_bits("dst backing", backing, want)


def test_empty_requests_and_empty_dst_are_no_ops():
    args = build([3], 4)
    before = args["dst"].clone()
    gather_upconvert(**dict(args, block_table=args["block_table"][:0], seq_lens=args["seq_lens"][:0],
                            starts=args["starts"][:0]))
    assert_bits("dst", args["dst"], before)
    gather_upconvert(**dict(args, dst=args["dst"][:0]))


# --- errors ---------------------------------------------------------------------------------------

BAD = [
    pytest.param("cache", lambda a: torch.zeros(2, 4, 576, dtype=torch.bfloat16, device=DEVICE), NotImplementedError,
                 r"only fp8_ds_mla", id="bf16-cache"),
    pytest.param("cache", lambda a: a["cache"].float(), ValueError, r"cache\.dtype", id="cache-fp32"),
    pytest.param("cache", lambda a: a["cache"][..., :600], ValueError, r"cache\.shape\[-1\]", id="cache-width"),
    pytest.param("cache", lambda a: a["cache"][0], ValueError, r"cache\.dim\(\)", id="cache-2d"),
    pytest.param("cache", lambda a: torch.zeros(2 * 4 * 656 + 1, dtype=torch.uint8, device=DEVICE)[1:].view(2, 4, 656),
                 ValueError, r"cache: expected rows starting at 4-byte aligned", id="cache-misaligned"),
    pytest.param("dst", lambda a: a["dst"].float(), ValueError, r"dst\.dtype", id="dst-fp32"),
    pytest.param("dst", lambda a: a["dst"][:, :512], ValueError, r"dst\.shape: expected \(\*, 576\)", id="dst-width"),
    pytest.param("dst", lambda a: a["dst"].t().contiguous().t(), ValueError, r"dst\.stride\(-1\)", id="dst-col-major"),
    pytest.param("block_table", lambda a: a["block_table"].long(), ValueError, r"block_table\.dtype", id="bt-int64"),
    pytest.param("block_table", lambda a: a["block_table"][0], ValueError, r"block_table\.dim\(\)", id="bt-1d"),
    pytest.param("seq_lens", lambda a: a["seq_lens"][:1], ValueError, r"seq_lens\.shape: expected \(2,\)", id="seq-lens-short"),
    pytest.param("seq_lens", lambda a: a["seq_lens"].long(), ValueError, r"seq_lens\.dtype", id="seq-lens-int64"),
    pytest.param("starts", lambda a: a["starts"].float(), ValueError, r"starts\.dtype", id="starts-float"),
    pytest.param("starts", lambda a: torch.zeros(4, dtype=torch.int32, device=DEVICE)[::2], ValueError,
                 r"starts: expected a contiguous tensor", id="starts-strided"),
    pytest.param("max_seq_len", lambda a: -1, ValueError, r"max_seq_len: expected None or a non-negative python int",
                 id="hint-negative"),
    pytest.param("max_seq_len", lambda a: torch.tensor(5), ValueError, r"max_seq_len", id="hint-tensor"),
]


@pytest.mark.parametrize("name,mutate,exc,match", BAD)
def test_bad_arguments(name, mutate, exc, match):
    args = build([5, 3], 4)
    args[name] = mutate(args)
    with pytest.raises(exc, match=match):
        gather_upconvert(**args)
