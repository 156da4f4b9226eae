"""Llama 3 / 3.1 / 3.2 / 3.3 (dense) <-> megatron-core 0.12.1 <-> vLLM, as one table (rows: converters/common.py).

transformers models/llama/modeling_llama.py: q/k/v/o_proj carry a bias only with ``attention_bias``, the MLP only
with ``mlp_bias`` (Llama 3 has neither); head_dim = config.head_dim or hidden / heads; q/k in rotate_half order
(megatron rotary_interleaved=False, vLLM neox: no permutation of the weights); rope_scaling ("llama3") acts in
the forward pass only; 3.2-1B/3B tie the embeddings. vLLM models/llama.py: the same stacked names as Qwen2.
"""
from . import common as c

MODEL_TYPES = ("llama",)
ARCHITECTURES = ("LlamaForCausalLM",)
PRESETS = {"llama-3.1-8b": "llama-3.1-8b.json", "llama-3.1-70b": "llama-3.1-70b.json",
           "llama-3.1-405b": "llama-3.1-405b.json"}
LAYER_PREFIX_HF = "model.layers.{i}."
# the tests' tiny model of this family (transformers' own config and model classes, random weights)
TINY = dict(model_type="llama", vocab_size=250, hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
            head_dim=32, intermediate_size=96, num_hidden_layers=6, max_position_embeddings=256, rms_norm_eps=1e-5,
            rope_theta=5e5, tie_word_embeddings=False)


def config(f) -> dict:
    for flag in ("attention_bias", "mlp_bias"):
        if f.bool(flag):  # o_proj's and the MLP's biases are megatron's add_bias_linear, which this table lacks
            raise f.error(f"{flag} is true: Llama checkpoints with biases are not supported (Llama 3 has none)")
    return dict(ffn=f.int("intermediate_size"))


GLOBAL = c.GLOBAL
LAYER = c.ATTENTION + c.DENSE_MLP
WEIGHT_NAMES, EXTRA_STATE, WEIGHT_DTYPES, DERIVED_BUFFERS = c.WEIGHT_NAMES, c.EXTRA_STATE, c.WEIGHT_DTYPES, c.DERIVED_BUFFERS
