#!/usr/bin/env python3
"""Decode context parallelism (mla/cp.py) on N GPUs: one decode step at a long context, 1 vs N.

    python tools/bench_dcp.py --nproc 2 --out dcp2.json              # spawns 2 ranks (NCCL)
    torchrun --nproc-per-node 4 tools/bench_dcp.py --out dcp4.json   # or under torchrun
    python tools/bench_dcp.py --nproc 2 --small                      # CPU: gloo + interpreter

Every rank builds the same global inputs (seeded): B requests of `--context` tokens each, one
query token each (the step's token is the last of its request). Per layer kind:

    mha     PagedAttentionImpl decode (bf16 cache, H query heads per rank, one KV head, D 128,
            as a GQA model under tensor parallelism). DCP scheme: the query heads gathered, the
            rank's context tokens attended, partials merged, the new token merged in.
    sparse  SparseMLAImpl.forward_mqa over the fp8_ds_mla cache, topk 2048 positions per token
            uniformly over the context, H heads per rank; DCP: heads gathered, the top-k mapped
            to the rank's local slots, partials merged (vLLM's MLA layer scheme).

Timed on every rank, median of --iters eager calls with a barrier before each (ms):
`one`      the layer without DCP on one GPU, this rank's H heads over the whole cache (the 1-GPU
           step at the same batch);
`dcp`      the same step under DCP: gather + local attention + merge, the rank's share of the
           cache;
`gather`, `merge`: the collectives of that step alone (ContextParallel.gather_heads / merge on
           the step's tensors); `share` = (gather + merge) / dcp.
On GPUs the same four are also timed as CUDA-graph replays (`graph_*`: each rank captures its
calls, collectives included, and replays them back to back), the kernels and the collectives
without the host's launch work, as an engine that captures its decode step runs them.
The DCP output is checked against `one` first (max_err: absolute, relative where the value
exceeds 1; bf16 tolerance 2e-2; on a CPU
only reported: the interpreter's bf16 defects, tools/bench.py, make it moot there unless
tests/conftest.py's corrections are loaded, as tests/tools/test_bench_dcp.py does). Rank 0
prints one JSON line per layer kind (the slowest rank's times) and writes them to --out.
On a CPU (--small or no GPU) the kernels run in Triton's interpreter on tiny shapes: the path
and the check run, the timings mean nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch

GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from openmla.mla import PagedAttentionImpl, SparseMLAImpl  # noqa: E402
from openmla.mla.cp import ContextParallel  # noqa: E402
from openmla.quant import FP8_DS_MLA  # noqa: E402

BS = 64
TOL = 2e-2  # DCP vs one rank: two bf16 roundings (2 * 2^-8 relative), abs below magnitude 1


def _timer(fn, iters: int, device) -> float:
    """Median ms of `iters` calls, a barrier before each so the ranks start together."""
    fn()  # warm up (compiles, autotunes)
    times = []
    for _ in range(iters):
        dist.barrier()
        if GPU:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _graph_timer(fn, iters: int) -> float:
    """Mean ms of a CUDA-graph replay of `fn` over `iters` back-to-back replays (every rank
    replays its own graph of the same collectives, which keep the ranks in step): the kernels
    and the collectives without the host's launch work."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / iters


def _graph_timer_or_nan(fn, iters: int, rank: int) -> float:
    """_graph_timer, or NaN (and the reason on stderr) where `fn` cannot be captured."""
    try:
        return _graph_timer(fn, iters)
    except RuntimeError as e:
        print(f"bench_dcp rank {rank}: not captured: {str(e).splitlines()[0]}", file=sys.stderr)
        torch.cuda.synchronize()
        return float("nan")


def _local_copy(full: torch.Tensor, cp: ContextParallel, seq_lens, table, total: int) -> torch.Tensor:
    """This rank's cache: every token of `full` (rows [nb * BS, ...]) that the rank holds,
    copied from its single-rank slot to its local slot; the rest NaN."""
    whole = torch.cat([seq_lens.new_zeros(1), seq_lens.cumsum(0)]).to(torch.int32)
    src = ContextParallel(1, 0).slot_mapping(whole, seq_lens, table, BS, total)
    dst = cp.slot_mapping(whole, seq_lens, table, BS, total)
    local = torch.full_like(full, float("nan")) if full.is_floating_point() else torch.full_like(full, 0xFF)
    keep = dst >= 0
    local.view(-1, *full.shape[2:])[dst[keep]] = full.view(-1, *full.shape[2:])[src[keep]]
    return local


