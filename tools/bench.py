#!/usr/bin/env python3
"""Benchmarks: a registry of ops and named shape sets (STYLE.md 14).

For every case: build random inputs (never zeros), check the op against the fp32 oracle on a
slice of the tokens, then time the op and a torch reference (gather + matmul in bf16, SDPA for
the MHA path) as the median of CUDA-graph replays (`triton.testing.do_bench_cudagraph`: kernel
time, no host overhead), and report bytes/s and FLOP/s against the copy bandwidth and
bf16 matmul rate measured in the same run.

    PYTHONPATH=. python3 tools/bench.py --op sparse_mla_decode --shapes standard --out decode.json
    PYTHONPATH=. python3 tools/bench.py --op all --compare old.json
    python tools/bench.py --shapes small      # no GPU: Triton interpreter, timings meaningless

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1 is set here) and
only the `small` shape sets are accepted. The interpreter computes some things silently wrong
(bf16/fp8 tl.dot operands, float->bf16/fp8 rounding; tests/conftest.py corrects them for the
tests, tools do not use test code), so on a CPU an op's result is checked only where it does
not depend on those defects (each op's `interpreter_exact`); elsewhere the check reads
"n/a (interpreter)". The one change made to Triton here is that the autotuner, which would
time configs on a GPU driver, takes the first config its prune function keeps: that picks a
config, it never changes what a config computes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict

import torch


# Imported first: without a GPU it sets TRITON_INTERPRET=1, which must precede importing triton.
from openmla.tools._bench_core import GPU, REGISTRY, Case, Op, register, rel_l2  # noqa: E402,F401  (re-exported)
# The op entries: each module registers its ops on import.
from openmla.tools import _bench_mla  # noqa: E402,F401
from openmla.tools import _bench_mha  # noqa: E402,F401
from openmla.quant.kv_cache import quantize_fp8_per_tensor as fp8_per_tensor  # noqa: E402,F401  (tools/sweep.py)
from triton.runtime.errors import InterpreterError  # noqa: E402

CPU_WARNING = ("WARNING: no GPU: kernels ran in Triton's interpreter on the CPU. The times below "
               "measure the interpreter and the CPU, not the kernels: do not read them as speed.")


# --------------------------------------------------------------------------------------------
# Ceilings measured in the same run, and the timing loop
def measure_ceilings(device) -> dict:
    """Copy bandwidth (bytes read + written per second) and bf16 matmul FLOP/s, on random data."""
    if device.type != "cuda":  # the CPU's own, for the record (interpreter runs are not compared to it)
        a = torch.randn(1 << 24, dtype=torch.bfloat16)
        b = torch.empty_like(a)
        copy_s = _cpu_seconds(lambda: b.copy_(a), 5)
        x = torch.randn(512, 512, dtype=torch.bfloat16)
        mm_s = _cpu_seconds(lambda: x @ x, 5)
        return {"copy_bytes_per_s": 2 * a.numel() * 2 / copy_s, "bf16_matmul_flops": 2 * 512**3 / mm_s}
    from triton.testing import do_bench
    n = 1 << 29  # 1 GiB of bf16 per buffer: several times the L2
    a = torch.randn(n, device=device, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), quantiles=[0.5])
    copy_bps = 2 * a.numel() * a.element_size() / (ms * 1e-3)
    del a, b
    m = 8192
    x = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    y = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    ms = do_bench(lambda: x @ y, quantiles=[0.5])
    return {"copy_bytes_per_s": copy_bps, "bf16_matmul_flops": 2 * m**3 / (ms * 1e-3)}


def _cpu_seconds(fn, reps: int) -> float:
    """Median wall time of reps calls (CPU: no device to synchronize)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def kernel_time(fn) -> tuple[float, str]:
    """Median ms of fn's GPU work: replays of a captured CUDA graph, so host overhead (validation,
    dispatch, launches) is not counted, as DESIGN.md asks for kernel time. Falls back to plain
    do_bench (host overhead included) for code that cannot be captured, and says which was used."""
    from triton.testing import do_bench, do_bench_cudagraph
    fn()  # compile / autotune outside the capture
    try:
        return do_bench_cudagraph(fn, quantiles=[0.5]), "cuda-graph"
    except Exception as e:  # e.g. a host sync inside fn
        print(f"    (graph capture failed: {type(e).__name__}; timing eagerly)", file=sys.stderr)
        torch.cuda.synchronize()
        return do_bench(fn, quantiles=[0.5]), "eager"


def _interpreter_autotune() -> None:
    """Under the interpreter, Triton 3.6's autotuner would time every config that pruning keeps,
    which needs a GPU driver. Report equal times: min() then keeps the first config the kernel's
    prune function keeps. This picks a config; it changes nothing a config computes."""
    from triton.runtime import autotuner
    if not hasattr(autotuner.Autotuner, "_bench"):
        raise RuntimeError("bench.py: triton.runtime.autotuner.Autotuner._bench is gone (Triton upgrade?); "
                           "the interpreter runs need a new way to skip config timing")
    autotuner.Autotuner._bench = lambda self, *args, config, **meta: [0.0, 0.0, 0.0]


