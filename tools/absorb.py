#!/usr/bin/env python3
"""Offline MLA weight absorption for DeepSeek-style checkpoints (V2, V2-Lite, V3, V3.2).

    python tools/absorb.py CHECKPOINT_DIR OUT_DIR [--mode split|fold] [--dtype bf16|fp32]
                           [--layers 0-3,7] [--force] [--no-verify]
    python tools/absorb.py [--demo]     # a small fp8 checkpoint in a temp folder, both modes

For every MLA layer chosen (default: every `*.layers.N.self_attn.kv_b_proj.weight` found, MTP
layers included), in --dtype (default bf16), fp8 block-scaled weights dequantized exactly:
  split  kv_b_proj.weight (and its weight_scale_inv) is replaced by
         `<layer>.self_attn.W_UK [H, qk_nope, kv_lora_rank]` and
         `<layer>.self_attn.W_UV [H, kv_lora_rank, v_head]` (mla/absorb.py has the maths).
  fold   as split, and W_UK is folded into q_b_proj.weight (q_proj.weight when q_lora_rank is
         null), which becomes [H*(kv_lora_rank + qk_rope), q_in] (rows per head: latent | rope),
         and W_UV into o_proj.weight, which becomes [hidden, H*kv_lora_rank]; their
         weight_scale_inv are dropped.
Every other tensor (scales included) is copied bit for bit, shard by shard, one tensor at a
time, so memory stays near the largest tensor produced, never the model. config.json gains
"openmla_absorbed" (what was done); model.safetensors.index.json is rewritten to match; other
files are copied. Then each layer is verified on random inputs: absorbed layer output against
the original's, in fp32, relative L2 error reported and bounded.

A weight or scale the layers are computed from, or a tensor written, that holds NaN or inf
fails the run, naming the tensor (also with --no-verify, which skips only the comparison).

Files are written under a temporary folder in OUT_DIR and moved into place only after
verification, so a failed or interrupted run (error, Ctrl-C, SIGTERM) leaves nothing under
OUT_DIR's final names; a temporary folder left by a killed run is named in the next run's error.
OUT_DIR/openmla-absorb-manifest.json lists the files a run wrote: --force replaces exactly those
(unchanged since) and refuses to overwrite, or write beside, checkpoint files it did not write.

Exit codes: 0 done and verified; 1 verification failed, NaN/inf included (nothing written);
2 bad input (one-line error: missing tensor, config disagreeing with shapes or of the wrong type,
unreadable shard, OUT_DIR not empty without --force or holding files the tool did not write);
3 internal error (a bug: traceback printed, nothing written); 130 / 143 interrupted by
SIGINT / SIGTERM (nothing written).
"""
from __future__ import annotations

import argparse
import math
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass, field

import torch


from openmla.mla.absorb import (
    MLAWeightDims,
    fold_o_proj,
    fold_q_proj,
    layer_output_folded,
    layer_output_split,
    layer_output_unabsorbed,
    split_kv_b_proj,
    weight_to_fp32,
)
from openmla.tools._absorb_demo import build_demo_checkpoint, run_demo  # noqa: E402,F401 (tests use it)
from openmla.tools._checkpoint import (
    CONFIG_NAME,
    INDEX_NAME,
    ITEMSIZE,
    AbsorbError,
    Checkpoint,
    OutTensor,
    TensorReader,
    copy_other_files,
    open_checkpoint,
    other_entries,
    size_text,
    write_index,
    write_json,
    write_shards,
)
from openmla.tools._outdir import MANIFEST_NAME, OutDir, files_under

OUT_DTYPES = {"bf16": (torch.bfloat16, "BF16"), "fp32": (torch.float32, "F32")}
# Bound on the relative L2 error of the absorbed layer output against the original, per --dtype:
# fp32 is reassociation only (measured ~1e-7); bf16 rounds every written weight (2^-9 relative).
VERIFY_BOUND = {"fp32": 1e-4, "bf16": 2e-2}
_LAYER_RE = re.compile(r"^(?P<prefix>(?:.+\.)?layers\.(?P<idx>\d+)\.self_attn)\.kv_b_proj\.weight$")


