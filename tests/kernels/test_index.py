"""convert_req_index_to_global against a plain Python loop (atol 0)."""
import pytest
import torch

from openmla.kernels.index import convert_req_index_to_global
from openmla.kernels.reference import convert_req_index_ref
from tests.helpers import DEVICE, INT32_MAX, INT32_MIN


def loop_convert(req_id, block_table, tok, bs, workspace=None):
    """DESIGN.md's rule, one element at a time."""
    T, K = tok.shape
    R, M = block_table.shape
    out = torch.full((T, K), -1, dtype=torch.int32)
    for t in range(T):
        for k in range(K):
            idx = int(tok[t, k])
            if workspace is not None and int(workspace[0][t]) >= 0:
                rid = int(workspace[0][t])
                if idx >= 0 and rid < workspace[1].numel():
                    row = int(workspace[1][rid]) + idx
                    out[t, k] = row if row <= INT32_MAX else -1
                continue
            r = int(req_id[t])
            if idx < 0 or not (0 <= r < R) or idx // bs >= M:
                continue
            e = int(block_table[r, idx // bs])
            if e < 0:
                continue
            slot = e * bs + idx % bs
            out[t, k] = slot if slot <= INT32_MAX else -1
    return out


def make_case(T, K, R, M, bs, seed, *, ws_tokens=0, poison=True):
    g = torch.Generator().manual_seed(seed)
    block_table = torch.randperm(R * M + 7, generator=g)[: R * M].view(R, M).to(torch.int32)
    if poison and R * M > 2:
        block_table.view(-1)[torch.randperm(R * M, generator=g)[: max(1, R * M // 5)]] = -1
    req_id = torch.randint(0, R, (T,), generator=g, dtype=torch.int32)
    tok = torch.randint(-3, M * bs + bs, (T, K), generator=g, dtype=torch.int32)
    if poison:  # every kind of invalid index somewhere
        bad = torch.tensor([INT32_MIN, -123456, -1, M * bs, INT32_MAX], dtype=torch.int32)
        pos = torch.randint(0, T * K, (bad.numel(),), generator=g)
        tok.view(-1)[pos] = bad
    workspace = None
    if ws_tokens:
        rid = torch.full((T,), -1, dtype=torch.int32)
        rid[T - ws_tokens:] = torch.randint(0, 3, (ws_tokens,), generator=g, dtype=torch.int32)
        starts = torch.tensor([0, 100, 5000], dtype=torch.int32)
        workspace = (rid, starts)
    return req_id, block_table, tok, workspace


CASES = [
    # regular
    pytest.param(4, 64, 2, 4, 64, 0, id="decode-T4-K64-bs64"),
    pytest.param(3, 1, 2, 3, 16, 0, id="decode-K1"),
    pytest.param(5, 300, 3, 5, 61, 0, id="decode-K300-bs61"),
    pytest.param(2, 2048, 2, 40, 64, 0, id="decode-K2048"),
    pytest.param(6, 37, 4, 9, 1, 0, id="decode-bs1"),
    # prefill workspace and mixed batches
    pytest.param(6, 50, 3, 4, 16, 6, id="prefill-only"),
    pytest.param(8, 129, 3, 4, 16, 5, id="mixed-3dec-5pf"),
]


@pytest.mark.parametrize("T, K, R, M, bs, ws_tokens", CASES)
def test_matches_loop(T, K, R, M, bs, ws_tokens):
    req_id, bt, tok, ws = make_case(T, K, R, M, bs, seed=T * 1000 + K, ws_tokens=ws_tokens)
    want = loop_convert(req_id, bt, tok, bs, ws)
    assert torch.equal(convert_req_index_ref(req_id, bt, tok, bs, workspace=ws), want)  # oracle == loop
    dev = lambda x: x.to(DEVICE)
    got, counts = convert_req_index_to_global(
        dev(req_id), dev(bt), dev(tok), bs,
        workspace=None if ws is None else (dev(ws[0]), dev(ws[1])), return_valid_counts=True)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(counts.cpu(), (want >= 0).sum(1).to(torch.int32))


def test_corner_cases():
    # request id out of range, workspace request id past starts, slot past int32, strided token_indices
    bt = torch.tensor([[0, 2**30], [5, -1]], dtype=torch.int32)
    req_id = torch.tensor([0, 7, -1, 1], dtype=torch.int32)
    wide = torch.randint(0, 8, (4, 10), dtype=torch.int32)
    tok = wide[:, ::1][:, :6]  # rows strided by 10
    tok[0, :3] = torch.tensor([1, 4, 5], dtype=torch.int32)  # blk 1 -> 2**30 * 4 + r overflows int32
    rid = torch.tensor([-1, -1, -1, 9], dtype=torch.int32)
    starts = torch.tensor([3], dtype=torch.int32)
    want = loop_convert(req_id, bt, tok, 4, (rid, starts))
    assert int(want[0, 1]) == -1 and int(want[0, 0]) == 1
    assert torch.equal(convert_req_index_ref(req_id, bt, tok, 4, workspace=(rid, starts)), want)
    got = convert_req_index_to_global(req_id.to(DEVICE), bt.to(DEVICE), tok.to(DEVICE), 4,
                                      workspace=(rid.to(DEVICE), starts.to(DEVICE)))
    assert torch.equal(got.cpu(), want)
    assert (got[1:] == -1).all()


def _on_device(d):
    move = lambda v: v.to(DEVICE) if isinstance(v, torch.Tensor) else v  # noqa: E731
    return {k: tuple(map(move, v)) if isinstance(v, tuple) else move(v) for k, v in d.items()}


@pytest.mark.parametrize("kwargs, match", [
    pytest.param(dict(req_id=torch.zeros(5, dtype=torch.int32)), r"req_id.shape: expected \(4,\)", id="req_id-longer"),
    pytest.param(dict(req_id=torch.zeros(4, dtype=torch.int64)), r"req_id.dtype: expected torch.int32", id="req_id-dtype"),
    pytest.param(dict(token_indices=torch.zeros(4, 3, dtype=torch.int64)), "token_indices.dtype", id="tok-dtype"),
    pytest.param(dict(block_table=torch.zeros(3, dtype=torch.int32)), r"block_table.dim\(\)", id="bt-1d"),
    pytest.param(dict(block_size=0), "block_size: expected a positive int", id="bs0"),
    pytest.param(dict(workspace=(torch.zeros(3, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))),
                 r"workspace.request_ids.shape", id="ws-rid-shape"),
])
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "after-a-good-call"])
def test_bad_input_raises(kwargs, match, warm):
    """Also after a good call that differs only in the bad argument (warm): checked call
    signatures are remembered, and a changed argument must still be checked."""
    args = dict(req_id=torch.zeros(4, dtype=torch.int32), block_table=torch.zeros(2, 3, dtype=torch.int32),
                token_indices=torch.zeros(4, 3, dtype=torch.int32), block_size=16)
    if warm:  # the good call on the test device; the bad arguments go there too
        args, kwargs = _on_device(args), _on_device(kwargs)
        assert (convert_req_index_to_global(**args) == 0).all()
    args.update(kwargs)
    ws = args.pop("workspace", None)
    with pytest.raises(ValueError, match=match):
        convert_req_index_to_global(args["req_id"], args["block_table"], args["token_indices"],
                                    args["block_size"], workspace=ws)


# ----------------------------------------------------------------------------------------------
# Request isolation: with seq_lens, a position at or past its own request's length is invalid on
# both paths, whatever the block table or the workspace would make of it.
# ----------------------------------------------------------------------------------------------
def loop_isolated(req_id, block_table, tok, bs, seq_lens, workspace=None):
    """loop_convert with DESIGN.md's isolation rule applied first (one element at a time)."""
    tok = tok.clone()
    R = block_table.shape[0]
    for t in range(tok.shape[0]):
        r = int(req_id[t])
        n = int(seq_lens[r]) if 0 <= r < R else 0
        for k in range(tok.shape[1]):
            if int(tok[t, k]) >= n:
                tok[t, k] = -1
    return loop_convert(req_id, block_table, tok, bs, workspace)


def isolation_case():
    """Three requests of lengths 21, 9, 30 (block size 8, 4 blocks each, every entry mapped: a
    position past a request's length still has a block table entry, as a partly filled or stale
    block does), decode tokens of requests 0 and 1 and prefill tokens of requests 0..2 packed into
    one workspace (starts 0, 21, 30). Each token's indices: in-range positions, then seq_len,
    seq_len + 1, the next request's whole range (seq_len .. seq_len + its length - 1, the
    workspace rows of the next request) and every invalid kind."""
    bs, seq = 8, [21, 9, 30]
    block_table = torch.arange(12, dtype=torch.int32).view(3, 4).flip(1).contiguous()
    req_id = torch.tensor([0, 1, 0, 0, 1, 2], dtype=torch.int32)
    rid = torch.tensor([-1, -1, 0, 0, 1, 2], dtype=torch.int32)
    starts = torch.tensor([0, 21, 30], dtype=torch.int32)
    K = 4 + 2 + 30 + 4
    tok = torch.full((6, K), -1, dtype=torch.int32)
    for t in range(6):
        r = int(req_id[t])
        n, nxt = seq[r], seq[(r + 1) % 3]
        row = [0, n // 2, n - 2, n - 1, n, n + 1] + [n + j for j in range(nxt)]
        row += [INT32_MIN, -1, 32, INT32_MAX]  # 32 = 4 blocks * 8: past the block table too
        tok[t, :len(row)] = torch.tensor(row, dtype=torch.int32)
    return req_id, block_table, tok, bs, torch.tensor(seq, dtype=torch.int32), (rid, starts)


@pytest.mark.parametrize("with_ws", [False, True], ids=["decode", "mixed-workspace"])
def test_positions_past_seq_len_are_invalid(with_ws):
    req_id, bt, tok, bs, seq_lens, ws = isolation_case()
    ws = ws if with_ws else None
    want = loop_isolated(req_id, bt, tok, bs, seq_lens, ws)
    # what isolation removes: without seq_lens, seq_len and past it would map to real slots / rows
    assert bool((loop_convert(req_id, bt, tok, bs, ws)[:, 4:6] >= 0).all())
    assert bool((want[:, 4:] == -1).all()) and bool((want[:, :4] >= 0).all())
    assert torch.equal(convert_req_index_ref(req_id, bt, tok, bs, workspace=ws, seq_lens=seq_lens), want)
    dev = lambda x: x.to(DEVICE)
    got, counts = convert_req_index_to_global(
        dev(req_id), dev(bt), dev(tok), bs, workspace=None if ws is None else (dev(ws[0]), dev(ws[1])),
        seq_lens=dev(seq_lens), return_valid_counts=True)
    assert torch.equal(got.cpu(), want)
    assert bool((counts.cpu() == 4).all())


def test_isolation_of_tokens_of_no_request():
    """A token whose req_id is outside [0, R) (padding: R) has length 0: everything invalid, on
    both paths (a workspace id does not bring its rows back)."""
    req_id, bt, tok, bs, seq_lens, (rid, starts) = isolation_case()
    req_id = torch.tensor([3, -1, 3, 0, 1, 2], dtype=torch.int32)
    want = loop_isolated(req_id, bt, tok, bs, seq_lens, (rid, starts))
    assert bool((want[:3] == -1).all())
    got = convert_req_index_to_global(req_id.to(DEVICE), bt.to(DEVICE), tok.to(DEVICE), bs,
                                      workspace=(rid.to(DEVICE), starts.to(DEVICE)),
                                      seq_lens=seq_lens.to(DEVICE))
    assert torch.equal(got.cpu(), want)
    assert torch.equal(convert_req_index_ref(req_id, bt, tok, bs, workspace=(rid, starts), seq_lens=seq_lens),
                       want)


@pytest.mark.parametrize("seq_lens, match", [
    pytest.param(torch.zeros(3, dtype=torch.int32), r"seq_lens.shape: expected \(2,\)", id="shape"),
    pytest.param(torch.zeros(2, dtype=torch.int64), r"seq_lens.dtype: expected torch.int32", id="dtype"),
])
def test_bad_seq_lens_raise(seq_lens, match):
    with pytest.raises(ValueError, match=match):
        convert_req_index_to_global(torch.zeros(4, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32),
                                    torch.zeros(4, 3, dtype=torch.int32), 16, seq_lens=seq_lens)


# ------------------------------------------------------------------ decode context parallelism
def loop_dcp(req_id, block_table, tok, bs, seq_lens, n, rank, i):
    """dcp=(n, rank, i) one element at a time: the rank's positions (as local indices, bounded by
    its local lengths, converted by loop_isolated's rule) in row order, then -1."""
    T, K = tok.shape
    local = torch.full_like(tok, -1)
    fronts, lengths = [], []
    for t in range(T):
        mine = [(int(p) // (n * i)) * i + int(p) % i for p in tok[t].tolist() if p >= 0 and (p // i) % n == rank]
        local[t, :len(mine)] = torch.tensor(mine, dtype=torch.int32)
        lengths.append(len(mine))
    conv = loop_isolated(req_id, block_table, local, bs, seq_lens, None)
    for t in range(T):
        conv[t, lengths[t]:] = -1
    return conv, torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.parametrize("n, i, K", [(1, 1, 40), (2, 1, 40), (2, 2, 300), (3, 1, 1030), (4, 5, 77)],
                         ids=lambda v: str(v))
def test_dcp_local_front(n, i, K):
    """dcp=(n, rank, i): every rank's positions converted by its local layout, packed to the
    front in row order (the decode kernel's topk_length) — against a loop and the oracle, with
    every kind of bad position (negative, INT32 extremes, past the request, past the table)."""
    g = torch.Generator().manual_seed(n * 100 + K)
    T, R, M, bs = 5, 3, 6, 8
    bt = torch.randperm(R * M + 5, generator=g)[:R * M].view(R, M).to(torch.int32)
    bt[1, 2] = -1
    req_id = torch.tensor([0, 1, 2, 1, 3], dtype=torch.int32)  # 3: a token of no request
    tok = torch.randint(-2, n * M * bs + 9, (T, K), generator=g, dtype=torch.int32)
    tok[:, :4] = torch.tensor([INT32_MIN, -1, INT32_MAX, n * M * bs], dtype=torch.int32)
    tok[2, 4:10] = torch.arange(6, dtype=torch.int32) * n * i  # rank 0's, in order
    for rank in range(n):
        loc = torch.tensor([n * M * bs // (n * 2) + rank, M * bs, 3], dtype=torch.int32)  # local lengths
        want, lengths = loop_dcp(req_id, bt, tok, bs, loc, n, rank, i)
        ref, ref_len = convert_req_index_ref(req_id, bt, tok, bs, seq_lens=loc, dcp=(n, rank, i))
        assert torch.equal(ref, want) and torch.equal(ref_len, lengths)
        dev = lambda x: x.to(DEVICE)  # noqa: E731
        got, got_len = convert_req_index_to_global(dev(req_id), dev(bt), dev(tok), bs, seq_lens=dev(loc),
                                                   dcp=(n, rank, i))
        assert torch.equal(got.cpu(), want), (n, i, rank)
        assert torch.equal(got_len.cpu(), lengths)
        assert int(lengths.sum()) > 0 and bool((want >= 0).any())
    if n == 1:  # one rank: the plain conversion, every position in front
        plain = convert_req_index_ref(req_id, bt, tok, bs, seq_lens=loc)
        kept = tok >= 0
        assert torch.equal(want[:, :int(lengths[0])][0], plain[0][kept[0]])


@pytest.mark.parametrize("dcp, err", [
    pytest.param((2, 2, 1), ValueError, id="rank-past-world"),
    pytest.param((0, 0, 1), ValueError, id="world-0"),
    pytest.param((2, 0, 0), ValueError, id="interleave-0"),
    pytest.param([2, 0, 1], ValueError, id="a-list"),
    pytest.param((2, 0), ValueError, id="two-values"),
])
def test_dcp_bad_arguments(dcp, err):
    args = (torch.zeros(4, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32),
            torch.zeros(4, 3, dtype=torch.int32), 16)
    with pytest.raises(err, match="dcp"):
        convert_req_index_to_global(*(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args), dcp=dcp)
    with pytest.raises(NotImplementedError, match="dcp"):
        convert_req_index_to_global(*(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args),
                                    dcp=(2, 0, 1), return_valid_counts=True)
