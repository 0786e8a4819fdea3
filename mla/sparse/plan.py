"""Per-step batch metadata for the sparse MLA layer: plan once per step, run every layer.

An engine calls `build_sparse_mla_plan` once per step with what it has (query_start_loc,
seq_lens, block_table, slot_mapping, and the host copies of the lengths it keeps anyway);
every layer's `SparseMLAImpl.forward` then reads the frozen plan (STYLE.md 6).

Paths (what runs which token):
    "bf16"      bf16 cache: every token through the decode kernel, which reads the paged cache.
    "mixed"     fp8 cache: every token through the decode kernel (dequantizes in the kernel).
                vLLM's choice below 32 heads per rank, where the prefill kernel's head blocks
                would be mostly empty.
    "separate"  fp8 cache: decode tokens through the decode kernel; prefill requests gathered
                chunk by chunk into a bf16 workspace (`quant.gather_upconvert`) and run by the
                prefill kernel over it.

Batch order: the engine puts decode requests (query_len <= decode_threshold) first, as vLLM's
reorder does. The decode part is the leading run of such requests; a short request after the
first long one is run with the prefills (correct, only slower), so the order is never wrong,
only cheaper when the engine keeps it. Decode lengths need not be uniform: the decode kernel
takes per-token indices.

Host syncs: the bf16 and mixed paths and decode-only separate steps read nothing from the
device when the engine passes `query_lens_cpu` (vLLM: `query_start_loc_cpu`) or a
`max_query_len` within the decode threshold; only a separate-path step with prefills may read
`seq_lens` back when `seq_lens_cpu` is not given.

CUDA graphs (DESIGN.md, Serving contract): a decode-only step runs all T rows through the
decode kernel on every path, padding rows included (they map to request R, outside the block
table, so every index of theirs is invalid and their output is 0). Its launches therefore
depend on T, H, the cache and topk alone, never on how many of the T rows are real, and a
graph captured for T replays any decode batch padded to T. The one tensor the plan makes
itself, req_id_per_token, goes into the caller's persistent `req_id_out` buffer when given, so
its address is the same at capture and at every later step; the others are views of the
engine's tensors.

Decode context parallelism (`dcp`, mla/cp.py): each rank holds only its share of every request's
tokens. The plan then carries the rank's place in the group and local_seq_lens (the tokens of
each request this rank holds); every token runs through the decode kernel (which returns the lse
the cross-rank merge needs) over the local slots of its top-k, whatever the cache format.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch

from openmla.mla.cp import ContextParallel
from openmla.quant.format_types import SPARSE_MLA, CacheFormat
from openmla.quant.formats import cache_format
from openmla.quant.validate import check_same_device, check_tensor, fail

__all__ = [
    "MIN_HEADS_FOR_SEPARATE",
    "PrefillChunk",
    "SparseMLAPlan",
    "build_sparse_mla_plan",
    "split_prefill_chunks",
]

# vLLM (FlashMLASparse): below this many heads per rank the fp8 cache takes the mixed path.
MIN_HEADS_FOR_SEPARATE = 32
MAX_HEADS = 128
_FP8_PATHS = ("mixed", "separate")

HostInts = Union[Sequence[int], torch.Tensor]


def _host_ints(name: str, x: HostInts, n: Optional[int] = None) -> list:
    """Host integers from a CPU tensor or a sequence; ValueError for a device tensor (reading
    one would be a sync) or a wrong length."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            fail(f"{name}.device", "cpu (host lengths; reading a device tensor is a sync)", x.device)
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            fail(f"{name}.dtype", "an integer dtype", x.dtype)
        check_tensor(name, x, ndim=1)
        vals = x.tolist()
    else:
        try:
            vals = [int(v) for v in x]
        except (TypeError, ValueError):
            fail(name, "a 1-D CPU integer tensor or a sequence of ints", type(x).__name__)
        if any(not float(v).is_integer() for v in x):
            fail(name, "integers", list(x))
    if n is not None and len(vals) != n:
        fail(f"len({name})", n, len(vals))
    return vals


