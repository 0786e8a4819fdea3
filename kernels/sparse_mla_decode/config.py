"""Launch configs of the portable Triton decode kernels and the topk split count
(kernels/sparse_mla_decode/op.py plans with them; the MODEL1 kernel uses the same table: its
register and shared-memory footprint is the fp8_ds_mla kernel's)."""
from __future__ import annotations

import triton

from openmla.kernels.configs import ConfigSpace
from openmla.kernels.device import arch_of

# The Triton kernel's config is selected on the host, not autotuned (kernels/configs.py):
# autotuning benchmarks on the first call, which cannot happen inside CUDA-graph capture, and the
# split count chosen on the host depends on the block shape. `_SPACE`'s prune rule is the table
# measured on Hopper (docs/notes/sparse_mla_decode.md).


def _config(block_h, block_n, num_warps, maxnreg=None):
    return triton.Config({"BLOCK_H": block_h, "BLOCK_N": block_n}, num_warps=num_warps,
                         num_stages=2, maxnreg=maxnreg)


def _table(configs, named_args, *, H):
    """The table measured on Hopper (docs/notes/sparse_mla_decode.md), one config per head-count
    bucket: H <= 16 in 16-head blocks of 32 rows at 4 warps, capped at 168 registers (three
    programs per SM); larger H in 32-head blocks of 64 rows at 8 warps (one program per SM).
    Both fit every target's shared memory (at most 115 KB on sm_90, 63 KB before it, 41 KB on
    AMD: tests/kernels/test_aot_compile.py); the register cap is an NVIDIA option (AMD has no
    maxnreg), so there the 16-head block runs uncapped."""
    capped_ok = arch_of(named_args["q_ptr"].device).maxnreg
    return [c for c in configs if (c.kwargs["BLOCK_H"] == 16) == (H <= 16)
            and (c.maxnreg is None or capped_ok)]


_SPACE = ConfigSpace("sparse_mla_decode_kernel",
                     (_config(16, 32, 4, maxnreg=168), _config(16, 32, 4), _config(32, 64, 8)),
                     key=("H",), prune=_table)


def _model1_table(configs, named_args, *, H):
    """The MODEL1 kernel (model1_kernel.py): the table above (its footprint is the same: eight
    64-wide accumulators for four 128-wide ones), except that 32-head blocks step 32 keys where a
    program has under 160 KB of shared memory: the 64-key step stages 128 KB on sm_90-class
    pipelines, past sm_120's 99 KB (32-key steps: 80 KB there; tests/kernels/aot_compile.py)."""
    big = arch_of(named_args["q_ptr"].device).smem_bytes >= 160 * 1024
    return [c for c in _table(configs, named_args, H=H)
            if c.kwargs["BLOCK_H"] == 16 or (c.kwargs["BLOCK_N"] == 64) == big]


_M1_SPACE = ConfigSpace("sparse_mla_decode_model1_kernel",
                        (_config(16, 32, 4, maxnreg=168), _config(16, 32, 4), _config(32, 64, 8),
                         _config(32, 32, 8)), key=("H",), prune=_model1_table)


def _pick_config(q, H: int, space=_SPACE) -> dict:
    """The config of a Triton kernel for H heads (`space.select`), as the planner reads it.

    occupancy: programs of this config resident per SM (registers and shared memory), used to
    size the split count. 16-head blocks: 168 registers x 128 threads and 72 KB shared -> 3 per
    SM. 32-head blocks: one program of 8 warps per SM (255 registers)."""
    c = space.select({"q_ptr": q}, H=H)
    return dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages, maxnreg=c.maxnreg,
                occupancy=3 if c.kwargs["BLOCK_H"] == 16 else 1)


WAVES = 2  # at most about two rounds of resident programs
MIN_STEPS = 5  # shorter splits spend more on the q prologue, partial stores and the merge
MIN_FILL = 0.9  # share of the resident-program slots the last round must keep busy
LONG_STEPS = 32  # key blocks a split keeps when a one-round kernel splits a long list for the rounds' fill
LONG_FILL = 0.95  # the rounds' fill such a split aims for


def _fill(programs: int, slots: int) -> float:
    """The share of the rounds' program slots that `programs` keep busy."""
    return programs / (triton.cdiv(programs, slots) * slots)


