"""pytest setup: Triton-interpreter corrections for CPU runs, CPU torch defaults, per-test seeds.

Without a GPU the tests run kernels in Triton's interpreter (TRITON_INTERPRET=1), which in
Triton 3.6 computes several things silently wrong (found by tests/test_interpreter.py):

* float conversions: fp32->bf16 truncates instead of rounding to nearest even; ->fp8 loses the
  carry into the exponent, rounds ties away from zero and overflows to NaN/inf where sm_90
  saturates (``cvt.rn.satfinite``); fp8 bytes 0x7f/0xff decode to 480, e5m2 inf/NaN to finite
  values, e5m2 and bf16 subnormals to 0; int->bf16 and fp64->bf16 store the value, converted to
  an integer, as the bf16 bit pattern.
* ``tl.dot`` multiplies bf16 operands as their raw uint16 patterns; fp8 operands go through
  the same broken fp8 decoder.
* bf16 (and fp8) elementwise arithmetic, comparisons, fma, ``tl.sum`` and scans compute on
  the raw uint16/uint8 storage; bf16 scalar constants (``x + 1.5``) raise AttributeError.
* ``triton.language.extra.libdevice`` (tanh, rint, ...) raises instead of computing.
* ``triton.autotune`` with several configs benchmarks, which asks for a GPU driver.

At import time, and only when TRITON_INTERPRET=1, this file patches the interpreter so that
kernels compute what sm_90 computes: conversions go through torch's own CPU conversions (RNE,
plus saturation for fp8 as ``cvt.rn.satfinite`` does), dots upcast to fp32 and accumulate in
fp32 as tensor cores do, libdevice symbols map to numpy. On a GPU (TRITON_INTERPRET unset) this
file changes nothing in Triton. OPENMLA_NO_INTERP_FIX=1 leaves the interpreter as shipped; the
tests in tests/test_interpreter.py then fail, which is how each correction is shown to matter.

Every patched attribute is checked to exist with the signature it had in Triton 3.6, so a
Triton upgrade fails loudly here instead of silently dropping a correction.
"""
from __future__ import annotations

import functools
import inspect
import math
import os
import zlib

import numpy as np
import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # same rule as tests.helpers
FIX_INTERPRETER = INTERPRET and os.environ.get("OPENMLA_NO_INTERP_FIX", "0") != "1"


# ----------------------------------------------------------------------------------------------
# Float formats: the interpreter keeps bf16 as uint16 and fp8 as uint8 numpy arrays; torch
# views those bytes as its own dtypes and converts them the way the GPU does.
# ----------------------------------------------------------------------------------------------
_TORCH_DTYPE = {  # Triton dtype name -> torch dtype. The AMD fp8 variants and fp8e4b15 are
    "fp16": torch.float16,  # absent on purpose: sm_90 has none of them, so they raise below.
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "fp64": torch.float64,
    "fp8e4nv": torch.float8_e4m3fn,
    "fp8e5": torch.float8_e5m2,
}
_STORAGE = {"bf16": torch.uint16, "fp8e4nv": torch.uint8, "fp8e5": torch.uint8}  # numpy side
_SATFINITE = {"fp8e4nv": 448.0, "fp8e5": 57344.0}  # sm_90 cvt.rn.satfinite: |x| > max -> max
_EMULATED = frozenset(_STORAGE)  # float types numpy cannot compute on


def _torch_view(data: np.ndarray, name: str) -> torch.Tensor:
    """The interpreter's numpy storage of a Triton float type as a torch tensor of that type."""
    if name not in _TORCH_DTYPE:
        raise NotImplementedError(f"tests/conftest.py: no interpreter emulation for Triton dtype {name}")
    t = torch.from_numpy(np.require(data, requirements=["C_CONTIGUOUS", "WRITEABLE"]))
    if t.is_floating_point():  # fp16/fp32/fp64 held natively: convert values, never reinterpret
        return t.to(_TORCH_DTYPE[name])
    assert t.element_size() == _TORCH_DTYPE[name].itemsize, f"{name} stored as {data.dtype}"
    return t.view(_TORCH_DTYPE[name])


