"""Mixtral (8x7B, 8x22B) <-> megatron-core 0.12.1 <-> vLLM, as one table (rows: converters/common.py).

transformers models/mixtral/modeling_mixtral.py: attention as Llama without bias; every layer MoE, on disk
``block_sparse_moe.gate`` (the router, E x H) and ``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2``
(down) (conversion_mapping.py: [w1; w3] = [gate; up]). megatron-core: all layers MoE (stacked), fc1 = [w1; w3],
router.weight = gate, no shared experts, no router bias. vLLM models/mixtral.py: FusedMoE with
``ckpt_names=("w1", "w2", "w3")`` -> ``block_sparse_moe.experts.w13_weight`` / ``w2_weight``; the router stays
``block_sparse_moe.gate.weight`` (not handed to the FusedMoE factory).
"""
from . import common as c

MODEL_TYPES = ("mixtral",)
ARCHITECTURES = ("MixtralForCausalLM",)
PRESETS = {"mixtral-8x7b": "mixtral-8x7b.json", "mixtral-8x22b": "mixtral-8x22b.json"}
LAYER_PREFIX_HF = "model.layers.{i}."
# the tests' tiny model of this family (transformers' own config and model classes, random weights)
TINY = dict(model_type="mixtral", vocab_size=250, hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
            head_dim=32, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=6,
            max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False)


def config(f) -> dict:
    experts = f.int("num_local_experts")
    # the experts' width is intermediate_size (transformers MixtralBlockSparseTop2MLP / MixtralExperts)
    return dict(experts=experts, topk=f.int("num_experts_per_tok"), moe_ffn=f.int("intermediate_size"),
                moe_layers=tuple(range(f.layers)))


GLOBAL = c.GLOBAL
LAYER = c.ATTENTION + [
    c.PRE_MLP_NORM_MOE,
    dict(hf="block_sparse_moe.gate.weight", shape=c.router, mcore="mlp.router.weight", where="moe", shard="rep",
         vllm=("block_sparse_moe.gate.weight", "rep")),
    *c.experts("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight",
               "block_sparse_moe.experts.{e}.w2.weight", vllm_prefix="block_sparse_moe.experts."),
]
WEIGHT_NAMES, EXTRA_STATE, WEIGHT_DTYPES, DERIVED_BUFFERS = c.WEIGHT_NAMES, c.EXTRA_STATE, c.WEIGHT_DTYPES, c.DERIVED_BUFFERS