class VerificationError(Exception):
    """The absorbed layers do not match the originals, or a tensor holds NaN/inf: exit code 1,
    nothing written."""


class Terminated(BaseException):
    """Raised by the SIGTERM handler of main(): unwinds like KeyboardInterrupt, so the temporary
    folder is removed (a BaseException, so that no `except Exception` swallows it)."""


def _not_finite(part: torch.Tensor) -> torch.Tensor:
    if part.dtype == torch.float8_e4m3fn:
        return (part.view(torch.uint8) & 0x7F) == 0x7F  # e4m3fn has no inf; S.1111.111 is NaN
    return ~torch.isfinite(part)


_CHECK_CHUNK = 1 << 24  # elements a step: the mask stays small next to the tensor checked


def check_finite(name: str, t: torch.Tensor, where: str = "") -> None:
    """VerificationError naming the tensor if t holds NaN or inf (fp8 e4m3fn: its NaN bytes)."""
    flat = t.reshape(-1)
    for start in range(0, flat.numel(), _CHECK_CHUNK):
        bad = _not_finite(flat[start:start + _CHECK_CHUNK])
        if not bool(bad.any()):
            continue
        first = start + int(bad.to(torch.uint8).argmax())
        count = sum(int(_not_finite(flat[i:i + _CHECK_CHUNK]).sum())
                    for i in range(start, flat.numel(), _CHECK_CHUNK))
        pos = [int(i) for i in torch.unravel_index(torch.tensor(first), t.shape)] if t.dim() else []
        raise VerificationError(f"{name}{where}: {count} of {t.numel()} values are NaN or inf, the "
                                f"first at {pos} ({float(flat[first].float())})")


def read_fp32(reader: TensorReader, name: str, where: str = "") -> torch.Tensor:
    """reader.fp32(name) with every part checked finite: the weight, its scale_inv, and the
    dequantized product (a huge scale can overflow it)."""
    w = reader.tensor(name)
    check_finite(name, w, where)
    scale = name + "_scale_inv"
    s = reader.tensor(scale) if scale in reader.where else None
    if s is not None:
        check_finite(scale, s, where)
    w = weight_to_fp32(w, s, reader.block)
    if s is not None:
        check_finite(f"{name} dequantized with {scale}", w, where)
    return w


# --------------------------------------------------------------------------------------------
# Planning: which layers, which tensors go where, all shapes checked before anything is written
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Layer:
    idx: int
    prefix: str  # "model.layers.3.self_attn"
    q_name: str  # "q_b_proj" or "q_proj"

    def weight(self, role: str) -> str:
        module = {"kv_b": "kv_b_proj", "q": self.q_name, "o": "o_proj"}[role]
        return f"{self.prefix}.{module}.weight"

    def out_name(self, kind: str) -> str:
        return {"w_uk": f"{self.prefix}.W_UK", "w_uv": f"{self.prefix}.W_UV",
                "q_folded": self.weight("q"), "o_folded": self.weight("o")}[kind]


@dataclass
class Plan:
    mode: str
    dtype: str
    dims: MLAWeightDims
    layers: list
    shards: dict = field(default_factory=dict)    # shard file name -> [OutTensor]
    removed: list = field(default_factory=list)   # input tensor names not written
    dequantized: list = field(default_factory=list)  # modules folded from fp8 into --dtype

    @property
    def out_where(self) -> dict:
        return {t.name: s for s, ts in self.shards.items() for t in ts}


def _config_dims(ck: Checkpoint) -> MLAWeightDims:
    try:
        return MLAWeightDims.from_config(ck.config)
    except ValueError as e:
        raise AbsorbError(f"{os.path.join(ck.root, CONFIG_NAME)}: {e}") from None


