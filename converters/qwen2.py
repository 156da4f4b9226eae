"""Qwen2 / Qwen2.5 (dense) <-> megatron-core 0.12.1 <-> vLLM, as one table (rows: converters/common.py).

transformers models/qwen2/modeling_qwen2.py: q/k/v_proj always carry a bias, o_proj and the MLP none; head_dim =
config.head_dim or hidden_size / num_attention_heads; small sizes tie the embeddings (no lm_head). megatron-core:
add_qkv_bias=True, add_bias_linear=False, qk_layernorm=False (``linear_qkv.bias`` cut like the weight's rows).
vLLM models/qwen2.py: QKVParallelLinear(bias=True) ``qkv_proj.weight`` / ``.bias``; with tied embeddings
``lm_head`` is ``model.embed_tokens`` itself, and sharded_state keeps the smaller name, ``lm_head.weight``.
"""
from . import common as c

MODEL_TYPES = ("qwen2",)
ARCHITECTURES = ("Qwen2ForCausalLM",)
PRESETS = {"qwen2.5-72b": "qwen2.5-72b.json", "qwen2.5-7b": "qwen2.5-7b.json"}
LAYER_PREFIX_HF = "model.layers.{i}."
# the tests' tiny model of this family (transformers' own config and model classes, random weights)
TINY = dict(model_type="qwen2", vocab_size=250, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, num_hidden_layers=6, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1e6,
            tie_word_embeddings=True)


def config(f) -> dict:
    if f.int("head_dim", 0, least=0) not in (0, f.int("hidden_size") // f.int("num_attention_heads")):
        # vLLM models/qwen2.py Qwen2Attention: head_dim = hidden_size // num_heads, config.head_dim unread
        raise f.error("head_dim differs from hidden_size / num_attention_heads: vLLM's Qwen2 would not load it")
    return dict(ffn=f.int("intermediate_size"), features={"qkv_bias"})


GLOBAL = c.GLOBAL
LAYER = c.ATTENTION + c.DENSE_MLP
WEIGHT_NAMES, EXTRA_STATE, WEIGHT_DTYPES, DERIVED_BUFFERS = c.WEIGHT_NAMES, c.EXTRA_STATE, c.WEIGHT_DTYPES, c.DERIVED_BUFFERS
