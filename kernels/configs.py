"""How every op in `openmla.kernels` chooses its launch config: one mechanism, documented here.

A launch config is a `triton.Config`: the tile-shape constexprs (BLOCK_N, ...) plus num_warps,
num_stages and optionally maxnreg. Each Triton kernel whose config is a choice declares one
`ConfigSpace` next to it:

1. Candidates: a list of `triton.Config`, the sound defaults first. Order matters: the first
   candidate that survives pruning is what runs when nothing is timed.
2. A prune rule with the signature of Triton's `early_config_prune`,
   `prune(configs, named_args, **constexprs) -> kept configs`: `named_args` holds the kernel's
   positional arguments by parameter name (the device of its tensors is the GPU to plan for:
   `kernels.device`), `constexprs` the launch's constexprs. It drops every candidate that cannot
   run or is known to lose for that shape class on that device, each rule with a comment saying
   why (registers, shared memory, a measured loser), keeps the survivors in candidate order, and
   never returns an empty list (an op whose rules can reject everything adds its own fallback).
   A rule may reduce a shape class to a single measured config: a hand-measured table is a prune
   rule that keeps one config per class.
3. A key: the constexprs that name the shape class (head-count bucket, GQA, head dim, page size,
   topk bucket, cache format flags, split count; STYLE.md 9), never raw token counts, so a
   choice is made once per class and reused.

From the survivors, a space picks in one of two ways:

- `@space.autotune()` on the kernel (`triton.autotune` keyed on `key`): the first launch of a
  shape class times every survivor and keeps the fastest. Warm such kernels up outside CUDA-graph
  capture. With `OPENMLA_AUTOTUNE=0` (read at each new shape class) nothing is timed: the first
  survivor runs, one compile per class (GPU test runs, quick experiments).
- `space.select(named_args, **constexprs)` on the host: the first survivor, never timed. For
  kernels whose config the host needs before the launch (sparse_mla_decode sizes its split count
  from the config's block shape and occupancy) or that must be capturable on their first call.
  Their prune rule is the measured table, so OPENMLA_AUTOTUNE has nothing to change there.

Where each op stands:

    op                            kernel                          picks by    key
    paged_attention,              paged_attention_kernel          autotune    BLOCK_M_WANT, GQA,
      varlen_attention                                                        HEAD_DIM, PAGE_SIZE,
                                                                              IS_FP8, K_INT8,
                                                                              V_INT8, NUM_SPLITS
    sparse_mla_prefill (Triton)   sparse_mla_prefill_kernel       autotune    H_BUCKET, TOPK_BUCKET,
                                                                              D_ROPE (576 or 512 rows)
    sparse_mla_decode (Triton)    sparse_mla_decode_kernel        select      H (<= 16 or more)
    mqa_logits (DSA indexer)      mqa_logits_kernel               autotune    HP, CLEAN, FP8_DOT

Not config spaces, on purpose:
- The Gluon kernels for Hopper (`sparse_mla_*/sm90*.py`) are each written for one tile shape
  (their module constants BLOCK_N, NUM_WARPS, the head block): their layouts, warp
  specialisation and register budget are built around it, so another shape is another kernel,
  not another config.
- Small kernels with no tile choice (split-KV reductions and merges, index conversion, cache
  writers and gathers) launch with fixed num_warps.
- The indexer's decode logits and top-k (`kernels/indexer/`) launch one fixed config, not yet
  measured: the decode logits size their split count from the tile before launch and must be
  capturable on their first call; the top-k is a loop of passes over one row.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Sequence

import triton

__all__ = ["ConfigSpace", "autotune_enabled"]

# prune(configs, named_args, **constexprs) -> kept configs (Triton's early_config_prune)
Prune = Callable[..., list]


def autotune_enabled() -> bool:
    """False under OPENMLA_AUTOTUNE=0: tuned kernels run their first surviving config untimed."""
    return os.environ.get("OPENMLA_AUTOTUNE", "1") != "0"


@dataclass(frozen=True)
class ConfigSpace:
    """The launch configs of one kernel: candidates (sound defaults first), the prune rule and
    the shape-class key (module docstring)."""
    name: str
    candidates: tuple
    key: tuple
    prune: Prune

    def survivors(self, named_args: dict, configs: Sequence[triton.Config] = None,
                  **constexprs) -> list:
        """The configs worth running for this launch, in candidate order."""
        kept = list(self.prune(list(self.candidates if configs is None else configs), named_args,
                               **constexprs))
        if not kept:
            raise RuntimeError(f"{self.name}: its prune rule kept no launch config for "
                               f"{constexprs}")
        return kept

    def select(self, named_args: dict, **constexprs) -> triton.Config:
        """The config the host launches with, untimed: the first survivor."""
        return self.survivors(named_args, **constexprs)[0]

    def autotune(self, **autotune_kwargs):
        """`triton.autotune` over the candidates keyed on `key`: times the survivors of the prune
        rule on the first launch of a shape class, or takes the first under OPENMLA_AUTOTUNE=0."""
        def early_config_prune(configs, named_args, **constexprs):
            kept = self.survivors(named_args, configs, **constexprs)
            return kept if autotune_enabled() else kept[:1]

        return triton.autotune(configs=list(self.candidates), key=list(self.key),
                               prune_configs_by={"early_config_prune": early_config_prune},
                               **autotune_kwargs)
