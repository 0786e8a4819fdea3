"""fp8 per-tensor cache scales (k_scale, v_scale: the cache holds e4m3fn(rne(x / scale))) must be
finite and > 0: a scale of 0 saturates every element to +-448, a negative one flips every sign,
NaN writes NaN. write_kv_cache raises ValueError naming the scale, before anything is written,
whenever it reads the scales: always for scales on the CPU, with check_slots (its one host read)
for device scales. With check_slots=False a device scale is not read (the run path; the layer
checks its scales where they are set: tests/mla/test_mha_impl.py)."""
import pytest
import torch

from openmla.quant.kv_cache import write_kv_cache
from tests.helpers import DEVICE

FP8 = torch.float8_e4m3fn
BAD = [pytest.param(v, id=i) for v, i in ((0.0, "zero"), (-0.5, "negative"), (float("nan"), "nan"),
                                          (float("inf"), "inf"), (-0.0, "minus-zero"))]


def _setup():
    g = torch.Generator().manual_seed(0)
    key = torch.randn(3, 2, 16, generator=g).bfloat16().to(DEVICE)
    kc = torch.zeros(2, 4, 2, 16, dtype=FP8, device=DEVICE)
    slots = torch.tensor([0, 5, -1], device=DEVICE)
    return key, kc, kc.clone(), slots


@pytest.mark.parametrize("check_slots", [True, pytest.param(False, id="no-slot-check")])
@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
@pytest.mark.parametrize("bad", BAD)
def test_bad_scale_raises_before_writing(bad, which, check_slots):
    key, kc, vc, slots = _setup()
    if DEVICE != "cpu" and not check_slots:
        pytest.skip("a device scale is read only with check_slots (no host sync in the run path)")
    scales = dict(k_scale=torch.tensor([0.25], device=DEVICE), v_scale=torch.tensor([0.25], device=DEVICE))
    scales[which] = torch.tensor([bad], device=DEVICE)
    with pytest.raises(ValueError, match=f"^{which}: expected a finite scale > 0, got "):
        write_kv_cache(key, key, kc, vc, slots, check_slots=check_slots, **scales)
    assert not kc.view(torch.uint8).any() and not vc.view(torch.uint8).any(), "nothing may be written"


def test_good_scales_write():
    """Finite positive scales pass the check and quantize as e4m3fn(rne(x / scale))."""
    key, kc, vc, slots = _setup()
    write_kv_cache(key, key, kc, vc, slots, k_scale=torch.tensor([0.25], device=DEVICE),
                   v_scale=torch.tensor([4.0], device=DEVICE))
    assert torch.equal(kc[0, 0].float(), (key[0].float() / 0.25).to(FP8).float())
    assert torch.equal(vc[1, 1].float(), (key[1].float() / 4.0).to(FP8).float())