def run_case(op: Op, params: dict, device, skip_ref: bool = False) -> Case:
    flops, nbytes = op.count(params)
    case = Case(op=op.name, name=op.label(params), params=params, flops=flops, bytes=nbytes)
    x = op.build(params, device)
    if device.type == "cuda":
        out = op.run(x)
        check = True
    else:  # interpreter: one run is both the check and the (meaningless) time
        check = op.interpreter_exact(params)
        t0 = time.perf_counter()
        try:
            out = op.run(x)
        except InterpreterError as e:
            if check:
                raise
            # e.g. libdevice calls, which Triton 3.6's interpreter does not implement
            case.extra["check"] = f"not run (the interpreter raised {str(e).split('(')[0]})"
            return case
        case.ms, case.extra["timing"] = (time.perf_counter() - t0) * 1e3, "interpreter, 1 run"
    if check:
        case.rel_err = op.error(x, out)
        case.extra["check"] = "oracle"
        if not math.isfinite(case.rel_err) or case.rel_err > 2e-2:
            raise RuntimeError(f"{op.name} {case.name}: relative L2 error {case.rel_err:.3g} against the "
                               f"fp32 oracle; refusing to time a wrong result")
    else:
        case.extra["check"] = "n/a (interpreter)"
    if device.type == "cuda":
        case.ms, case.extra["timing"] = kernel_time(lambda: op.run(x))
    if not skip_ref:
        if device.type == "cuda":
            case.ref_ms, case.extra["ref_timing"] = kernel_time(lambda: op.torch_ref(x))
        else:
            case.ref_ms, case.extra["ref_timing"] = _cpu_seconds(lambda: op.torch_ref(x), 3) * 1e3, "cpu, median of 3"
    del x
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return case


def git_revision() -> str:
    """OPENMLA_REV when set (a copied tree may carry a stale .git: the GPU machine's did), else
    the checkout's HEAD."""
    if os.environ.get("OPENMLA_REV"):
        return os.environ["OPENMLA_REV"]
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except Exception:  # not a git checkout (e.g. a copied tree on the GPU machine)
        return os.environ.get("OPENMLA_REV", "unknown")


# FlashMLA on the same GPU model (DESIGN.md, Performance): fp8 decode and bf16 prefill, ms.
FLASHMLA_MS = {
    ("sparse_mla_decode", "fp8", 128): {128: 0.187, 64: 0.117, 32: 0.117, 16: 0.117},
    ("sparse_mla_decode", "fp8", 32): {128: 0.067, 64: 0.051, 32: 0.051, 16: 0.051},
    ("sparse_mla_prefill", None, 4096): {128: 4.19, 64: 2.17, 32: 2.17, 16: 2.33},
}


def flashmla_ms(c: dict) -> float:
    p = c["params"]
    return FLASHMLA_MS.get((c["op"], p.get("cache"), p.get("tokens")), {}).get(p.get("heads"), float("nan"))


def _err(c: dict) -> str:
    """The check column: the relative error, or why there is none."""
    check = c.get("extra", {}).get("check", "oracle")
    return f"{c['rel_err']:.1e}" if check == "oracle" else check


def _row(c: dict, ceil: dict, flash: str = "") -> str:
    """The numeric columns after the case name: ms, [FlashMLA], ref, ratio, bytes/s, FLOP/s, check
    ('–' where the case did not run)."""
    if not math.isfinite(c["ms"]):
        return f" – |{flash} – | – | – | – | – | – | {_err(c)} |"
    bps, fps = c["bytes"] / (c["ms"] * 1e-3), c["flops"] / (c["ms"] * 1e-3)
    return (f" {c['ms']:.4f} |{flash} {c['ref_ms']:.4f} | {c['ref_ms'] / c['ms']:.1f}x | {bps / 1e9:.0f} | "
            f"{100 * bps / ceil['copy_bytes_per_s']:.0f}% | {fps / 1e12:.1f} | "
            f"{100 * fps / ceil['bf16_matmul_flops']:.0f}% | {_err(c)} |")


