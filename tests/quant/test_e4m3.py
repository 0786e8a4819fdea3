"""quant.e4m3: the e4m3fn conversions of every mode the kernels compile (kernels.device.Arch.e4m3)
agree bit for bit with torch's casts. The PTX mode runs on sm_89+ GPUs only (the GPU tests of
the fp8 ops cover it); BITS, the path of GPUs before sm_89, is plain Triton and runs here."""
import pytest
import torch
import triton
import triton.language as tl

from openmla.quant.e4m3 import E4M3_BITS, E4M3_CAST, E4M3_PTX, e4m3_to_f16, f32_to_e4m3
from tests.helpers import DEVICE, INTERPRET

# the modes this machine can run: PTX needs an NVIDIA GPU of sm_89+, BITS any GPU's integer units
_MODES = [pytest.param(E4M3_BITS, id="bits"), pytest.param(E4M3_CAST, id="cast")]
if DEVICE == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability() >= (8, 9):
    _MODES.append(pytest.param(E4M3_PTX, id="ptx"))
elif not INTERPRET and DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9):
    _MODES = _MODES[:1]  # Triton has no float8e4nv type before sm_89


@triton.jit
def _decode_kernel(x_ptr, y_ptr, MODE: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + o, e4m3_to_f16(tl.load(x_ptr + o), MODE))


@triton.jit
def _encode_kernel(x_ptr, y_ptr, n, MODE: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(y_ptr + o, f32_to_e4m3(tl.load(x_ptr + o, mask=m, other=0.0), MODE), mask=m)


@pytest.mark.parametrize("mode", _MODES)
def test_decode_every_byte(mode):
    """All 256 bytes: values bit-equal to torch's e4m3fn -> fp16 (subnormals, -0, +-448), and
    0x7F / 0xFF (e4m3fn's NaN) NaN."""
    x = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    y = torch.empty(256, dtype=torch.float16, device=DEVICE)
    _decode_kernel[(2,)](x.to(DEVICE), y, MODE=mode, BLOCK=128)
    want = x.view(torch.float8_e4m3fn).to(torch.float16)
    got = y.cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert int(torch.isnan(got).sum()) == 2
    finite = ~torch.isnan(want)
    assert torch.equal(got[finite].view(torch.int16), want[finite].view(torch.int16))


def _encode_inputs() -> torch.Tensor:
    """fp32 values where rounding is easy to get wrong: every e4m3fn value, the midpoints between
    neighbours (ties to even) and one fp32 ulp either side of them, the subnormal range, the
    saturation edge (448 .. 464 and beyond), inf, NaN, signed zeros, fp32 subnormals, and random
    values over the whole exponent range, all with both signs."""
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    vals = vals[torch.isfinite(vals) & (vals >= 0)].sort().values
    mids = (vals[1:] + vals[:-1]) / 2  # exact in fp32
    ulp = lambda x, k: (x.view(torch.int32) + k).view(torch.float32)  # noqa: E731
    g = torch.Generator().manual_seed(7)
    rnd = torch.exp2(torch.rand(4096, generator=g) * 40 - 20) * (1 + torch.rand(4096, generator=g))
    edge = torch.tensor([448.0, 449.0, 455.99, 456.0, 456.01, 463.99, 464.0, 465.0, 480.0, 1e6,
                         3.4e38, float("inf"), float("nan"), 0.0, 1e-45, 1e-40, 2.0 ** -6,
                         2.0 ** -7, 2.0 ** -9, 2.0 ** -10, 2.0 ** -10 * 1.0001, 2.0 ** -11])
    pos = torch.cat([vals, mids, ulp(mids, 1), ulp(mids, -1), rnd, edge,
                     torch.linspace(0, 2.0 ** -6, 1000)])
    return torch.cat([pos, -pos]).contiguous()


@pytest.mark.parametrize("mode", _MODES)
def test_encode_matches_torch(mode):
    """fp32 -> e4m3fn bytes: torch's cast (RNE) of the input saturated to +-448, NaN as 0x7F with
    the input's sign (torch writes it so)."""
    x = _encode_inputs()
    y = torch.empty(x.numel(), dtype=torch.uint8, device=DEVICE)
    _encode_kernel[(triton.cdiv(x.numel(), 1024),)](x.to(DEVICE), y, x.numel(), MODE=mode,
                                                     BLOCK=1024)
    want = x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    got = y.cpu()
    if mode != E4M3_BITS:  # the sign of a NaN is the hardware's (PTX writes 0x7F)
        nan = torch.isnan(x)
        got, want = got[~nan], want[~nan]
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, (f"{bad.numel()} bytes differ, first x = {x[bad[0]].item()!r}: "
                              f"got {got[bad[0]].item():#x}, want {want[bad[0]].item():#x}")