def _to_numpy(t: torch.Tensor, name: str) -> np.ndarray:
    """Back to the interpreter's numpy storage for Triton dtype `name`."""
    return t.view(_STORAGE.get(name, t.dtype)).numpy()


def _round_to_odd_fp32(x: np.ndarray) -> np.ndarray:
    """fp64 -> fp32 rounding to odd. Rounding the result again to any format of <= 22 bits gives
    the correctly rounded fp64 value (no double-rounding error), so fp64 -> bf16/fp16/fp8 and
    fp64 arithmetic results can go through torch's fp32 conversions."""
    with np.errstate(all="ignore"):
        f = x.astype(np.float32)  # RNE
        fix = (f.astype(np.float64) != x) & ~np.isnan(x) & ((f.view(np.uint32) & 1) == 0)
        toward = np.where(x > f, np.float32(np.inf), np.float32(-np.inf)).astype(np.float32)
        f[fix] = np.nextafter(f[fix], toward[fix])  # the odd neighbour on x's side
    return f


def _convert(data: np.ndarray, src: str, dst: str, rtz: bool = False) -> np.ndarray:
    """Convert interpreter storage of Triton float type src to dst as sm_90 does: round to nearest
    even (toward zero if rtz); fp8 destinations saturate at +-max (NaN stays NaN)."""
    t = _torch_view(data, src)
    x64 = t.to(torch.float64)
    if src == "fp64" and dst != "fp32":
        t = torch.from_numpy(_round_to_odd_fp32(t.numpy()))
    if dst in _SATFINITE:
        # Clamp first: torch < 2.12 turns e4m3 overflow into NaN and e5m2 overflow into inf.
        t = t.to(torch.float32).clamp(-_SATFINITE[dst], _SATFINITE[dst])
    y = t.to(_TORCH_DTYPE[dst])
    if rtz:  # RNE rounded away from zero -> step one ulp back toward zero (sign-magnitude bits)
        away = y.to(torch.float64).abs() > x64.abs()
        bits = y.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[y.element_size()])
        y = torch.where(away, bits - 1, bits).view(y.dtype)
    return _to_numpy(y, dst)


def _decode(data: np.ndarray, name: str, np_dtype=np.float64) -> np.ndarray:
    return _torch_view(data, name).to(torch.float64).numpy().astype(np_dtype)


def _encode(x64: np.ndarray, name: str) -> np.ndarray:
    return _convert(np.asarray(x64, dtype=np.float64), "fp64", name)


# ----------------------------------------------------------------------------------------------
# libdevice symbols -> numpy, computed in fp64 and rounded once to the return type (libdevice's
# fp32 functions are within 1-2 ulp of that). Unknown symbols raise, naming themselves.
# ----------------------------------------------------------------------------------------------
def _round_half_away(x):
    t = np.trunc(x)
    return np.where(np.abs(x - t) >= 0.5, t + np.sign(x), t)