def split_prefill_chunks(seq_lens: HostInts, workspace_rows: int) -> list[tuple[int, int]]:
    """Greedy contiguous request ranges whose summed seq_len fits the workspace (DESIGN.md).

    Args:
        seq_lens: [R] host ints (a CPU tensor or a sequence), tokens to gather per request (>= 0).
        workspace_rows: rows of the bf16 workspace (> 0).

    Returns:
        Half-open request ranges [(start, end), ...] covering 0..R in order, each as long as the
        next request still fits (a request of seq_len 0 always fits). [] for R = 0.

    Raises ValueError when one sequence alone is longer than the workspace.
    """
    if isinstance(workspace_rows, bool) or not isinstance(workspace_rows, int) or workspace_rows < 1:
        fail("workspace_rows", "a positive int", workspace_rows)
    lens = _host_ints("seq_lens", seq_lens)
    chunks = []
    start, total = 0, 0
    for i, s in enumerate(lens):
        if s < 0:
            fail(f"seq_lens[{i}]", ">= 0", s)
        if s > workspace_rows:
            fail(f"seq_lens[{i}]", f"<= workspace_rows = {workspace_rows} (one sequence must fit "
                 "the prefill workspace; raise workspace_rows)", s)
        if total + s > workspace_rows:
            chunks.append((start, i))
            start, total = i, 0
        total += s
    if start < len(lens):
        chunks.append((start, len(lens)))
    return chunks


@dataclass(frozen=True, eq=False)
class PrefillChunk:
    """One group of prefill requests gathered into the workspace together (separate path).

    Host ints:
        token_start, token_end: the chunk's query tokens, [token_start, token_end) of the batch.
        req_start, req_end: its requests, [req_start, req_end) of the batch.
        num_rows: workspace rows it fills, sum of its seq_lens (<= the plan's workspace_rows).
        max_seq_len: its longest sequence (the gather's grid hint).
    Device tensors:
        workspace_starts: [R_c] int32, first workspace row of each request, restarting at 0.
        workspace_request_ids: [T_c] int32, request of each token within the chunk (0..R_c-1).
        seq_lens: [R_c] int32, a view of the batch's seq_lens.
        block_table: [R_c, M] int32, a view of the batch's block_table rows.
    """

    token_start: int
    token_end: int
    req_start: int
    req_end: int
    num_rows: int
    max_seq_len: int
    workspace_starts: torch.Tensor
    workspace_request_ids: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor


@dataclass(frozen=True, eq=False)
class SparseMLAPlan:
    """What one step's batch is, built once (`build_sparse_mla_plan`) and read by every layer.

    Built for (checked on use by `check_matches`): num_tokens (T, rows of q, padding included),
    num_reqs (R), block_size, num_heads, cache_format (the cache's quant descriptor:
    BF16_MLA, FP8_DS_MLA or FP8_DS_MLA_RAW), path ("bf16" | "mixed" | "separate"), device.

    Split: tokens [0, num_decode_tokens) run through the decode kernel (all T on the bf16 and
    mixed paths and in a decode-only step, where num_decodes = R); with prefills on the
    separate path, tokens [num_decode_tokens, num_decode_tokens + num_prefill_tokens) run chunk
    by chunk (prefill_chunks) and the num_padding_tokens after them (T beyond
    query_start_loc[R]) get out = 0.

    Device tensors (the engine's own where possible, so in-place updates between CUDA graph
    replays are seen): req_id_per_token [T] int32 (R for padding tokens, which makes every index
    of theirs invalid), block_table [R, M] int32, seq_lens [R] int32.

    Step scratch (`buffer`): intermediates every layer of the step needs (the absorbed query,
    the latent output) are allocated once per step, not once per layer.

    DCP (mla/cp.py): dcp is this rank's ContextParallel (None: one rank holds every token);
    local_seq_lens [R] int32, the tokens of each request on this rank (None without dcp).
    num_heads is then the heads the kernels see (the group's N * H for sharded heads).
    """

    num_tokens: int
    num_reqs: int
    block_size: int
    num_heads: int
    cache_format: CacheFormat
    path: str
    decode_threshold: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    workspace_rows: int
    device: torch.device
    req_id_per_token: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    prefill_chunks: tuple = ()
    dcp: Optional[ContextParallel] = None
    local_seq_lens: Optional[torch.Tensor] = None
    scratch: dict = field(default_factory=dict, repr=False)

    def buffer(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A device tensor `name` of `shape` and `dtype` that the layers of this step share,
        allocated on the first call and returned again by later ones (layers run one after
        another on one stream, as engines run them: a layer's intermediates are dead when the
        next layer starts). Kept apart by whether a CUDA graph is being captured, so that a
        graph never records a tensor allocated outside its memory pool, which the plan could
        free while the graph still writes to it."""
        return self.buffer_views(name, shape, dtype, None)[0]

    def buffer_views(self, name: str, shape: tuple, dtype: torch.dtype, make) -> tuple:
        """(buffer(name, shape, dtype), make(that buffer)): views of the step's buffer that every
        layer uses, made once with it (a view costs the host about a microsecond per layer).
        One `make` per name (None: no views)."""
        key = (name, self.device.type == "cuda" and torch.cuda.is_current_stream_capturing())
        hit = self.scratch.get(key)
        if hit is None or hit[0].shape != shape or hit[0].dtype != dtype:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            hit = self.scratch[key] = (t, make(t) if make is not None else None)
        elif hit[1] is None and make is not None:  # first asked for views
            hit = self.scratch[key] = (hit[0], make(hit[0]))
        return hit

    @property
    def num_padding_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens - self.num_prefill_tokens

    @property
    def is_decode_only(self) -> bool:
        return self.num_prefills == 0

    def check_matches(self, q: torch.Tensor, cache: torch.Tensor, topk_indices: torch.Tensor) -> None:
        """ValueError unless q [T, H, *], cache and topk_indices [T, topk] are what this plan was
        built for (a plan reused for another batch shape, head count or cache is a bug)."""
        check_tensor("q", q, ndim=3)
        T, H = q.shape[0], q.shape[1]
        if T != self.num_tokens:
            fail("q.shape[0]", f"{self.num_tokens} (the plan's num_tokens)", T)
        if H != self.num_heads:
            fail("q.shape[1]", f"{self.num_heads} (the plan's num_heads)", H)
        check_tensor("topk_indices", topk_indices, dtype=torch.int32, ndim=2, last_dim_contiguous=True)
        if topk_indices.shape[0] != T:
            fail("topk_indices.shape[0]", f"{T} (q.shape[0])", topk_indices.shape[0])
        if topk_indices.shape[1] < 1:
            fail("topk_indices.shape[1] (topk)", ">= 1", topk_indices.shape[1])
        self.cache_format.check_cache(cache)
        if cache.shape[1] != self.block_size:
            fail("cache.shape[1] (block_size)", f"{self.block_size} (the plan's block_size)",
                 tuple(cache.shape))
        check_same_device(**{"plan tensors": self.req_id_per_token, "q": q, "cache": cache,
                             "topk_indices": topk_indices})


def _choose_path(fmt, num_heads: int, fp8_path: Optional[str]) -> str:
    if not fmt.quantized:
        if fp8_path is not None:
            fail("fp8_path", "None for a bf16 cache (it picks how an fp8 cache is read)", repr(fp8_path))
        return "bf16"
    if fp8_path is None:
        return "mixed" if num_heads < MIN_HEADS_FOR_SEPARATE else "separate"
    if fp8_path not in _FP8_PATHS:
        fail("fp8_path", f"one of {_FP8_PATHS} or None (auto)", repr(fp8_path))
    return fp8_path


def _positive_int(name: str, x) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        fail(name, "a positive int", repr(x))
    return x


def build_sparse_mla_plan(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    block_size: int,
    num_heads: int,
    kv_cache_dtype,
    max_model_len: int,
    decode_threshold: int = 1,
    fp8_path: Optional[str] = None,
    workspace_rows: Optional[int] = None,
    query_lens_cpu: Optional[HostInts] = None,
    seq_lens_cpu: Optional[HostInts] = None,
    max_query_len: Optional[int] = None,
    req_id_out: Optional[torch.Tensor] = None,
    dcp: Optional[ContextParallel] = None,
    dcp_local_seq_lens: Optional[torch.Tensor] = None,
) -> SparseMLAPlan:
    """Build one step's plan from what the engine has.

    Args:
        query_start_loc: [R+1] int32 (device), cumulative query tokens per request, from 0.
        seq_lens: [R] int32 (device), tokens per request including this step's new ones (all
            already written to the cache).
        block_table: [R, M] int32 (device), physical block of each logical block (< 0: unmapped).
        slot_mapping: [T] int32/int64 (device), cache slot of each query token; only its length
            T is used (T >= query_start_loc[R]: tokens past the last request are padding).
        block_size: cache page size in tokens.
        num_heads: H, query heads per rank, 1..128.
        kv_cache_dtype: a sparse MLA cache format: a name ("bf16"/"auto"/"bfloat16" for the bf16
            cache, "fp8_ds_mla"/"fp8", "fp8_ds_mla_raw") or a quant descriptor (BF16_MLA,
            FP8_DS_MLA, FP8_DS_MLA_RAW); others NotImplementedError (quant.cache_format).
        max_model_len: the longest sequence the engine serves; sets the default workspace.
        decode_threshold: a request with query_len <= this is a decode (raise it to the
            speculative length for spec decoding; lengths need not be uniform).
        fp8_path: "mixed", "separate" or None (auto: mixed when num_heads < 32, as vLLM).
            Must be None for a bf16 cache.
        workspace_rows: bf16 workspace rows for separate-path prefill chunks (default
            5 * max_model_len, as vLLM).
        query_lens_cpu: [R] host ints (CPU tensor or sequence), query tokens per request; the
            separate path needs them and reads query_start_loc back (a sync) without them.
        seq_lens_cpu: [R] host ints; the separate path with prefills reads seq_lens back (a
            sync) without them. Both must agree with the device tensors (not checked: a sync).
        max_query_len: optional host bound on every query length (vLLM's max_query_len); when
            it is <= decode_threshold the step is decode-only without looking at the lengths.
        req_id_out: optional persistent int32 buffer of >= T elements on the batch's device:
            req_id_per_token is written into its first T entries (CUDA graphs: module
            docstring). Default: a new tensor each build.
        dcp: this rank's ContextParallel (mla/cp.py) when each rank holds a share of every
            request's tokens; num_heads is then the heads the kernels see. fp8_path "separate"
            is refused (NotImplementedError): under DCP every token runs through the decode
            kernel, which returns the lse the merge needs.
        dcp_local_seq_lens: optional [R] int32 on the batch's device, the engine's own tokens
            per request on this rank (vLLM's dcp_local_seq_lens, a persistent buffer); default
            dcp.local_seq_lens(seq_lens).

    Returns a SparseMLAPlan. Decode-only steps build no prefill structures and, given
    query_lens_cpu or max_query_len on the separate path, read nothing from the device.
    """
    fmt = cache_format(kv_cache_dtype, SPARSE_MLA, who="sparse MLA")
    _positive_int("block_size", block_size)
    _positive_int("max_model_len", max_model_len)
    _positive_int("decode_threshold", decode_threshold)
    _positive_int("num_heads", num_heads)
    if num_heads > MAX_HEADS:
        raise NotImplementedError(f"sparse MLA: num_heads {num_heads} > {MAX_HEADS} (the kernels' limit)")
    if dcp is not None:
        if not isinstance(dcp, ContextParallel):
            fail("dcp", "None or an openmla.mla.cp.ContextParallel", type(dcp).__name__)
        if fp8_path == "separate":
            raise NotImplementedError("sparse MLA with DCP: fp8_path 'separate' (every token runs "
                                      "through the decode kernel, which returns the merge's lse)")
        if fmt.quantized:
            fp8_path = "mixed"
    elif dcp_local_seq_lens is not None:
        fail("dcp_local_seq_lens", "None without dcp", "a tensor")
    path = _choose_path(fmt, num_heads, fp8_path)
    if workspace_rows is None:
        workspace_rows = 5 * max_model_len
    _positive_int("workspace_rows", workspace_rows)

    check_tensor("query_start_loc", query_start_loc, dtype=torch.int32, ndim=1)
    R = query_start_loc.shape[0] - 1
    if R < 0:
        fail("query_start_loc.shape", "(R + 1,) with R >= 0", tuple(query_start_loc.shape))
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(R,), contiguous=True)
    check_tensor("block_table", block_table, dtype=torch.int32, shape=(R, None), last_dim_contiguous=True)
    check_tensor("slot_mapping", slot_mapping, dtype=(torch.int32, torch.int64), ndim=1)
    T = slot_mapping.shape[0]
    if max_query_len is not None and (isinstance(max_query_len, bool)
                                      or not isinstance(max_query_len, int) or max_query_len < 0):
        fail("max_query_len", "None or an int >= 0", repr(max_query_len))
    if req_id_out is not None:
        check_tensor("req_id_out", req_id_out, dtype=torch.int32, ndim=1, contiguous=True)
        if req_id_out.shape[0] < T:
            fail("req_id_out.shape[0]", f">= {T} (the step's tokens, slot_mapping.shape[0])",
                 req_id_out.shape[0])
    device = check_same_device(query_start_loc=query_start_loc, seq_lens=seq_lens,
                               block_table=block_table, slot_mapping=slot_mapping,
                               req_id_out=req_id_out)

    # Token -> request on the device, from shapes only: request r owns tokens
    # [qsl[r], qsl[r+1]); a padding token past qsl[R] gets R (outside the block table), and so
    # does every token when R = 0. A padding request (qsl repeated) owns no token.
    tokens = torch.arange(T, dtype=torch.int32, device=device)
    req_id_per_token = None if req_id_out is None else req_id_out[:T]
    req_id_per_token = torch.searchsorted(query_start_loc[1:], tokens, right=True, out_int32=True,
                                          out=req_id_per_token)

    common = dict(num_tokens=T, num_reqs=R, block_size=block_size, num_heads=num_heads,
                  cache_format=fmt, path=path, decode_threshold=decode_threshold,
                  workspace_rows=workspace_rows, device=device, req_id_per_token=req_id_per_token,
                  block_table=block_table, seq_lens=seq_lens)
    if dcp is not None:
        if dcp_local_seq_lens is None:
            dcp_local_seq_lens = dcp.local_seq_lens(seq_lens)
        else:
            check_tensor("dcp_local_seq_lens", dcp_local_seq_lens, dtype=torch.int32, shape=(R,))
            check_same_device(seq_lens=seq_lens, dcp_local_seq_lens=dcp_local_seq_lens)
        common.update(dcp=dcp, local_seq_lens=dcp_local_seq_lens)
    if path != "separate":
        return SparseMLAPlan(num_decodes=R, num_decode_tokens=T, num_prefills=0,
                             num_prefill_tokens=0, **common)

    # Separate path: split on the host lengths, unless the bound says every request is a decode.
    if max_query_len is not None and max_query_len <= decode_threshold:
        return SparseMLAPlan(num_decodes=R, num_decode_tokens=T, num_prefills=0,
                             num_prefill_tokens=0, **common)
    if query_lens_cpu is None:
        qsl = query_start_loc.tolist()  # a sync; the engine avoids it by passing query_lens_cpu
        qlens = [qsl[i + 1] - qsl[i] for i in range(R)]
    else:
        qlens = _host_ints("query_lens_cpu", query_lens_cpu, R)
    for i, n in enumerate(qlens):
        if n < 0:
            fail(f"query_lens_cpu[{i}]", ">= 0", n)
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    if starts[-1] > T:
        fail("sum(query_lens_cpu)", f"<= num tokens {T} (slot_mapping.shape[0])", starts[-1])
    nd = 0
    while nd < R and qlens[nd] <= decode_threshold:
        nd += 1
    if nd == R:  # decode-only: every row through the decode kernel (module docstring)
        return SparseMLAPlan(num_decodes=R, num_decode_tokens=T, num_prefills=0,
                             num_prefill_tokens=0, **common)
    common.update(num_decodes=nd, num_decode_tokens=starts[nd], num_prefills=R - nd,
                  num_prefill_tokens=starts[R] - starts[nd])

    if seq_lens_cpu is None:
        pf_lens = seq_lens[nd:].tolist()  # a sync, on the prefill path only
    else:
        pf_lens = _host_ints("seq_lens_cpu", seq_lens_cpu, R)[nd:]
    for j, (s, n) in enumerate(zip(pf_lens, qlens[nd:])):
        if s < n:
            fail(f"seq_lens[{nd + j}]", f">= its query length {n} (the new tokens are in the cache)", s)
    bounds = split_prefill_chunks(pf_lens, workspace_rows)

    # All chunks' host-built int32 data go to the device in one copy, then get sliced.
    host, layout = [], []
    for rs, re in bounds:
        lens = pf_lens[rs:re]
        ws_starts, acc = [], 0
        for s in lens:
            ws_starts.append(acc)
            acc += s
        ws_rids = [k for k, n in enumerate(qlens[nd + rs:nd + re]) for _ in range(n)]
        layout.append((len(host), len(ws_starts), len(ws_rids)))
        host += ws_starts + ws_rids
    buf = torch.tensor(host, dtype=torch.int32).to(device)
    chunks = []
    for (rs, re), (off, n_req, n_tok) in zip(bounds, layout):
        lens = pf_lens[rs:re]
        chunks.append(PrefillChunk(
            token_start=starts[nd + rs], token_end=starts[nd + re], req_start=nd + rs,
            req_end=nd + re, num_rows=sum(lens), max_seq_len=max(lens),
            workspace_starts=buf[off:off + n_req],
            workspace_request_ids=buf[off + n_req:off + n_req + n_tok],
            seq_lens=seq_lens[nd + rs:nd + re], block_table=block_table[nd + rs:nd + re]))
    return SparseMLAPlan(prefill_chunks=tuple(chunks), **common)
