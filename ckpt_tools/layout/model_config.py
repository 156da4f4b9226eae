"""Model dimensions read from an HF ``config.json`` (the only model description any command needs).

The fields every family has (hidden size, layers, heads, head dim, vocab, tied embeddings) are read here; the rest
(experts, which layers are MoE, shared experts, biases, MTP layers) by the family's table in ``converters/``
(its ``config(fields)``), through :class:`Fields`, which validates each one: a bad value is a one-line ConfigError
naming the field, never a traceback later."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from importlib import resources

import converters

from ..core.errors import InputError
from ..core.files import read_json


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
    moe_layers: tuple = field(default=())  # indices of the MoE layers (MTP layers' indices follow the decoder's)
    shared_ffn: int = 0  # intermediate size of the shared experts of a MoE layer, 0: none
    mtp_layers: int = 0  # multi-token-prediction layers after the decoder (HF model.layers.{layers + k})
    features: frozenset = field(default=frozenset())  # what the family's rows ask for: qkv_bias, qk_norm, ...
    mtp_dropped: int = 0  # MTP layers the config declares that this run leaves out (--no-mtp)
    # multi-latent attention: the query / key-value latent ranks (q_lora_rank 0: no query compression), the
    # per-head dims of q and k without and with rotary embedding, of v
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def layer_is_moe(self, i: int) -> bool:
        return i in self.moe_layers

    @property
    def mixed(self) -> bool:
        """Some decoder layers are dense and some MoE: megatron-core then keys every layer by its own index
        (transformer_block.py sharded_state_dict: ``non_homogeneous_layers`` for a list ``moe_layer_freq``)."""
        return self.is_moe and len([i for i in self.moe_layers if i < self.layers]) != self.layers

    def has(self, feature: str) -> bool:
        return feature in self.features

    def without_mtp(self) -> "ModelConfig":
        """The main model only (``--no-mtp``): the MTP layers the config declares are left out, on purpose."""
        if not self.mtp_layers:
            return self
        return replace(self, mtp_layers=0, mtp_dropped=self.mtp_layers,
                       moe_layers=tuple(i for i in self.moe_layers if i < self.layers))

    def config_edits(self) -> dict:
        """Fields a config.json written for this model changes: the MTP layer count when they were left out."""
        fam = converters.get(self.model_type)
        return {k: 0 for k in getattr(fam, "MTP_CONFIG", ()) if k in self.raw} if self.mtp_dropped else {}


def load_config(path_or_preset: str, no_mtp: bool = False, presets: bool = True) -> ModelConfig:
    """``path_or_preset``: an HF model dir, a config.json path, or (``presets``) a preset name (``ckpt-tools plan
    --help``); ``no_mtp``: the main model only (:meth:`ModelConfig.without_mtp`). ``presets=False`` where a config
    alone does not serve (a conversion needs the model's weights or its side files): a path only, and a missing
    one is said so, with no presets offered (issue 54)."""
    cfg = _load_config(path_or_preset, presets)
    return cfg.without_mtp() if no_mtp else cfg


def _load_config(path_or_preset: str, presets: bool) -> ModelConfig:
    known = converters.presets() if presets else {}
    if path_or_preset in known:
        text = resources.files("converters").joinpath("presets", known[path_or_preset]).read_text()
        return config_from_dict(json.loads(text))
    p = path_or_preset
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    if not os.path.isfile(p):
        at = f"no HF config at {path_or_preset or repr('')}"
        if known:
            raise ConfigError(f"{at} (expected a model dir, a config.json or one of the presets "
                              f"{', '.join(sorted(known))})")
        why = ("no config.json in it" if os.path.isdir(path_or_preset) else "not a file"
               if os.path.exists(path_or_preset) else "no such file or directory")
        raise ConfigError(f"{at}: {why} (expected an HF model dir or its config.json)")
    if p.endswith(".safetensors"):
        raise ConfigError(f"{p} is a weights file: give the model directory (config.json + *.safetensors)")
    d = read_json(p, ConfigError)
    try:
        return config_from_dict(d)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None


MAX_FIELD = 1 << 40  # any size or count field of a config (a vocab, a width, a layer or expert count)
MAX_TENSORS = 1 << 22  # num_hidden_layers x num_experts: the tensors a config implies are listed one by one


class Fields:
    """Validated access to a config's fields for the family tables (they import nothing of ckpt_tools)."""

    def __init__(self, d: dict):
        self.d, self.model_type = d, d.get("model_type")
        self.layers = 0

    def int(self, key: str, default=None, least: int = 1, alias: str | None = None) -> int:
        """Field ``key`` (or ``alias``) as an int >= ``least``; ``default`` when absent or null. One-line
        ConfigError naming the field otherwise (``"abc"``, ``true``, ``1.5``, ``0`` heads)."""
        d = self.d
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

    def bool(self, key: str, default: bool = False) -> bool:
        v = self.d.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise ConfigError(f"{key} is {v!r}: not true/false")
        return v

    def number(self, key: str, default: float, low: float, high: float) -> float:
        """A real number in [low, high] (e.g. partial_rotary_factor in (0, 1])."""
        v = self.d.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not low <= v <= high:
            raise ConfigError(f"{key} is {v!r}: not a number in [{low}, {high}]")
        return float(v)

    def layer_list(self, key: str) -> list:
        """A list of layer numbers (absent or null: [])."""
        v = self.d.get(key) or []
        if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
            raise ConfigError(f"{key} is {v!r}: not a list of layer numbers")
        return v

    def error(self, message: str) -> ConfigError:
        return ConfigError(message)


def config_from_dict(d: dict) -> ModelConfig:
    """Every field the tool reads, validated one by one (type and range): the common ones here, the family's by
    its table (converters/<family>.py ``config``)."""
    if not isinstance(d, dict):
        raise ConfigError(f"config.json holds {type(d).__name__}, not an object")
    mt = d.get("model_type")
    try:
        fam = converters.get(mt)
    except converters.UnknownFamily as e:
        raise ConfigError(str(e)) from None
    arch = d.get("architectures")
    if arch is not None:
        if not isinstance(arch, list) or not all(isinstance(a, str) for a in arch):
            raise ConfigError(f"architectures is {arch!r}: not a list of class names")
        other = [a for a in arch if a not in fam.ARCHITECTURES]
        if other:
            raise ConfigError(f"architectures names {other[0]}: model_type {mt!r} is supported as "
                              f"{', '.join(fam.ARCHITECTURES)} only (another head has other tensors)")
    f = Fields(d)
    heads = f.int("num_attention_heads")
    hidden = f.int("hidden_size")
    layers = f.layers = f.int("num_hidden_layers")
    head_dim = f.int("head_dim", default=max(1, hidden // heads))
    kv_heads = f.int("num_key_value_heads", default=heads)
    if heads % kv_heads:
        raise ConfigError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    vocab = f.int("vocab_size")
    tie = f.bool("tie_word_embeddings", False)
    fields = dict(model_type=mt, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                  vocab=vocab, tie_embeddings=tie)
    fields.update(fam.config(f))
    fields["features"] = frozenset(fields.get("features", ()))
    fields["moe_layers"] = tuple(fields.get("moe_layers", ()))
    experts, topk = fields.get("experts", 0), fields.get("topk", 0)
    if (layers + fields.get("mtp_layers", 0)) * max(1, experts) > MAX_TENSORS:
        raise ConfigError(f"num_hidden_layers x num_experts is {layers} x {max(1, experts)}: more than {MAX_TENSORS}, "
                          f"no model's (each expert's tensors are listed one by one)")
    if experts and topk > experts:
        raise ConfigError(f"num_experts_per_tok is {topk}: more than num_experts ({experts})")
    return ModelConfig(**fields, raw=d)