_PAIRED = {  # name (fp64 symbol) and name + "f" (fp32 symbol)
    "exp": np.exp, "exp2": np.exp2, "exp10": lambda x: np.power(10.0, x), "expm1": np.expm1,
    "log": np.log, "log2": np.log2, "log10": np.log10, "log1p": np.log1p,
    "sqrt": np.sqrt, "rsqrt": lambda x: 1.0 / np.sqrt(x), "cbrt": np.cbrt, "rcbrt": lambda x: 1.0 / np.cbrt(x),
    "sin": np.sin, "cos": np.cos, "tan": np.tan, "asin": np.arcsin, "acos": np.arccos, "atan": np.arctan,
    "atan2": np.arctan2, "sinh": np.sinh, "cosh": np.cosh, "tanh": np.tanh, "asinh": np.arcsinh,
    "acosh": np.arccosh, "atanh": np.arctanh,
    "erf": np.vectorize(math.erf, otypes=[np.float64]), "erfc": np.vectorize(math.erfc, otypes=[np.float64]),
    "floor": np.floor, "ceil": np.ceil, "trunc": np.trunc, "rint": np.rint, "nearbyint": np.rint,
    "round": _round_half_away, "fabs": np.abs, "pow": np.power,
    "fmod": np.fmod, "hypot": np.hypot, "copysign": np.copysign, "fdim": lambda x, y: np.maximum(x - y, 0.0),
    "fma": lambda x, y, z: x * y + z, "ldexp": lambda x, n: np.ldexp(x, n.astype(np.int32)),
}
_LIBDEVICE = {**_PAIRED, **{k + "f": v for k, v in _PAIRED.items()}}
_LIBDEVICE.update({
    "abs": np.abs, "llabs": np.abs,  # the integer ones
    "fast_expf": np.exp, "fast_exp10f": _PAIRED["exp10"], "fast_logf": np.log, "fast_log2f": np.log2,
    "fast_log10f": np.log10, "fast_powf": np.power, "fast_sinf": np.sin, "fast_cosf": np.cos,
    "fast_tanf": np.tan, "fast_fdividef": np.divide,
    "fadd_rn": np.add, "fsub_rn": np.subtract, "fmul_rn": np.multiply, "fdiv_rn": np.divide,
    "frcp_rn": lambda x: 1.0 / x, "fsqrt_rn": np.sqrt, "frsqrt_rn": _PAIRED["rsqrt"], "fmaf_rn": _PAIRED["fma"],
    "dadd_rn": np.add, "dsub_rn": np.subtract, "dmul_rn": np.multiply, "ddiv_rn": np.divide,
    "drcp_rn": lambda x: 1.0 / x, "dsqrt_rn": np.sqrt, "fma_rn": _PAIRED["fma"],
    "isnanf": np.isnan, "isnand": np.isnan, "isinff": np.isinf, "isinfd": np.isinf,
    "finitef": np.isfinite, "isfinited": np.isfinite, "signbitf": np.signbit, "signbitd": np.signbit,
    "saturatef": lambda x: np.where(np.isnan(x), 0.0, np.clip(x, 0.0, 1.0)),
})
for _src in ("float", "double"):  # float2int_rn etc.: round, then saturate with NaN -> 0 as cvt does
    for _mode, _rnd in (("rn", np.rint), ("rz", np.trunc), ("rd", np.floor), ("ru", np.ceil)):
        _LIBDEVICE[f"{_src}2int_{_mode}"] = lambda x, r=_rnd: np.clip(np.nan_to_num(r(x)), -2.0**31, 2.0**31 - 1)
        _LIBDEVICE[f"{_src}2uint_{_mode}"] = lambda x, r=_rnd: np.clip(np.nan_to_num(r(x)), 0.0, 2.0**32 - 1)


def _libdevice_fn(symbol: str):
    name = symbol[len("__nv_"):] if symbol.startswith("__nv_") else None
    if name not in _LIBDEVICE:
        raise NotImplementedError(
            f"tests/conftest.py: libdevice symbol {symbol} has no interpreter emulation; add it to _LIBDEVICE")
    return _LIBDEVICE[name]


# ----------------------------------------------------------------------------------------------
# The patches
# ----------------------------------------------------------------------------------------------
def _expect(owner, name: str, params: list[str]):
    """The attribute we replace, checked against Triton 3.6's signature (fail loudly on upgrades)."""
    assert hasattr(owner, name), f"tests/conftest.py: {owner.__name__}.{name} is gone; re-check the corrections"
    got = list(inspect.signature(getattr(owner, name)).parameters)
    assert got == params, f"tests/conftest.py: {owner.__name__}.{name}{got} changed (expected {params})"
    return getattr(owner, name)


