"""SparseMLAImpl: what an engine calls once per layer per step for DeepSeek-V3.2-style sparse MLA.

    impl = SparseMLAImpl(num_heads, scale, "fp8_ds_mla", max_model_len=...)
    impl.load_kv_b_proj(kv_b_proj.weight, kv_b_proj.weight_scale_inv)      # once, at load
    plan = impl.build_plan(query_start_loc, seq_lens, block_table, slot_mapping, block_size=64,
                           query_lens_cpu=..., seq_lens_cpu=...)          # once per step
    impl.write_cache(kv_c, k_pe, cache, slot_mapping)                      # per layer
    out = impl.forward(q_nope, q_pe, cache, topk_indices, plan)            # per layer

forward absorbs the query into the latent space (q_lat_h = q_nope_h W_UK[h]), attends over the
latent cache with the sparse kernels (mla/sparse/plan.py says which tokens take which path), and
projects the latent output back (o_h = o_lat_h W_UV[h]). mla/absorb.py holds the weight maths.

Decode context parallelism (dcp=, mla/cp.py): the cache holds this rank's share of every request's
tokens (write_cache takes the rank's slot mapping, where another rank's tokens are -1). forward
gathers the group's query heads ("sharded"), attends over the local slots of the top-k, and merges
the ranks' partial (out, lse) before the output projection; forward_mqa(return_lse=True) gives
the partial alone, for an engine that merges itself (vLLM's MLA layer does).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from openmla.kernels.index import convert_checked, convert_req_index_to_global
from openmla.kernels.head_matmul import bind_absorb_convert, bind_head_matmul, head_matmul
from openmla.kernels.sparse_mla_decode import sparse_mla_decode
from openmla.kernels.merge_project import bind_merge_project, fuses
from openmla.kernels.sparse_mla_decode.op import bind_layer, check_inputs, layer_plan, run_plan
from openmla.kernels.sparse_mla_prefill import sparse_mla_prefill
from openmla.mla import D_QK, KV_LORA_RANK, ROPE_DIM
from openmla.mla.absorb import split_kv_b_proj
from openmla.mla.cp import ContextParallel
from openmla.mla.sparse.plan import MAX_HEADS, SparseMLAPlan, build_sparse_mla_plan
from openmla.quant.format_types import SPARSE_MLA
from openmla.quant.formats import cache_format
from openmla.quant.validate import check_same_device, check_tensor, fail
from openmla.quant.mla_gather import gather_upconvert
from openmla.quant.mla_writer import write_mla_cache

__all__ = ["SparseMLAImpl"]


class SparseMLAImpl:
    """One sparse MLA attention layer (per tensor-parallel rank), without vLLM.

    Args:
        num_heads: H, query heads of this rank, 1..128 (never padded).
        scale: softmax scale applied to q.k (DeepSeek: (n + r)^-0.5 times the YaRN mscale^2).
        kv_cache_dtype: the cache format, by name or as a quant descriptor (resolved once, by
            quant.cache_format, and kept as `cache_format`): "bf16"/"auto"/"bfloat16" (BF16_MLA,
            cache [blocks, block_size, 576] bf16), "fp8_ds_mla"/"fp8" (FP8_DS_MLA, cache
            [blocks, block_size, 656] uint8) or "fp8_ds_mla_raw" (FP8_DS_MLA_RAW: the same bytes,
            written with the older vLLM scale rule); others raise NotImplementedError.
        kv_lora_rank: L, must be 512; qk_rope_head_dim: r, must be 64 (the kernels' widths;
            other values raise NotImplementedError).
        qk_nope_head_dim: n (DeepSeek 128), v_head_dim: v (DeepSeek 128): any positive size.
        max_model_len: longest sequence served; the fp8 separate path's workspace holds
            workspace_rows (default 5 * max_model_len) bf16 rows of 576, allocated once, on first use.
        fp8_path: "mixed", "separate" or None (auto: mixed below 32 heads); see mla/sparse/plan.py.
        dcp: this rank's ContextParallel (mla/cp.py), or None. With "sharded" heads the kernels
            see dcp.attn_heads(num_heads) = N * num_heads heads (<= 128).
    """

    def __init__(self, num_heads: int, scale: float, kv_cache_dtype, *,
                 kv_lora_rank: int = KV_LORA_RANK, qk_nope_head_dim: int = 128,
                 qk_rope_head_dim: int = ROPE_DIM, v_head_dim: int = 128, max_model_len: int,
                 fp8_path: Optional[str] = None, workspace_rows: Optional[int] = None,
                 dcp: Optional[ContextParallel] = None):
        self.cache_format = cache_format(kv_cache_dtype, SPARSE_MLA, who="SparseMLAImpl")
        if kv_lora_rank != KV_LORA_RANK or qk_rope_head_dim != ROPE_DIM:
            raise NotImplementedError(
                f"SparseMLAImpl: kv_lora_rank={kv_lora_rank}, qk_rope_head_dim={qk_rope_head_dim}; "
                f"the sparse MLA kernels need kv_lora_rank={KV_LORA_RANK} and qk_rope_head_dim={ROPE_DIM}")
        for name, val in (("num_heads", num_heads), ("qk_nope_head_dim", qk_nope_head_dim),
                          ("v_head_dim", v_head_dim), ("max_model_len", max_model_len)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                fail(name, "a positive int", repr(val))
        if dcp is not None and not isinstance(dcp, ContextParallel):
            fail("dcp", "None or an openmla.mla.cp.ContextParallel", type(dcp).__name__)
        attn_heads = num_heads if dcp is None else dcp.attn_heads(num_heads)
        if attn_heads > MAX_HEADS:
            raise NotImplementedError(
                f"SparseMLAImpl: {attn_heads} heads per kernel call (num_heads={num_heads}"
                + ("" if dcp is None else f", DCP x{dcp.world_size}") + f") > {MAX_HEADS} (the kernels' limit)")
        if (isinstance(scale, bool) or not isinstance(scale, (int, float))
                or not (math.isfinite(scale) and scale > 0)):
            fail("scale", "a finite positive float", repr(scale))
        if workspace_rows is None:
            workspace_rows = 5 * max_model_len
        if isinstance(workspace_rows, bool) or not isinstance(workspace_rows, int) or workspace_rows < 1:
            fail("workspace_rows", "a positive int", repr(workspace_rows))
        if not self.cache_format.quantized and fp8_path is not None:
            fail("fp8_path", "None for a bf16 cache (it picks how an fp8 cache is read)", repr(fp8_path))
        self.num_heads = num_heads
        self.dcp = dcp
        self.attn_heads = attn_heads  # heads of the q forward_mqa takes
        self.scale = float(scale)
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.max_model_len = max_model_len
        self.fp8_path = fp8_path
        self.workspace_rows = workspace_rows
        self.W_UK: Optional[torch.Tensor] = None  # [H, n, L] bf16
        self.W_UV: Optional[torch.Tensor] = None  # [H, L, v] bf16
        self._workspace: Optional[torch.Tensor] = None  # [workspace_rows, 576] bf16
        self._cache_dtype = self.cache_format.cache_dtype  # read by every forward's checks
        self._row_width = self.cache_format.row_width

    # ------------------------------------------------------------------ load time
    def load_kv_b_proj(self, weight: torch.Tensor, weight_scale_inv: Optional[torch.Tensor] = None) -> None:
        """Split kv_b_proj into W_UK [H, n, L] and W_UV [H, L, v], stored in bf16.

        Args:
            weight: [H*(n+v), L] bf16/fp16/fp32, or float8_e4m3fn with weight_scale_inv; rows per
                head [n rows of W_UK[h] | v rows of W_UV[h]^T] (DeepSeek's layout).
            weight_scale_inv: [ceil(H*(n+v)/128), ceil(L/128)] fp32 block scales of an fp8
                weight (dequantized exactly, in fp32, before the single rounding to bf16); None
                for a float weight.
        ValueError names a shape that does not match this layer's configuration.
        """
        H, n, v, L = self.num_heads, self.qk_nope_head_dim, self.v_head_dim, self.kv_lora_rank
        check_tensor("kv_b_proj.weight", weight, ndim=2)
        want = (H * (n + v), L)
        if tuple(weight.shape) != want:
            fail("kv_b_proj.weight.shape",
                 f"{want} = (num_heads*(qk_nope_head_dim+v_head_dim), kv_lora_rank) for H={H}, n={n}, "
                 f"v={v}, L={L}", tuple(weight.shape))
        w_uk, w_uv = split_kv_b_proj(weight, weight_scale_inv, num_heads=H, qk_nope_head_dim=n,
                                     v_head_dim=v)
        self.W_UK = w_uk.to(torch.bfloat16).contiguous()
        self.W_UV = w_uv.to(torch.bfloat16).contiguous()

    # ------------------------------------------------------------------ per step
    def build_plan(self, query_start_loc, seq_lens, block_table, slot_mapping, *, block_size: int,
                   decode_threshold: int = 1, query_lens_cpu=None, seq_lens_cpu=None,
                   max_query_len=None, req_id_out=None, dcp_local_seq_lens=None) -> SparseMLAPlan:
        """build_sparse_mla_plan with this layer's heads (as the kernels see them), cache dtype,
        fp8 path, workspace and DCP place (req_id_out: a persistent buffer for CUDA graphs,
        dcp_local_seq_lens: the engine's local lengths under DCP; mla/sparse/plan.py)."""
        return build_sparse_mla_plan(
            query_start_loc, seq_lens, block_table, slot_mapping, block_size=block_size,
            num_heads=self.attn_heads, kv_cache_dtype=self.cache_format,
            max_model_len=self.max_model_len, decode_threshold=decode_threshold,
            fp8_path=self.fp8_path, workspace_rows=self.workspace_rows,
            query_lens_cpu=query_lens_cpu, seq_lens_cpu=seq_lens_cpu,
            max_query_len=max_query_len, req_id_out=req_id_out, dcp=self.dcp,
            dcp_local_seq_lens=dcp_local_seq_lens)

    # ------------------------------------------------------------------ per layer
    def write_cache(self, kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
        """Write this step's new tokens into the cache (quant.write_mla_cache, no host sync).

        kv_c [T, 512], k_pe [T, 64] (bf16; fp16/fp32 accepted), cache in this layer's format,
        slot_mapping [T] int32/int64 (< 0: skip the token; out-of-range slots are skipped too).
        """
        fmt = self._check_cache(cache)
        write_mla_cache(kv_c, k_pe, cache, slot_mapping, fmt=fmt, check_slots=False)

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                topk_indices: torch.Tensor, plan: SparseMLAPlan, *,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Sparse MLA attention of one layer, MHA form in and out.

        Args:
            q_nope: [T, H, n] bf16, q_pe: [T, H, r] bf16 (RoPE already applied); any strides.
            cache: this layer's cache (written for every token of the batch).
            topk_indices: [T, topk] int32, positions within each token's request, in
                [0, seq_len) of that request (the indexer's causal top-k). An index < 0 or
                >= its request's seq_len is skipped on every path (request isolation: never a
                stale slot of the request's blocks, never another request's workspace row); a
                row of only those gives 0.
            plan: this step's plan (build_plan), checked against the shapes here.
            out: optional [T, H, v] bf16 to write into.

        Returns [T, H, v] bf16: o_h = softmax(scale * q.k over the selected tokens) . V_h, with
        k = [W_UK[h]^T c | k_pe] and V_h = W_UV[h]^T c. The absorption and the output projection
        are bf16 per-head matmuls (kernels.head_matmul: fp32 sums, rounded to bf16).
        """
        if self.W_UK is None:
            raise RuntimeError("SparseMLAImpl.forward: call load_kv_b_proj() first")
        H, n, r, v = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        T, dev, bf16 = plan.num_tokens, plan.device, torch.bfloat16
        # the checks below as one expression (attribute reads); the named checks say what is wrong
        if not (isinstance(q_nope, torch.Tensor) and q_nope.dtype == bf16 and q_nope.shape == (T, H, n)
                and q_nope.device == dev and isinstance(q_pe, torch.Tensor) and q_pe.dtype == bf16
                and q_pe.shape == (T, H, r) and q_pe.device == dev and self.W_UK.device == dev
                and (out is None or (isinstance(out, torch.Tensor) and out.dtype == bf16
                                     and out.shape == (T, H, v) and out.device == dev))):
            check_tensor("q_nope", q_nope, dtype=bf16, shape=(T, H, n))
            check_tensor("q_pe", q_pe, dtype=bf16, shape=(T, H, r))
            if out is not None:
                check_tensor("out", out, dtype=bf16, shape=(T, H, v))
            check_same_device(q_nope=q_nope, q_pe=q_pe, W_UK=self.W_UK, out=out,
                              **{"plan tensors": plan.req_id_per_token})
        W_UK, W_UV = self.W_UK, self.W_UV
        if (self.dcp is None and plan.num_decode_tokens == T and q_nope.stride(2) == 1
                and q_pe.stride(2) == 1 and (out is None or out.stride(2) == 1)
                and W_UK.dtype == bf16 and W_UV.dtype == bf16 and W_UK.stride(2) == 1
                and W_UV.stride(2) == 1 and W_UV.device == dev
                and W_UK.shape == (H, n, KV_LORA_RANK) and W_UV.shape == (H, KV_LORA_RANK, v)):
            # (the unchecked launches need what head_matmul's checks ask of the weights too: a
            # layer whose weights were replaced by other tensors takes the checked path below)
            layer = self._decode_layer(cache, topk_indices, plan)
            first = layer is None and T > 0 and self._layer_inputs_ok(cache, topk_indices, plan)
            if first:  # the step's first layer of this cache layout: its prologue checked
                layer = self._first_decode_layer(q_nope, q_pe, cache, topk_indices, plan)
            if layer is not None:
                absorb, decode, project = layer[3] or self._bind_decode_layer(layer, plan)
                # the absorption (rope tail included) and the index conversion in one launch (the
                # first layer ran them as the checked ops), the decode, then the output
                # projection (with the split decode's merge at a few tokens)
                if not first:
                    absorb(q_nope, W_UK, q_pe, topk_indices)
                decode(cache, self.scale)
                if out is None:
                    out = torch.empty(T, H, v, dtype=bf16, device=dev)
                project(W_UV, out)
                return out
        # (head_matmul reads rows with a contiguous last dim; any other layout is copied once)
        if q_nope.stride(2) != 1:
            q_nope = q_nope.contiguous()
        if q_pe.stride(2) != 1:
            q_pe = q_pe.contiguous()
        # the absorbed query [q_nope W_UK | q_pe] and the latent output are step scratch
        # (plan.buffer); one launch writes both parts of the query
        q = plan.buffer("q", (T, H, D_QK), bf16)
        head_matmul(q_nope, self.W_UK, tail=q_pe, out=q)
        o_lat = plan.buffer("o_lat", (T, H, KV_LORA_RANK), bf16)
        if self.dcp is None:
            self.forward_mqa(q, cache, topk_indices, plan, out=o_lat)
        else:  # this rank's partial over the group's heads, merged across the ranks
            part, lse = self.forward_mqa(self.dcp.gather_heads(q), cache, topk_indices, plan,
                                         return_lse=True)
            self.dcp.merge(part, lse, result=o_lat)
        if out is not None and out.stride(2) != 1:
            out.copy_(head_matmul(o_lat, self.W_UV))
            return out
        return head_matmul(o_lat, self.W_UV, out=out)

    def forward_mqa(self, q: torch.Tensor, cache: torch.Tensor, topk_indices: torch.Tensor,
                    plan: SparseMLAPlan, *, out: Optional[torch.Tensor] = None,
                    return_lse: bool = False):
        """Latent (absorbed) sparse attention, for callers that absorb the query themselves.

        Args:
            q: [T, Ha, 576] bf16 (latent 512 | rope 64), last dim contiguous; Ha = attn_heads
                (num_heads, or the DCP group's gathered heads: dcp.gather_heads).
            cache, topk_indices, plan: as forward.
            out: optional [T, Ha, 512] bf16, last dim contiguous.
            return_lse: also return lse [T, Ha] fp32 (natural log, -inf for a row without a
                valid index). Needs a plan that runs every token through the decode kernel
                (bf16 or mixed path, decode-only steps, every DCP plan); NotImplementedError
                for a separate-path step with prefills.

        Returns [T, Ha, 512] bf16, the softmax-weighted latent; 0 for a token without a valid
        index (and for padding tokens); (out, lse) with return_lse. With a DCP plan this is the
        rank's partial over its local tokens (its top-k entries held by other ranks skipped):
        ContextParallel.merge combines the ranks' partials.
        """
        if not self._mqa_inputs_ok(q, cache, topk_indices, plan, out):
            check_tensor("q", q, dtype=torch.bfloat16, shape=(None, self.attn_heads, D_QK),
                         last_dim_contiguous=True)
            self._check_cache(cache)
            if plan.cache_format != self.cache_format:
                fail("plan.cache_format", f"{self.cache_format.name!r} (this layer's cache)",
                     repr(plan.cache_format.name))
            plan.check_matches(q, cache, topk_indices)
            if out is not None:
                check_tensor("out", out, dtype=torch.bfloat16, shape=(q.shape[0], q.shape[1], KV_LORA_RANK),
                             last_dim_contiguous=True)
                check_same_device(q=q, out=out)
        T, H = plan.num_tokens, plan.num_heads
        if out is None:
            out = torch.empty(T, H, KV_LORA_RANK, dtype=torch.bfloat16, device=q.device)
        bs = plan.block_size

        # every conversion bounds an index by its own request's seq_len (request isolation)
        td = plan.num_decode_tokens
        if td == T:  # every row through the decode kernel: no slices (decode-only steps)
            n_local = None
            if plan.dcp is None:
                layer = self._decode_layer(cache, topk_indices, plan)
                if layer is not None:
                    lse = self._run_decode_layer(layer, q, cache, topk_indices, plan, out)
                else:  # the step's first layer of this cache layout: the checked ops
                    idx = plan.buffer("slots", tuple(topk_indices.shape), torch.int32)
                    convert_req_index_to_global(plan.req_id_per_token, plan.block_table,
                                                topk_indices, bs, seq_lens=plan.seq_lens, out=idx)
                    _, lse = sparse_mla_decode(q, cache, idx, scale=self.scale, out=out,
                                               fmt=self.cache_format)
                    if T > 0:  # (an empty step launches nothing: no launch plan to keep)
                        self._remember_decode_layer(q, cache, idx, plan)
                return (out, lse) if return_lse else out
            else:  # this rank's share of the top-k as local slots, in front, with its count
                cp = plan.dcp
                idx, n_local = convert_req_index_to_global(
                    plan.req_id_per_token, plan.block_table, topk_indices, bs,
                    seq_lens=plan.local_seq_lens, dcp=(cp.world_size, cp.rank, cp.interleave))
            _, lse = sparse_mla_decode(q, cache, idx, scale=self.scale, topk_length=n_local, out=out,
                                       fmt=self.cache_format)
            return (out, lse) if return_lse else out
        if return_lse:
            raise NotImplementedError("SparseMLAImpl.forward_mqa(return_lse=True) with a separate-path "
                                      "prefill step (the lse comes from the decode kernel's path)")
        if td > 0:
            idx = convert_req_index_to_global(plan.req_id_per_token[:td], plan.block_table,
                                              topk_indices[:td], bs, seq_lens=plan.seq_lens)
            sparse_mla_decode(q[:td], cache, idx, scale=self.scale, out=out[:td], fmt=self.cache_format)
        if plan.prefill_chunks:
            ws = self._get_workspace(plan, q.device)
            for ch in plan.prefill_chunks:
                gather_upconvert(cache, ws, ch.block_table, ch.seq_lens, ch.workspace_starts,
                                 max_seq_len=ch.max_seq_len, fmt=self.cache_format)
                t0, t1 = ch.token_start, ch.token_end
                idx = convert_req_index_to_global(
                    plan.req_id_per_token[t0:t1], plan.block_table, topk_indices[t0:t1], bs,
                    workspace=(ch.workspace_request_ids, ch.workspace_starts), seq_lens=plan.seq_lens)
                sparse_mla_prefill(q[t0:t1], ws[:ch.num_rows], idx, scale=self.scale, out=out[t0:t1])
        if plan.num_padding_tokens > 0:
            out[T - plan.num_padding_tokens:] = 0
        return out

    # ------------------------------------------------------------------ helpers
    # A decode-only step (every token through the decode kernel, no DCP) runs the same launches in
    # every layer. The step's first layer of a cache layout runs checked ops (forward: the
    # absorption, the index conversion and sparse_mla_decode's input checks; forward_mqa: the
    # conversion and sparse_mla_decode) and leaves in the step's plan the decode op's launch plan
    # and the step buffers (slots, lse, split partials). Every later layer checks its own tensors
    # with forward's / forward_mqa's one-expression checks (`_layer_inputs_ok` for the cache and
    # the indices) and launches directly; forward's first layer makes the same decode and
    # projection launches as its later ones, so all layers of a step compute alike.
    def _layer_key(self, cache, topk_indices, plan: SparseMLAPlan) -> tuple:
        capturing = plan.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        return ("decode layer", capturing, cache.shape, cache.stride(), cache.data_ptr() & 15 == 0,
                topk_indices.shape[1])

    def _decode_layer(self, cache, topk_indices, plan: SparseMLAPlan):
        """What _remember_decode_layer kept for inputs like these, or None (not yet, or inputs
        that fail the checks: the caller's checked path then says what is wrong)."""
        if not self._layer_inputs_ok(cache, topk_indices, plan):
            return None
        return plan.scratch.get(self._layer_key(cache, topk_indices, plan))

    def _remember_decode_layer(self, q, cache, idx, plan: SparseMLAPlan) -> list:
        """After the checked ops ran on q, cache and the slots idx (a plan.buffer): keep the
        decode op's launch plan and the step buffers it writes, and return that record. Its last
        item is filled by forward (_bind_decode_layer): its three launches bound to the step's
        buffers."""
        launch, lse_shape, parts = layer_plan(q, cache, idx, self.cache_format)
        scratch = (plan.buffer("lse", lse_shape, torch.float32),
                   None if parts is None else plan.buffer("partial out", parts[0], torch.float32),
                   None if parts is None else plan.buffer("partial lse", parts[1], torch.float32))
        layer = plan.scratch[self._layer_key(cache, idx, plan)] = [launch, idx, scratch, None]
        return layer

    def _first_decode_layer(self, q_nope, q_pe, cache, topk_indices, plan: SparseMLAPlan):
        """forward's first layer of a decode-only step and cache layout, its inputs passing
        forward's and _layer_inputs_ok's expressions: the absorption and the index conversion as
        the checked ops into the step's buffers, sparse_mla_decode's checks of the cache, and the
        layer's record (_remember_decode_layer), whose launches run next as in every later
        layer."""
        T, H = plan.num_tokens, self.num_heads
        q = plan.buffer("q", (T, H, D_QK), torch.bfloat16)
        head_matmul(q_nope, self.W_UK, tail=q_pe, out=q)
        idx = plan.buffer("slots", tuple(topk_indices.shape), torch.int32)
        convert_req_index_to_global(plan.req_id_per_token, plan.block_table, topk_indices,
                                    plan.block_size, seq_lens=plan.seq_lens, out=idx)
        check_inputs(q, cache, idx, self.cache_format)
        return self._remember_decode_layer(q, cache, idx, plan)

    def _bind_decode_layer(self, layer, plan: SparseMLAPlan) -> tuple:
        """forward's three launches bound to the step's buffers, kept as the record's last item:
        the absorption with the index conversion, the decode, the projection. A split decode
        where merge_project.fuses leaves its partials to merge_project, which merges and projects
        in one launch; otherwise the decode (and its merge) writes the latent output and
        head_matmul projects it."""
        T, H, bf16 = plan.num_tokens, self.num_heads, torch.bfloat16
        launch, idx, scratch, _ = layer
        q = plan.buffer("q", (T, H, D_QK), bf16)
        o_lat = plan.buffer("o_lat", (T, H, KV_LORA_RANK), bf16)
        po, plse = scratch[1], scratch[2]
        fused = po is not None and fuses(T, H, po.shape[1], KV_LORA_RANK)
        layer[3] = (
            bind_absorb_convert(q, plan.req_id_per_token, plan.block_table, idx, plan.seq_lens,
                                plan.block_size),
            bind_layer(launch, q, idx, o_lat, scratch, self.cache_format, merge=not fused),
            bind_merge_project(po, plse) if fused else bind_head_matmul(o_lat))
        return layer[3]

    def _run_decode_layer(self, layer, q, cache, topk_indices, plan: SparseMLAPlan, out):
        """The index conversion into the step's slots and the decode launch (checked inputs).
        Returns lse [T, H] (a step buffer)."""
        launch, idx, scratch, _ = layer
        convert_checked(plan.req_id_per_token, plan.block_table, topk_indices, plan.block_size,
                        plan.seq_lens, idx)
        return run_plan(launch, q, cache, idx, None, None, out, self.scale, self.cache_format,
                        scratch=scratch)

    def _mqa_inputs_ok(self, q, cache, topk_indices, plan, out) -> bool:
        """forward_mqa's boundary checks (the named ones it falls back to: q, the cache in this
        layer's format, the plan's shapes, topk_indices, out, one device) as one expression of
        attribute reads, for the call that passes them all."""
        T, dev = plan.num_tokens, plan.device
        return (isinstance(q, torch.Tensor) and q.dtype == torch.bfloat16
                and q.shape == (T, self.attn_heads, D_QK) and q.stride(2) == 1 and q.device == dev
                and (out is None or (isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
                                     and out.shape == (T, self.attn_heads, KV_LORA_RANK)
                                     and out.stride(2) == 1 and out.device == dev))
                and self._layer_inputs_ok(cache, topk_indices, plan))

    def _layer_inputs_ok(self, cache, topk_indices, plan: SparseMLAPlan) -> bool:
        """The cache and topk_indices part of _mqa_inputs_ok (and the plan's heads and format)."""
        T, dev = plan.num_tokens, plan.device
        return (plan.num_heads == self.attn_heads
                and (plan.cache_format is self.cache_format or plan.cache_format == self.cache_format)
                and isinstance(cache, torch.Tensor) and cache.dtype == self._cache_dtype
                and cache.dim() == 3 and cache.shape[1] == plan.block_size
                and cache.shape[2] == self._row_width and cache.stride(2) == 1 and cache.device == dev
                and isinstance(topk_indices, torch.Tensor) and topk_indices.dtype == torch.int32
                and topk_indices.dim() == 2 and topk_indices.shape[0] == T and topk_indices.shape[1] >= 1
                and (topk_indices.stride(1) == 1 or topk_indices.shape[1] == 1)
                and topk_indices.device == dev)

    def _check_cache(self, cache: torch.Tensor):
        self.cache_format.check_cache(cache)
        return self.cache_format

    def _get_workspace(self, plan: SparseMLAPlan, device: torch.device) -> torch.Tensor:
        """The bf16 prefill workspace, allocated on first use and reused by every later step."""
        if plan.workspace_rows > self.workspace_rows:
            fail("plan.workspace_rows", f"<= {self.workspace_rows} (this layer's workspace)",
                 plan.workspace_rows)
        if self._workspace is None or self._workspace.device != device:
            self._workspace = torch.empty(self.workspace_rows, D_QK, dtype=torch.bfloat16, device=device)
        return self._workspace



