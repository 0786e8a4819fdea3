"""head_matmul (the per-head projections around MLA's latent attention) against its fp32 oracle."""
import pytest
import torch

from openmla.kernels import head_matmul as hm
from openmla.kernels.head_matmul import head_matmul
from openmla.kernels.reference import head_matmul_ref
from tests.helpers import DEVICE, assert_close, nan_filled


def padded(T, H, K, g, dtype=torch.bfloat16, scale=1.0):
    """[T, H, K] random values as a view into a NaN-filled buffer with padded token and head
    strides: a read outside the view would put NaN into the result."""
    buf = nan_filled((T, H + 1, K + 24), dtype).to(DEVICE)
    x = buf[:, :H, :K]
    x.copy_((torch.randn(T, H, K, generator=g) * scale).to(dtype))
    return x


CASES = [
    # (T, H, K, N, R): DeepSeek's absorption (K 128 -> 512 | rope 64) and output projection
    # (512 -> 128), tails of K and N that are not tile multiples, one token, one head
    pytest.param(1, 4, 128, 512, 64, id="absorb-T1"),
    pytest.param(5, 3, 128, 512, 64, id="absorb-T5"),
    pytest.param(3, 2, 512, 128, 0, id="project-T3"),
    pytest.param(17, 2, 40, 72, 0, id="ragged-T17-K40-N72"),
    pytest.param(2, 1, 100, 24, 8, id="ragged-tail8"),
    pytest.param(40, 2, 16, 16, 0, id="T40-K16"),
]


@pytest.mark.parametrize("T,H,K,N,R", CASES)
def test_head_matmul_matches_oracle(T, H, K, N, R):
    g = torch.Generator().manual_seed(T * 1000 + K + N)
    x = padded(T, H, K, g)
    w = (torch.randn(H, K, N, generator=g) * K ** -0.5).bfloat16().to(DEVICE)
    tail = padded(T, H, R, g, scale=30.0) if R else None
    out = nan_filled((T, H + 2, N + R), torch.bfloat16).to(DEVICE)[:, 1:H + 1]
    got = head_matmul(x, w, tail=tail, out=out)
    assert got is out
    want = head_matmul_ref(x, w, tail)
    assert_close("out", got, want, "bf16")
    if R:  # the tail is copied, not computed
        assert torch.equal(got[..., N:], tail)
    # as torch.bmm rounds: each element within one bf16 step of the exactly rounded product
    step = want[..., :N].abs().clamp_min(1e-30) * 2.0 ** -7
    assert bool(((got[..., :N].float() - want[..., :N]).abs() <= step + 1e-6).all())
    again = head_matmul(x, w, tail=tail)  # allocated out, same values
    assert torch.equal(again, got)


def test_head_matmul_faults_stay_in_their_row():
    """A NaN in x[t, h] or an inf in w[h] makes exactly the rows that read it non-finite."""
    g = torch.Generator().manual_seed(3)
    T, H, K, N = 4, 3, 64, 32
    x = padded(T, H, K, g)
    w = (torch.randn(H, K, N, generator=g) * 0.1).bfloat16().to(DEVICE)
    x[2, 1, 7] = float("nan")
    w[0, 5, 3] = float("inf")
    got = head_matmul(x, w).float()
    assert bool(got[2, 1].isnan().all())
    assert bool((~got[:, 0, 3].isfinite()).all())  # column 3 of head 0 reads the inf, every token
    bad = torch.zeros(T, H, N, dtype=torch.bool)
    bad[2, 1] = True
    bad[:, 0, 3] = True
    assert bool(got[~bad.to(got.device)].isfinite().all())


def test_head_matmul_empty_and_checks(monkeypatch):
    w = torch.randn(2, 8, 16).bfloat16().to(DEVICE)
    assert head_matmul(torch.empty(0, 2, 8, dtype=torch.bfloat16, device=DEVICE), w).shape == (0, 2, 16)
    x = torch.randn(3, 2, 8).bfloat16().to(DEVICE)
    with pytest.raises(ValueError, match="w.shape"):
        head_matmul(x, w[:, :4])
    with pytest.raises(ValueError, match="w.dtype"):
        head_matmul(x, w.float())
    with pytest.raises(ValueError, match="x.dtype"):
        head_matmul(x.float(), w.float())
    with pytest.raises(ValueError, match="tail.shape"):
        head_matmul(x, w, tail=torch.zeros(3, 1, 4, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="out"):
        head_matmul(x, w, out=torch.empty(3, 2, 17, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="x.stride"):
        head_matmul(torch.randn(3, 8, 2).bfloat16().to(DEVICE).transpose(1, 2), w)
    # a signature that passed is not checked again; a new one is
    from openmla.quant.validate import CheckedCalls
    monkeypatch.setattr(hm, "_CHECKED", CheckedCalls())
    calls, real = [], hm.check_same_device
    monkeypatch.setattr(hm, "check_same_device", lambda **kw: calls.append(1) or real(**kw))
    head_matmul(x, w)
    head_matmul(x, w)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="w.shape"):  # same x, bad w: checked again
        head_matmul(x, w[:1])


def test_bound_launches_follow_layout_changes():
    """bind_absorb_convert / bind_head_matmul (mla.sparse.impl's later layers) give what the ops
    give, also when the tensors passed change strides between calls (the argument list is rebuilt)
    and back again)."""
    from openmla.kernels.head_matmul import bind_absorb_convert, bind_head_matmul
    from openmla.kernels.index import convert_req_index_to_global
    g = torch.Generator().manual_seed(11)
    T, H, K, N, R, KI, bs = 3, 2, 40, 72, 8, 20, 16
    w = (torch.randn(H, K, N, generator=g) * 0.2).bfloat16().to(DEVICE)
    layouts = [(padded(T, H, K, g), padded(T, H, R, g)),
               (torch.randn(T, H, K, generator=g).bfloat16().to(DEVICE),
                torch.randn(T, H, R, generator=g).bfloat16().to(DEVICE))]
    layouts.append(layouts[0])
    req_id = torch.tensor([1, 0, 5], dtype=torch.int32, device=DEVICE)  # 5: no such request
    block_table = torch.tensor([[3, 0, -1, 2], [1, 4, 6, 5]], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([40, 55], dtype=torch.int32, device=DEVICE)
    tok = torch.randint(-3, 70, (T, KI), generator=g, dtype=torch.int32).to(DEVICE)
    out = torch.empty(T, H, N + R, dtype=torch.bfloat16, device=DEVICE)
    slots = torch.empty(T, KI, dtype=torch.int32, device=DEVICE)
    run = bind_absorb_convert(out, req_id, block_table, slots, seq_lens, bs)
    want_slots = convert_req_index_to_global(req_id, block_table, tok, bs, seq_lens=seq_lens)
    for x, tail in layouts:
        out.fill_(float("nan"))
        slots.fill_(7)
        run(x, w, tail, tok)
        assert torch.equal(out, head_matmul(x, w, tail=tail))
        assert torch.equal(slots, want_slots)
    lat = padded(T, H, N, g)
    w2 = (torch.randn(H, N, K, generator=g) * 0.2).bfloat16().to(DEVICE)
    project = bind_head_matmul(lat)
    wide = nan_filled((T, H + 1, K + 8), torch.bfloat16).to(DEVICE)[:, :H, :K]
    for dst in (torch.empty(T, H, K, dtype=torch.bfloat16, device=DEVICE), wide):
        project(w2, dst)
        assert torch.equal(dst, head_matmul(lat, w2))