def report(result: dict) -> str:
    """Markdown for docs/benchmarks.md from a bench JSON: header, then one table per op, each with
    the device, date and command above it."""
    ceil = result["ceilings"]
    out = [f"{result['device']}, {result['date']}, torch {result['torch']}, triton {result['triton']}, "
           f"git {result['git']}. Copy bandwidth {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
           f"{ceil['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s (measured in the same run).",
           f"Command: `PYTHONPATH=. python3 {result['command']}`", ""]
    if result.get("warning"):
        out += [f"**{result['warning']}**", ""]
    caption = f"_{result['device']}, {result['date']}: `{result['command']}`_"
    ops = sorted({c["op"] for c in result["cases"]})
    for op in ops:
        cases = [c for c in result["cases"] if c["op"] == op]
        has_flash = any(math.isfinite(flashmla_ms(c)) for c in cases)
        out.append(f"### {op}\n")
        out.append(caption + "\n")
        out.append("| case | ms | FlashMLA ms | FlashMLA / ours | torch ref ms | ref / ours | GB/s | % copy BW "
                   "| TFLOP/s | % matmul | rel err |" if has_flash else
                   "| case | ms | torch ref ms | ref / ours | GB/s | % copy BW | TFLOP/s | % matmul | rel err |")
        out.append("|" + "---|" * (11 if has_flash else 9))
        for c in cases:
            fm = flashmla_ms(c)
            flash = f" {fm:.3f} | {fm / c['ms']:.2f}x |" if math.isfinite(fm) else " – | – |"
            out.append(f"| {c['name']} |" + _row(c, ceil, flash if has_flash else ""))
        out.append("")
    return "\n".join(out)


def table(cases: list[Case], ceil: dict) -> str:
    lines = ["| op | case | ms | torch ref ms | speedup vs ref | GB/s | % copy BW | TFLOP/s | % matmul | rel err |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        lines.append(f"| {c.op} | {c.name} |" + _row(asdict(c), ceil))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", default="all", help=f"'all', or one or more (comma-separated) of {sorted(REGISTRY)}")
    ap.add_argument("--shapes", default=None, help="shape set name (standard, small, ...); default: standard "
                    "on a GPU, small without one")
    ap.add_argument("--heads", type=int, nargs="*", help="only these head counts")
    ap.add_argument("--no-ref", action="store_true", help="skip timing the torch reference")
    ap.add_argument("--out", help="write JSON here")
    ap.add_argument("--compare", help="a previous JSON: print time ratios old/new")
    ap.add_argument("--report", metavar="JSON", help="print markdown for docs/benchmarks.md from a saved run; no GPU")
    args = ap.parse_args(argv)
    if args.report:
        with open(args.report) as f:
            print(report(json.load(f)))
        return 0
    shapes = args.shapes or ("standard" if GPU else "small")
    if not GPU and shapes != "small":
        ap.error(f"--shapes {shapes}: without a GPU only the 'small' shape sets run (Triton's interpreter)")
    names = sorted(REGISTRY) if args.op == "all" else args.op.split(",")
    for n in names:
        if n not in REGISTRY:
            ap.error(f"--op: expected 'all' or names from {sorted(REGISTRY)}, got {n!r}")
        if shapes not in REGISTRY[n].shape_sets:
            ap.error(f"--shapes: {n} has {sorted(REGISTRY[n].shape_sets)}, got {shapes!r}")
    import triton
    if GPU:
        device, device_name = torch.device("cuda"), torch.cuda.get_device_name()
    else:
        device, device_name = torch.device("cpu"), "cpu (Triton interpreter)"
        print(CPU_WARNING, file=sys.stderr, flush=True)
        _interpreter_autotune()
    ceil = measure_ceilings(device)
    print(f"# {device_name} | copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s | "
          f"bf16 matmul {ceil['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s", flush=True)
    if not GPU:
        print(f"# {CPU_WARNING}", flush=True)
    cases = []
    for n in names:
        op = REGISTRY[n]
        for p in op.shape_sets[shapes]:
            if args.heads and p.get("heads") not in args.heads:
                continue
            c = run_case(op, p, device, skip_ref=args.no_ref)
            print(f"  {c.op} {c.name}: {c.ms:.4f} ms (torch ref {c.ref_ms:.4f} ms), rel err {_err(asdict(c))}",
                  file=sys.stderr if not GPU else sys.stdout, flush=True)
            cases.append(c)
    print(table(cases, ceil))
    result = {
        "device": device_name, "date": datetime.date.today().isoformat(),
        "torch": torch.__version__, "triton": triton.__version__, "git": git_revision(),
        "command": " ".join(["tools/bench.py"] + (argv if argv is not None else sys.argv[1:])),
        "ceilings": ceil, "cases": [asdict(c) for c in cases],
    }
    if not GPU:
        result["warning"] = CPU_WARNING
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.compare:
        with open(args.compare) as f:
            old = {(c["op"], c["name"]): c for c in json.load(f)["cases"]}
        print("\n| op | case | old ms | new ms | old/new |\n|---|---|---|---|---|")
        for c in cases:
            o = old.get((c.op, c.name))
            if o:
                print(f"| {c.op} | {c.name} | {o['ms']:.4f} | {c.ms:.4f} | {o['ms'] / c.ms:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
