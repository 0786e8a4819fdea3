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

Exit codes: 0 done and verified; 1 verification failed (nothing written); 2 bad input (one-line
error: missing tensor, config disagreeing with shapes, unreadable shard, OUT_DIR not empty
without --force). Files are written under a temporary folder in OUT_DIR and renamed into place
only after verification, so a failed run leaves nothing under OUT_DIR's final names.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mla.absorb import (  # noqa: E402
    FP8_WEIGHT_BLOCK,
    MLAWeightDims,
    fold_o_proj,
    fold_q_proj,
    layer_output_folded,
    layer_output_split,
    layer_output_unabsorbed,
    quantize_fp8_blocks,
    scale_inv_shape,
    split_kv_b_proj,
    weight_to_fp32,
)

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
OUT_DTYPES = {"bf16": (torch.bfloat16, "BF16"), "fp32": (torch.float32, "F32")}
# Bound on the relative L2 error of the absorbed layer output against the original, per --dtype:
# fp32 is reassociation only (measured ~1e-7); bf16 rounds every written weight (2^-9 relative).
VERIFY_BOUND = {"fp32": 1e-4, "bf16": 2e-2}
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2,
             "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8,
             "F64": 8}
_FLOAT_WEIGHTS = ("BF16", "F16", "F32")
_SCALES = ("F32", "BF16", "F16")
_COPY_CHUNK = 8 << 20
_LAYER_RE = re.compile(r"^(?P<prefix>(?:.+\.)?layers\.(?P<idx>\d+)\.self_attn)\.kv_b_proj\.weight$")


class AbsorbError(Exception):
    """Bad input: reported as one line, exit code 2."""


class VerificationError(Exception):
    """The absorbed layers do not match the originals: exit code 1, nothing written."""


# --------------------------------------------------------------------------------------------
# Reading: safetensors headers (parsed here, so that a bad shard is a clear error and untouched
# tensors can be copied as raw bytes) and tensors (through safetensors, one at a time)
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Entry:
    dtype: str
    shape: tuple
    begin: int  # data offsets, relative to the end of the header
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class ShardHeader:
    path: str
    data_start: int
    entries: dict
    metadata: dict


