"""The DSA indexer rows of tools/sweep.py (`--indexer`, issue 26): how often the fp8 path changes
the lightning indexer's selected top-k set, against fp32 math on the same unquantized inputs.

For each data kind and shape: `rows` query tokens (64 heads of 128, bf16) and `context` keys
(128, bf16) drawn as tools/sweep.py draws its data (gaussian, outlier channels, heavy-tailed; with
outlier key channels q is divided by the same factor, as the sweep does for attention), random
head weights. The reference top-k comes from float64 logits of the bf16 q and k (weights times
softmax_scale * head_scale, vLLM's folding without q's scale); the measured top-k from the
path vLLM runs: q quantized per token and head with ue8m0 scales (indexer_q_quant_ref), k through
the cache format (INDEXER_K_FP8.pack), logits by kernels.indexer.mqa_logits on a GPU or by its
oracle elsewhere (which the kernel equals within fp32 rounding), top-k of each.

Reported per row: `changed`, the fraction of the top-k set that differs (|A xor B| / 2k), mean and
max over the query rows, and `logit_loss`: how much of the reference top-k's summed logit the
fp8 selection misses (sum over its set of the reference logits vs the best possible), mean.
Random data has far more near-ties than a trained model's indexer: read these as what
quantization can move, not as a model's figure.
"""
from __future__ import annotations

import zlib

import torch

from openmla.kernels import reference
from openmla.quant.indexer_cache import INDEXER_K_FP8

H, D = 64, 128
SOFTMAX_SCALE, HEAD_SCALE = D ** -0.5, H ** -0.5
GRIDS = {
    "default": [dict(context=2048, topk=512, rows=8), dict(context=8192, topk=2048, rows=4)],
    "full": [dict(context=c, topk=2048, rows=16) for c in (4096, 16384, 65536)],
}


def _logits_fp8(q, w, k, device, run_kernels):
    qf, wf = reference.indexer_q_quant_ref(q, w, softmax_scale=SOFTMAX_SCALE, head_scale=HEAD_SCALE)
    kv, ks = INDEXER_K_FP8.pack(k)
    k8, ks = kv.view(torch.float8_e4m3fn), ks[:, 0].contiguous()
    T, S = q.shape[0], k.shape[0]
    starts = torch.zeros(T, dtype=torch.int32, device=device)
    ends = torch.full((T,), S, dtype=torch.int32, device=device)
    if run_kernels:
        from openmla.kernels.indexer import mqa_logits
        return mqa_logits(qf, wf, k8, ks, starts, ends)
    return reference.mqa_logits_ref(qf, wf, k8, ks, starts, ends)


def _logits_ref(q, w, k):
    s = torch.einsum("thd,sd->ths", q.double(), k.double()).relu()
    return (s * (w.double() * SOFTMAX_SCALE * HEAD_SCALE)[:, :, None]).sum(1)


def indexer_rows(kinds, grid: list, *, sample, seed: int = 0, device=None, run_kernels: bool = False) -> list:
    """One row per (shape, data kind); `sample(kind, shape, gen, device) -> (x, gain)` is the
    sweep's data generator."""
    device = torch.device(device or ("cuda" if run_kernels else "cpu"))
    rows = []
    for shape in grid:
        S, k, T = shape["context"], shape["topk"], shape["rows"]
        for kind in kinds:
            gen = torch.Generator(device=device).manual_seed(
                seed ^ zlib.crc32(f"indexer-{S}-{k}-{kind}".encode()))
            keys, gain = sample(kind, (S, D), gen, device)
            # q of the gaussian kind (divided by the key gains: scores keep their spread)
            q = sample("gaussian", (T, H, D), gen, device)[0] / gain
            w = torch.randn(T, H, generator=gen, device=device)
            q, keys = q.bfloat16(), keys.bfloat16()
            ref = _logits_ref(q, w, keys)
            got = _logits_fp8(q, w, keys, device, run_kernels)
            top_ref = torch.topk(ref, k, dim=-1).indices
            top_got = torch.topk(got.double(), k, dim=-1).indices
            changed, loss = [], []
            for r in range(T):
                a, b = set(top_ref[r].tolist()), set(top_got[r].tolist())
                changed.append(len(a ^ b) / (2 * k))
                best = ref[r, top_ref[r]].sum()
                loss.append(float((best - ref[r, top_got[r]].sum()) / best.abs().clamp_min(1e-300)))
            rows.append({"family": "indexer", "kind": kind, "context": S, "topk": k, "rows": T,
                         "measured": "kernel" if run_kernels else "oracle",
                         "changed_mean": sum(changed) / T, "changed_max": max(changed),
                         "logit_loss_mean": sum(loss) / T})
    return rows


def indexer_table(rows: list) -> str:
    lines = ["| data | context | topk | query rows | set changed (mean) | set changed (max) | "
             "top-k logit lost (mean) | measured |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['context']} | {r['topk']} | {r['rows']} | {r['changed_mean']:.2%} | "
                     f"{r['changed_max']:.2%} | {r['logit_loss_mean']:.2e} | {r['measured']} |")
    return "\n".join(lines)
