"""merge_project (a split decode's merge and the output projection in one launch) against its
fp32 oracle, on partials with empty, faulty and NaN-filled splits."""
import pytest
import torch

from openmla.kernels.merge_project import MAX_PARTS, bind_merge_project, merge_project
from openmla.kernels.reference import merge_project_ref
from tests.helpers import DEVICE, assert_close, nan_filled


def partials(T, S, H, D, g, *, empty=0.25):
    """po [T, S, H, D] and plse [T, S, H]: lse spread over +-6 (so the weights differ by up to
    e^12), a share of the splits empty (+inf or -inf) with NaN in their po, the rest ~N(0, 1)."""
    po = torch.randn(T, S, H, D, generator=g)
    plse = torch.rand(T, S, H, generator=g) * 12 - 6
    gone = torch.rand(T, S, H, generator=g) < empty
    plse[gone] = torch.where(torch.rand(int(gone.sum()), generator=g) < 0.5, float("inf"), float("-inf"))
    po[gone] = float("nan")
    return po.to(DEVICE), plse.to(DEVICE)


def weights(H, D, N, g, dtype=torch.bfloat16):
    """w [H, D, N] as a view into a NaN-filled buffer with padded rows: a read outside the view
    would put NaN into the result."""
    buf = nan_filled((H, D, N + 8), dtype).to(DEVICE)
    w = buf[:, :, :N]
    w.copy_((torch.randn(H, D, N, generator=g) * D ** -0.5).to(dtype))
    return w


CASES = [
    # (T, S, H, D, N): DeepSeek's latent 512 -> v 128 at a decode's split counts, one split, an S
    # that is not a power of two, ragged D and N, one head
    pytest.param(1, 16, 3, 512, 128, id="T1-S16"),
    pytest.param(2, 5, 2, 512, 128, id="T2-S5"),
    pytest.param(3, 1, 2, 512, 128, id="T3-S1"),
    pytest.param(1, 33, 1, 40, 24, id="S33-D40-N24"),
    pytest.param(4, 2, 3, 100, 72, id="T4-D100-N72"),
    # more than 32 splits: the latent in unrolled slices (4 of 128, 8 of 64 at MAX_PARTS); head 3
    # of these is a plain row (heads 0-2 hold the adversarial rows below)
    pytest.param(1, 100, 4, 512, 32, id="S100-slices"),
    pytest.param(1, 256, 4, 512, 16, id="S256-slices"),
]


@pytest.mark.parametrize("T,S,H,D,N", CASES)
def test_merge_project_matches_oracle(T, S, H, D, N):
    g = torch.Generator().manual_seed(T * 1000 + S * 10 + D)
    po, plse = partials(T, S, H, D, g)
    # adversarial rows: every split empty (out 0); one non-empty split whose lse is NaN, one whose
    # partial holds an inf (both rows NaN); one split alone far above the others
    if T * H > 1:  # (a single row stays a plain one)
        plse[0, :, 0] = float("-inf")
    if H > 1:
        plse[-1, 0, 1] = float("nan")
    if T > 1:
        plse[1, -1, 0], po[1, -1, 0, D // 2] = 0.5, float("inf")
    if H > 2:
        plse[-1, :, 2], plse[-1, 0, 2] = -30.0, 40.0
        po[-1, 0, 2] = torch.randn(D, generator=g).to(DEVICE)
    w = weights(H, D, N, g)
    out = nan_filled((T, H + 1, N), torch.bfloat16).to(DEVICE)[:, 1:]
    got = merge_project(po, plse, w, out=out)
    assert got is out
    want = merge_project_ref(po, plse, w)
    assert_close("out", got, want, "bf16")
    if T * H > 1:
        assert bool((got[0, 0] == 0).all())
    else:
        assert bool(got.isfinite().all()) and bool((got != 0).any())
    if H > 1:
        assert bool(got[-1, 1].isnan().all())
    if T > 1:
        assert bool(got[1, 0].isnan().all())
    if H > 3:
        assert bool(got[:, 3].isfinite().all()) and bool((got[:, 3] != 0).any())
    # bound form (mla.sparse.impl's later layers): the same bits, an allocated out the same values
    bound = torch.empty_like(got)
    run = bind_merge_project(po, plse)
    run(w, bound)
    run(w, bound)
    assert torch.equal(bound.nan_to_num(7.0), got.nan_to_num(7.0))
    again = merge_project(po, plse, w)
    assert torch.equal(again.nan_to_num(7.0), got.nan_to_num(7.0))


def test_merge_project_latent_widths_of_one_stride():
    """Two latent widths whose weights share every stride (views of one buffer) and every other
    size: each call is compiled for its own width (the launch key holds D)."""
    g = torch.Generator().manual_seed(5)
    T, S, H, N = 1, 4, 2, 16
    buf = (torch.randn(H, 64, N, generator=g) * 0.2).bfloat16().to(DEVICE)
    for D in (40, 48, 40):
        po, plse = partials(T, S, H, D, g, empty=0.0)
        w = buf[:, :D]
        assert_close(f"out D={D}", merge_project(po, plse, w), merge_project_ref(po, plse, w), "bf16")


def test_merge_project_checks():
    po = torch.randn(2, 3, 4, 16, device=DEVICE)
    plse = torch.randn(2, 3, 4, device=DEVICE)
    w = torch.randn(4, 16, 8, device=DEVICE).bfloat16()
    assert merge_project(po[:0], plse[:0], w).shape == (0, 4, 8)
    with pytest.raises(ValueError, match="po.dtype"):
        merge_project(po.bfloat16(), plse, w)
    with pytest.raises(ValueError, match="plse.shape"):
        merge_project(po, plse[:, :2], w)
    with pytest.raises(ValueError, match="w.shape"):
        merge_project(po, plse, w[:, :8])
    with pytest.raises(ValueError, match="w.dtype"):
        merge_project(po, plse, w.float())
    with pytest.raises(ValueError, match="out.shape"):
        merge_project(po, plse, w, out=torch.empty(2, 4, 9, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="po"):
        merge_project(po.transpose(0, 1), plse, w)
    with pytest.raises(NotImplementedError, match="splits"):
        merge_project(po[:, :0], plse[:, :0], w)
    many = MAX_PARTS + 1
    with pytest.raises(NotImplementedError, match="splits"):
        merge_project(torch.zeros(1, many, 1, 16, device=DEVICE), torch.zeros(1, many, 1, device=DEVICE),
                      w[:1])
