"""Model dimensions read from an HF ``config.json`` (the only model description any command needs)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from importlib import resources

PRESETS = {"qwen3-235b-a22b": "qwen3-235b-a22b.config.json"}


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int = 0
    topk: int = 0
    moe_ffn: int = 0
    ffn: int = 0
    tie_embeddings: bool = False
    moe_layers: tuple = field(default=())
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def layer_is_moe(self, i: int) -> bool:
        return i in self.moe_layers


def load_config(path_or_preset: str) -> ModelConfig:
    """``path_or_preset``: an HF model dir, a config.json path, or a preset name (``qwen3-235b-a22b``)."""
    if path_or_preset in PRESETS:
        text = resources.files("ckpt_tools.fixtures").joinpath(PRESETS[path_or_preset]).read_text()
        return config_from_dict(json.loads(text))
    p = path_or_preset
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    if not os.path.isfile(p):
        raise ConfigError(f"no HF config at {path_or_preset} (expected a model dir, a config.json or one of {sorted(PRESETS)})")
    if p.endswith(".safetensors"):
        raise ConfigError(f"{p} is a weights file: give the model directory (config.json + *.safetensors)")
    with open(p, "rb") as f:
        try:
            d = json.loads(f.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{p}: not a config object")
    try:
        return config_from_dict(d)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None


def config_from_dict(d: dict) -> ModelConfig:
    mt = d.get("model_type")
    if mt not in ("qwen3_moe", "qwen3"):
        raise ConfigError(f"model_type {mt!r} is not supported (supported: qwen3_moe, qwen3)")
    try:
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        layers = int(d["num_hidden_layers"])
        head_dim = int(d.get("head_dim") or hidden // heads)
        # transformers >= 5 writes num_local_experts (num_experts is its attribute alias)
        experts = int(d.get("num_experts") or d.get("num_local_experts") or 0) if mt == "qwen3_moe" else 0
        if experts:
            step = int(d.get("decoder_sparse_step", 1) or 1)
            mlp_only = set(d.get("mlp_only_layers") or [])
            # vllm/model_executor/models/qwen3_moe.py and transformers' Qwen3MoeDecoderLayer use this rule
            moe_layers = tuple(i for i in range(layers) if i not in mlp_only and (i + 1) % step == 0)
        else:
            moe_layers = ()
        return ModelConfig(
            model_type=mt, hidden=hidden, layers=layers, heads=heads,
            kv_heads=int(d.get("num_key_value_heads") or heads), head_dim=head_dim,
            vocab=int(d["vocab_size"]), experts=experts, topk=int(d.get("num_experts_per_tok") or 0),
            moe_ffn=int(d.get("moe_intermediate_size") or 0), ffn=int(d.get("intermediate_size") or 0),
            tie_embeddings=bool(d.get("tie_word_embeddings", False)), moe_layers=moe_layers, raw=d)
    except KeyError as e:
        raise ConfigError(f"config.json lacks {e.args[0]!r}") from None