def make_plan(ck: Checkpoint, mode: str, dtype: str, only_layers=None) -> Plan:
    dims = _config_dims(ck)
    q_name = "q_b_proj" if dims.q_lora_rank is not None else "q_proj"
    found = {}
    for name in ck.where:
        m = _LAYER_RE.match(name)
        if m:
            found.setdefault(int(m["idx"]), []).append(Layer(int(m["idx"]), m["prefix"], q_name))
    if not found:
        raise AbsorbError(f"missing tensor *.layers.N.self_attn.kv_b_proj.weight: no MLA layer in {ck.root}")
    if only_layers is not None:
        if not isinstance(only_layers, LayerSelection):
            only_layers = LayerSelection.of(only_layers)
        absent = only_layers.missing(found)
        if absent:
            shown = ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in absent[:8])
            raise AbsorbError(f"--layers: no layer {shown}{',...' if len(absent) > 8 else ''} in the "
                              f"checkpoint (it has {_ranges(sorted(found))})")
    layers = [l for i in sorted(found) if only_layers is None or i in only_layers for l in found[i]]
    plan = Plan(mode, dtype, dims, layers)
    shapes = dims.shapes()
    out_dtype = OUT_DTYPES[dtype][1]
    keys = {"kv_b": "num_attention_heads, qk_nope_head_dim, v_head_dim, kv_lora_rank",
            "q": "num_attention_heads, qk_nope_head_dim, qk_rope_head_dim, "
                 + ("q_lora_rank" if dims.q_lora_rank is not None else "hidden_size"),
            "o": "hidden_size, num_attention_heads, v_head_dim"}  # config keys giving each shape
    replace = {}  # input weight name -> [(Layer, kind)] written in its place (same shard)
    for l in layers:
        fp8 = {role: ck.check_linear(l.weight(role), shapes[role], keys[role])
               for role in ("kv_b", "q", "o")}
        for nm in (f"{l.prefix}.W_UK", f"{l.prefix}.W_UV"):
            if nm in ck.where:
                raise AbsorbError(f"{nm} already exists in the checkpoint (absorbed already?)")
        replace[l.weight("kv_b")] = [(l, "w_uk"), (l, "w_uv")]
        roles = ["kv_b"]
        if mode == "fold":
            replace[l.weight("q")] = [(l, "q_folded")]
            replace[l.weight("o")] = [(l, "o_folded")]
            roles += ["q", "o"]
            plan.dequantized += [l.weight(r)[:-len(".weight")] for r in ("q", "o") if fp8[r]]
        for r in roles:
            plan.removed.append(l.weight(r))
            if fp8[r]:
                plan.removed.append(l.weight(r) + "_scale_inv")
    removed = set(plan.removed)
    itemsize = OUT_DTYPES[dtype][0].itemsize
    for s, h in ck.headers.items():
        outs = []
        for name, e in h.entries.items():
            for layer, kind in replace.get(name, ()):
                shape = shapes[kind]
                outs.append(OutTensor(layer.out_name(kind), out_dtype, shape,
                                      math.prod(shape) * itemsize, compute=(layer, kind)))
            if name not in removed:
                outs.append(OutTensor(name, e.dtype, e.shape, e.nbytes, copy_of=e))
        # Largest alignment first (as safetensors orders them), so every tensor stays aligned.
        outs.sort(key=lambda t: (-ITEMSIZE.get(t.dtype, 1), t.name))
        plan.shards[s] = outs
    return plan


def _ranges(xs) -> str:
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


@dataclass(frozen=True)
class LayerSelection:
    """Layer numbers as sorted, disjoint, inclusive ranges ((lo, hi), ...): '0-9999999' stays
    one pair, never a list of ten million numbers."""

    ranges: tuple

    @classmethod
    def of(cls, numbers) -> "LayerSelection":
        return cls._merged((int(i), int(i)) for i in numbers)

    @classmethod
    def _merged(cls, pairs) -> "LayerSelection":
        out = []
        for lo, hi in sorted(pairs):
            if out and lo <= out[-1][1] + 1:
                out[-1] = (out[-1][0], max(out[-1][1], hi))
            else:
                out.append((lo, hi))
        return cls(tuple(out))

    def __contains__(self, i: int) -> bool:
        return any(lo <= i <= hi for lo, hi in self.ranges)

    def missing(self, have) -> list:
        """The selected numbers not in have (a small set), as ranges: work ~ len(have) + ranges."""
        have = sorted(have)
        out = []
        for lo, hi in self.ranges:
            start = lo
            for i in have:
                if lo <= i <= hi:
                    if i > start:
                        out.append((start, i - 1))
                    start = i + 1
            if start <= hi:
                out.append((start, hi))
        return out