def _inputs(p, device):
    B, C = p["batch"], p["context"]
    g = torch.Generator(device=device).manual_seed(1)
    per = -(-C // BS)
    nb = B * per + 1
    table = torch.randperm(nb, device=device, generator=g)[:B * per].view(B, per).to(torch.int32)
    return g, nb, table, torch.full((B,), C, dtype=torch.int32, device=device)


def bench_mha(p, cp, device) -> dict:
    B, H, n, D = p["batch"], p["heads"], cp.world_size, p["head_dim"]
    g, nb, table, seq_lens = _inputs(p, device)
    full = torch.randn(2, nb, BS, 1, D, device=device, generator=g).bfloat16()
    q_all = torch.randn(B, n * H, D, device=device, generator=g).bfloat16()
    kv_new = torch.randn(2, B, 1, D, device=device, generator=g).bfloat16()
    q = q_all[:, cp.rank * H:(cp.rank + 1) * H]  # this rank's heads (one KV head: any order)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=device)
    scale = D ** -0.5
    one = PagedAttentionImpl(H, D, scale, 1)
    plan1 = one.build_plan(qsl, seq_lens, table, ContextParallel(1, 0).slot_mapping(qsl, seq_lens, table, BS, B),
                           max_query_len=1, block_size=BS)
    out1 = torch.empty(B, H, D, dtype=torch.bfloat16, device=device)
    run1 = lambda: one.forward(q, kv_new[0], kv_new[1], (full[0], full[1]), plan1, out1)  # noqa: E731
    dcp = PagedAttentionImpl(H, D, scale, 1, dcp=cp)
    local = torch.stack([_local_copy(full[i], cp, seq_lens, table, B * p["context"]) for i in range(2)])
    plan = dcp.build_plan(qsl, seq_lens, table, cp.slot_mapping(qsl, seq_lens, table, BS, B),
                          max_query_len=1, block_size=BS)
    out = torch.empty_like(out1)
    run = lambda: dcp.forward(q, kv_new[0], kv_new[1], (local[0], local[1]), plan, out)  # noqa: E731
    part = torch.randn(B, cp.attn_heads(H), D, device=device, generator=g).bfloat16()
    lse = torch.randn(B, cp.attn_heads(H), device=device, generator=g)
    return _measure(p, cp, device, run1, run, lambda: cp.gather_heads(q),
                    lambda: cp.merge(part, lse), out1, out)


def bench_sparse(p, cp, device) -> dict:
    B, H, n, topk = p["batch"], p["heads"], cp.world_size, p["topk"]
    g, nb, table, seq_lens = _inputs(p, device)
    full = torch.empty(nb, BS, FP8_DS_MLA.row_width, dtype=torch.uint8, device=device)
    for b0 in range(0, nb, 1024):  # pack in pieces to bound temporary memory
        b1 = min(nb, b0 + 1024)
        full[b0:b1] = FP8_DS_MLA.pack(torch.randn(b1 - b0, BS, 512, device=device, generator=g).bfloat16(),
                                      torch.randn(b1 - b0, BS, 64, device=device, generator=g).bfloat16())
    q_all = torch.randn(B, n * H, 576, device=device, generator=g).bfloat16()
    q = q_all[:, cp.rank * H:(cp.rank + 1) * H].contiguous()
    topk_idx = torch.randint(0, p["context"], (B, topk), device=device, generator=g, dtype=torch.int32)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=device)
    slots = torch.full((B,), -1, device=device)
    scale = 576 ** -0.5
    one = SparseMLAImpl(H, scale, FP8_DS_MLA, max_model_len=p["context"])
    plan1 = one.build_plan(qsl, seq_lens, table, slots, block_size=BS)
    out1 = torch.empty(B, H, 512, dtype=torch.bfloat16, device=device)
    run1 = lambda: one.forward_mqa(q, full, topk_idx, plan1, out=out1)  # noqa: E731
    dcp = SparseMLAImpl(H, scale, FP8_DS_MLA, max_model_len=p["context"], dcp=cp)
    local = _local_copy(full, cp, seq_lens, table, B * p["context"])
    plan = dcp.build_plan(qsl, seq_lens, table, slots, block_size=BS)
    out = torch.empty_like(out1)

    def run():
        part, lse = dcp.forward_mqa(cp.gather_heads(q), local, topk_idx, plan, return_lse=True)
        cp.merge(part, lse, result=out)
    part = torch.randn(B, cp.attn_heads(H), 512, device=device, generator=g).bfloat16()
    lse = torch.randn(B, cp.attn_heads(H), device=device, generator=g)
    return _measure(p, cp, device, run1, run, lambda: cp.gather_heads(q),
                    lambda: cp.merge(part, lse), out1, out)