def _install_interpreter_fixes() -> None:
    import triton
    import triton.language as tl
    import triton.language.extra.cuda.libdevice as cuda_libdevice
    import triton.language.extra.libdevice as stub_libdevice
    from triton.runtime import autotuner, interpreter as interp

    TensorHandle, Builder = interp.TensorHandle, interp.InterpreterBuilder
    assert triton.__version__.startswith("3.6"), (
        f"tests/conftest.py corrects Triton 3.6's interpreter, this is {triton.__version__}: re-check with "
        "OPENMLA_NO_INTERP_FIX=1 TRITON_INTERPRET=1 pytest tests/test_interpreter.py which corrections still apply")
    assert hasattr(interp, "_get_np_dtype") and hasattr(interp, "interpreter_semantic")
    assert hasattr(interp._ir, "ROUNDING_MODE") and hasattr(interp._ir.ROUNDING_MODE, "RTZ")

    def is_emulated(h) -> bool:
        # Comparison results carry their operand's dtype label over bool data: look at both.
        return h.dtype.scalar.name in _EMULATED and h.data.dtype in (np.uint8, np.uint16)

    # -- 1. conversions --------------------------------------------------------------------------
    # cast_impl serves fp_ext/fp_trunc/int<->fp; shipped, it truncates fp32->bf16, flushes bf16
    # subnormals and reinterprets the bits for int->bf16 and fp64->bf16.
    orig_cast_impl = _expect(Builder, "cast_impl", ["self", "src", "dst_type"])

    def cast_impl(self, src, dst_type):
        s, d = src.dtype.scalar, dst_type.scalar
        if src.data.dtype == np.bool_:  # comparison results keep their operands' float label
            s = tl.int1
        if s.is_floating() and d.is_floating():
            return TensorHandle(_convert(src.data, s.name, d.name), d)
        if d.name in _EMULATED:  # int -> bf16: exact in fp64 for |i| < 2^53, then one rounding
            return TensorHandle(_encode(src.data.astype(np.float64), d.name), d)
        if s.name in _EMULATED:  # bf16 -> int (Triton routes this via fp32 today; keep it exact)
            return orig_cast_impl(self, TensorHandle(_decode(src.data, s.name, np.float32), tl.float32), dst_type)
        return orig_cast_impl(self, src, dst_type)

    Builder.cast_impl = cast_impl

    # create_fp_to_fp serves every conversion touching fp8 and non-default rounding modes; its
    # hand-written bit manipulation (_convert_float) gets fp8 rounding, saturation and NaN wrong.
    _expect(Builder, "create_fp_to_fp", ["self", "src", "dst_type", "rounding_mode"])

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        modes = interp._ir.ROUNDING_MODE
        if rounding_mode not in (None, modes.RTNE, modes.RTZ):
            raise NotImplementedError(f"tests/conftest.py: rounding mode {rounding_mode}")
        d = dst_type.scalar
        return TensorHandle(_convert(src.data, src.dtype.scalar.name, d.name, rtz=rounding_mode == modes.RTZ), d)

    Builder.create_fp_to_fp = create_fp_to_fp

    # Scalar constants of these types (`x_bf16 + 1.5`, tl.full(..., 1.5, tl.bfloat16)) call
    # builder.get_bf16 etc., which the interpreter lacks (AttributeError). Round the Python float
    # once, as the compiler's constant folding does.
    for name in sorted(_EMULATED):
        assert not hasattr(Builder, f"get_{name}"), f"Triton now has InterpreterBuilder.get_{name}: drop ours"
        ty = getattr(tl, {"bf16": "bfloat16", "fp8e4nv": "float8e4nv", "fp8e5": "float8e5"}[name])
        setattr(Builder, f"get_{name}",
                lambda self, value, _n=name, _t=ty: TensorHandle(_encode(np.array([value], np.float64), _n), _t))

    # -- 2. dot: bf16 operands were multiplied as uint16 integers, fp8 ones decoded wrongly. ------
    # Tensor cores take the exact products of narrow floats and accumulate in fp32: do that.
    # (fp32 operands stay fp32: the interpreter does not emulate tf32 rounding.)
    orig_dot = _expect(Builder, "create_dot", ["self", "a", "b", "d", "input_precision", "max_num_imprecise_acc"])

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        at, bt, dt = a.dtype.scalar, b.dtype.scalar, d.dtype.scalar
        if not (at.is_floating() and bt.is_floating()) or "fp64" in (at.name, bt.name):
            return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        a32, b32 = _decode(a.data, at.name, np.float32), _decode(b.data, bt.name, np.float32)
        acc = np.matmul(a32, b32) + _decode(d.data, dt.name, np.float32)
        return TensorHandle(_convert(acc, "fp32", dt.name), dt)

    Builder.create_dot = create_dot

    # -- 3. bf16/fp8 arithmetic: numpy would add the uint16 patterns. Compute in fp64, round once
    # (correctly rounded, as sm_90's bf16 instructions and torch's bf16 ops are).
    _FLOAT_UFUNCS = {np.add, np.subtract, np.multiply, np.divide, np.fmod, np.minimum, np.maximum,
                     np.less, np.less_equal, np.greater, np.greater_equal, np.equal, np.not_equal}
    orig_binary = _expect(Builder, "binary_op", ["self", "lhs", "rhs", "op"])

    def binary_op(self, lhs, rhs, op):
        if not (is_emulated(lhs) or is_emulated(rhs)):
            return orig_binary(self, lhs, rhs, op)
        if op not in _FLOAT_UFUNCS:
            raise NotImplementedError(f"tests/conftest.py: {op} on {lhs.dtype.scalar}")
        ty = lhs.dtype.scalar
        with np.errstate(all="ignore"):
            out = op(_decode(lhs.data, ty.name), _decode(rhs.data, rhs.dtype.scalar.name))
        if out.dtype == np.bool_:
            return TensorHandle(out, tl.int1)
        return TensorHandle(_encode(out, ty.name), ty)

    Builder.binary_op = binary_op

    orig_ternary = _expect(Builder, "ternary_op", ["self", "lhs", "rhs", "other", "op"])

    def ternary_op(self, lhs, rhs, other, op):  # np.where selects bits and is fine as shipped
        if op is np.clip and is_emulated(other):
            ty = other.dtype.scalar
            out = np.clip(*(_decode(h.data, h.dtype.scalar.name) for h in (lhs, rhs, other)))
            return TensorHandle(_encode(out, ty.name), ty)
        return orig_ternary(self, lhs, rhs, other, op)

    Builder.ternary_op = ternary_op

    orig_fma = _expect(Builder, "create_fma", ["self", "x", "y", "z"])

    def create_fma(self, x, y, z):
        if not is_emulated(z):
            return orig_fma(self, x, y, z)
        ty = z.dtype.scalar
        out = _decode(x.data, ty.name) * _decode(y.data, ty.name) + _decode(z.data, ty.name)
        return TensorHandle(_encode(out, ty.name), ty)

    Builder.create_fma = create_fma

    # Reductions and scans on bf16 summed the uint16 patterns too. (max/min/argmax promote bf16 to
    # fp32 in triton.language and never get here with bf16; fp8/bf16 sums are rounded once, the
    # GPU rounds every partial sum: close, not bit-exact.)
    def _float_reduce(owner, name, compute, scan):
        orig = _expect(owner, name, ["self", "input"])

        def patched(self, input):
            if not is_emulated(input.handle):
                return orig(self, input)
            out = compute(self, _decode(input.handle.data, input.dtype.name))
            result = self.to_tensor(_encode(np.asarray(out), input.dtype.name), input.dtype)
            return [result] if scan else result  # scans return a list, as shipped

        setattr(owner, name, patched)

    _float_reduce(interp.ReduceOps, "sum", lambda self, x: np.sum(x, axis=self.axis, keepdims=self.keep_dims), False)
    _float_reduce(interp.ScanOps, "cumsum", lambda self, x: np.cumsum(x, axis=self.axis), True)
    _float_reduce(interp.ScanOps, "cumprod", lambda self, x: np.cumprod(x, axis=self.axis), True)

    # -- 4. libdevice: the builder raises on extern_elementwise, the stub module (the import
    # kernels use, resolved to the CUDA module only by the GPU compiler) returns None, and the
    # CUDA module's builtins get no _semantic from the interpreter. Map symbols to numpy.
    _expect(Builder, "create_extern_elementwise",
            ["self", "libName", "libPath", "symbol", "argList", "retType", "isPure"])

    def create_extern_elementwise(self, libName, libPath, symbol, argList, retType, isPure):
        fn = _libdevice_fn(symbol)
        args = [h.data.astype(np.float64) if h.data.dtype.kind == "f" else h.data for h in argList]
        with np.errstate(all="ignore"):
            out = np.asarray(fn(*args))
            return TensorHandle(out.astype(interp._get_np_dtype(retType)), retType.scalar)

    Builder.create_extern_elementwise = create_extern_elementwise

    def with_semantic(fn):
        @functools.wraps(fn)
        def call(*args, _semantic=None, **kwargs):
            return fn(*args, _semantic=_semantic or interp.interpreter_semantic, **kwargs)
        return call

    names = [n for n, f in vars(cuda_libdevice).items() if getattr(f, "__triton_builtin__", False)]
    assert "tanh" in names and "rint" in names, "triton.language.extra.cuda.libdevice changed"
    for n in names:
        wrapped = with_semantic(getattr(cuda_libdevice, n))
        setattr(cuda_libdevice, n, wrapped)
        if callable(getattr(stub_libdevice, n, None)):
            stub = functools.wraps(wrapped)(lambda *a, _w=wrapped, **k: _w(*a, **k))
            stub.__module__ = stub_libdevice.__name__  # the JIT ignores this module's stubs
            setattr(stub_libdevice, n, stub)

    # -- 5. autotune: several configs are benchmarked, which needs a GPU driver. Report every
    # config as equally fast: Autotuner.run still calls prune_configs (the kernels' prune
    # functions run) and min() then keeps the first remaining config.
    _expect(autotuner.Autotuner, "_bench", ["self", "args", "config", "meta"])
    autotuner.Autotuner._bench = lambda self, *args, config, **meta: [0.0, 0.0, 0.0]

    _install_interpreter_speedups(tl, interp)