def parse_layers(text: str) -> LayerSelection:
    """'0-3,7' -> LayerSelection(((0, 3), (7, 7)))."""
    pairs = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d{1,18})\s*(?:-\s*(\d{1,18})\s*)?", part)
        if not m or (m[2] is not None and int(m[2]) < int(m[1])):
            shown = text if len(text) <= 60 else text[:60] + "..."
            raise argparse.ArgumentTypeError(f"expected layer numbers like 0-3,7, got {shown!r}")
        pairs.append((int(m[1]), int(m[2] or m[1])))
    return LayerSelection._merged(pairs)


# --------------------------------------------------------------------------------------------
# Computing the absorbed tensors, and the config note that says what was done
# --------------------------------------------------------------------------------------------

class Computer:
    """Produces the absorbed tensors of a layer on demand, keeping W_UK/W_UV of two layers."""

    def __init__(self, reader: TensorReader, plan: Plan):
        self.reader, self.plan = reader, plan
        self.cache = OrderedDict()

    def _split(self, layer: Layer):
        if layer.prefix not in self.cache:
            d = self.plan.dims
            self.cache[layer.prefix] = split_kv_b_proj(
                read_fp32(self.reader, layer.weight("kv_b")), num_heads=d.num_heads,
                qk_nope_head_dim=d.qk_nope_head_dim, v_head_dim=d.v_head_dim)
            while len(self.cache) > 2:
                self.cache.popitem(last=False)
        return self.cache[layer.prefix]

    def __call__(self, layer: Layer, kind: str) -> torch.Tensor:
        """The tensor `kind` of `layer` in --dtype; VerificationError if an input it is computed
        from or the result holds NaN or inf (checked here, so also with --no-verify)."""
        w_uk, w_uv = self._split(layer)
        dtype = OUT_DTYPES[self.plan.dtype][0]
        if kind == "w_uk":
            out = w_uk.to(dtype)
        elif kind == "w_uv":
            out = w_uv.to(dtype)
        elif kind == "q_folded":
            out = fold_q_proj(read_fp32(self.reader, layer.weight("q")), w_uk, out_dtype=dtype,
                              qk_rope_head_dim=self.plan.dims.qk_rope_head_dim)
        else:
            out = fold_o_proj(read_fp32(self.reader, layer.weight("o")), w_uv, out_dtype=dtype)
        check_finite(layer.out_name(kind), out, f" (computed in {self.plan.dtype})")
        return out


def absorbed_config(ck: Checkpoint, plan: Plan) -> dict:
    cfg = dict(ck.config)
    rel = sorted({n.split(".self_attn.", 1)[-1] for n in plan.removed})
    note = {
        "mode": plan.mode,
        "dtype": plan.dtype,
        "layers": sorted({l.idx for l in plan.layers}),
        "tensors": {
            "self_attn.W_UK": "[num_attention_heads, qk_nope_head_dim, kv_lora_rank]; "
                              "k_nope of head h = W_UK[h] @ c",
            "self_attn.W_UV": "[num_attention_heads, kv_lora_rank, v_head_dim]; "
                              "v of head h = W_UV[h]^T @ c",
        },
        "removed": ["self_attn." + r for r in rel],
        "tool": "openmla tools/absorb.py",
    }
    if plan.mode == "fold":
        q = plan.layers[0].q_name
        q_in = "q_lora_rank" if plan.dims.q_lora_rank is not None else "hidden_size"
        note["tensors"][f"self_attn.{q}.weight"] = (
            f"[num_attention_heads * (kv_lora_rank + qk_rope_head_dim), {q_in}]; rows per head: "
            "W_UK[h]^T Wq_nope[h] (kv_lora_rank) | Wq_rope[h] (qk_rope_head_dim)")
        note["tensors"]["self_attn.o_proj.weight"] = (
            "[hidden_size, num_attention_heads * kv_lora_rank]; takes the latent attention output")
        note["removed"] = [r for r in note["removed"] if not r.endswith((f"{q}.weight", "o_proj.weight"))]
        note["unquantized_modules"] = sorted(plan.dequantized)
    cfg["openmla_absorbed"] = note
    return cfg