def _measure(p, cp, device, run1, run, gather, merge, out1, out) -> dict:
    run1()
    run()
    # abs error, relative where |one| > 1 (bf16 rounds once more in the merge)
    err = ((out.float() - out1.float()).abs() / out1.float().abs().clamp_min(1)).max().item()
    if GPU and not err <= TOL:  # the bare interpreter's bf16 defects (bench.py) make CPU values moot
        raise AssertionError(f"rank {cp.rank}: DCP output differs from one rank by {err} > {TOL}")
    t = {k: _timer(fn, p["iters"], device) for k, fn in
         (("one", run1), ("dcp", run), ("gather", gather), ("merge", merge))}
    worst = torch.tensor([t[k] for k in ("one", "dcp", "gather", "merge")], dtype=torch.float64,
                         device=device if GPU else "cpu")
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    one, dcp, ga, me = worst.tolist()
    res = {"one_ms": one, "dcp_ms": dcp, "gather_ms": ga, "merge_ms": me,
           "share": (ga + me) / dcp, "speedup": one / dcp, "max_err": err}
    if GPU:  # the same four, each captured in a CUDA graph and replayed (no host time)
        g = torch.tensor([_graph_timer_or_nan(fn, 10 * p["iters"], cp.rank)
                          for fn in (run1, run, gather, merge)], dtype=torch.float64, device=device)
        dist.all_reduce(g, op=dist.ReduceOp.MAX)
        one, dcp, ga, me = g.tolist()
        res.update(graph_one_ms=one, graph_dcp_ms=dcp, graph_gather_ms=ga, graph_merge_ms=me,
                   graph_share=(ga + me) / dcp, graph_speedup=one / dcp)
    return res


def _rank_main(rank: int, world: int, args, port) -> None:
    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    if not GPU:  # the interpreter: the autotuner takes its first config (tools/bench.py)
        from openmla.tools.bench import _interpreter_autotune
        _interpreter_autotune()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if GPU:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if GPU else "gloo", device_id=device if GPU else None)
    try:
        cp = ContextParallel.from_group(None, interleave=args.interleave)
        p = dict(batch=args.batch, context=args.context, heads=args.heads, head_dim=128,
                 topk=min(args.topk, args.context), iters=args.iters)
        rows = []
        for kind in args.layer:
            res = (bench_mha if kind == "mha" else bench_sparse)(p, cp, device)
            row = {"layer": kind, "ranks": world, **{k: v for k, v in p.items() if k != "iters"},
                   "interleave": args.interleave, **res,
                   "device": torch.cuda.get_device_name(device) if GPU else "cpu (interpreter)"}
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
        if rank == 0 and args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
        dist.barrier()  # no rank tears its connections down while another still writes
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=None, help="ranks to spawn (default: torchrun's, else 2)")
    ap.add_argument("--layer", nargs="+", choices=("mha", "sparse"), default=["mha", "sparse"])
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16, help="query heads per rank")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--interleave", type=int, default=1)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU: the interpreter)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.small or not GPU:
        args.context, args.batch, args.heads, args.topk, args.iters = 96, 2, 2, 16, 1
    if "RANK" in os.environ and args.nproc is None:  # under torchrun
        _rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None)
        return 0
    n = args.nproc or 2
    if GPU and torch.cuda.device_count() < n:
        print(f"bench_dcp: {n} ranks need {n} GPUs, this machine has {torch.cuda.device_count()}",
              file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(n, args, port), nprocs=n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
