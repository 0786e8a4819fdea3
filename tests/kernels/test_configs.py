"""kernels.configs: the one way every op chooses its launch config (candidates, prune rule,
shape-class key; autotune or select; OPENMLA_AUTOTUNE=0 takes the first survivor)."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from openmla.kernels.configs import ConfigSpace
from openmla.kernels.paged_attention import kernel as paged_kernel
from openmla.kernels.sparse_mla_prefill import op as prefill_op

CANDIDATES = tuple(triton.Config({"BLOCK": b}, num_warps=w) for b in (64, 32, 128) for w in (4, 8))


def _prune(configs, named_args, **constexprs):
    """Keeps the blocks that divide N, 4 warps for blocks below 64 (the toy rules of this test)."""
    return [c for c in configs if constexprs["N"] % c.kwargs["BLOCK"] == 0
            and not (c.kwargs["BLOCK"] < 64 and c.num_warps == 8)]


SPACE = ConfigSpace("toy_kernel", CANDIDATES, key=("N",), prune=_prune)


def _blocks(configs):
    return [(c.kwargs["BLOCK"], c.num_warps) for c in configs]


def test_select_is_the_first_survivor_in_candidate_order():
    assert _blocks(SPACE.survivors({}, N=192)) == [(64, 4), (64, 8), (32, 4)]
    assert _blocks([SPACE.select({}, N=192)]) == [(64, 4)]
    assert _blocks([SPACE.select({}, N=96)]) == [(32, 4)]


def test_a_prune_rule_that_keeps_nothing_is_an_error():
    with pytest.raises(RuntimeError, match="toy_kernel: its prune rule kept no launch config"):
        SPACE.select({}, N=7)


@pytest.mark.parametrize("env,want", [("1", [(64, 4), (64, 8), (32, 4)]), ("0", [(64, 4)])])
def test_autotune_times_the_survivors_or_takes_the_first(env, want, monkeypatch):
    """The autotuner gets the candidates and the key; its prune step is the space's rule, cut to
    the first survivor under OPENMLA_AUTOTUNE=0 (read when a new shape class is pruned)."""
    @SPACE.autotune()
    @triton.jit
    def toy_kernel(x_ptr, N, BLOCK: tl.constexpr):
        pass

    assert list(toy_kernel.configs) == list(CANDIDATES) and list(toy_kernel.keys) == ["N"]
    monkeypatch.setenv("OPENMLA_AUTOTUNE", env)
    toy_kernel.nargs = {"x_ptr": torch.empty(1)}
    assert _blocks(toy_kernel.prune_configs({"N": 192})) == want



@pytest.mark.parametrize("kernel,space", [
    (paged_kernel.paged_attention_kernel, paged_kernel._SPACE),
    (prefill_op.sparse_mla_prefill_kernel, prefill_op._SPACE),
], ids=["paged_attention", "sparse_mla_prefill"])
def test_tuned_ops_are_wired_to_their_space(kernel, space):
    assert list(kernel.configs) == list(space.candidates)
    assert list(kernel.keys) == list(space.key)


def test_paged_attention_decode_class_first_survivor(monkeypatch):
    """What a short-query bf16 launch runs under OPENMLA_AUTOTUNE=0 (GPU test runs): the 16-row
    block its host plan asked for, the first of the sound defaults."""
    monkeypatch.setenv("OPENMLA_AUTOTUNE", "0")
    shape = dict(BLOCK_M_WANT=16, BLOCK_D=128, IS_FP8=False, K_INT8=False, V_INT8=False)
    c = paged_kernel._SPACE.select({"q_ptr": torch.empty(1)}, **shape)
    assert (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) == (16, 64, 4, 2)


@pytest.mark.parametrize("H", [1, 5, 16, 17, 32, 64, 100, 128])
def test_sparse_mla_decode_selects_its_measured_table(H):
    """The decode op's hand-measured table expressed as a space: 16-head blocks of 32 rows at 4
    warps capped at 168 registers (3 programs per SM) up to 16 heads, 32-head blocks of 64 rows
    at 8 warps (one per SM) above; never timed."""
    from openmla.kernels.sparse_mla_decode import op as decode_op
    cfg = decode_op._pick_config(torch.empty(1), H)
    want = (dict(BLOCK_H=16, BLOCK_N=32, num_warps=4, num_stages=2, maxnreg=168, occupancy=3)
            if H <= 16 else
            dict(BLOCK_H=32, BLOCK_N=64, num_warps=8, num_stages=2, maxnreg=None, occupancy=1))
    assert cfg == want


@pytest.mark.parametrize("block_h,want", [(16, (32, True, 3, 4)), (32, (32, True, 3, 4)),
                                          (64, (64, False, 3, 8))])
def test_sparse_mla_prefill_first_survivor_is_the_measured_choice(block_h, want):
    """What the portable prefill kernel runs untimed (OPENMLA_AUTOTUNE=0) on a 227 KB-shared-memory
    device: the configs its prune rule's comments name as measured best."""
    c = prefill_op._SPACE.select({"q_ptr": torch.empty(1)}, BLOCK_H=block_h)
    assert (c.kwargs["BLOCK_N"], c.kwargs["PREFETCH"], c.num_stages, c.num_warps) == want
