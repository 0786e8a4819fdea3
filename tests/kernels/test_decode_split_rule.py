"""The split count of the one-round (Gluon) decode kernels (kernels/sparse_mla_decode/config.py):
a single round where the programs fit in one, and splits of long lists where they fill more than
one round with a part-empty last round. Host arithmetic only: the kernels' results for any split
count are checked by the decode test files (forced split counts)."""
import pytest

from openmla.kernels.sparse_mla_decode import config

CFG = dict(BLOCK_H=64, BLOCK_N=64, occupancy=1, one_round=True)


def fill(programs, slots):
    return programs / (-(-programs // slots) * slots)


@pytest.mark.parametrize("T,num_hb,topk,want", [
    (148, 2, 16384, 3),  # 296 programs: 3 rounds, the last 24 % full; 3 splits: 888 of 924 slots
    (148, 2, 4096, 2),  # the longest split count the 32-block floor allows
    (128, 2, 2048, 1),  # 256 programs fill 2 rounds 97 %: no split
    (148, 2, 2048, 1),  # a list of 32 blocks is too short to split past one round
    (64, 2, 1024, 1),  # 128 programs fit one round of 132: no split
    (8, 2, 2048, 8),  # the tokens leave SMs idle: the first round filled
])
def test_one_round_split_counts(T, num_hb, topk, want):
    got = config._pick_splits(T, num_hb, topk, CFG, 132)
    assert got == want
    chunk, n = config._splits(T, num_hb, topk, CFG, None, 132)
    assert n == got and chunk % CFG["BLOCK_N"] == 0 and (n - 1) * chunk < topk <= n * chunk


def test_long_splits_fill_and_length():
    """Past one round, a long list's splits keep >= LONG_STEPS blocks and reach LONG_FILL where a
    count allows it, else the fullest count; never a worse fill than not splitting."""
    slots = 132
    for T in range(67, 400, 7):
        for topk in (4096, 8192, 16384, 65536):
            base = 2 * T
            if base <= slots:
                continue
            s = config._pick_splits(T, 2, topk, CFG, slots)
            chunk = config._split_chunk(topk, s, 64)
            assert s == 1 or chunk >= config.LONG_STEPS * 64, (T, topk, s)
            assert fill(base * s, slots) >= fill(base, slots) - 1e-9
            counts = range(1, topk // (config.LONG_STEPS * 64) + 1)
            if any(fill(base * c, slots) >= config.LONG_FILL for c in counts):
                assert fill(base * s, slots) >= config.LONG_FILL, (T, topk, s)
