"""The demo checkpoint of tools/absorb.py (also the tests' fixture) and the --demo run."""
from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from typing import Callable, Optional

import torch

from openmla.mla.absorb import FP8_WEIGHT_BLOCK, quantize_fp8_blocks, scale_inv_shape
from openmla.tools._checkpoint import CONFIG_NAME, INDEX_NAME

DEMO_DIMS = dict(num_attention_heads=4, qk_nope_head_dim=24, qk_rope_head_dim=16, v_head_dim=20,
                 kv_lora_rank=144, q_lora_rank=200, hidden_size=160)


def _demo_weight(rows, cols, gen, block):
    """A random weight whose 128x128 blocks differ in magnitude by up to 2^6 (a scale read from
    the wrong block shows), about unit gain."""
    w = torch.randn(rows, cols, generator=gen) / math.sqrt(cols)
    mag = 2.0 ** torch.randint(-3, 4, scale_inv_shape((rows, cols), block), generator=gen).float()
    return w * mag.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def build_demo_checkpoint(root: str, *, fp8: bool = True, q_lora_rank: Optional[int] = 200,
                          num_layers: int = 2, num_shards: int = 3, filler_bytes: int = 0,
                          seed: int = 0) -> dict:
    """Write a small checkpoint in DeepSeek-V3's exact layout (tensor names, row grouping,
    128x128 fp8 blocks with ragged edges: kv_b_proj is 176 x 144) with safetensors' own writer.
    fp8=False writes bf16 weights without scales (V2 style); q_lora_rank=None writes q_proj
    (V2-Lite). o_proj and one weight_scale_inv sit in other shards than the rest of their
    layer. filler_bytes adds that many bytes of untouched bf16 data to every shard. Returns the config."""
    from safetensors.torch import save_file

    os.makedirs(root, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    d = dict(DEMO_DIMS, q_lora_rank=q_lora_rank)
    H, n, r, v, L, hid = (d["num_attention_heads"], d["qk_nope_head_dim"], d["qk_rope_head_dim"],
                          d["v_head_dim"], d["kv_lora_rank"], d["hidden_size"])
    vocab, inter, block = 96, 112, FP8_WEIGHT_BLOCK
    shard_of, tensors = {}, {}

    def linear(name, rows, cols, shard):
        w = _demo_weight(rows, cols, gen, block)
        if fp8:
            tensors[name], tensors[name + "_scale_inv"] = quantize_fp8_blocks(w, block)
            shard_of[name + "_scale_inv"] = shard
        else:
            tensors[name] = w.bfloat16()
        shard_of[name] = shard

    def norm(name, size, shard):
        tensors[name] = (1 + 0.1 * torch.randn(size, generator=gen)).bfloat16()
        shard_of[name] = shard

    tensors["model.embed_tokens.weight"] = torch.randn(vocab, hid, generator=gen).bfloat16()
    shard_of["model.embed_tokens.weight"] = 0
    for i in range(num_layers):
        p, s = f"model.layers.{i}", i % num_shards
        norm(f"{p}.input_layernorm.weight", hid, s)
        norm(f"{p}.post_attention_layernorm.weight", hid, s)
        if q_lora_rank is not None:
            linear(f"{p}.self_attn.q_a_proj.weight", q_lora_rank, hid, s)
            norm(f"{p}.self_attn.q_a_layernorm.weight", q_lora_rank, s)
            linear(f"{p}.self_attn.q_b_proj.weight", H * (n + r), q_lora_rank, s)
        else:
            linear(f"{p}.self_attn.q_proj.weight", H * (n + r), hid, s)
        linear(f"{p}.self_attn.kv_a_proj_with_mqa.weight", L + r, hid, s)
        norm(f"{p}.self_attn.kv_a_layernorm.weight", L, s)
        linear(f"{p}.self_attn.kv_b_proj.weight", H * (n + v), L, s)
        linear(f"{p}.self_attn.o_proj.weight", hid, H * v, (s + 1) % num_shards)
        linear(f"{p}.mlp.gate_proj.weight", inter, hid, s)
        linear(f"{p}.mlp.up_proj.weight", inter, hid, s)
        linear(f"{p}.mlp.down_proj.weight", hid, inter, s)
    if fp8 and num_layers > 1:  # a weight and its scale in different shards (HF splits do this)
        qn = "q_b_proj" if q_lora_rank is not None else "q_proj"
        shard_of[f"model.layers.1.self_attn.{qn}.weight_scale_inv"] = num_shards - 1
    norm("model.norm.weight", hid, num_shards - 1)
    tensors["lm_head.weight"] = torch.randn(vocab, hid, generator=gen).bfloat16()
    shard_of["lm_head.weight"] = num_shards - 1
    for k in range(num_shards if filler_bytes else 0):
        name = f"model.filler.{k}.weight"  # stands for the experts: big, untouched
        tensors[name] = torch.randn(filler_bytes // 2, generator=gen).bfloat16()
        shard_of[name] = k

    files = [f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors" for k in range(num_shards)]
    for k, fn in enumerate(files):
        save_file({nm: t for nm, t in tensors.items() if shard_of[nm] == k},
                  os.path.join(root, fn), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": {nm: files[shard_of[nm]] for nm in sorted(tensors)}}
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        **d, "num_key_value_heads": H, "num_hidden_layers": num_layers, "vocab_size": vocab,
        "intermediate_size": inter, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
    }
    if fp8:
        config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3",
                                         "quant_method": "fp8", "weight_block_size": list(block)}
    for name, obj in ((INDEX_NAME, index), (CONFIG_NAME, config)):
        with open(os.path.join(root, name), "w") as f:
            json.dump(obj, f, indent=2)
    with open(os.path.join(root, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": 1}, f)
    return config


def run_demo(absorb: Callable, dtype: str, seed: int, out=None, err=None) -> int:
    """Build the demo checkpoint in a temporary folder and absorb it in both modes with absorb
    (tools/absorb.py's absorb(), passed in so that this module does not import the tool)."""
    out = out or sys.stdout
    with tempfile.TemporaryDirectory(prefix="openmla-absorb-demo-") as tmp:
        ck = os.path.join(tmp, "checkpoint")
        cfg = build_demo_checkpoint(ck, seed=seed)
        H, n, v, L = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"],
                      cfg["kv_lora_rank"])
        print(f"demo: DeepSeek-V3 layout, 2 layers, 3 shards, H={H} qk_nope={n} "
              f"qk_rope={cfg['qk_rope_head_dim']} v_head={v} kv_lora_rank={L} "
              f"q_lora_rank={cfg['q_lora_rank']} hidden={cfg['hidden_size']}; fp8 e4m3 weights in "
              f"128x128 blocks, kv_b_proj {H * (n + v)}x{L} "
              f"(ragged last block {H * (n + v) % 128}x{L % 128})",
              file=out)
        for mode in ("split", "fold"):
            print(file=out)
            absorb(ck, os.path.join(tmp, f"absorbed-{mode}"), mode=mode, dtype=dtype, seed=seed,
                   out=out, err=err)
    return 0
