"""Safetensors checkpoints for tools/absorb.py: reading headers and tensors, writing shards.

Headers are parsed here (not by safetensors) so that a bad shard is a one-line AbsorbError and
untouched tensors can be copied as raw bytes; tensors are loaded through safetensors, one at a
time. The writer streams: header first, then one tensor at a time, so memory stays near the
largest tensor produced, never the shard or the model. Where the output goes (a temporary
folder, then OUT_DIR) is tools/_outdir.py's job.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from openmla.mla.absorb import FP8_WEIGHT_BLOCK, scale_inv_shape, weight_to_fp32

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2,
            "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8,
            "F64": 8}
_FLOAT_WEIGHTS = ("BF16", "F16", "F32")
_SCALES = ("F32", "BF16", "F16")
_COPY_CHUNK = 8 << 20


class AbsorbError(Exception):
    """Bad input: reported as one line, exit code 2."""


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Entry:
    """One tensor of a shard header: safetensors dtype name, shape, byte range."""

    dtype: str
    shape: tuple
    begin: int  # data offsets, relative to the end of the header
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class ShardHeader:
    """A parsed shard header: the file, where its data starts, name -> Entry, __metadata__."""

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
    if not isinstance(metadata, dict):
        bad(f"__metadata__ is not a JSON object (got {type(metadata).__name__})")
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
        if dtype in ITEMSIZE and end - b != math.prod(shape) * ITEMSIZE[dtype]:
            bad(f"tensor {name}: {end - b} bytes for {dtype} {list(shape)}")
        entries[name] = Entry(dtype, shape, b, end)
    return ShardHeader(path, data_start, entries, metadata)


@dataclass
class Checkpoint:
    """An opened checkpoint: config, index and every shard header, nothing loaded."""

    root: str
    config: dict
    index: Optional[dict]           # the parsed index json, None for a single-file checkpoint
    headers: dict                   # shard file name -> ShardHeader, in shard order
    where: dict                     # tensor name -> shard file name
    block: tuple = FP8_WEIGHT_BLOCK

    def entry(self, name: str) -> Entry:
        return self.headers[self.where[name]].entries[name]

    def check_linear(self, name: str, want: tuple, config_keys: str) -> bool:
        """Check a linear weight (and its scale) from the headers, nothing loaded: present, of
        shape want (config_keys: the config.json keys that give it, for the error), F8_E4M3 with
        `<name>_scale_inv` float block scales, or a float without them. Returns whether it is fp8."""
        if name not in self.where:
            raise AbsorbError(f"missing tensor {name} (needed to absorb its layer)")
        e = self.entry(name)
        if e.shape != want:
            raise AbsorbError(f"{name}: shape {list(e.shape)} disagrees with config.json "
                              f"({config_keys}), which gives {list(want)}")
        scale = name + "_scale_inv"
        if e.dtype == "F8_E4M3":
            if scale not in self.where:
                raise AbsorbError(f"missing tensor {scale} (the block scales of fp8 {name})")
            se, want_s, block = self.entry(scale), scale_inv_shape(want, self.block), self.block
            if se.shape != want_s or se.dtype not in _SCALES:
                raise AbsorbError(f"{scale}: expected {list(want_s)} float scales for {list(want)} "
                                  f"in {block[0]}x{block[1]} blocks, got {se.dtype} {list(se.shape)}")
            return True
        if e.dtype not in _FLOAT_WEIGHTS:
            raise AbsorbError(f"{name}: dtype {e.dtype} not supported "
                              "(expected BF16, F16, F32 or F8_E4M3)")
        if scale in self.where:
            raise AbsorbError(f"{scale}: a scale for the {e.dtype} weight {name} "
                              "(scales go with F8_E4M3)")
        return False


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
        if not isinstance(index.get("metadata") or {}, dict):
            raise AbsorbError(f"{index_path}: 'metadata': expected a JSON object, got "
                              f"{_json_text(index['metadata'])}")
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
    return Checkpoint(root, config, index, headers, where, _weight_block(config, root))


def _json_text(value, limit: int = 80) -> str:
    """A config value as its JSON text, cut to limit characters (a wrong value may be huge)."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _weight_block(config: dict, root: str) -> tuple:
    """The fp8 block shape: config.json quantization_config.weight_block_size, two positive
    ints (DeepSeek's [128, 128] when absent); AbsorbError for any other value or type."""
    where = f"{os.path.join(root, CONFIG_NAME)} quantization_config"
    qc = config.get("quantization_config")
    if qc is None:
        return FP8_WEIGHT_BLOCK
    if not isinstance(qc, dict):
        raise AbsorbError(f"{where}: expected a JSON object, got {_json_text(qc)}")
    block = qc.get("weight_block_size")
    if block is None:
        return FP8_WEIGHT_BLOCK
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise AbsorbError(f"{where}.weight_block_size: expected two positive ints like [128, 128], "
                          f"got {_json_text(block)}")
    return tuple(block)


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
# Writing: a streaming safetensors writer (header first, then one tensor at a time)
# --------------------------------------------------------------------------------------------