# --------------------------------------------------------------------------------------------
# Verification
# --------------------------------------------------------------------------------------------

def random_layer_inputs(dims: MLAWeightDims, gen: torch.Generator, tokens=6, rows=40, topk=12):
    """x_q [T, q_in], c_kv [N, L], k_pe [N, r] ~ N(0, 1) fp32 and indices [T, topk] int32 with the
    invalid kinds mixed in and a last token that has no valid index."""
    x_q = torch.randn(tokens, dims.q_in, generator=gen)
    c_kv = torch.randn(rows, dims.kv_lora_rank, generator=gen)
    k_pe = torch.randn(rows, dims.qk_rope_head_dim, generator=gen)
    idx = torch.stack([torch.randperm(rows, generator=gen)[:topk] for _ in range(tokens)]).int()
    bad = torch.tensor([-1, rows, -(2**31), rows + 5], dtype=torch.int32)
    idx[:-1, :2] = bad[:2]
    idx[-1] = bad.repeat(topk)[:topk]
    return x_q, c_kv, k_pe, idx


def verify(ck: Checkpoint, plan: Plan, out_root: str, seed: int = 0, stream=None) -> list:
    """Per layer: rel L2 error of the absorbed layer output (what was written) against the
    original (the input checkpoint), both computed in fp32 on the same random inputs.

    The bound is VERIFY_BOUND[dtype], or 4x the error of the original layer with its own weights
    rounded to --dtype when that is larger (a layer with sharp attention amplifies rounding the
    same way whether it is absorbed or not); ok needs finite errors under a finite bound. A
    weight read (input or written) holding NaN or inf raises VerificationError naming it.
    Returns rows {layer, split, fold (fold mode), baseline, bound, ok}."""
    src = TensorReader(ck.root, ck.where, ck.block)
    out = TensorReader(out_root, plan.out_where, ck.block)
    d, out_dtype = plan.dims, OUT_DTYPES[plan.dtype][0]
    tty = stream is not None and hasattr(stream, "isatty") and stream.isatty()
    rows = []
    for n, l in enumerate(plan.layers, 1):
        if tty:
            print(f"\rverify layer {l.idx} ({n}/{len(plan.layers)})", end="", file=stream, flush=True)
        gen = torch.Generator().manual_seed(seed * 1000003 + l.idx)
        x_q, c_kv, k_pe, idx = random_layer_inputs(d, gen)
        args = dict(dims=d, scale=d.softmax_scale)
        wq, kv_b, wo = (read_fp32(src, l.weight(role)) for role in ("q", "kv_b", "o"))
        want = layer_output_unabsorbed(x_q, c_kv, k_pe, idx, wq=wq, kv_b=kv_b, wo=wo, **args)
        rounded = layer_output_unabsorbed(x_q, c_kv, k_pe, idx, **{
            k: w.to(out_dtype) for k, w in (("wq", wq), ("kv_b", kv_b), ("wo", wo))}, **args)
        row = {"layer": l.idx, "baseline": _rel(rounded, want)}
        row["bound"] = max(VERIFY_BOUND[plan.dtype], 4 * row["baseline"])
        written = " (as written)"
        if plan.mode == "split":  # q and o were copied through: read them back from OUT_DIR too
            wq, wo = (read_fp32(out, l.weight(role), written) for role in ("q", "o"))
        got = layer_output_split(x_q, c_kv, k_pe, idx, wq=wq, w_uk=_written(out, l.out_name("w_uk")),
                                 w_uv=_written(out, l.out_name("w_uv")), wo=wo, **args)
        row["split"] = _rel(got, want)
        if plan.mode == "fold":
            got = layer_output_folded(x_q, c_kv, k_pe, idx,
                                      wq_folded=_written(out, l.out_name("q_folded")),
                                      wo_folded=_written(out, l.out_name("o_folded")), **args)
            row["fold"] = _rel(got, want)
        # NaN compares False and inf <= inf is True: only finite errors under a finite bound pass
        row["ok"] = math.isfinite(row["bound"]) and all(
            math.isfinite(row[k]) and row[k] <= row["bound"] for k in ("split", "fold") if k in row)
        rows.append(row)
    if tty and plan.layers:
        print("\r" + " " * 40 + "\r", end="", file=stream, flush=True)
    return rows


