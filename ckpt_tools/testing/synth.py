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
    d = dict(load_config(next(iter(_USERS.PRESETS))).raw)  # the users' model: their family's first preset
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


# ------------------------------------------------------------------------------- block-scaled FP8 (issue 33)
FP8_BLOCK = (128, 128)


def fp8_quantizable(name: str, shape) -> bool:
    """The tensors DeepSeek's and Qwen3's FP8 releases store in FP8: the layers' linear weights (q/k/v/o, the
    experts' and dense MLPs' gate/up/down, MLA's q_a / q_b / kv_a_proj_with_mqa / kv_b, MTP's eh_proj);
    embeddings, lm_head, norms and the router stay as they are."""
    return len(shape) == 2 and name.startswith("model.layers.") and name.endswith(("_proj.weight", "_mqa.weight"))


def fp8_block_quant(w: torch.Tensor, block=FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block rule (deepseek-ai/DeepSeek-V3 inference/kernel.py ``weight_quant_kernel``): per block,
    ``s = amax(|w|) / 448``, ``q = float8_e4m3fn(w / s)`` in float32, the stored ``weight_scale_inv`` = ``s``;
    partial edge blocks. An all-zero block gets s = 1 (the kernel's 0/0 would store NaN)."""
    bm, bn = block
    r, c = w.shape
    x = w.to(torch.float32)
    pad = torch.nn.functional.pad(x, (0, -c % bn, 0, -r % bm))  # zeros: no effect on a block's amax
    amax = pad.view(pad.shape[0] // bm, bm, pad.shape[1] // bn, bn).abs().amax(dim=(1, 3))
    s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (x / s.repeat_interleave(bm, 0)[:r].repeat_interleave(bn, 1)[:, :c]).to(torch.float8_e4m3fn)
    return q, s


def fp8_quant_config(block=FP8_BLOCK) -> dict:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}


def _write_fp8_config(out: str, config: dict, block):
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(dict(config, quantization_config=fp8_quant_config(block)), f, indent=1)


def quantize_fp8(src: str, out: str, block=FP8_BLOCK, which=fp8_quantizable, max_shard_size=2 * 10 ** 9) -> list:
    """Quantize the saved HF model ``src`` into ``out`` as DeepSeek / Qwen3 FP8 releases are stored: every
    tensor ``which(name, shape)`` as float8_e4m3fn beside its float32 ``{name}_scale_inv``
    (:func:`fp8_block_quant`), the others as they are, config.json with ``quantization_config``. One tensor in
    memory at a time. Returns the names quantized."""
    from ..formats.hf import HFReader
    from ..layout.blocks import scale_shape

    os.makedirs(out, exist_ok=True)
    r = HFReader(src)
    entries, quant = [], []
    for n in r.keys():
        shp = tuple(r.shape(n))
        if which(n, shp):
            quant.append(n)
            entries += [(n, shp, torch.float8_e4m3fn), (n + "_scale_inv", scale_shape(shp, block), torch.float32)]
        else:
            entries.append((n, shp, r.dtype(n)))
    w = HFShardWriter(out, entries, max_shard_size)
    for n in r.keys():
        t = r.read(n)
        if n in quant:
            q, s = fp8_block_quant(t, block)
            w.write(n, q)
            w.write(n + "_scale_inv", s)
        else:
            w.write(n, t)
    w.finish()
    r.close()
    with open(os.path.join(src, "config.json")) as f:
        _write_fp8_config(out, json.load(f), block)
    return quant


def make_synthetic_fp8(out: str, config: dict, block=FP8_BLOCK, max_shard_size=2 * 10 ** 9, seed=0,
                       progress=True) -> int:
    """Stream a random FP8 checkpoint of ``config`` (benchmarks, memory tests): the :func:`fp8_quantizable`
    tensors as random finite float8_e4m3fn bytes with random positive scales, the rest random bf16. Returns the
    bytes of tensor data written."""
    from ..layout.blocks import scale_shape

    os.makedirs(out, exist_ok=True)
    shapes = hf_shapes(config_from_dict(config))
    entries = []
    for n, s in shapes.items():
        if fp8_quantizable(n, s):
            entries += [(n, s, torch.float8_e4m3fn), (n + "_scale_inv", scale_shape(s, block), torch.float32)]
        else:
            entries.append((n, s, torch.bfloat16))
    w = HFShardWriter(out, entries, max_shard_size)
    g = torch.Generator().manual_seed(seed)
    for n, s in tqdm(shapes.items(), desc="synth fp8", disable=not progress):
        if fp8_quantizable(n, s):
            b = torch.randint(0, 255, s, generator=g, dtype=torch.uint8)
            b[b == 0x7F] = 0x7E  # 0x7f and 0xff are NaN; 255 is excluded by randint
            w.write(n, b.view(torch.float8_e4m3fn))
            w.write(n + "_scale_inv", torch.rand(scale_shape(s, block), generator=g) * 1e-4 + 1e-5)
        else:
            w.write(n, (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16))
    idx = w.finish()
    _write_fp8_config(out, dict(config, torch_dtype="bfloat16"), block)
    return idx["metadata"]["total_size"]