def _split_chunk(topk: int, splits: int, block_n: int) -> int:
    """Keys per split: a multiple of BLOCK_N; ceil(topk / chunk) splits actually run."""
    return triton.cdiv(triton.cdiv(topk, splits), block_n) * block_n


def _pick_splits(T: int, num_hb: int, topk: int, cfg: dict, num_sms: int) -> int:
    """Split count from shapes and the SM count only (no device tensor is read).

    Programs all run the same number of key blocks, so the GPU works in rounds of
    occupancy x SMs programs: a count just under a multiple of that round keeps every slot busy,
    one just over leaves a nearly empty last round that takes as long as a full one. Take the
    largest split count up to WAVES rounds (one for the Gluon kernels) whose rounds are
    at least MIN_FILL full, with at least MIN_STEPS key blocks per split (the Triton kernels,
    unless that floor leaves the first round part empty); failing that, the fullest. A list of
    fewer than MIN_STEPS blocks does not split."""
    base = T * num_hb
    slots = cfg["occupancy"] * num_sms
    # a list of at least MIN_STEPS key blocks may split; then the first round of programs is
    # always filled, down to one key block a program where the tokens alone leave SMs idle (a
    # batch of 1-16: a program's serial gathers bound it, and more programs shorten the batch)
    floor = topk // (MIN_STEPS * cfg["BLOCK_N"])
    one_round = min(slots // base, triton.cdiv(topk, cfg["BLOCK_N"])) if floor else 1
    if cfg.get("one_round"):
        if base > slots and topk >= 2 * LONG_STEPS * cfg["BLOCK_N"]:
            return _long_splits(base, slots, topk, cfg["BLOCK_N"])
        # the Gluon kernels (one program per SM): a single round, as each split pays the q
        # prologue and a partial row for each of its heads (the timings against the two-round
        # rule: docs/notes/sparse_mla_decode.md)
        most = max(1, one_round)
    else:
        most = max(1, min(triton.cdiv(WAVES * slots, base), floor), one_round)
    best, best_fill = 1, 0.0
    for s in range(1, most + 1):
        s = triton.cdiv(topk, _split_chunk(topk, s, cfg["BLOCK_N"]))
        fill = _fill(base * s, slots)
        if fill >= MIN_FILL or fill > best_fill + 1e-9 and best_fill < MIN_FILL:
            best, best_fill = s, fill
    return best


def _long_splits(base: int, slots: int, topk: int, block_n: int) -> int:
    """A one-round kernel's split count where its programs fill more than one round and each has a
    long list (topk 16384 at 148 tokens x 2 head blocks: 296 programs on 132 SMs leave the third
    round a quarter full). The fewest splits of at least LONG_STEPS key blocks whose rounds are
    LONG_FILL full; failing that, the fullest. A split of that length pays its q prologue and its
    partial rows (written, then merged) on under a tenth of its work."""
    best, best_fill = 1, _fill(base, slots)
    for s in range(2, topk // (LONG_STEPS * block_n) + 1):
        if best_fill >= LONG_FILL:
            break
        s = triton.cdiv(topk, _split_chunk(topk, s, block_n))
        fill = _fill(base * s, slots)
        if fill > best_fill + 1e-9:
            best, best_fill = s, fill
    return best


def _triton_config(q, H: int, config, space=_SPACE) -> dict:
    """A Triton kernel's config for H heads, updated with a pinned `config` (tests, sweeps)."""
    cfg = _pick_config(q, H, space)
    if config:
        cfg.update(config)
    return cfg


def _head_blocks(cfg: dict, H: int):
    """(heads a program, head blocks a token): BLOCK_H, shrunk to H's power of two (>= 16, a dot's
    smallest M)."""
    block_h = max(16, min(cfg["BLOCK_H"], triton.next_power_of_2(H)))
    return block_h, triton.cdiv(H, block_h)


def _splits(T: int, num_hb: int, length: int, cfg: dict, num_splits, sms: int):
    """(keys a split, splits) over `length` keys: `num_splits` when given, else `_pick_splits`;
    the count is what a chunk of whole BLOCK_N key blocks leaves."""
    if num_splits is None:
        num_splits = _pick_splits(T, num_hb, length, cfg, sms)
    chunk = _split_chunk(length, num_splits, cfg["BLOCK_N"])
    return chunk, triton.cdiv(length, chunk)
