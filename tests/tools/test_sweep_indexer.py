"""tools/_sweep_indexer.py (tools/sweep.py --indexer): the set-change measure is 0 where the fp8 path
is exact and grows with what quantization rounds away."""
import torch

from openmla.tools._sweep_indexer import indexer_rows, indexer_table

SHAPE = [dict(context=1024, topk=64, rows=4)]


def _grid_values(kind, shape, gen, device):
    """Values on a coarse dyadic grid: multiples of 1/4 up to 2, which e4m3 holds exactly after
    any power-of-two scale (q is drawn as kind 'gaussian': on the grid too); kind 'fine' adds
    noise that e4m3 partly rounds away to the keys."""
    x = torch.randint(-8, 9, shape, generator=gen, device=device).float() / 4
    x = x + torch.rand(shape, generator=gen, device=device) * 0.1 if kind == "fine" else x
    return x, torch.ones(x[0].numel(), device=device)


def test_exact_inputs_change_nothing_and_noise_does():
    rows = indexer_rows(["grid", "fine"], SHAPE, sample=_grid_values, seed=1)
    exact, fine = rows
    # fp8 q and k are exact and the weights' folding rounds in fp32 only: the sets differ only
    # where that rounding reorders exact ties, which costs no logit
    assert exact["changed_mean"] <= 1 / 64 and abs(exact["logit_loss_mean"]) < 1e-6
    assert fine["changed_mean"] > exact["changed_mean"]
    assert 0 <= fine["changed_max"] <= 1
    table = indexer_table(rows)
    assert table.count("\n") == 3 and "| grid | 1024 | 64 | 4 |" in table
