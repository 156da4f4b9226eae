"""Locally generated models (no hub downloads): a tiny real model of any family via transformers, and large synthetic
checkpoints streamed tensor by tensor (benchmarks), plus the 235B "structural twin" config."""
from __future__ import annotations

import json
import os

import torch
from tqdm import tqdm

import converters

from ..formats.hf import HFShardWriter
from ..layout import hf_shapes
from ..layout.model_config import config_from_dict, load_config

# the users' family (the first table, converters.FAMILIES): its tiny model and the one real vLLM runs
_USERS = converters.families()[0]
TINY, TINY_VLLM = _USERS.TINY, _USERS.TINY_VLLM


def twin_config(hidden=32, head_dim=8, moe_ffn=16, vocab=160) -> dict:
    """Qwen3-235B-A22B's layer/expert/head counts (94 layers, 128 experts top-8, 64 q / 4 kv heads) with tiny widths."""
    d = dict(load_config("qwen3-235b-a22b").raw)
    d.update(hidden_size=hidden, head_dim=head_dim, moe_intermediate_size=moe_ffn, intermediate_size=moe_ffn * 2,
             vocab_size=vocab)
    return d


def make_tiny_hf(out: str, seed: int = 0, dtype=torch.float32, max_shard_size="200KB", model_type: str | None = None,
                 **overrides) -> str:
    """A real transformers model of family ``model_type`` (default: the users' family) with random weights: its
    table's ``TINY`` config (with ``overrides``) through transformers' own config and model classes
    (AutoConfig.for_model, AutoModelForCausalLM.from_config), saved as sharded safetensors + index."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(converters.get(model_type).TINY if model_type else TINY)
    kw.update(overrides)
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    keep = getattr(model, "_keep_in_fp32_modules_strict", None) or []  # what from_pretrained keeps fp32 (GLM's bias)
    for n, t in list(model.named_parameters()) + list(model.named_buffers()):
        if any(k in n for k in keep):
            t.data = t.data.float()
    with torch.no_grad():  # norms initialise to ones, biases to zeros: make them random so a swapped one is caught
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_((0.0 if n.endswith(".bias") else 1.0) + 0.1 * torch.randn_like(p))
        for n, b in model.named_buffers():  # the router's expert bias (zeros at init), not a parameter
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
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