def _written(reader: TensorReader, name: str) -> torch.Tensor:
    t = reader.tensor(name)
    check_finite(name, t, " (as written)")
    return t


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    den = float(want.double().norm())
    return float((got.double() - want.double()).norm()) / (den if den > 0 else 1.0)


# --------------------------------------------------------------------------------------------
# The whole run
# --------------------------------------------------------------------------------------------

def absorb(checkpoint_dir: str, out_dir: str, *, mode: str = "split", dtype: str = "bf16",
           layers=None, force: bool = False, verify_layers: bool = True, seed: int = 0,
           out=None, err=None) -> dict:
    """Absorb a checkpoint into OUT_DIR. Raises AbsorbError (bad input) or VerificationError;
    either way nothing is left under OUT_DIR's final names. Returns a summary dict."""
    out = out or sys.stdout
    err = err or sys.stderr
    t0 = time.time()
    if mode not in ("split", "fold"):
        raise AbsorbError(f"--mode: expected split or fold, got {mode!r}")
    if dtype not in OUT_DTYPES:
        raise AbsorbError(f"--dtype: expected bf16 or fp32, got {dtype!r}")
    dest = OutDir(out_dir, checkpoint_dir, force)
    ck = open_checkpoint(checkpoint_dir)
    plan = make_plan(ck, mode, dtype, layers)
    others = other_entries(ck.root, set(plan.shards) | {CONFIG_NAME, INDEX_NAME, MANIFEST_NAME}, dest.real)
    planned = list(plan.shards) + [CONFIG_NAME] + ([INDEX_NAME] if ck.index is not None else [])
    for name in others:
        p = os.path.join(ck.root, name)
        planned += [f"{name}/{rel}" for rel in files_under(p)] if os.path.isdir(p) else [name]
    dest.check_targets(planned)  # before any work: a refusal costs nothing

    try:
        with dest.staged() as tmp:  # moved into OUT_DIR only if the block completes
            compute = Computer(TensorReader(ck.root, ck.where, ck.block), plan)
            total = write_shards(ck, tmp, plan.shards, compute, err)
            write_json(os.path.join(tmp, CONFIG_NAME), absorbed_config(ck, plan))
            write_index(ck, tmp, plan.out_where, total)
            copy_other_files(ck.root, tmp, others)

            rows = verify(ck, plan, tmp, seed, err) if verify_layers else []
            failed = [r for r in rows if not r["ok"]]
            if failed:
                r = failed[0]
                errs = ", ".join(f"{k} {r[k]:.3g}" for k in ("split", "fold") if k in r)
                raise VerificationError(
                    f"verification failed for {len(failed)} layer(s), first layer {r['layer']}: "
                    f"rel err {errs}, bound {r['bound']:.3g}")
    except VerificationError as e:
        raise VerificationError(f"{e}; nothing written to {out_dir}") from None

    n_copied = sum(t.copy_of is not None for ts in plan.shards.values() for t in ts)
    n_written = sum(t.compute is not None for ts in plan.shards.values() for t in ts)
    summary = {
        "mode": mode, "dtype": dtype, "layers": [l.idx for l in plan.layers],
        "shards": len(plan.shards), "copied": n_copied, "written": n_written,
        "removed": len(plan.removed),
        "bytes_in": sum(e.nbytes for h in ck.headers.values() for e in h.entries.values()),
        "bytes_out": total, "seconds": time.time() - t0, "verify": rows,
    }
    print_summary(summary, checkpoint_dir, out_dir, out)
    return summary


