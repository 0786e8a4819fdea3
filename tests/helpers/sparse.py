"""SparseMLAImpl engine steps (tests/mla/test_mla_impl.py, tests/vllm/test_vllm_backend.py): one
step over a NaN-filled strided paged cache with a shuffled block table, decodes first, invalid and
empty index rows, DeepSeek's fp8 kv_b_proj, a non-default scale, and the float64 unabsorbed
reference fed the formats' round trips."""
import math

import torch

from openmla.mla.absorb import attention_unabsorbed, dequantize_fp8_blocks, quantize_fp8_blocks
from tests.helpers import DEVICE, INT32_MAX, INT32_MIN, random_paged_cache, shuffled_block_table

SCALE = 0.083
N_NOPE, ROPE, V_DIM, L = 128, 64, 128, 512
INVALID = [INT32_MIN, -123456, -1, INT32_MAX]
# (context, new tokens) per request, decodes first as the engine orders them.
MIXED_BATCH = [(30, 1), (47, 1), (20, 3), (37, 3), (10, 6), (0, 9), (22, 8), (5, 7)]
# rows (token of a request, as (request, i)) whose indices are all invalid: out must be 0
EMPTY_ROWS = {(1, 0), (5, 4)}


def kv_b_proj_fp8(H, g, n=N_NOPE, v=V_DIM):
    """DeepSeek's kv_b_proj: fp8 e4m3 [H*(n+v), L] with 128x128 block scales."""
    w = torch.randn(H * (n + v), L, generator=g) / math.sqrt(L)
    return quantize_fp8_blocks(w)


def reference_weight(w8, scale):
    """kv_b_proj as the layer holds it: exactly dequantized, then bf16 (W_UK/W_UV are stored in
    bf16, as vLLM does; test_load_kv_b_proj_* pin that rounding exactly), as fp32."""
    return dequantize_fp8_blocks(w8, scale).to(torch.bfloat16).float()


class Step:
    """One engine step over a paged cache: inputs for the impl and the float64 reference."""

    def __init__(self, impl, reqs, *, block_size, topk, padding, seed, empty_rows=()):
        g = torch.Generator().manual_seed(seed)
        self.g = g
        fmt = impl.cache_format
        H, bs = impl.num_heads, block_size
        self.reqs = reqs
        R = len(reqs)
        self.qlens = [n for _, n in reqs]
        self.seq = [c + n for c, n in reqs]
        nblk = [-(-s // bs) for s in self.seq]
        M = max(nblk)
        num_blocks = R * M + 5  # the table's unused entries are -1, their blocks stay NaN
        bt = shuffled_block_table(R, M, num_blocks, generator=g, device="cpu")
        for r in range(R):
            bt[r, nblk[r]:] = -1
        self.cache, _ = random_paged_cache(num_blocks, bs, fmt.row_width, fmt.cache_dtype)
        lat = [torch.randn(s, L, generator=g).to(torch.bfloat16) for s in self.seq]
        pe = [torch.randn(s, ROPE, generator=g).to(torch.bfloat16) for s in self.seq]

        def slot(r, p):
            return int(bt[r, p // bs]) * bs + p % bs

        # an earlier step wrote the context
        ctx = [(r, p) for r, (c, _) in enumerate(reqs) for p in range(c)]
        if ctx:
            impl.write_cache(torch.stack([lat[r][p] for r, p in ctx]).to(DEVICE),
                             torch.stack([pe[r][p] for r, p in ctx]).to(DEVICE), self.cache,
                             torch.tensor([slot(r, p) for r, p in ctx], dtype=torch.int32, device=DEVICE))
        # this step's tokens, then padding (slot -1: not written)
        toks = [(r, c + i) for r, (c, n) in enumerate(reqs) for i in range(n)]
        T = len(toks) + padding
        self.T = T
        kv_c = torch.randn(T, L, generator=g).to(torch.bfloat16)
        k_pe = torch.randn(T, ROPE, generator=g).to(torch.bfloat16)
        for t, (r, p) in enumerate(toks):
            kv_c[t], k_pe[t] = lat[r][p], pe[r][p]
        self.slot_mapping = torch.tensor([slot(r, p) for r, p in toks] + [-1] * padding,
                                         dtype=torch.int32, device=DEVICE)
        impl.write_cache(kv_c.to(DEVICE), k_pe.to(DEVICE), self.cache, self.slot_mapping)

        qsl = [0]
        for n in self.qlens:
            qsl.append(qsl[-1] + n)
        self.query_start_loc = torch.tensor(qsl, dtype=torch.int32, device=DEVICE)
        self.seq_lens = torch.tensor(self.seq, dtype=torch.int32, device=DEVICE)
        self.block_table = bt.to(DEVICE)

        # q_nope | q_pe as slices of one [T, H, n + r] tensor (vLLM splits q this way)
        q = torch.randn(T, H, N_NOPE + ROPE, generator=g).to(torch.bfloat16).to(DEVICE)
        self.q_nope, self.q_pe = q[..., :N_NOPE], q[..., N_NOPE:]

        # indices: causal positions (distinct, random order) and invalid values; padding rows
        # get positions too, which must be ignored
        base = [0]
        for s in self.seq:
            base.append(base[-1] + s)
        idx = torch.empty(T, topk, dtype=torch.int32)
        ref = torch.full((T, topk), -1, dtype=torch.int64)
        per_req = {}
        for t, (r, p) in enumerate(toks):
            i = per_req.setdefault(r, 0)
            per_req[r] += 1
            n_bad = topk if (r, i) in empty_rows else int(torch.randint(1, 5, (1,), generator=g))
            n_ok = min(p + 1, topk - n_bad)
            pos = torch.randperm(p + 1, generator=g)[:n_ok]
            bad = torch.tensor(INVALID)[torch.randint(0, len(INVALID), (topk - n_ok,), generator=g)]
            order = torch.randperm(topk, generator=g)
            idx[t] = torch.cat([pos, bad])[order].to(torch.int32)
            ref[t] = torch.cat([pos + base[r], torch.full((topk - n_ok,), -1)])[order]
        idx[len(toks):] = torch.randint(0, 8, (padding, topk), generator=g, dtype=torch.int32)
        self.topk_indices = idx.to(DEVICE)

        # reference rows: the format's round trip of every (request, position) latent
        rows = torch.cat([fmt.unpack(fmt.pack(lat[r], pe[r])) for r in range(R)])  # [N, 576] fp32
        self.ref_rows, self.ref_idx, self.q_cpu = rows, ref, q.cpu()

    def plan(self, impl, *, threshold, host_lens=True):
        kw = dict(query_lens_cpu=self.qlens, seq_lens_cpu=self.seq) if host_lens else {}
        return impl.build_plan(self.query_start_loc, self.seq_lens, self.block_table, self.slot_mapping,
                               block_size=self.cache.shape[1], decode_threshold=threshold, **kw)

    def reference(self, w_fp32, H):
        """float64 unabsorbed MLA: per-head K = [W_UK c | k_pe], V = W_UV^T c."""
        c, k_pe = self.ref_rows[:, :L].double(), self.ref_rows[:, L:].double()
        kv = (c @ w_fp32.double().T).view(-1, H, N_NOPE + V_DIM)
        return attention_unabsorbed(self.q_cpu.double(), kv[..., :N_NOPE], k_pe, kv[..., N_NOPE:],
                                    self.ref_idx, scale=SCALE)
