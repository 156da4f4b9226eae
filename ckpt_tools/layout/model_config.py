"""Model dimensions read from an HF ``config.json`` (the only model description any command needs)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from importlib import resources

from ..core.errors import InputError
from ..core.files import read_json

PRESETS = {"qwen3-235b-a22b": "qwen3-235b-a22b.config.json"}


class ConfigError(InputError):
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
    d = read_json(p, ConfigError)
    try:
        return config_from_dict(d)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None


def _int(d: dict, key: str, default=None, least: int = 1, alias: str | None = None) -> int:
    """Field ``key`` (or ``alias``) of the config as an int >= ``least``; ``default`` when absent or null.
    One-line ConfigError naming the field otherwise (``"abc"``, ``true``, ``1.5``, ``0`` heads)."""
    v = d.get(key)
    if v is None and alias is not None:
        key, v = alias, d.get(alias)
    if v is None:
        if default is None:
            raise ConfigError(f"config.json lacks {key!r}")
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise ConfigError(f"{key} is {v!r}: not an integer")
    if v < least:
        raise ConfigError(f"{key} is {v}: must be >= {least}")
    if v > MAX_FIELD:
        raise ConfigError(f"{key} is {v}: more than {MAX_FIELD}, no model's")
    return v


MAX_FIELD = 1 << 40  # any size or count field of a config (a vocab, a width, a layer or expert count)
MAX_TENSORS = 1 << 22  # num_hidden_layers x num_experts: the tensors a config implies are listed one by one


def config_from_dict(d: dict) -> ModelConfig:
    """Every field the tool reads, validated one by one (type and range): a bad value is a one-line
    ConfigError naming the field, never a traceback later."""
    mt = d.get("model_type")
    if mt not in ("qwen3_moe", "qwen3"):
        raise ConfigError(f"model_type {mt!r} is not supported (supported: qwen3_moe, qwen3)")
    heads = _int(d, "num_attention_heads")
    hidden = _int(d, "hidden_size")
    layers = _int(d, "num_hidden_layers")
    head_dim = _int(d, "head_dim", default=max(1, hidden // heads))
    kv_heads = _int(d, "num_key_value_heads", default=heads)
    if heads % kv_heads:
        raise ConfigError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    vocab = _int(d, "vocab_size")
    # transformers >= 5 writes num_local_experts (num_experts is its attribute alias)
    experts = _int(d, "num_experts", 0, 0, alias="num_local_experts") if mt == "qwen3_moe" else 0
    topk = _int(d, "num_experts_per_tok", 0, 0)
    moe_ffn, ffn = _int(d, "moe_intermediate_size", 0, 0), _int(d, "intermediate_size", 0, 0)
    if layers * max(1, experts) > MAX_TENSORS:
        raise ConfigError(f"num_hidden_layers x num_experts is {layers} x {max(1, experts)}: more than {MAX_TENSORS}, "
                          f"no model's (each expert's tensors are listed one by one)")
    if experts and topk > experts:
        raise ConfigError(f"num_experts_per_tok is {topk}: more than num_experts ({experts})")
    tie = d.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ConfigError(f"tie_word_embeddings is {tie!r}: not true/false")
    if experts:
        step = _int(d, "decoder_sparse_step", 1)
        mlp_only = d.get("mlp_only_layers") or []
        if not isinstance(mlp_only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in mlp_only):
            raise ConfigError(f"mlp_only_layers is {mlp_only!r}: not a list of layer numbers")
        # vllm/model_executor/models/qwen3_moe.py and transformers' Qwen3MoeDecoderLayer use this rule
        moe_layers = tuple(i for i in range(layers) if i not in set(mlp_only) and (i + 1) % step == 0)
    else:
        moe_layers = ()
    return ModelConfig(model_type=mt, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                       head_dim=head_dim, vocab=vocab, experts=experts, topk=topk, moe_ffn=moe_ffn, ffn=ffn,
                       tie_embeddings=tie, moe_layers=moe_layers, raw=d)