def print_summary(s: dict, src: str, dst: str, out) -> None:
    print(f"absorbed {len(s['layers'])} MLA layers ({_ranges(sorted(set(s['layers'])))}), "
          f"mode {s['mode']}, dtype {s['dtype']}: {src} -> {dst}", file=out)
    print(f"  {s['shards']} shards: {s['copied']} tensors copied bit for bit, {s['written']} written "
          f"in {s['dtype']} in place of {s['removed']}; {size_text(s['bytes_in'])} in, "
          f"{size_text(s['bytes_out'])} out, {s['seconds']:.1f} s", file=out)
    if not s["verify"]:
        print("  verification skipped (--no-verify)", file=out)
        return
    cols = "split" + (", fold" if s["mode"] == "fold" else "")
    print(f"  verification: rel L2 error of the layer output, absorbed ({cols}) vs original, "
          f"fp32, random inputs; 'orig {s['dtype']}': the original with its weights in {s['dtype']}",
          file=out)
    for r in s["verify"]:
        errs = "  ".join(f"{k} {r[k]:.2e}" for k in ("split", "fold") if k in r)
        print(f"    layer {r['layer']:3d}: {errs}  (orig {s['dtype']} {r['baseline']:.2e}, "
              f"bound {r['bound']:.1e})  {'ok' if r['ok'] else 'FAILED'}", file=out)
    print(f"  all {len(s['verify'])} layers agree with the original", file=out)


def _raise_terminated(signum, frame):
    raise Terminated(signum)


def main(argv=None) -> int:
    """The command line; returns the exit code. SIGTERM is handled like Ctrl-C while it runs (in
    the main thread), so that either removes the temporary folder."""
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if on_main else None
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("absorb.py: error: interrupted (SIGINT); no partial output is left in OUT_DIR", file=sys.stderr)
        return 130
    except Terminated:
        print("absorb.py: error: terminated (SIGTERM); no partial output is left in OUT_DIR", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _main(argv) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(prog="absorb.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint_dir", nargs="?", metavar="CHECKPOINT_DIR")
    ap.add_argument("out_dir", nargs="?", metavar="OUT_DIR")
    ap.add_argument("--mode", choices=["split", "fold"], default="split")
    ap.add_argument("--dtype", choices=list(OUT_DTYPES), default="bf16",
                    help="dtype of every tensor written (default bf16)")
    ap.add_argument("--layers", type=parse_layers, help="layers to absorb, e.g. 0-3,7 (default all)")
    ap.add_argument("--force", action="store_true",
                    help="write into a non-empty OUT_DIR, replacing the files an earlier run wrote there "
                         f"(listed in its {MANIFEST_NAME}); other checkpoint files there are refused")
    ap.add_argument("--no-verify", action="store_true", help="skip the per-layer verification")
    ap.add_argument("--seed", type=int, default=0, help="seed of the verification inputs")
    ap.add_argument("--demo", action="store_true",
                    help="absorb a small generated checkpoint in both modes (the default without arguments)")
    args = ap.parse_args(argv)
    try:
        if args.demo or (args.checkpoint_dir is None and args.out_dir is None):
            if args.checkpoint_dir is not None:
                ap.error("--demo takes no CHECKPOINT_DIR / OUT_DIR")
            return run_demo(absorb, args.dtype, args.seed)
        if args.out_dir is None:
            ap.error("OUT_DIR is required with CHECKPOINT_DIR")
        absorb(args.checkpoint_dir, args.out_dir, mode=args.mode, dtype=args.dtype,
               layers=args.layers, force=args.force, verify_layers=not args.no_verify, seed=args.seed)
        return 0
    except AbsorbError as e:
        print(f"absorb.py: error: {e}", file=sys.stderr)
        return 2
    except VerificationError as e:
        print(f"absorb.py: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # disk full, permissions while writing OUT_DIR
        print(f"absorb.py: error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 2
    except Exception:  # a bug: not "verification failed" (1), which Python's own exit code would say
        traceback.print_exc()
        print("absorb.py: internal error (the traceback above says where); nothing written",
              file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
