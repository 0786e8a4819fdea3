#!/usr/bin/env python3
"""Accuracy sweep of the cache formats against bf16 input.

First form (Foundation issue): for every MLA cache format, the round-trip error of
pack -> unpack against the bf16 input, on Gaussian latents and on latents with outlier channels.
Prints a markdown table; `--out FILE.json` also writes the numbers.

    python tools/sweep.py                # default grid, CPU, a few seconds
    python tools/sweep.py --tokens 4096 --out sweep.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from quant import MLA_FORMATS  # noqa: E402


def make_latents(kind: str, tokens: int, gen: torch.Generator):
    """(kv_c [tokens, 512] bf16, k_pe [tokens, 64] bf16) of one data kind."""
    kv_c = torch.randn(tokens, 512, generator=gen)
    k_pe = torch.randn(tokens, 64, generator=gen)
    if kind == "outliers":
        # A few channels 50-200x larger than the rest, as seen in real MLA latents: they set the
        # tile's scale, so the other 127 elements of that tile lose resolution.
        chans = torch.randperm(512, generator=gen)[:8]
        kv_c[:, chans] *= torch.empty(8).uniform_(50, 200, generator=gen)
    elif kind != "gaussian":
        raise ValueError(f"kind: expected 'gaussian' or 'outliers', got {kind!r}")
    return kv_c.bfloat16(), k_pe.bfloat16()


def round_trip_errors(fmt, kv_c: torch.Tensor, k_pe: torch.Tensor) -> dict:
    """Errors of unpack(pack(x)) against x (the bf16 input, taken as exact), over all 576 dims."""
    ref = torch.cat([kv_c, k_pe], dim=-1).double()
    got = fmt.unpack(fmt.pack(kv_c, k_pe)).double()
    diff = got - ref
    return {
        "rel_l2": float(diff.norm() / ref.norm()),
        "max_abs": float(diff.abs().max()),
        "cosine": float((got * ref).sum() / (got.norm() * ref.norm())),
        "latent_rel_l2": float(diff[:, :512].norm() / ref[:, :512].norm()),
        "rope_exact": bool(torch.equal(got[:, 512:], ref[:, 512:])),
    }


def run(tokens: int, seed: int, kinds, formats, progress=sys.stderr) -> list[dict]:
    rows = []
    for kind in kinds:
        gen = torch.Generator().manual_seed(seed)
        kv_c, k_pe = make_latents(kind, tokens, gen)
        for name in formats:
            print(f"  {name:16s} {kind} ...", file=progress, flush=True)
            rows.append({"format": name, "data": kind, "tokens": tokens,
                         **round_trip_errors(MLA_FORMATS[name], kv_c, k_pe)})
    return rows


def to_markdown(rows: list[dict]) -> str:
    head = "| format | data | rel L2 | latent rel L2 | max abs | cosine | rope exact |\n"
    head += "|---|---|---|---|---|---|---|\n"
    body = "".join(
        f"| {r['format']} | {r['data']} | {r['rel_l2']:.3e} | {r['latent_rel_l2']:.3e} | "
        f"{r['max_abs']:.3e} | {r['cosine']:.8f} | {'yes' if r['rope_exact'] else 'NO'} |\n"
        for r in rows)
    return head + body


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per data kind (default 2048)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--formats", nargs="+", default=list(MLA_FORMATS), choices=list(MLA_FORMATS))
    ap.add_argument("--data", nargs="+", default=["gaussian", "outliers"], choices=["gaussian", "outliers"])
    ap.add_argument("--out", help="write the rows as JSON to this file")
    args = ap.parse_args(argv)
    if args.tokens < 1:
        ap.error(f"--tokens: expected >= 1, got {args.tokens}")

    t0 = time.time()
    print(f"round-trip sweep: {len(args.formats)} formats x {len(args.data)} data kinds, "
          f"{args.tokens} tokens each", file=sys.stderr)
    rows = run(args.tokens, args.seed, args.data, args.formats)
    print(to_markdown(rows), end="")
    print(f"\n({time.time() - t0:.1f} s; error of unpack(pack(x)) against the bf16 input x)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"sweep": "mla_format_round_trip", "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