def _install_interpreter_speedups(tl, interp) -> None:
    """Pure speed-ups of Triton 3.6's interpreter; what the kernels compute is unchanged.

    * Every call of a @triton.jit device function (and every element a tl.reduce / argmax-style
      combine function folds, one call each) re-ran _patch_lang: inspect.getmembers over
      triton.language, its tensor and math modules to wrap each builtin, which after the
      kernel launch's own patch finds nothing left to wrap and re-sets equivalent attributes.
      That was ~25 % of an interpreted test's time. Within one launch the patch now runs once per
      set of language modules a function sees (the launch's own scope still restores it all).
    * _get_np_dtype built its 17-entry dict on every call (~0.25 M calls in a big test): the
      answer for each scalar dtype is now remembered.
    """
    import inspect as _inspect

    orig_patch_lang = _expect(interp, "_patch_lang", ["fn"])
    orig_grid_call = _expect(interp.GridExecutor, "__call__", ["self", "args_dev", "kwargs"])
    assert hasattr(interp, "_LangPatchScope"), "tests/conftest.py: interpreter._LangPatchScope is gone"
    langs_of = (tl, tl.core)
    state = {"patched": None}  # ids of the language modules patched in the running launch

    def grid_call(self, *args_dev, **kwargs):
        outer = state["patched"]
        state["patched"] = set()
        try:
            return orig_grid_call(self, *args_dev, **kwargs)
        finally:
            state["patched"] = outer

    def patch_lang(fn):
        patched = state["patched"]
        langs = {id(v) for v in fn.__globals__.values() if _inspect.ismodule(v) and v in langs_of}
        if patched is None:  # outside a launch: as shipped
            return orig_patch_lang(fn)
        if langs and langs <= patched:  # already patched in this launch: nothing to do
            return interp._LangPatchScope()
        scope = orig_patch_lang(fn)
        patched |= langs
        return scope

    interp.GridExecutor.__call__ = grid_call
    interp._patch_lang = patch_lang

    orig_np_dtype = _expect(interp, "_get_np_dtype", ["tt_dtype"])
    u64, scalar_np = np.dtype(np.uint64), {}

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.pointer_type):
            return u64
        if isinstance(tt_dtype, tl.block_type):
            if isinstance(tt_dtype.element_ty, tl.pointer_type):
                return u64
            tt_dtype = tt_dtype.element_ty
        got = scalar_np.get(tt_dtype)
        if got is None:
            got = scalar_np[tt_dtype] = orig_np_dtype(tt_dtype)
        return got

    interp._get_np_dtype = get_np_dtype

    # tl.reduce with a combine function the interpreter does not know folds element by element in
    # Python (generic_reduce: a device-function call per element). The NaN-propagating max of
    # quant/ (_max_nan: tl.maximum(a, b, propagate_nan=ALL), the interpreter's np.maximum) over
    # native float data is folded here with the same np.maximum, in the same order along the
    # axis, a whole slice at a time: the same bits (tests/test_interpreter.py compares them).
    orig_apply = _expect(interp.ReduceOps, "apply_impl", ["self", "input"])
    nan_max_combines = {("openmla.quant.int8", "_max_nan"), ("openmla.quant.mla_writer", "_max_nan")}

    def fold_nan_max(self, input):
        original_axis = self.axis
        (x,), axis = self.unravel(input, self.axis)
        data = x.handle.data
        acc = np.take(data, 0, axis=axis)
        for i in range(1, data.shape[axis]):
            acc = np.maximum(acc, np.take(data, i, axis=axis))
        acc = np.asarray(acc, dtype=data.dtype)
        if self.keep_dims:  # as generic_reduce packs its result
            if original_axis is not None:
                acc = np.expand_dims(acc, axis)
            else:
                for _ in range(data.ndim):
                    acc = np.expand_dims(acc, 0)
        elif original_axis is None:
            acc = acc.item()
        return [self.to_tensor(acc, input[0].dtype)]

    def apply_impl(self, input):
        fn = getattr(self.combine_fn, "fn", None)
        if (len(input) == 1 and (getattr(fn, "__module__", None), getattr(fn, "__name__", None)) in nan_max_combines
                and input[0].handle.data.dtype.kind == "f"):
            return fold_nan_max(self, input)
        return orig_apply(self, input)

    interp.ReduceOps.apply_impl = apply_impl

    # Integer +, - and * check for overflow by recomputing in int64 and handing the bounds test to
    # device_assert, which does nothing unless the options' debug is set; the interpreter's options
    # never set it (InterpreterOptions()), so the check built ~10 tensors per integer op only to
    # drop them. Skipped while debug is off.
    from triton.language.semantic import TritonSemantic
    orig_sanitize = _expect(TritonSemantic, "binary_op_sanitize_overflow_impl", ["self", "lhs", "rhs", "binary_op"])
    assert interp.InterpreterOptions().debug is False, "tests/conftest.py: the interpreter's debug default changed"

    def sanitize_overflow(self, lhs, rhs, binary_op):
        if not self.builder.options.debug:
            return None
        return orig_sanitize(self, lhs, rhs, binary_op)

    TritonSemantic.binary_op_sanitize_overflow_impl = sanitize_overflow


