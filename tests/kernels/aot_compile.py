"""Ahead-of-time compiles of every kernel for a GPU this machine does not have (no GPU needed:
Triton ships ptxas, and its AMD backend links in-process).

How a compile job is found: the public ops are called on small CPU tensors for the standard shape
classes (`aot_cases.py`) inside `kernels.device.assume(arch)`, so their dispatch picks what it
would pick on that GPU (Gluon or Triton, e4m3 path, block shapes, split counts); the launches are
captured instead of run (`JITFunction.run` and `Autotuner.run` patched in this process only).
An autotuned launch yields every config its own prune function keeps for that GPU (or, in the
default set, the first: what runs without benchmarking). Each captured launch is then bound the
way Triton binds a real one (same signature, constexprs and alignment attributes) and compiled
for the target down to the binary (cubin / hsaco).

Run by tests/kernels/test_aot_compile.py in a child process, because the interpreter
(TRITON_INTERPRET=1, the CPU test suite's setting) replaces @triton.jit functions at import time:
    python -m tests.kernels.aot_compile sm_80 --out results.jsonl [--full]
writes one JSON line per compile (and per case whose dispatch raised) and a last line listing the
kernels found in kernels/ and quant/ (stdout gets what Triton prints about a failed compile).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import pkgutil
import re
import sys
import tempfile
import time
import traceback

import triton
from triton.compiler import ASTSource, make_backend
from triton.runtime.autotuner import Autotuner, Heuristics
from triton.runtime.jit import JITFunction, create_function_from_signature

PACKAGES = ("openmla.kernels", "openmla.quant")


def kernel_name(fn) -> str:
    return f"{fn.__module__}.{fn.__name__}"


def discover_kernels() -> dict:
    """Every kernel entry point in kernels/ and quant/: module-level @triton.jit / @gluon.jit
    objects named *_kernel (the rest are device functions they call), name -> is_gluon."""
    found = {}
    for pkg_name in PACKAGES:
        pkg = importlib.import_module(pkg_name)
        mods = [pkg] + [importlib.import_module(m.name)
                        for m in pkgutil.walk_packages(pkg.__path__, pkg_name + ".")]
        for mod in mods:
            for name, obj in vars(mod).items():
                while isinstance(obj, (Autotuner, Heuristics)):
                    obj = obj.fn
                if isinstance(obj, JITFunction) and name.endswith("_kernel") \
                        and obj.__module__ == mod.__name__:
                    found[kernel_name(obj)] = obj.is_gluon()
    return found


class Capture:
    """Records kernel launches instead of running them (within the `with` block)."""

    def __init__(self, all_configs: bool):
        self.all_configs = all_configs
        self.launches = []  # (fn, args, kwargs, case)
        self.case = None

    def _jit_run(self, fn, args, kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
        self.launches.append((fn, args, kwargs, self.case))

    @contextlib.contextmanager
    def __call__(self):
        capture = self
        jit_run, tuner_run = JITFunction.run, Autotuner.run

        def run_jit(fn, *args, **kwargs):
            capture._jit_run(fn, args, kwargs)

        def run_tuner(tuner, *args, **kwargs):
            tuner.nargs = dict(zip(tuner.arg_names, args))
            configs = tuner.prune_configs(kwargs) if len(tuner.configs) > 1 else tuner.configs
            for config in (configs if capture.all_configs else configs[:1]):
                tuner.fn.run(*args, **kwargs, **config.all_kwargs())
            tuner.nargs = None

        # (@triton.heuristics wrappers fill in their constexprs and call the patched run).
        # FastLaunch (kernels/launch.py) reads the CUDA device and caches compiled kernels: it
        # launches as `kernel[grid](...)` here, which is what it stands for.
        from openmla.kernels.launch import FastLaunch
        fast_call, fast_keyed = FastLaunch.__call__, FastLaunch.keyed

        def run_fast(fast, grid, *args, **kwargs):
            fast.kernel[grid](*args, **kwargs)

        def run_keyed(fast, key, grid, *args, **kwargs):
            fast.kernel[grid](*args, **kwargs)

        JITFunction.run, Autotuner.run = run_jit, run_tuner
        FastLaunch.__call__, FastLaunch.keyed = run_fast, run_keyed
        try:
            yield self
        finally:
            JITFunction.run, Autotuner.run = jit_run, tuner_run
            FastLaunch.__call__, FastLaunch.keyed = fast_call, fast_keyed


def bind(fn, args, kwargs, target):
    """(source, options) of a captured launch, bound as JITFunction.run binds a real one."""
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = {"debug": False, **kwargs}
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization,
                                                         options)
    if fn.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource as source_type
    else:
        source_type = ASTSource
    return source_type(fn, signature, constexprs, attrs), options


def _describe(src, options) -> dict:
    """The constexprs and launch options that tell two compiles of one kernel apart."""
    consts = {src.fn.arg_names[k[0]]: v for k, v in src.constants.items() if len(k) == 1}
    opts = {k: getattr(options, k) for k in ("num_warps", "num_stages", "maxnreg")
            if getattr(options, k, None) is not None}
    return {k: (v if isinstance(v, (bool, int, float, str)) else repr(v))
            for k, v in {**consts, **opts}.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("arch", help="a name of kernels.device.ARCHES, e.g. sm_80 or gfx942")
    ap.add_argument("--out", required=True, help="file to write the JSON lines to")
    ap.add_argument("--cases", default="", help="only the cases whose id matches this regex")
    ap.add_argument("--full", action="store_true",
                    help="every shape class and every autotune candidate (default: a subset)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("run without TRITON_INTERPRET=1: the interpreter replaces the kernels")
    os.environ["OPENMLA_AUTOTUNE"] = "1"  # the prune functions keep every candidate

    from openmla.kernels import device
    from tests.kernels.aot_cases import cases

    out = open(args.out, "w")

    def emit(line):
        out.write(json.dumps(line) + "\n")
        out.flush()

    arch = device.ARCHES[args.arch]
    target = arch.target()
    capture = Capture(all_configs=args.full)
    # On sm_90 the cases run twice: with the Gluon kernels, and as OPENMLA_SM90_GLUON=0 runs them
    passes = [""] + ([" [OPENMLA_SM90_GLUON=0]"] if arch.gluon_sm90 else [])
    for suffix in passes:
        if suffix:
            os.environ["OPENMLA_SM90_GLUON"] = "0"
        with capture(), device.assume(arch):
            for case_id, run in cases(args.full, arch.name):
                if not re.search(args.cases, case_id):
                    continue
                capture.case = case_id + suffix
                try:
                    run()
                except Exception:  # a dispatch that fails for this GPU is a finding, not a crash
                    emit(dict(kernel=None, case=capture.case, ok=False,
                              error=traceback.format_exc()[-3000:]))

    seen = set()
    for fn, a, kw, case_id in capture.launches:
        line = dict(kernel=kernel_name(fn), case=case_id)
        t0 = time.time()
        try:
            src, options = bind(fn, a, kw, target)
            key = (line["kernel"], repr(src.signature), repr(sorted(src.constants.items())),
                   repr(sorted(src.attrs.items())), repr(sorted(options.__dict__.items())))
            if key in seen:
                continue
            seen.add(key)
            line["config"] = _describe(src, options)
            k = triton.compile(src, target=target, options=options.__dict__)
            line.update(ok=True, shared=k.metadata.shared, seconds=round(time.time() - t0, 2))
        except Exception:
            line.update(ok=False, error=traceback.format_exc()[-3000:])
        emit(line)
    emit(dict(kernels=discover_kernels(), smem_bytes=arch.smem_bytes))
    out.close()
    return 0


if __name__ == "__main__":
    # a fresh cache: every run compiles (and the user's cache gets no foreign targets)
    with tempfile.TemporaryDirectory() as cache_dir:
        os.environ["TRITON_CACHE_DIR"] = cache_dir
        sys.exit(main())
