"""Kernel launches at the lowest host cost Triton allows.

`kernel[grid](*args, **constexprs)` binds and specializes every argument in Python on every call
(tens of microseconds for a kernel with twenty arguments) before it reaches the compiled
launcher. A decode step calls the same kernels with the same shapes thousands of times, so
`FastLaunch` keeps, per call signature, the compiled kernel and the order of its parameters, and
from then on calls the compiled launcher directly.

The call signature is the key: each tensor's dtype and whether its address is 16-byte aligned,
each int's exact value, each other argument's type, the keyword arguments (constexprs and launch
options), and the device. Triton specializes a kernel on tensor alignment and on int values
(== 1, divisibility by 16, width), so two calls with equal keys need the same compiled kernel;
keying on the exact int values is stricter than Triton, never looser. The first call of a key goes
through Triton's own path (compile, autotune) and records what it launched.

Not cached (each call goes through Triton's path): the interpreter, autotuned kernels whose chosen
config has pre/post hooks, and launches while a launch hook is installed (profilers).
"""
from __future__ import annotations

import torch
from triton import knobs

try:
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # a Triton without the interpreter
    InterpretedFunction = None

__all__ = ["BoundLaunch", "FastLaunch", "cdiv", "next_pow2"]


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host ints: what triton.cdiv returns, without its constexpr-function
    wrapper (about 3 us a call on the host; this costs ~0.1 us)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): triton.next_power_of_2 for host ints,
    without its wrapper's cost."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()

_MAX_ENTRIES = 4096


def _call_key(args) -> tuple:
    key = []
    for a in args:
        t = type(a)
        if t is int:
            key.append(a)
        elif isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() & 15 == 0))
        elif t is bool or a is None:
            key.append((t, a))
        else:
            key.append(t)
    return tuple(key)


def _hooked() -> bool:
    """A launch hook is installed (Triton 3.6 keeps an always-present, usually empty chain)."""
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


# The current CUDA stream's handle, as Triton's own launcher reads it (torch.cuda.current_stream()
# builds a Python Stream object per call), and the current device's index (what
# torch.cuda.current_device() returns after its initialisation check; a launch on CUDA tensors
# has initialised CUDA).
_raw_stream = torch._C._cuda_getCurrentRawStream if hasattr(torch._C, "_cuda_getCurrentRawStream") else None
_current_device = (torch._C._cuda_getDevice if hasattr(torch._C, "_cuda_getDevice")
                   else torch.cuda.current_device)


class FastLaunch:
    """`FastLaunch(kernel)(grid, *args, **kwargs)` launches like `kernel[grid](*args, **kwargs)`.

    `kernel` is a `@triton.jit` / Gluon kernel or a `triton.autotune` wrapper of one; `grid` a
    tuple of 1 to 3 ints. Positional `args` are the kernel's leading parameters; constexprs and
    launch options (num_warps, ...) go in `kwargs`, as with `kernel[grid]`."""

    def __init__(self, kernel):
        self.kernel = kernel
        fn = kernel
        while not hasattr(fn, "arg_names"):  # autotune / heuristics wrappers
            fn = fn.fn
        self._names = fn.arg_names
        # TRITON_INTERPRET=1 at the kernel's definition made it an interpreted function, which
        # has no compiled launcher: every call goes through Triton's path
        inner = kernel
        while InterpretedFunction is not None and not isinstance(inner, InterpretedFunction) \
                and hasattr(inner, "fn"):  # through autotune / heuristics wrappers
            inner = inner.fn
        self._interpreted = InterpretedFunction is not None and isinstance(inner, InterpretedFunction)
        self._cache: dict = {}

    def __call__(self, grid, *args, **kwargs):
        if self._interpreted or _hooked():
            self.kernel[grid](*args, **kwargs)
            return
        device = _current_device()
        key = (device, _call_key(args), tuple(kwargs.items()))
        try:
            hit = self._cache.get(key)
        except TypeError:  # an unhashable keyword value: Triton's path
            self.kernel[grid](*args, **kwargs)
            return
        self._launch(hit, key, device, grid, args, kwargs)

    def keyed(self, key, grid, *args, **kwargs):
        """As a call, with the caller's `key` in place of the one built from the arguments (which
        costs about half a microsecond an argument). The caller guarantees that equal keys mean
        equal specializations: its key must determine every int argument's value, every tensor's
        dtype and 16-byte alignment, and the keyword arguments; a float may vary."""
        if self._interpreted or _hooked():
            self.kernel[grid](*args, **kwargs)
            return
        device = _current_device()
        key = (device, key)
        self._launch(self._cache.get(key), key, device, grid, args, kwargs)

    def cached(self, key):
        """(call, head, fill, device) of what `keyed(key, ...)` cached for the current device, or
        None (nothing cached yet: the interpreter, a launch hook, Triton's path kept)."""
        if self._interpreted or not self._cache or _hooked():
            return None
        device = _current_device()
        hit = self._cache.get((device, key))
        return None if hit is None else (*hit, device)

    def _launch(self, hit, key, device, grid, args, kwargs):
        if hit is None:
            self._first_launch(key, grid, args, kwargs)
            return
        call, head, fill = hit
        n = len(grid)
        call(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _raw_stream(device), *head,
             *args, *fill)

    def _first_launch(self, key, grid, args, kwargs):
        compiled = self.kernel.run(*args, grid=grid, warmup=False, **kwargs)
        if hasattr(self.kernel, "configs"):  # triton.autotune: the config it chose
            config = getattr(self.kernel, "best_config", None)
            if config is None or config.pre_hook is not None or getattr(config, "post_hook", None):
                return
            kwargs = {**kwargs, **config.kwargs}
        if hasattr(compiled, "result"):
            compiled = compiled.result()
        # the parameters after the positional ones, in signature order: constexprs and any
        # argument passed by keyword (every parameter has a value: Triton has just bound them)
        constants = compiled.src.constants
        fill = []
        for i, name in enumerate(self._names[len(args):], start=len(args)):
            if name in kwargs:
                fill.append(kwargs[name])
            elif (i,) in constants:
                fill.append(constants[(i,)])
            else:
                return  # a default the kernel's signature supplies: leave it to Triton's path
        compiled._init_handles()
        if len(self._cache) >= _MAX_ENTRIES:  # shapes that never repeat: start over
            self._cache.clear()
        self._cache[key] = _launcher(compiled) + (tuple(fill),)