if INTERPRET:
    import triton

    if not triton.knobs.runtime.interpret:
        raise pytest.UsageError("tests/conftest.py: TRITON_INTERPRET=1 but Triton does not interpret")
if FIX_INTERPRETER:
    _install_interpreter_fixes()


@pytest.fixture(scope="session", autouse=True)
def _cpu_defaults_under_interpreter():
    """Under the interpreter, tensors made without a device or dtype are CPU fp32 (the interpreter
    runs on host memory). None, not "cpu": a "cpu" device context would wrap every torch call."""
    if INTERPRET:
        torch.set_default_device(None)
        torch.set_default_dtype(torch.float32)
        assert torch.empty(0).device.type == "cpu"
    yield


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    """Each test draws the same random data whichever tests run before it."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


# ----------------------------------------------------------------------------------------------
# pytest-xdist (the README's `-n auto --dist loadfile`): hand the ahead-of-time compile module
# out first. xdist hands out the files with the most tests first; that module has few tests, but
# its fixture keeps both cores busy for minutes (one child process per core): handed out late,
# it ran alone at the end of the run while the other worker sat idle.
# ----------------------------------------------------------------------------------------------
FIRST_FILES = ("tests/kernels/test_aot_compile.py",)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FirstFilesFirst(LoadFileScheduling):
        def _assign_work_unit(self, node):
            for scope in reversed(FIRST_FILES):
                if scope in self.workqueue:
                    self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return FirstFilesFirst(config, log)
