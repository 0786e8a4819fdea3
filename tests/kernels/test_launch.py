"""kernels.launch.FastLaunch: the cached launch computes what `kernel[grid]` computes, and a new
specialization (alignment, an int of 1, another dtype, other constexprs) gets its own entry.

On the CPU (interpreter) FastLaunch takes Triton's own path every time: the results are checked
there too, the cache only on a GPU."""
import pytest
import torch
import triton
import triton.language as tl

from openmla.kernels.launch import FastLaunch, cdiv, next_pow2
from tests.helpers import DEVICE


@triton.jit
def _axpy(x_ptr, y_ptr, out_ptr, n, stride, alpha, BLOCK: tl.constexpr, NEG: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(x_ptr + o * stride, mask=m)
    y = tl.load(y_ptr + o, mask=m)
    r = alpha * x.to(tl.float32) + y.to(tl.float32)
    if NEG:
        r = -r
    tl.store(out_ptr + o, r.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, stride, alpha, BLOCK: tl.constexpr, NEG: tl.constexpr):
    _axpy(x_ptr, y_ptr, out_ptr, n, stride, alpha, BLOCK, NEG)


@triton.autotune(configs=[triton.Config({"BLOCK": 32}), triton.Config({"BLOCK": 64})], key=["n"])
@triton.jit
def _axpy_tuned_kernel(x_ptr, y_ptr, out_ptr, n, stride, alpha, BLOCK: tl.constexpr, NEG: tl.constexpr):
    _axpy(x_ptr, y_ptr, out_ptr, n, stride, alpha, BLOCK, NEG)


def _want(x, y, alpha, neg):
    r = alpha * x.float() + y.float()
    return (-r if neg else r).to(y.dtype)


CASES = [  # (dtype, n, offset of x in its buffer (elements), stride of x, NEG)
    pytest.param(torch.float32, 100, 0, 1, False, id="f32-n100"),
    pytest.param(torch.float32, 100, 1, 1, False, id="f32-n100-misaligned"),
    pytest.param(torch.float32, 1, 0, 1, False, id="f32-n1"),
    pytest.param(torch.float32, 64, 0, 3, True, id="f32-n64-stride3-neg"),
    pytest.param(torch.bfloat16, 100, 0, 1, False, id="bf16-n100"),
]


@pytest.mark.parametrize("tuned", [False, True], ids=["jit", "autotune"])
def test_fast_launch_matches_and_specializes(tuned):
    kernel = _axpy_tuned_kernel if tuned else _axpy_kernel
    fast = FastLaunch(kernel)
    g = torch.Generator().manual_seed(0)
    keys_seen = 0
    for rep in range(2):  # the second round hits the cache on a GPU
        for case in CASES:
            dtype, n, off, stride, neg = case.values
            buf = torch.randn(off + n * stride + 1, generator=g).to(dtype).to(DEVICE)
            x = buf[off:off + n * stride]
            y = torch.randn(n, generator=g).to(dtype).to(DEVICE)
            out = torch.full_like(y, float("nan"))
            alpha = float(torch.rand((), generator=g)) + 0.5
            kw = dict(NEG=neg) if tuned else dict(BLOCK=64, NEG=neg, num_warps=2)
            grid = (triton.cdiv(n, 32),)
            fast(grid, x, y, out, n, stride, alpha, **kw)
            tol = 1e-6 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(out, _want(x[::stride], y, alpha, neg), rtol=tol, atol=tol)
        if DEVICE == "cuda":
            if rep == 0:
                keys_seen = len(fast._cache)
                # one entry per distinct specialization: 5 cases, all different
                assert keys_seen == len(CASES)
            else:
                assert len(fast._cache) == keys_seen  # the second round only hit the cache


def test_host_arithmetic_equals_tritons():
    """cdiv / next_pow2 (the launch paths' host arithmetic) return what triton.cdiv /
    triton.next_power_of_2 return for every size a launch passes them."""
    for n in list(range(1, 5000)) + [2 ** 20 - 1, 2 ** 20, 2 ** 20 + 1, 2 ** 31 - 1]:
        assert next_pow2(n) == triton.next_power_of_2(n), n
    for a in list(range(0, 700)) + [2 ** 31 - 1, 2 ** 40 + 3]:
        for b in (1, 2, 3, 16, 64, 127, 1024):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_bound_launch_goes_to_the_cached_launcher(monkeypatch):
    """BoundLaunch: the first call goes through FastLaunch.keyed; once keyed has cached the
    compiled launcher under (device, key), calls go to it directly with the grid padded to three
    dims, the stream of the entry's device, and the launcher's head and fill around the args;
    another current device or an installed launch hook takes keyed's path again."""
    import openmla.kernels.launch as L
    calls, keyed = [], []

    class Fake:
        _interpreted = False
        _cache = {}
        cached = L.FastLaunch.cached

        def keyed(self, key, grid, *args, **kwargs):
            keyed.append((key, grid, args, kwargs))
            self._cache[(L._current_device(), key)] = (lambda *a: calls.append(a), ("h",), ("f",))

    device = [3]
    hooked = [False]
    monkeypatch.setattr(L, "_current_device", lambda: device[0])
    monkeypatch.setattr(L, "_raw_stream", lambda d: 100 + d)
    monkeypatch.setattr(L, "_hooked", lambda: hooked[0])
    go = L.BoundLaunch(Fake(), "k", (5, 2), BLOCK=16)
    go(1, 2)
    assert keyed == [("k", (5, 2), (1, 2), {"BLOCK": 16})] and calls == []
    go(7, 8)
    assert calls == [(5, 2, 1, 103, "h", 7, 8, "f")] and len(keyed) == 1
    device[0] = 4  # another device: keyed's path (which keys on the device)
    go(9, 9)
    assert len(keyed) == 2 and len(calls) == 1
    device[0] = 3
    hooked[0] = True  # a profiler's hook: Triton's path, through keyed
    go(6, 6)
    assert len(keyed) == 3 and len(calls) == 1
    hooked[0] = False
    go(5, 5)
    assert calls[-1] == (5, 2, 1, 103, "h", 5, 5, "f")
    assert go.try_launch(0x7000, 4)  # the compiled launcher's call, whatever the arguments
    assert calls[-1] == (5, 2, 1, 103, "h", 0x7000, 4, "f") and len(keyed) == 3
    hooked[0] = True
    assert not go.try_launch(1, 1)
    device[0], hooked[0] = 4, False
    assert not go.try_launch(1, 1)
    assert len(calls) == 3 and len(keyed) == 3  # nothing launched by a refused try


def test_bound_layer_passes_its_step_buffers_as_addresses(monkeypatch):
    """op.bind_layer's run, where the compiled launchers are at hand (BoundLaunch.try_launch): the
    decode gets q and the step buffers (slots, lse, out, partials) as their data_ptr() and the
    layer's cache as the tensor; the merge only addresses; otherwise (here: the interpreter) the
    tensors themselves go through Triton's path."""
    import openmla.kernels.launch as L
    from openmla.kernels.sparse_mla_decode import op
    from openmla.quant import FP8_DS_MLA
    from tests.kernels.test_sparse_mla_decode import make_inputs

    q, cache, idx = make_inputs("fp8", 1, 16, 2048 if DEVICE == "cuda" else 200, 64, 64, seed=3)
    plan, lse_shape, parts = op.layer_plan(q, cache, idx, FP8_DS_MLA)
    assert parts is not None  # a split plan: decode and merge
    scratch = tuple(torch.empty(s, device=DEVICE) for s in (lse_shape, *parts))
    out = torch.empty(1, 16, 512, dtype=torch.bfloat16, device=DEVICE)
    run = op.bind_layer(plan, q, idx, out, scratch, FP8_DS_MLA)
    got = []
    monkeypatch.setattr(L.BoundLaunch, "try_launch", lambda self, *a: got.append(a) or True)
    run(cache, 0.1)
    (dec, mrg) = got
    lse, po, plse = scratch
    assert dec[0] == q.data_ptr() and dec[1] is cache
    assert dec[2:9] == (idx.data_ptr(), lse.data_ptr(), lse.data_ptr(), out.data_ptr(), lse.data_ptr(),
                        po.data_ptr(), plse.data_ptr())
    assert not any(isinstance(a, torch.Tensor) for a in dec[2:] + mrg)
    assert mrg[:5] == (po.data_ptr(), plse.data_ptr(), lse.data_ptr(), out.data_ptr(), lse.data_ptr())


def test_bound_launch_of_an_interpreted_kernel_always_takes_keyed(monkeypatch):
    import openmla.kernels.launch as L
    keyed = []

    class Fake:
        _interpreted = True
        _cache = {}
        cached = L.FastLaunch.cached

        def keyed(self, key, grid, *args, **kwargs):
            keyed.append(args)

    go = L.BoundLaunch(Fake(), "k", (1,))
    go(1)
    go(2)
    assert keyed == [(1,), (2,)]