def _launcher(compiled) -> tuple:
    """(call, head): `call(gx, gy, gz, stream, *head, *kernel_args)` launches `compiled`. For
    Triton 3.6's CUDA launcher without scratch memory, its C launch function itself (its Python
    wrapper only allocates scratch and passes its own flags); otherwise the wrapper."""
    run = compiled.run
    if (type(run).__name__ == "CudaLauncher" and not run.global_scratch_size
            and not run.profile_scratch_size and hasattr(run, "launch")):
        return run.launch, (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None,
                            None, compiled.packed_metadata, None, None, None)
    return run, (compiled.function, compiled.packed_metadata, None, None, None)


class BoundLaunch:
    """`BoundLaunch(fast, key, grid, **kwargs)(*args)` is `fast.keyed(key, grid, *args, **kwargs)`
    for a caller that launches one kernel with one grid, constexprs and key over and over (a
    decode step's layers): after the first launch has compiled and cached the kernel, later calls
    go straight to the compiled launcher, skipping even the cache lookup. The caller's promise is
    `keyed`'s: equal keys, equal specializations (its key fixes every int argument, every
    tensor's dtype and 16-byte alignment). Calls on another device than the first, or while a
    launch hook is installed, take `keyed`'s path."""

    def __init__(self, fast: FastLaunch, key, grid, **kwargs):
        self._fast, self._key, self._grid, self._kwargs = fast, key, tuple(grid), kwargs
        g = self._grid + (1,) * (3 - len(self._grid))
        self._g0, self._g1, self._g2 = g
        self._entry = None  # (call, head, fill, device) once the kernel is compiled and cached

    def __call__(self, *args):
        if self.try_launch(*args):
            return
        self._fast.keyed(self._key, self._grid, *args, **self._kwargs)
        if self._entry is None:
            self._entry = self._fast.cached(self._key)

    def try_launch(self, *args) -> bool:
        """The compiled launcher's call, when a call now goes straight to it (False, and nothing
        launched, otherwise: before the first call, under a launch hook, on another device).
        Unlike Triton's path it also takes a pointer argument as an int (a data_ptr() the caller
        keeps valid by holding the tensor): the launcher then skips that argument's data_ptr()
        call and its cuPointerGetAttribute check (a decode step's layers pass their fixed step
        buffers so, and fall back to `self(*tensors)` when this says False)."""
        e = self._entry
        if e is None or _hooked() or _current_device() != e[3]:
            return False
        call, head, fill, device = e
        call(self._g0, self._g1, self._g2, _raw_stream(device), *head, *args, *fill)
        return True
