#!/usr/bin/env python3
"""Benchmarks: a registry of ops and named shape sets (STYLE.md 14).

For every case: build random inputs (never zeros), check the op against the fp32 oracle on a
slice of the tokens, then time the op and a torch reference (gather + matmul in bf16, SDPA for
the MHA path) as the median of CUDA-graph replays (`triton.testing.do_bench_cudagraph`: kernel
time, no host overhead), and report bytes/s and FLOP/s against the copy bandwidth and
bf16 matmul rate measured in the same run. `--timing flushed` times each call alone after an 8 GB
memset instead, the regime of FlashMLA's own perf tests (kernelkit's bench_kineto), where the
GPU's clocks recover between calls: compute-bound kernels run 5-15 % faster there than in
back-to-back replays (H200, docs/benchmarks.md), so compare numbers of one regime only.

Eager time (`eager ms`): the wall time per call of back-to-back eager calls with one synchronize
at the end (300 calls, fewer where the kernel is long: the count is recorded), median of 5 repeats:
what a call costs an engine that does not capture graphs, host overhead (validation, dispatch,
launches, allocations) included. Ops run as engines replay them from a CUDA graph (the 61-layer
decode step, tools/_bench_step.py) also report `captured ms`: the wall time per call of that
replay, host work before it included, timed as eager ms.

FlashMLA (`FlashMLA ms`, `ratio` = ms / FlashMLA ms): ops with a FlashMLA counterpart (sparse
decode over the fp8 cache, sparse prefill) also time `flash_mla` in the same process on the same
tensors, CUDA-graph replay and eager, when it is importable (tools/_bench_peer.py; install with
`. tools/flashmla_peer.sh`), and report how far its outputs are from openmla's (max abs
difference of out and lse) and from the oracle. Without it those columns say "not measured".

    PYTHONPATH=. python3 tools/bench.py --op sparse_mla_decode --shapes standard --out decode.json
    PYTHONPATH=. python3 tools/bench.py --op all --compare old.json
    python tools/bench.py --shapes small      # no GPU: Triton interpreter, timings meaningless
    PYTHONPATH=. python3 tools/bench.py --op sparse_mla_decode --paths both   # Hopper: Gluon and Triton kernels

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1 is set here) and
only the `small` shape sets are accepted; eager times are not measured there unless
--eager-calls asks. The interpreter computes some things silently wrong
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
from openmla.tools._bench_core import GPU, REGISTRY, Case, NotMeasured, Op, Peer, register, rel_l2  # noqa: E402,F401  (re-exported)
# The op entries: each module registers its ops on import.
from openmla.tools import _bench_mla  # noqa: E402,F401
from openmla.tools import _bench_mla_v4  # noqa: E402,F401
from openmla.tools import _bench_mha  # noqa: E402,F401
from openmla.tools import _bench_step  # noqa: E402,F401
from openmla.tools import _bench_indexer  # noqa: E402,F401
from openmla.tools import _bench_indexer_step  # noqa: E402,F401
from openmla.tools import _bench_peer  # noqa: E402
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


# How kernel_time times (--timing): "graph", replays of a captured CUDA graph back to back; "flushed",
# FlashMLA's own regime (its tests' kernelkit.bench_kineto: an 8 GB memset before every call, which
# flushes L2 and leaves the GPU between calls on memory-bound work), each call timed alone.
KERNEL_TIMING = "graph"
FLUSH_CALLS = 30


def flushed_time(fn, calls: int = FLUSH_CALLS) -> float:
    """Median ms of fn timed alone after a memset of min(8 GB, a quarter of the free memory): CUDA
    events around each call. The memset (~2 ms) is still running when the host has enqueued the
    events and fn, so the host's work is hidden; the GPU's gaps between fn's kernels are counted."""
    free, _ = torch.cuda.mem_get_info()
    buf = torch.empty(min(int(8e9), free // 4) // 4, dtype=torch.int32, device="cuda")
    times = []
    for i in range(calls + 3):  # three calls to settle, not counted
        buf.zero_()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        fn()
        t1.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(t0.elapsed_time(t1))
    del buf
    return sorted(times)[len(times) // 2]


def kernel_time(fn) -> tuple[float, str]:
    """Median ms of fn's GPU work: replays of a captured CUDA graph, so host overhead (validation,
    dispatch, launches) is not counted, as DESIGN.md asks for kernel time. Falls back to plain
    do_bench (host overhead included) for code that cannot be captured, and says which was used.
    With KERNEL_TIMING "flushed": flushed_time, FlashMLA's regime."""
    from triton.testing import do_bench, do_bench_cudagraph
    fn()  # compile / autotune outside the capture
    if KERNEL_TIMING == "flushed":
        return flushed_time(fn), f"flushed (8 GB memset before each call, median of {FLUSH_CALLS})"
    try:
        return do_bench_cudagraph(fn, quantiles=[0.5]), "cuda-graph"
    except Exception as e:  # e.g. a host sync inside fn
        print(f"    (graph capture failed: {type(e).__name__}; timing eagerly)", file=sys.stderr)
        torch.cuda.synchronize()
        _reset_capture_state()
        return do_bench(fn, quantiles=[0.5]), "eager"


def _reset_capture_state() -> None:
    """A capture that failed part-way leaves torch's CUDA generator in its capture state, and the
    next random tensor of the run (the next case's inputs) raises "Offset increment outside graph
    capture encountered unexpectedly"; one complete capture, of a single add, resets it."""
    x = torch.zeros(1, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        x.add_(1)
    torch.cuda.synchronize()


EAGER_CALLS, EAGER_REPEATS = 300, 5
EAGER_BUDGET_MS = 500.0  # one repeat's target wall time: long kernels get fewer calls


def eager_time(fn, calls: int, repeats: int, kernel_ms: float = float("nan")) -> tuple[float, str]:
    """Wall time per call (ms) of `calls` eager calls back to back with one synchronize at the
    end, median of `repeats`, and how it was taken. Where the kernel alone takes longer than
    EAGER_BUDGET_MS / calls, fewer calls (at least 10) keep a repeat near that budget."""
    sync = torch.cuda.synchronize if GPU else (lambda: None)
    if math.isfinite(kernel_ms) and kernel_ms > 0:
        calls = max(min(calls, 10), min(calls, int(EAGER_BUDGET_MS / kernel_ms)))
    fn()  # compile / autotune / first-use work outside the timing
    sync()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / calls)
    return sorted(times)[len(times) // 2] * 1e3, f"eager, {calls} calls, one sync, median of {repeats}"


def _interpreter_autotune() -> None:
    """Under the interpreter, Triton 3.6's autotuner would time every config that pruning keeps,
    which needs a GPU driver. Report equal times: min() then keeps the first config the kernel's
    prune function keeps. This picks a config; it changes nothing a config computes."""
    from triton.runtime import autotuner
    if not hasattr(autotuner.Autotuner, "_bench"):
        raise RuntimeError("bench.py: triton.runtime.autotuner.Autotuner._bench is gone (Triton upgrade?); "
                           "the interpreter runs need a new way to skip config timing")
    autotuner.Autotuner._bench = lambda self, *args, config, **meta: [0.0, 0.0, 0.0]


def run_case(op: Op, params: dict, device, skip_ref: bool = False, peer: tuple = (None, "not requested"),
             eager: tuple[int, int] = (0, 0)) -> Case:
    """One case: build, check against the oracle, time (graph replay, eager when eager[0] > 0 calls,
    the torch reference), and time and compare the FlashMLA peer when the op has one.

    peer: (flash_mla module or None, why None) from _bench_peer.load; eager: (calls, repeats)."""
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
        case.extra.update(x.get("report", {}))  # what an op's check measured besides the error
        if not math.isfinite(case.rel_err) or case.rel_err > 2e-2:
            raise RuntimeError(f"{op.name} {case.name}: relative L2 error {case.rel_err:.3g} against the "
                               f"fp32 oracle; refusing to time a wrong result")
    else:
        case.extra["check"] = "n/a (interpreter)"
    del out
    if device.type == "cuda":
        case.ms, case.extra["timing"] = kernel_time(lambda: op.run(x))
    if eager[0] > 0:
        case.eager_ms, case.extra["eager_timing"] = eager_time(lambda: op.run(x), *eager, kernel_ms=case.ms)
    else:
        case.extra["eager_timing"] = "not measured (interpreter)" if device.type != "cuda" else "not measured"
    if op.captured is not None and device.type == "cuda" and eager[0] > 0:
        case.extra["captured_ms"], case.extra["captured_timing"] = eager_time(op.captured(x), *eager,
                                                                              kernel_ms=case.ms)
    if op.peer is not None:
        case.extra["peer"] = run_peer(case, op, x, peer, device, eager)
    if not skip_ref:
        if device.type == "cuda":
            case.ref_ms, case.extra["ref_timing"] = kernel_time(lambda: op.torch_ref(x))
        else:
            case.ref_ms, case.extra["ref_timing"] = _cpu_seconds(lambda: op.torch_ref(x), 3) * 1e3, "cpu, median of 3"
    del x
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return case


def run_peer(case: Case, op: Op, x: dict, peer: tuple, device, eager: tuple[int, int]) -> dict:
    """Time op.peer on the case's inputs (graph replay and eager, into case.peer_ms and
    case.peer_eager_ms) and compare its outputs with openmla's. Returns the record kept in
    case.extra["peer"]: status "measured", "not measured" or "failed", and why."""
    fm, why = peer
    rec = {"name": op.peer.name}
    if fm is None:
        return {**rec, "status": "not measured", "reason": why}
    try:
        px = op.peer.prepare(x, fm)
    except NotMeasured as e:
        return {**rec, "status": "not measured", "reason": str(e)}
    try:
        t0 = time.perf_counter()
        raw = op.peer.call(px)  # the first call also builds FlashMLA's scheduler metadata
        cpu_ms = (time.perf_counter() - t0) * 1e3
        rec.update(status="measured", version=_bench_peer.describe(fm), heads_run=_bench_peer.padded_to(px))
        rec.update(_bench_peer.compare(op.peer, x, px, raw, op.error))
        del raw
        if device.type == "cuda":
            case.peer_ms, rec["timing"] = kernel_time(lambda: op.peer.call(px))
        else:
            case.peer_ms, rec["timing"] = cpu_ms, "cpu, 1 run"
        if eager[0] > 0:
            case.peer_eager_ms, rec["eager_timing"] = eager_time(lambda: op.peer.call(px), *eager,
                                                                  kernel_ms=case.peer_ms)
    except Exception as e:  # the peer's failure is reported, openmla's numbers are kept
        rec = {**rec, "status": "failed", "reason": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
        case.peer_ms = case.peer_eager_ms = float("nan")
        print(f"    FlashMLA {op.peer.name} failed on {case.name}: {rec['reason']}", file=sys.stderr, flush=True)
    return rec


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


def _err(c: dict) -> str:
    """The check column: the relative error, or why there is none."""
    check = c.get("extra", {}).get("check", "oracle")
    return f"{c['rel_err']:.1e}" if check == "oracle" else check


def _ms(v: float, why: str = "not measured") -> str:
    return f"{v:.4f}" if math.isfinite(v) else why


PEER_HEADER = "FlashMLA ms | ratio | FlashMLA eager ms | max abs diff out / lse | FlashMLA rel err"


def _peer_cells(c: dict) -> str:
    """The FlashMLA columns of one case: its time, ms / FlashMLA ms, its eager time, max |openmla -
    FlashMLA| of out / lse, its error against the oracle; its status where it was not measured
    ('–' for an op without a FlashMLA counterpart)."""
    rec = c.get("extra", {}).get("peer")
    if rec is None:
        return " – | – | – | – | – |"
    if rec["status"] != "measured":
        return f" {rec['status']} |" * 5
    ratio = f"{c['ms'] / c['peer_ms']:.2f}" if math.isfinite(c["ms"]) and math.isfinite(c["peer_ms"]) else "–"
    return (f" {_ms(c['peer_ms'])} | {ratio} | {_ms(c.get('peer_eager_ms', float('nan')))} | "
            f"{rec['max_abs_out']:.1e} / {rec['max_abs_lse']:.1e} | {rec['peer_rel_err']:.1e} |")


def _row(c: dict, ceil: dict, eager: bool, peer: bool) -> str:
    """The numeric columns after the case name: ms, [eager ms], [FlashMLA columns], ref, ratio,
    bytes/s, FLOP/s, check ('–' where the case did not run)."""
    cols = f" {_ms(c['ms'], '–')} |"
    if eager:
        cols += f" {_ms(c.get('eager_ms', float('nan')))} |"
    if peer:
        cols += _peer_cells(c)
    if not math.isfinite(c["ms"]):
        return cols + f" – | – | – | – | – | – | {_err(c)} |"
    bps, fps = c["bytes"] / (c["ms"] * 1e-3), c["flops"] / (c["ms"] * 1e-3)
    speedup = f"{c['ref_ms'] / c['ms']:.1f}x" if math.isfinite(c["ref_ms"]) else "–"  # --no-ref: not timed
    return cols + (f" {_ms(c['ref_ms'], '–')} | {speedup} | {bps / 1e9:.0f} | "
                   f"{100 * bps / ceil['copy_bytes_per_s']:.0f}% | {fps / 1e12:.1f} | "
                   f"{100 * fps / ceil['bf16_matmul_flops']:.0f}% | {_err(c)} |")


def _header(first: str, eager: bool, peer: bool) -> list[str]:
    cols = first + " | ms |" + (" eager ms |" if eager else "") + (f" {PEER_HEADER} |" if peer else "") \
        + " torch ref ms | ref / ours | GB/s | % copy BW | TFLOP/s | % matmul | rel err |"
    return [cols, "|" + "---|" * (cols.count("|") - 1)]


def _peer_notes(cases: list[dict], flushed: bool = False) -> list[str]:
    """What the FlashMLA columns of one op's table are: the peer measured in this run, or why not."""
    notes = []
    measured = [c["extra"]["peer"] for c in cases if c["extra"]["peer"]["status"] == "measured"]
    if measured:
        rec = measured[0]
        notes.append(f"FlashMLA ({rec['version']}, `{rec['name']}`) timed in the same run on the same tensors "
                     f"({'timed as openmla' if flushed else 'CUDA-graph replay'}; eager as for openmla); q padded to 64 or 128 heads "
                     "(FlashMLA's sm90 kernels), the padded call timed, only the real heads compared. ratio = "
                     "ms / FlashMLA ms (below 1: openmla faster). max abs diff: openmla against FlashMLA on "
                     "the same inputs; FlashMLA rel err: its relative L2 error against the fp32 oracle.")
    reasons = {}
    for c in cases:
        rec = c["extra"]["peer"]
        if rec["status"] != "measured":
            reasons.setdefault(f"{rec['status']}: {rec['reason']}", []).append(c["name"])
    for why, names in reasons.items():
        where = "every case" if len(names) == len(cases) else ", ".join(names)
        notes.append(f"FlashMLA {why} ({where}).")
    return notes


def report(result: dict) -> str:
    """Markdown for docs/benchmarks.md from a bench JSON: header, then one table per op, each with
    the device, date and command right above it. An op's table has the eager column when the run
    measured eager times and the FlashMLA columns when the op has a FlashMLA counterpart (runs
    older than those columns have neither)."""
    ceil = result["ceilings"]
    out = [f"{result['device']}, {result['date']}, torch {result['torch']}, triton {result['triton']}, "
           f"git {result['git']}. Copy bandwidth {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
           f"{ceil['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s (measured in the same run).",
           f"Command: `PYTHONPATH=. python3 {result['command']}`", ""]
    if result.get("warning"):
        out += [f"**{result['warning']}**", ""]
    caption = f"_{result['device']}, {result['date']}: `{result['command']}`_"
    ops = sorted({c["op"] for c in result["cases"]})
    flushed = result.get("timing") == "flushed"
    for op in ops:
        cases = [c for c in result["cases"] if c["op"] == op]
        eager = any("eager_ms" in c for c in cases)
        peer = any("peer" in c.get("extra", {}) for c in cases)
        out.append(f"### {op}\n")
        notes = []
        if flushed:
            notes.append("ms: FlashMLA's timing regime (--timing flushed): each call timed alone by CUDA events "
                         "after an 8 GB memset (L2 flushed, the GPU between calls on memory-bound work), median "
                         f"of {FLUSH_CALLS} calls; FlashMLA timed the same way.")
        if eager:
            notes.append(("" if flushed else "ms: CUDA-graph replay (kernel time). ") + "eager ms: wall time per "
                         "call of eager calls back to back, one synchronize at the end, host overhead included "
                         "(calls and repeats per case in the JSON).")
        if peer:
            notes += _peer_notes(cases, flushed)
        captured = [c for c in cases if "captured_ms" in c.get("extra", {})]
        if captured:
            notes.append("captured ms: wall time per step replayed from a CUDA graph as vLLM runs one (the "
                         "plan built eagerly, then the replay), timed as eager ms; against ms: " + ", ".join(
                             f"{c['name']} {c['extra']['captured_ms']:.4f} ms ({c['extra']['captured_ms'] / c['ms']:.2f}x, "
                             f"eager {c['eager_ms'] / c['ms']:.2f}x)" for c in captured) + ".")
        if notes:
            out.append(" ".join(notes) + "\n")
        out.append(caption + "\n")
        out += _header("| case", eager, peer)
        for c in cases:
            out.append(f"| {c['name']} |" + _row(c, ceil, eager, peer))
        out.append("")
    return "\n".join(out)


def table(cases: list[Case], ceil: dict) -> str:
    """The run's table on stdout: every case, with the eager and FlashMLA columns."""
    lines = _header("| op | case", True, True)
    for c in cases:
        lines.append(f"| {c.op} | {c.name} |" + _row(asdict(c), ceil, True, True))
    return "\n".join(lines)


# Ops whose dispatch runs Hopper Gluon kernels (kernels/*/sm90*.py): --paths both times them twice
GLUON_OPS = ("sparse_mla_decode", "sparse_mla_prefill", "flashmla_compat_decode", "sparse_mla_impl_decode",
             "sparse_mla_step")


def _paths(choice: str, op_name: str, device) -> tuple:
    """The kernel paths to time an op on: None (the dispatch's own) and/or "triton"."""
    from openmla.kernels.device import arch_of
    if choice == "gluon" or (choice == "both" and (op_name not in GLUON_OPS or device.type != "cuda"
                                                   or not arch_of(device).gluon_sm90)):
        return (None,)
    return ("triton",) if choice == "triton" else (None, "triton")


def _run_on_path(path, op, params, device, **kw) -> Case:
    """run_case, with OPENMLA_SM90_GLUON=0 for the "triton" path (read by the dispatch at each call)."""
    if path is None:
        return run_case(op, params, device, **kw)
    old = os.environ.get("OPENMLA_SM90_GLUON")
    os.environ["OPENMLA_SM90_GLUON"] = "0"
    try:
        c = run_case(op, params, device, **kw)
    finally:
        if old is None:
            del os.environ["OPENMLA_SM90_GLUON"]
        else:
            os.environ["OPENMLA_SM90_GLUON"] = old
    c.name += " [triton]"
    c.extra["path"] = "triton (OPENMLA_SM90_GLUON=0)"
    return c


def _print_case(c: Case, op: Op) -> None:
    line = f"  {c.op} {c.name}: {c.ms:.4f} ms, eager {_ms(c.eager_ms)}"
    if "captured_ms" in c.extra:
        line += f", captured {c.extra['captured_ms']:.4f}"
    if op.peer is not None:
        rec = c.extra["peer"]
        line += (f", FlashMLA {c.peer_ms:.4f} ms (eager {_ms(c.peer_eager_ms)}), max abs diff out "
                 f"{rec['max_abs_out']:.1e} lse {rec['max_abs_lse']:.1e}" if rec["status"] == "measured"
                 else f", FlashMLA {rec['status']}")
    print(line + f" (torch ref {c.ref_ms:.4f} ms), rel err {_err(asdict(c))}",
          file=sys.stderr if not GPU else sys.stdout, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", default="all", help=f"'all', or one or more (comma-separated) of {sorted(REGISTRY)}")
    ap.add_argument("--shapes", default=None, help="shape set name (standard, small, ...); default: standard "
                    "on a GPU, small without one")
    ap.add_argument("--heads", type=int, nargs="*", help="only these head counts")
    ap.add_argument("--no-ref", action="store_true", help="skip timing the torch reference")
    ap.add_argument("--eager-calls", type=int, default=None, metavar="N",
                    help=f"eager calls per repeat (default {EAGER_CALLS} on a GPU; 0 = no eager time, the "
                    "default without one: the interpreter takes seconds a call)")
    ap.add_argument("--eager-repeats", type=int, default=EAGER_REPEATS, metavar="N",
                    help=f"repeats of the eager loop, median reported (default {EAGER_REPEATS})")
    ap.add_argument("--no-peer", action="store_true", help="do not time FlashMLA even where it is importable")
    ap.add_argument("--paths", choices=("gluon", "triton", "both"), default="gluon",
                    help="on Hopper: the dispatch's own kernels (gluon, default), the portable Triton kernels "
                    "(OPENMLA_SM90_GLUON=0, what other GPUs run; cases named '... [triton]'), or both, one "
                    "after the other, for the ops with Gluon kernels")
    ap.add_argument("--timing", choices=("graph", "flushed"), default="graph",
                    help="kernel time as CUDA-graph replays back to back (default), or each call alone after "
                         "an 8 GB memset, FlashMLA's own regime (tests/kernelkit's bench_kineto)")
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
    eager_calls = args.eager_calls if args.eager_calls is not None else (EAGER_CALLS if GPU else 0)
    if eager_calls < 0 or args.eager_repeats < 1:
        ap.error(f"--eager-calls >= 0 and --eager-repeats >= 1, got {eager_calls} and {args.eager_repeats}")
    eager = (eager_calls, args.eager_repeats)
    global KERNEL_TIMING
    KERNEL_TIMING = args.timing
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
    peer = (None, "--no-peer") if args.no_peer else _bench_peer.load(GPU)
    if any(REGISTRY[n].peer is not None for n in names):
        print(f"# FlashMLA: {_bench_peer.describe(peer[0]) + ', timed in this run' if peer[0] else 'not measured: ' + peer[1]}",
              flush=True)
    cases = []
    for n in names:
        op = REGISTRY[n]
        for p in op.shape_sets[shapes]:
            if args.heads and p.get("heads") not in args.heads:
                continue
            for path in _paths(args.paths, n, device):
                c = _run_on_path(path, op, p, device, skip_ref=args.no_ref, peer=peer, eager=eager)
                _print_case(c, op)
                cases.append(c)
    print(table(cases, ceil))
    result = {
        "device": device_name, "date": datetime.date.today().isoformat(),
        "torch": torch.__version__, "triton": triton.__version__, "git": git_revision(),
        "command": " ".join(["tools/bench.py"] + (argv if argv is not None else sys.argv[1:])),
        "ceilings": ceil, "cases": [asdict(c) for c in cases],
        "eager": {"calls": eager[0], "repeats": eager[1]}, "timing": args.timing,
        "peer": {"module": _bench_peer.describe(peer[0])} if peer[0] else {"not_measured": peer[1]},
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