@dataclass
class OutTensor:
    """One tensor of a shard to write: copied from the input or computed."""

    name: str
    dtype: str
    shape: tuple
    nbytes: int
    copy_of: Optional[Entry] = None               # raw copy from the same-named input shard
    compute: Optional[tuple] = None               # the arguments of write_shard's compute


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
        return (f"absorb [{bar}] {100 * frac:5.1f}%  {size_text(self.done)}/"
                f"{size_text(self.total)}  shard {i}/{self.nshards} {name}")

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


def size_text(n: int) -> str:
    """A byte count for people: '467.1 KB'."""
    for unit, k in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n} B"


def write_shard(path: str, src: ShardHeader, outs: list, compute: Callable, progress: Progress,
                i: int, name: str) -> None:
    """Write one shard to path with the OutTensors outs, in their order: one with copy_of (an
    Entry of src) is copied as raw bytes from src's file, any other is compute(*t.compute), a CPU
    tensor of exactly t.shape and t.nbytes."""
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


def write_shards(ck: Checkpoint, dst_root: str, shards: dict, compute: Callable, stream=None) -> int:
    """Write every shard of shards (file name -> [OutTensor], sources in ck) under dst_root, with
    a progress bar on stream (default stderr). Returns the bytes of tensor data written."""
    total = sum(t.nbytes for ts in shards.values() for t in ts)
    progress = Progress(total, len(shards), stream)
    for i, (s, outs) in enumerate(shards.items(), 1):
        path = os.path.join(dst_root, s)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_shard(path, ck.headers[s], outs, compute, progress, i, s)
        progress.shard_done(i, s)
    return total


def write_json(path: str, obj) -> None:
    """obj as indented JSON with a final newline (config.json, the shard index)."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def write_index(ck: Checkpoint, dst_root: str, weight_map: dict, total_size: int) -> None:
    """The shard index of the written checkpoint: the input's, with weight_map (tensor name ->
    shard file) and metadata.total_size replaced. A single-file checkpoint has none."""
    if ck.index is None:
        return
    index = dict(ck.index)
    index["metadata"] = dict(index.get("metadata") or {}, total_size=total_size)
    index["weight_map"] = dict(sorted(weight_map.items()))
    write_json(os.path.join(dst_root, INDEX_NAME), index)


def other_entries(src_root: str, skip, real_out: str) -> list:
    """Top-level names in src_root to copy into the output: all but those in skip, the output
    folder real_out (a realpath) and any folder holding it."""
    out = []
    for name in sorted(os.listdir(src_root)):
        rp = os.path.realpath(os.path.join(src_root, name))
        if name in skip or rp == real_out or real_out.startswith(rp + os.sep):
            continue
        out.append(name)
    return out


def copy_other_files(src_root: str, dst_root: str, names) -> None:
    """Copy the top-level entries names of src_root into dst_root: a file (or a link to one, as
    a Hugging Face snapshot holds them) by content, a folder whole with links inside kept as links."""
    for name in names:
        p = os.path.join(src_root, name)
        if os.path.isdir(p):
            shutil.copytree(p, os.path.join(dst_root, name), symlinks=True)
        else:
            shutil.copy2(p, os.path.join(dst_root, name))