def read_header(path: str) -> ShardHeader:
    """Parse and check a safetensors header; AbsorbError('unreadable shard ...') if it is bad."""
    def bad(why):
        raise AbsorbError(f"unreadable shard {path}: {why}")

    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                bad(f"{size} bytes, shorter than the 8-byte header length")
            n = int.from_bytes(raw, "little")
            if n > size - 8 or n > (100 << 20):
                bad(f"header length {n} does not fit a {size}-byte file")
            header = json.loads(f.read(n))
    except OSError as e:
        bad(e.strerror or str(e))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        bad(f"header is not JSON ({e.__class__.__name__})")
    if not isinstance(header, dict):
        bad("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + n
    entries = {}
    for name, e in header.items():
        try:
            dtype, shape, (b, end) = e["dtype"], tuple(e["shape"]), e["data_offsets"]
            ok = (isinstance(dtype, str) and all(isinstance(s, int) and s >= 0 for s in shape)
                  and isinstance(b, int) and isinstance(end, int) and 0 <= b <= end)
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            bad(f"malformed header entry for {name!r}")
        if data_start + end > size:
            bad(f"tensor {name} ends at byte {data_start + end}, past the end of the file "
                f"({size} bytes; truncated?)")
        if dtype in _ITEMSIZE and end - b != math.prod(shape) * _ITEMSIZE[dtype]:
            bad(f"tensor {name}: {end - b} bytes for {dtype} {list(shape)}")
        entries[name] = Entry(dtype, shape, b, end)
    return ShardHeader(path, data_start, entries, metadata)


@dataclass
class Checkpoint:
    root: str
    config: dict
    index: Optional[dict]           # the parsed index json, None for a single-file checkpoint
    headers: dict                   # shard file name -> ShardHeader, in shard order
    where: dict                     # tensor name -> shard file name
    block: tuple = FP8_WEIGHT_BLOCK

    def entry(self, name: str) -> Entry:
        return self.headers[self.where[name]].entries[name]


def _load_json(path: str, what: str):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise AbsorbError(f"{path}: not found ({what})") from None
    except OSError as e:
        raise AbsorbError(f"{path}: {e.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AbsorbError(f"{path}: not valid JSON ({e})") from None


def open_checkpoint(root: str) -> Checkpoint:
    """config.json, the index (if any) and every shard header; checks they agree."""
    if not os.path.isdir(root):
        raise AbsorbError(f"CHECKPOINT_DIR {root}: not a directory")
    config = _load_json(os.path.join(root, CONFIG_NAME), "the model config")
    if not isinstance(config, dict):
        raise AbsorbError(f"{os.path.join(root, CONFIG_NAME)}: not a JSON object")
    if "openmla_absorbed" in config:
        raise AbsorbError(f"{root} is already absorbed (config.json openmla_absorbed = "
                          f"{json.dumps(config['openmla_absorbed'])[:120]})")
    index_path = os.path.join(root, INDEX_NAME)
    index = None
    if os.path.exists(index_path):
        index = _load_json(index_path, "the shard index")
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise AbsorbError(f"{index_path}: expected a 'weight_map' of tensor name -> shard file")
        shards = sorted(set(wm.values()))
    else:
        shards = sorted(f for f in os.listdir(root) if f.endswith(".safetensors"))
        if not shards:
            raise AbsorbError(f"CHECKPOINT_DIR {root}: no {INDEX_NAME} and no *.safetensors files")
    for s in shards:
        if os.path.isabs(s) or ".." in s.split("/"):
            raise AbsorbError(f"{index_path}: shard name {s!r} points outside the checkpoint")
    headers = {s: read_header(os.path.join(root, s)) for s in shards}
    where = {}
    for s, h in headers.items():
        for name in h.entries:
            if name in where:
                raise AbsorbError(f"tensor {name} is in two shards: {where[name]} and {s}")
            where[name] = s
    if index is not None:
        for name, s in index["weight_map"].items():
            if name not in headers[s].entries:
                raise AbsorbError(f"missing tensor {name}: {INDEX_NAME} puts it in {s}, "
                                  "which does not hold it")
    qc = config.get("quantization_config") or {}
    block = tuple(qc.get("weight_block_size") or FP8_WEIGHT_BLOCK)
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise AbsorbError("config.json quantization_config.weight_block_size: expected two "
                          f"positive ints, got {list(block)}")
    return Checkpoint(root, config, index, headers, where, block)


class TensorReader:
    """Loads one tensor at a time (safetensors safe_open); fp8 weights dequantized with their scales."""

    def __init__(self, root: str, where: dict, block):
        self.root, self.where, self.block = root, where, block

    def tensor(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.where:
            raise AbsorbError(f"missing tensor {name}")
        path = os.path.join(self.root, self.where[name])
        try:
            with safe_open(path, framework="pt") as f:
                return f.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise AbsorbError(f"unreadable shard {path}: {' '.join(str(e).split())}") from None

    def fp32(self, name: str) -> torch.Tensor:
        scale = name + "_scale_inv"
        return weight_to_fp32(self.tensor(name),
                              self.tensor(scale) if scale in self.where else None, self.block)


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
class OutTensor:
    name: str
    dtype: str
    shape: tuple
    nbytes: int
    copy_of: Optional[Entry] = None               # raw copy from the same-named input shard
    compute: Optional[tuple] = None               # (Layer, kind)


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


def _check_weight(ck: Checkpoint, name: str, want: tuple, dims: MLAWeightDims, role: str) -> bool:
    """Check a weight (and its scale) against the config; returns whether it is fp8."""
    if name not in ck.where:
        raise AbsorbError(f"missing tensor {name} (needed to absorb its layer)")
    e = ck.entry(name)
    if e.shape != want:
        keys = {"kv_b": "num_attention_heads, qk_nope_head_dim, v_head_dim, kv_lora_rank",
                "q": "num_attention_heads, qk_nope_head_dim, qk_rope_head_dim, "
                     + ("q_lora_rank" if dims.q_lora_rank is not None else "hidden_size"),
                "o": "hidden_size, num_attention_heads, v_head_dim"}[role]
        raise AbsorbError(f"{name}: shape {list(e.shape)} disagrees with config.json ({keys}), "
                          f"which gives {list(want)}")
    scale = name + "_scale_inv"
    if e.dtype == "F8_E4M3":
        if scale not in ck.where:
            raise AbsorbError(f"missing tensor {scale} (the block scales of fp8 {name})")
        se = ck.entry(scale)
        want_s = scale_inv_shape(want, ck.block)
        if se.shape != want_s or se.dtype not in _SCALES:
            raise AbsorbError(f"{scale}: expected {list(want_s)} float scales for {list(want)} in "
                              f"{ck.block[0]}x{ck.block[1]} blocks, got {se.dtype} {list(se.shape)}")
        return True
    if e.dtype not in _FLOAT_WEIGHTS:
        raise AbsorbError(f"{name}: dtype {e.dtype} not supported (expected BF16, F16, F32 or F8_E4M3)")
    if scale in ck.where:
        raise AbsorbError(f"{scale}: a scale for the {e.dtype} weight {name} (scales go with F8_E4M3)")
    return False


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
        absent = sorted(set(only_layers) - set(found))
        if absent:
            raise AbsorbError(f"--layers: no layer {absent} in the checkpoint "
                              f"(it has {_ranges(sorted(found))})")
    layers = [l for i in sorted(found) if only_layers is None or i in only_layers for l in found[i]]
    plan = Plan(mode, dtype, dims, layers)
    shapes = dims.shapes()
    out_dtype = OUT_DTYPES[dtype][1]
    replace = {}  # input weight name -> [(Layer, kind)] written in its place (same shard)
    for l in layers:
        fp8 = {role: _check_weight(ck, l.weight(role), shapes[role], dims, role)
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
        outs.sort(key=lambda t: (-_ITEMSIZE.get(t.dtype, 1), t.name))
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


def parse_layers(text: str) -> list:
    """'0-3,7' -> [0, 1, 2, 3, 7]."""
    out = set()
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m or (m[2] is not None and int(m[2]) < int(m[1])):
            raise argparse.ArgumentTypeError(f"expected layer numbers like 0-3,7, got {text!r}")
        out.update(range(int(m[1]), int(m[2] or m[1]) + 1))
    return sorted(out)


# --------------------------------------------------------------------------------------------
# Writing: a streaming safetensors writer (header first, then one tensor at a time)
# --------------------------------------------------------------------------------------------

class Computer:
    """Produces the absorbed tensors of a layer on demand, keeping W_UK/W_UV of two layers."""

    def __init__(self, reader: TensorReader, plan: Plan):
        self.reader, self.plan = reader, plan
        self.cache = OrderedDict()

    def _split(self, layer: Layer):
        if layer.prefix not in self.cache:
            d = self.plan.dims
            kv_b = self.reader.tensor(layer.weight("kv_b"))
            scale_name = layer.weight("kv_b") + "_scale_inv"
            scale = self.reader.tensor(scale_name) if scale_name in self.reader.where else None
            self.cache[layer.prefix] = split_kv_b_proj(
                kv_b, scale, num_heads=d.num_heads, qk_nope_head_dim=d.qk_nope_head_dim,
                v_head_dim=d.v_head_dim, block=self.reader.block)
            while len(self.cache) > 2:
                self.cache.popitem(last=False)
        return self.cache[layer.prefix]

    def __call__(self, layer: Layer, kind: str) -> torch.Tensor:
        w_uk, w_uv = self._split(layer)
        dtype = OUT_DTYPES[self.plan.dtype][0]
        if kind == "w_uk":
            return w_uk.to(dtype)
        if kind == "w_uv":
            return w_uv.to(dtype)
        if kind == "q_folded":
            return fold_q_proj(self.reader.fp32(layer.weight("q")), w_uk, out_dtype=dtype,
                               qk_rope_head_dim=self.plan.dims.qk_rope_head_dim)
        return fold_o_proj(self.reader.fp32(layer.weight("o")), w_uv, out_dtype=dtype)


class Progress:
    """A byte-count progress bar on stderr (redrawn in place on a terminal, a line per shard otherwise)."""

    def __init__(self, total: int, nshards: int, stream=None):
        self.total, self.nshards, self.done = max(total, 1), nshards, 0
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.last = 0.0

    def _line(self, i, name):
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        return (f"absorb [{bar}] {100 * frac:5.1f}%  {_size(self.done)}/{_size(self.total)}  "
                f"shard {i}/{self.nshards} {name}")

    def advance(self, nbytes, i, name):
        self.done += nbytes
        now = time.monotonic()
        if self.tty and now - self.last > 0.1:
            self.last = now
            print("\r" + self._line(i, name), end="", file=self.stream, flush=True)

    def shard_done(self, i, name):
        if self.tty:
            print("\r" + self._line(i, name), end="\n" if i == self.nshards else "",
                  file=self.stream, flush=True)
        else:
            print(self._line(i, name), file=self.stream, flush=True)


def _size(n: int) -> str:
    for unit, k in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n} B"


def write_shard(path: str, src: ShardHeader, outs: list, compute: Computer, progress, i, name):
    metadata = dict(src.metadata) or {"format": "pt"}
    header, off = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}, 0
    for t in outs:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    buf = bytearray(_COPY_CHUNK)
    mv = memoryview(buf)
    with open(path, "wb") as dst, open(src.path, "rb") as f_in:
        dst.write(len(hb).to_bytes(8, "little"))
        dst.write(hb)
        for t in outs:
            if t.copy_of is not None:
                f_in.seek(src.data_start + t.copy_of.begin)
                left = t.nbytes
                while left:
                    n = f_in.readinto(mv[:min(left, len(buf))])
                    if not n:
                        raise AbsorbError(f"unreadable shard {src.path}: ends inside tensor {t.name}")
                    dst.write(mv[:n])
                    left -= n
                    progress.advance(n, i, name)
            else:
                data = compute(*t.compute)
                assert tuple(data.shape) == t.shape and data.nbytes == t.nbytes, t.name
                dst.write(data.view(torch.uint8).reshape(-1).numpy().data)
                progress.advance(t.nbytes, i, name)
                del data


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
    same way whether it is absorbed or not). Returns rows {layer, split, fold (fold mode),
    baseline, bound, ok}."""
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
        wq, kv_b, wo = (src.fp32(l.weight(role)) for role in ("q", "kv_b", "o"))
        want = layer_output_unabsorbed(x_q, c_kv, k_pe, idx, wq=wq, kv_b=kv_b, wo=wo, **args)
        rounded = layer_output_unabsorbed(x_q, c_kv, k_pe, idx, **{
            k: w.to(out_dtype) for k, w in (("wq", wq), ("kv_b", kv_b), ("wo", wo))}, **args)
        row = {"layer": l.idx, "baseline": _rel(rounded, want)}
        row["bound"] = max(VERIFY_BOUND[plan.dtype], 4 * row["baseline"])
        if plan.mode == "split":  # q and o were copied through: read them back from OUT_DIR too
            wq, wo = out.fp32(l.weight("q")), out.fp32(l.weight("o"))
        got = layer_output_split(x_q, c_kv, k_pe, idx, wq=wq, w_uk=out.tensor(l.out_name("w_uk")),
                                 w_uv=out.tensor(l.out_name("w_uv")), wo=wo, **args)
        row["split"] = _rel(got, want)
        if plan.mode == "fold":
            got = layer_output_folded(x_q, c_kv, k_pe, idx,
                                      wq_folded=out.tensor(l.out_name("q_folded")),
                                      wo_folded=out.tensor(l.out_name("o_folded")), **args)
            row["fold"] = _rel(got, want)
        row["ok"] = all(row[k] <= row["bound"] for k in ("split", "fold") if k in row)
        rows.append(row)
    if tty and plan.layers:
        print("\r" + " " * 40 + "\r", end="", file=stream, flush=True)
    return rows


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
    out_existed = os.path.exists(out_dir)
    if out_existed:
        if not os.path.isdir(out_dir):
            raise AbsorbError(f"OUT_DIR {out_dir}: exists and is not a directory")
        if os.listdir(out_dir) and not force:
            raise AbsorbError(f"OUT_DIR {out_dir}: not empty (--force writes into it)")
    real_in, real_out = os.path.realpath(checkpoint_dir), os.path.realpath(out_dir)
    if real_in == real_out:
        raise AbsorbError("OUT_DIR is CHECKPOINT_DIR: write the absorbed checkpoint somewhere else")

    ck = open_checkpoint(checkpoint_dir)
    plan = make_plan(ck, mode, dtype, layers)

    os.makedirs(out_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".absorb-tmp-", dir=out_dir)
    committed = False
    try:
        compute = Computer(TensorReader(ck.root, ck.where, ck.block), plan)
        total = sum(t.nbytes for ts in plan.shards.values() for t in ts)
        progress = Progress(total, len(plan.shards), err)
        for i, (s, outs) in enumerate(plan.shards.items(), 1):
            path = os.path.join(tmp, s)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            write_shard(path, ck.headers[s], outs, compute, progress, i, s)
            progress.shard_done(i, s)
        with open(os.path.join(tmp, CONFIG_NAME), "w") as f:
            json.dump(absorbed_config(ck, plan), f, indent=2)
            f.write("\n")
        if ck.index is not None:
            index = dict(ck.index)
            index["metadata"] = dict(index.get("metadata") or {}, total_size=total)
            index["weight_map"] = dict(sorted(plan.out_where.items()))
            with open(os.path.join(tmp, INDEX_NAME), "w") as f:
                json.dump(index, f, indent=2)
                f.write("\n")
        skip = set(plan.shards) | {CONFIG_NAME, INDEX_NAME}
        for name in sorted(os.listdir(ck.root)):
            p = os.path.join(ck.root, name)
            rp = os.path.realpath(p)
            if name in skip or rp == real_out or real_out.startswith(rp + os.sep):
                continue
            if os.path.isdir(p):
                shutil.copytree(p, os.path.join(tmp, name), symlinks=True)
            else:
                shutil.copy2(p, os.path.join(tmp, name))

        rows = verify(ck, plan, tmp, seed, err) if verify_layers else []
        failed = [r for r in rows if not r["ok"]]
        if failed:
            r = failed[0]
            raise VerificationError(
                f"verification failed for {len(failed)} layer(s), first layer {r['layer']}: rel err "
                f"{max(r.get('split', 0), r.get('fold', 0)):.3g} > bound {r['bound']:.3g}; "
                f"nothing written to {out_dir}")
        for dirpath, _, files in os.walk(tmp):
            for fn in files:
                rel = os.path.relpath(os.path.join(dirpath, fn), tmp)
                dst = os.path.join(out_dir, rel)
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                os.replace(os.path.join(dirpath, fn), dst)
        committed = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not committed and not out_existed:
            try:
                os.rmdir(out_dir)
            except OSError:
                pass

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
          f"in {s['dtype']} in place of {s['removed']}; {_size(s['bytes_in'])} in, "
          f"{_size(s['bytes_out'])} out, {s['seconds']:.1f} s", file=out)
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


# --------------------------------------------------------------------------------------------
# The demo checkpoint (also the tests' fixture)
# --------------------------------------------------------------------------------------------

DEMO_DIMS = dict(num_attention_heads=4, qk_nope_head_dim=24, qk_rope_head_dim=16, v_head_dim=20,
                 kv_lora_rank=144, q_lora_rank=200, hidden_size=160)


def _demo_weight(rows, cols, gen, block):
    """A random weight whose 128x128 blocks differ in magnitude by up to 2^6 (a scale read from
    the wrong block shows), about unit gain."""
    w = torch.randn(rows, cols, generator=gen) / math.sqrt(cols)
    mag = 2.0 ** torch.randint(-3, 4, scale_inv_shape((rows, cols), block), generator=gen).float()
    return w * mag.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def build_demo_checkpoint(root: str, *, fp8: bool = True, q_lora_rank: Optional[int] = 200,
                          num_layers: int = 2, num_shards: int = 3, filler_bytes: int = 0,
                          seed: int = 0) -> dict:
    """Write a small checkpoint in DeepSeek-V3's exact layout (tensor names, row grouping,
    128x128 fp8 blocks with ragged edges: kv_b_proj is 176 x 144) with safetensors' own writer.
    fp8=False writes bf16 weights without scales (V2 style); q_lora_rank=None writes q_proj
    (V2-Lite). o_proj and one weight_scale_inv sit in other shards than the rest of their
    layer. filler_bytes adds that many bytes of untouched bf16 data to every shard. Returns the config."""
    from safetensors.torch import save_file

    os.makedirs(root, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    d = dict(DEMO_DIMS, q_lora_rank=q_lora_rank)
    H, n, r, v, L, hid = (d["num_attention_heads"], d["qk_nope_head_dim"], d["qk_rope_head_dim"],
                          d["v_head_dim"], d["kv_lora_rank"], d["hidden_size"])
    vocab, inter, block = 96, 112, FP8_WEIGHT_BLOCK
    shard_of, tensors = {}, {}

    def linear(name, rows, cols, shard):
        w = _demo_weight(rows, cols, gen, block)
        if fp8:
            tensors[name], tensors[name + "_scale_inv"] = quantize_fp8_blocks(w, block)
            shard_of[name + "_scale_inv"] = shard
        else:
            tensors[name] = w.bfloat16()
        shard_of[name] = shard

    def norm(name, size, shard):
        tensors[name] = (1 + 0.1 * torch.randn(size, generator=gen)).bfloat16()
        shard_of[name] = shard

    tensors["model.embed_tokens.weight"] = torch.randn(vocab, hid, generator=gen).bfloat16()
    shard_of["model.embed_tokens.weight"] = 0
    for i in range(num_layers):
        p, s = f"model.layers.{i}", i % num_shards
        norm(f"{p}.input_layernorm.weight", hid, s)
        norm(f"{p}.post_attention_layernorm.weight", hid, s)
        if q_lora_rank is not None:
            linear(f"{p}.self_attn.q_a_proj.weight", q_lora_rank, hid, s)
            norm(f"{p}.self_attn.q_a_layernorm.weight", q_lora_rank, s)
            linear(f"{p}.self_attn.q_b_proj.weight", H * (n + r), q_lora_rank, s)
        else:
            linear(f"{p}.self_attn.q_proj.weight", H * (n + r), hid, s)
        linear(f"{p}.self_attn.kv_a_proj_with_mqa.weight", L + r, hid, s)
        norm(f"{p}.self_attn.kv_a_layernorm.weight", L, s)
        linear(f"{p}.self_attn.kv_b_proj.weight", H * (n + v), L, s)
        linear(f"{p}.self_attn.o_proj.weight", hid, H * v, (s + 1) % num_shards)
        linear(f"{p}.mlp.gate_proj.weight", inter, hid, s)
        linear(f"{p}.mlp.up_proj.weight", inter, hid, s)
        linear(f"{p}.mlp.down_proj.weight", hid, inter, s)
    if fp8 and num_layers > 1:  # a weight and its scale in different shards (HF splits do this)
        qn = "q_b_proj" if q_lora_rank is not None else "q_proj"
        shard_of[f"model.layers.1.self_attn.{qn}.weight_scale_inv"] = num_shards - 1
    norm("model.norm.weight", hid, num_shards - 1)
    tensors["lm_head.weight"] = torch.randn(vocab, hid, generator=gen).bfloat16()
    shard_of["lm_head.weight"] = num_shards - 1
    for k in range(num_shards if filler_bytes else 0):
        name = f"model.filler.{k}.weight"  # stands for the experts: big, untouched
        tensors[name] = torch.randn(filler_bytes // 2, generator=gen).bfloat16()
        shard_of[name] = k

    files = [f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors" for k in range(num_shards)]
    for k, fn in enumerate(files):
        save_file({nm: t for nm, t in tensors.items() if shard_of[nm] == k},
                  os.path.join(root, fn), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": {nm: files[shard_of[nm]] for nm in sorted(tensors)}}
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        **d, "num_key_value_heads": H, "num_hidden_layers": num_layers, "vocab_size": vocab,
        "intermediate_size": inter, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
    }
    if fp8:
        config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3",
                                         "quant_method": "fp8", "weight_block_size": list(block)}
    for name, obj in ((INDEX_NAME, index), (CONFIG_NAME, config)):
        with open(os.path.join(root, name), "w") as f:
            json.dump(obj, f, indent=2)
    with open(os.path.join(root, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": 1}, f)
    return config


def run_demo(dtype: str, seed: int, out=None, err=None) -> int:
    out = out or sys.stdout
    with tempfile.TemporaryDirectory(prefix="openmla-absorb-demo-") as tmp:
        ck = os.path.join(tmp, "checkpoint")
        cfg = build_demo_checkpoint(ck, seed=seed)
        H, n, v, L = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"],
                      cfg["kv_lora_rank"])
        print(f"demo: DeepSeek-V3 layout, 2 layers, 3 shards, H={H} qk_nope={n} "
              f"qk_rope={cfg['qk_rope_head_dim']} v_head={v} kv_lora_rank={L} "
              f"q_lora_rank={cfg['q_lora_rank']} hidden={cfg['hidden_size']}; fp8 e4m3 weights in "
              f"128x128 blocks, kv_b_proj {H * (n + v)}x{L} "
              f"(ragged last block {H * (n + v) % 128}x{L % 128})",
              file=out)
        for mode in ("split", "fold"):
            print(file=out)
            absorb(ck, os.path.join(tmp, f"absorbed-{mode}"), mode=mode, dtype=dtype, seed=seed,
                   out=out, err=err)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(prog="absorb.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint_dir", nargs="?", metavar="CHECKPOINT_DIR")
    ap.add_argument("out_dir", nargs="?", metavar="OUT_DIR")
    ap.add_argument("--mode", choices=["split", "fold"], default="split")
    ap.add_argument("--dtype", choices=list(OUT_DTYPES), default="bf16",
                    help="dtype of every tensor written (default bf16)")
    ap.add_argument("--layers", type=parse_layers, help="layers to absorb, e.g. 0-3,7 (default all)")
    ap.add_argument("--force", action="store_true", help="write into a non-empty OUT_DIR")
    ap.add_argument("--no-verify", action="store_true", help="skip the per-layer verification")
    ap.add_argument("--seed", type=int, default=0, help="seed of the verification inputs")
    ap.add_argument("--demo", action="store_true",
                    help="absorb a small generated checkpoint in both modes (the default without arguments)")
    args = ap.parse_args(argv)
    try:
        if args.demo or (args.checkpoint_dir is None and args.out_dir is None):
            if args.checkpoint_dir is not None:
                ap.error("--demo takes no CHECKPOINT_DIR / OUT_DIR")
            return run_demo(args.dtype, args.seed)
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


if __name__ == "__main__":
    sys.exit(main())
