"""DSA indexer steps (tests/mla/test_indexer_step.py, tests/vllm/test_vllm_indexer.py): index keys
of a batch written into a NaN-filled strided index cache, the indexer query of every token, the
openmla oracles' selection per request, and the one comparison of selections (sets, up to ties)."""
import torch

from openmla.kernels.reference.indexer import indexer_q_quant_ref, paged_mqa_logits_ref, topk_per_row_ref
from openmla.quant.indexer_cache import write_indexer_k_cache
from tests.helpers import DEVICE, random_paged_cache

D_INDEX = 128
# A logit's fp8 MMA accumulation error relative to its logit of |q|, |w|, |k|
# (kernels/indexer/_tile.py): both logits kernels sum the whole K = 128 in the MMA, as DeepGEMM's
# do. Exact fp32 paths (the interpreter, fp16 dots) are far inside it.
FP8_MMA_REL = 2.0 ** -7


def abs_index_cache(cache, fmt):
    """A copy of an indexer cache holding |k| (every value's sign bit cleared; NaN stays NaN)."""
    c = cache.clone()
    fmt.read_ref(c)[0].bitwise_and_(0x7F)
    return c


class IndexInputs:
    """The index side of a batch of requests (context, new tokens) over `block_table` [R, M]
    (block_size bs, num_blocks): the keys of every (request, position) written into a NaN-filled
    strided index cache (the context's as an earlier step wrote them; the step's new keys are
    `new_k` [T, 128] bf16 and `slots` [T], padding rows random with slot -1, written by
    `write_new()` unless the code under test writes them), and the indexer query of all T tokens
    (`q_fp8` [T, heads, 128], `weights` [T, heads], quantized and folded as the model does)."""

    def __init__(self, reqs, block_table, num_blocks, bs, T, heads, fmt, seed):
        g = torch.Generator().manual_seed(seed)
        bt = block_table.cpu()
        self.fmt, self.reqs, self.T = fmt, reqs, T
        self.cache, _ = random_paged_cache(num_blocks, bs, fmt.bytes_per_token, torch.uint8)
        ctx_slots, ctx_keys, new_slots, new_keys = [], [], [], []
        for r, (c, n) in enumerate(reqs):
            keys = torch.randn(c + n, D_INDEX, generator=g) * torch.rand(c + n, 1, generator=g) * 4
            for p in range(c + n):
                (ctx_slots if p < c else new_slots).append(int(bt[r, p // bs]) * bs + p % bs)
            ctx_keys.append(keys[:c])
            new_keys.append(keys[c:])
        pad = T - len(new_slots)
        new_keys.append(torch.randn(pad, D_INDEX, generator=g))
        if ctx_slots:
            write_indexer_k_cache(torch.cat(ctx_keys).to(torch.bfloat16).to(DEVICE), self.cache,
                                  torch.tensor(ctx_slots, dtype=torch.int32, device=DEVICE), fmt=fmt)
        self.new_k = torch.cat(new_keys).to(torch.bfloat16).to(DEVICE)
        self.slots = torch.tensor(new_slots + [-1] * pad, dtype=torch.int64, device=DEVICE)
        q = torch.randn(T, heads, D_INDEX, generator=g).to(torch.bfloat16)
        w = torch.randn(T, heads, generator=g)
        self.q_fp8, self.weights = indexer_q_quant_ref(q.to(DEVICE), w.to(DEVICE),
                                                       softmax_scale=D_INDEX ** -0.5,
                                                       head_scale=heads ** -0.5)

    def write_new(self):
        write_indexer_k_cache(self.new_k, self.cache, self.slots, fmt=self.fmt)


def oracle_selection(idx, block_table, topk):
    """The oracles' top-k of every token of `idx`'s batch, one paged row group per request with
    per-row context lengths (position + 1); padding tokens select nothing. Returns (selection
    [T, topk] int32 on the CPU, per token (the fp32 logits of its visible positions, their logits
    of |q|, |w|, |k|: what the decode logits' accumulation error scales with))."""
    sel = torch.full((idx.T, topk), -1, dtype=torch.int32)
    logits_of = [None] * idx.T
    abs_cache = abs_index_cache(idx.cache, idx.fmt)
    t = 0
    for r, (c, n) in enumerate(idx.reqs):
        ends = torch.arange(c + 1, c + n + 1, dtype=torch.int32, device=DEVICE)
        args = (ends.view(1, n), block_table[r:r + 1])
        q, w = idx.q_fp8[t:t + n].unsqueeze(0), idx.weights[t:t + n]
        lg = paged_mqa_logits_ref(q, w, idx.cache, *args, max_model_len=c + n, fmt=idx.fmt)
        bound = paged_mqa_logits_ref(q.float().abs(), w.abs(), abs_cache, *args, max_model_len=c + n,
                                     fmt=idx.fmt)
        sel[t:t + n] = topk_per_row_ref(lg, ends, topk).cpu()
        for i in range(n):
            logits_of[t + i] = (lg[i, :c + i + 1].cpu(), bound[i, :c + i + 1].cpu())
        t += n
    return sel, logits_of


def assert_same_selection(got, want, logits_of, *, rtol=1e-5):
    """Row by row the same set of positions (-1 fill ignored, no duplicates); a position in one
    set only must tie with the weakest logit the reference keeps (within rtol of it, relative to
    max(1, |logit|)), the only freedom the top-k contract leaves. `logits_of[t]`: the reference
    logits of row t's visible positions, or (those logits, their logits of |q|, |w|, |k|): then a
    tie also spans the fp8 MMA's accumulation error of both logits (FP8_MMA_REL of each bound)."""
    got, want = got.cpu(), want.cpu()
    for t in range(want.shape[0]):
        g, w = got[t][got[t] >= 0].tolist(), want[t][want[t] >= 0].tolist()
        a, b = set(g), set(w)
        assert len(a) == len(g) == len(w) == len(b), (t, sorted(g), sorted(w))
        if a == b:
            continue
        lg, bound = logits_of[t] if isinstance(logits_of[t], tuple) else (logits_of[t], None)
        p_kth = min(b, key=lambda p: float(lg[p]))
        kth = float(lg[p_kth])
        for p in a ^ b:
            tol = rtol * max(1.0, abs(kth))
            if bound is not None:
                tol += FP8_MMA_REL * (float(bound[p]) + float(bound[p_kth]))
            assert abs(float(lg[p]) - kth) <= tol, (t, p, float(lg[p]), kth, tol)
